"""vLLM's per-request sampling controls (logit_bias, allowed_token_ids, bad_words) and logits processors, in the
sampler: what each does to a row, that neighbours are untouched, and that the greedy fast path steps aside."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.sampling import LogitsProcessor, LogitsRow, SamplingMetadata, SamplingParams, sample
from deepinfer_core.sampling.bad_words import banned_next_ids, tokenize_bad_words
from deepinfer_core.sampling.logits_processor import LogitsProcessorError
from deepinfer_core.sampling.sampler import greedy_rows

VOCAB = 11


def _metadata(params, outputs=None, processors=(), bad_words_ids=None):
    rows = len(params)
    outputs = outputs or [[] for _ in range(rows)]
    return SamplingMetadata.from_params(
        params, seeds=list(range(rows)), prompt_token_ids=[[1, 2]] * rows, output_token_ids=outputs,
        bad_words_token_ids=bad_words_ids or [[] for _ in range(rows)], logits_processors=processors,
        request_ids=[f"r{i}" for i in range(rows)])


def _logits(rows: int) -> torch.Tensor:
    return torch.arange(VOCAB, dtype=torch.float32).repeat(rows, 1)  # [rows, vocab]: id 10 best, then 9, ...


GREEDY = SamplingParams(temperature=0)


def test_logit_bias_allowed_ids_and_bad_words_each_change_only_their_row():
    params = [GREEDY, SamplingParams(temperature=0, logit_bias={3: 100.0}),
              SamplingParams(temperature=0, allowed_token_ids=[2, 5]), SamplingParams(temperature=0, bad_words=["x"])]
    words = [[], [], [], [[10]]]  # "x" tokenized as the single token 10
    out = sample(_logits(4), _metadata(params, bad_words_ids=words))
    assert out.sampled_token_ids.tolist() == [10, 3, 5, 9]
    raw = torch.log_softmax(_logits(1), -1)[0]
    assert torch.equal(out.sampled_logprobs, raw[[10, 3, 5, 9]])  # log-probabilities stay the raw model's


def test_multi_token_bad_word_bans_its_last_token_only_after_its_prefix():
    words = [[[4, 7, 10]]]
    params = [SamplingParams(temperature=0, bad_words=["abc"])]
    assert sample(_logits(1), _metadata(params, [[4]], bad_words_ids=words)).sampled_token_ids.item() == 10
    assert sample(_logits(1), _metadata(params, [[4, 7]], bad_words_ids=words)).sampled_token_ids.item() == 9
    assert banned_next_ids([[5], [1, 2]], []) == [5]  # a longer word cannot end in an empty output
    assert banned_next_ids([[1, 2]], [9, 1]) == [2]


def test_bad_words_are_tokenized_plain_and_with_a_leading_space():
    vocab = {"foo": [3], " foo": [8], "a b": [4, 5], " a b": [9, 5, 6]}
    assert tokenize_bad_words(["  foo", "a b"], lambda text: vocab[text]) == [[3], [8], [4, 5]]


def test_random_rows_never_sample_a_banned_or_disallowed_token():
    params = [SamplingParams(temperature=1.5, seed=s, allowed_token_ids=[1, 4, 6], bad_words=["w"])
              for s in range(200)]
    out = sample(torch.zeros(200, VOCAB), _metadata(params, bad_words_ids=[[[4]]] * 200))
    assert set(out.sampled_token_ids.tolist()) == {1, 6}


class AddToToken(LogitsProcessor):
    """Adds ``extra_args["boost"]`` to token 0 of the rows that ask for it; records what it saw."""

    def __init__(self):
        self.seen: list[tuple[tuple[int, ...], list[LogitsRow]]] = []

    def applies_to(self, params: SamplingParams) -> bool:
        return "boost" in (params.extra_args or {})

    def __call__(self, logits, rows):
        self.seen.append((tuple(logits.shape), list(rows)))
        logits[:, 0] += torch.tensor([row.params.extra_args["boost"] for row in rows])
        return logits


def test_a_processor_sees_only_its_rows_after_the_controls_and_its_neighbours_stay_bitwise():
    proc = AddToToken()
    params = [GREEDY, SamplingParams(temperature=0, extra_args={"boost": 100.0}, logit_bias={0: -50.0}),
              SamplingParams(temperature=0.7, seed=3, top_k=4)]
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    with_proc = sample(logits, _metadata(params, [[], [7, 8], []], processors=[proc]))
    without = sample(logits, _metadata(params, [[], [7, 8], []]))
    assert with_proc.sampled_token_ids[1].item() == 0  # -50 from logit_bias, then +100 from the processor
    assert torch.equal(with_proc.sampled_token_ids[[0, 2]], without.sampled_token_ids[[0, 2]])
    (shape, rows), = proc.seen
    assert shape == (1, VOCAB)
    assert rows == [LogitsRow("r1", params[1], [1, 2], [7, 8], 2)]


def test_processors_and_controls_turn_the_greedy_fast_path_off_only_where_they_apply():
    called = []

    def greedy(rows):
        called.append(True)
        return greedy_rows(rows)

    sample(_logits(2), _metadata([GREEDY, GREEDY], processors=[AddToToken()]), greedy=greedy)
    assert called == [True]  # the processor applies to no row: the fast path stays
    boosted = SamplingParams(temperature=0, extra_args={"boost": 1.0})
    out = sample(_logits(2), _metadata([GREEDY, boosted], processors=[AddToToken()]), greedy=greedy)
    assert called == [True] and out.sampled_token_ids.tolist() == [10, 10]
    for controlled in (SamplingParams(temperature=0, logit_bias={1: 1.0}),
                       SamplingParams(temperature=0, allowed_token_ids=[3])):
        sample(_logits(1), _metadata([controlled]), greedy=greedy)
        assert called == [True]


def test_a_plain_function_is_a_processor_for_every_row():
    def zero_all_but_two(logits, rows):
        assert [row.request_id for row in rows] == ["r0", "r1"]
        keep = torch.full_like(logits, float("-inf"))
        keep[:, 2] = 0
        return keep

    out = sample(_logits(2), _metadata([GREEDY, SamplingParams(temperature=1.0, seed=1)],
                                       processors=[zero_all_but_two]))
    assert out.sampled_token_ids.tolist() == [2, 2]


@pytest.mark.parametrize(("processor", "message"), [
    (lambda logits, rows: logits[:, :3], r"returned shape \(2, 3\); it must return logits of the input's shape"),
    (lambda logits, rows: 1 / 0, "raised ZeroDivisionError: division by zero"),
])
def test_a_broken_processor_is_named(processor, message):
    with pytest.raises(LogitsProcessorError, match=message):
        sample(_logits(2), _metadata([GREEDY, GREEDY], processors=[processor]))


def test_bad_words_without_their_token_ids_is_an_error():
    with pytest.raises(ValueError, match="no bad_words_token_ids were given"):
        SamplingMetadata.from_params([SamplingParams(bad_words=["x"])], seeds=[0], prompt_token_ids=[[1]],
                                     output_token_ids=[[]])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"logit_bias": [1.0]}, "logit_bias must be a dict of token id -> number or None"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids >= 0, got -1"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias keys must be token ids >= 0, got 'x'"),
    ({"logit_bias": {1: float("inf")}}, "logit_bias\\[1\\] must be finite"),
    ({"logit_bias": {1: "high"}}, "logit_bias\\[1\\] must be a number"),
    ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids must contain ints >= 0, got -2"),
    ({"bad_words": "word"}, "bad_words must be a list of str or None"),
    ({"bad_words": ["ok", " "]}, "bad_words must not contain a blank string"),
    ({"extra_args": [("a", 1)]}, "extra_args must be a dict or None"),
    ({"extra_args": {1: "a"}}, "extra_args keys must be strings, got 1"),
])
def test_controls_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_controls_normalise_like_vllm():
    p = SamplingParams(logit_bias={"7": 2, 3: -1.5}, allowed_token_ids=(4, 5), bad_words=[], extra_args={"k": [1]})
    assert (p.logit_bias, p.allowed_token_ids, p.bad_words, p.extra_args) == ({7: 2.0, 3: -1.5}, [4, 5], None,
                                                                              {"k": [1]})
    assert p.uses_logits_controls and not SamplingParams(extra_args={"k": 1}).uses_logits_controls

"""Speculative decoding in the core (docs/speculative.md): the ngram proposer, the verification rule, exact rollback
of the model state, the engine's outputs with and without speculation, metrics, and refused configurations."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from v4_factory import ALL_TYPES, tiny_checkpoint

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.sampling.sampler import SamplingMetadata
from deepinfer_core.spec_decode import Draft, Proposer, SpeculativeConfig, SpeculativeConfigError
from deepinfer_core.spec_decode.config import resolve_speculative_config
from deepinfer_core.spec_decode.ngram import NgramProposer, lookup
from deepinfer_core.spec_decode.proposer import default_registry
from deepinfer_core.spec_decode.speculator import check_model
from deepinfer_core.spec_decode.verify import verify

pytest.importorskip("transformers")

VOCAB = 64
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "ckpt"
    tiny_checkpoint(path, layer_types=ALL_TYPES * 2, hc_mult=2)
    return path


def _llm(folder, **kwargs) -> LLM:
    kwargs.setdefault("block_size", 8)
    kwargs.setdefault("max_num_seqs", 8)
    return LLM(str(folder), **kwargs)


def _repetitive_prompts(lengths, seed=0):
    """Prompts that repeat a short random phrase (so prompt lookup finds matches), then some random tokens."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for n in lengths:
        phrase = torch.randint(2, VOCAB, (5,), generator=gen).tolist()
        tail = torch.randint(2, VOCAB, (3,), generator=gen).tolist()
        prompts.append((phrase * (n // 5 + 1))[:n] + tail)
    return prompts


def _generate(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def assert_same_or_near_tie(base, spec, tolerance=1e-4):
    """Greedy outputs equal, except where the run without speculation had its top two tokens within ``tolerance``
    in log-probability (fp32 logits of a one-token step and of a verification step may round differently there):
    such a near tie is reported, not hidden, and the outputs must agree up to it. Returns the near ties."""
    ties = []
    for b, s in zip(base, spec, strict=True):
        for completion_b, completion_s in zip(b.outputs, s.outputs, strict=True):
            ours, theirs = completion_s.token_ids, completion_b.token_ids
            if ours == theirs:
                continue
            i = next(i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y)
            top = sorted(completion_b.logprobs[i].values(), key=lambda lp: -lp.logprob)
            gap = top[0].logprob - top[1].logprob
            assert gap < tolerance, f"outputs differ at token {i} without a near tie (top-2 gap {gap:.3g})"
            ties.append((b.request_id, i, gap))
            warnings.warn(f"request {b.request_id}: outputs differ at token {i}, a near tie (top-2 gap {gap:.3g})",
                          stacklevel=2)
        for completion_b, completion_s in zip(b.outputs, s.outputs):  # the chosen tokens' logprobs, up to a tie
            for i, (x, y) in enumerate(zip(completion_b.token_ids, completion_s.token_ids)):
                if x != y:
                    break
                assert abs(completion_b.logprobs[i][x].logprob - completion_s.logprobs[i][y].logprob) < tolerance
    return ties


# ------------------------------------------------------------------------------------- ngram proposer
def test_prompt_lookup_proposes_what_followed_the_latest_match():
    tokens = [7, 1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3]
    assert lookup(tokens, 1, 3, 3) == [4, 5, 1]  # the last [1, 2, 3] before the suffix is at index 5
    assert lookup(tokens, 1, 3, 1) == [4]
    assert lookup([1, 2, 3, 4], 1, 3, 3) == []  # no earlier occurrence of any suffix
    assert lookup([5, 6, 5, 7, 5], 2, 3, 2) == []  # [7, 5] never occurred before; n=1 is below prompt_lookup_min
    assert lookup([5, 6, 5, 7, 5], 1, 3, 2) == [7, 5]  # n=1: the latest earlier 5 is at index 2


def _lookup_by_scan(tokens, min_n, max_n, k):
    """The rule, position by position: largest n first, the latest earlier occurrence of the last n tokens."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[len(tokens) - n:]:
                return tokens[start + n:start + n + k]
    return []


@given(st.lists(st.sampled_from([0, 1, 2, 256, 65536, 2**31 - 1]), max_size=40), st.integers(1, 4),
       st.integers(0, 3), st.integers(1, 5))
@settings(max_examples=300, deadline=None)
def test_prompt_lookup_equals_the_position_by_position_rule(tokens, min_n, extra, k):
    assert lookup(tokens, min_n, min_n + extra, k) == _lookup_by_scan(tokens, min_n, min_n + extra, k)


def test_ngram_proposer_respects_max_draft_len():
    from deepinfer_core.spec_decode.proposer import DraftBatch, DraftSequence

    proposer = NgramProposer(SpeculativeConfig("ngram", 3, {"prompt_lookup_min": 2}))
    seqs = [DraftSequence(f"r{i}", i, [1, 2, 3, 4, 1, 2], 5, 0, None, 0, SamplingParams(), n) for i, n in
            enumerate((3, 1, 0))]
    assert [d.token_ids for d in proposer.propose(DraftBatch(seqs))] == [[3, 4, 1], [3], []]


# ------------------------------------------------------------------------------------- configuration
@pytest.mark.parametrize(("config", "match"), [
    ({"method": "eagle", "num_speculative_tokens": 3}, r"'eagle' is not registered.*\['ngram'\]"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, r"\['draft_model'\].*'ngram'"),
    (["ngram"], "must be a dict"),
])
def test_bad_speculative_configs_are_refused(config, match):
    with pytest.raises(SpeculativeConfigError, match=match):
        resolve_speculative_config(config, None, default_registry().methods())


def test_nextn_variable_means_dspark_and_needs_its_proposer():
    methods = default_registry().methods()
    with pytest.raises(SpeculativeConfigError, match=r"DEEPINFER_USE_NEXTN_DECODE=5.*no proposer 'dspark'"):
        resolve_speculative_config(None, 5, methods)
    assert resolve_speculative_config(None, 0, methods) is None
    config = resolve_speculative_config(None, 4, {**methods, "dspark": ()})
    assert (config.method, config.num_speculative_tokens) == ("dspark", 4)
    explicit = resolve_speculative_config(NGRAM, 4, methods)  # a speculative_config wins over the variable
    assert explicit.method == "ngram" and explicit.options == {"prompt_lookup_max": 3}


def test_ngram_keys_are_checked():
    with pytest.raises(SpeculativeConfigError, match="prompt_lookup_min=4 is larger than prompt_lookup_max=2"):
        NgramProposer(SpeculativeConfig("ngram", 3, {"prompt_lookup_min": 4, "prompt_lookup_max": 2}))
    with pytest.raises(SpeculativeConfigError, match="prompt_lookup_max must be an integer >= 1"):
        NgramProposer(SpeculativeConfig("ngram", 3, {"prompt_lookup_max": 0}))


def test_a_model_that_cannot_roll_back_refuses_speculation():
    class NoRollback:
        vocab_size = 8

    with pytest.raises(SpeculativeConfigError, match=r"lacks \[.*'rollback_draft_state'.*SpeculativeModel"):
        check_model(NoRollback(), SpeculativeConfig("ngram", 3))


def test_engine_refuses_more_draft_tokens_than_the_model_rolls_back(folder):
    # the tiny config's carries hold 8 positions (CSA 2 x 4, HCA 8): one step carries at most 7 draft tokens
    with pytest.raises(SpeculativeConfigError, match=r"num_speculative_tokens=8 is more than .* \(7\)"):
        _llm(folder, speculative_config={"method": "ngram", "num_speculative_tokens": 8})
    with pytest.raises(SpeculativeConfigError, match="not registered"):
        _llm(folder, speculative_config={"method": "mtp-typo", "num_speculative_tokens": 2})


# ------------------------------------------------------------------------------------- verification rule
def _metadata(rows, temperature=0.0, seeds=None, positions=None):
    params = [SamplingParams(temperature=temperature)] * rows
    return SamplingMetadata.from_params(params, seeds=seeds or [0] * rows, prompt_token_ids=[[1]] * rows,
                                        output_token_ids=[[]] * rows, positions=positions or [1] * rows)


def test_greedy_verification_keeps_the_draft_while_it_equals_the_argmax():
    logits = torch.full((8, 6), -1.0)
    for row, best in enumerate([3, 4, 0, 5, 2, 2, 2, 1]):
        logits[row, best] = 2.0
    drafts = [[3, 4, 1], [5], [2]]  # rows 0-3, 4-5, 6-7 (each draft's last row: the bonus)
    out = verify(logits, _metadata(8), drafts)
    assert out.num_emitted.tolist() == [3, 1, 2]
    ids = out.sampler_output.sampled_token_ids.tolist()
    assert ids[:3] == [3, 4, 0]  # 3, 4 accepted; 1 rejected: the target's argmax instead
    assert ids[4] == 2 and ids[6:8] == [2, 1]  # 5 rejected; 2 accepted, then the bonus


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(probs) - 1) / 2), statistic / 2))


@pytest.mark.parametrize("probabilistic", [True, False])
def test_rejection_sampling_follows_the_target_distribution(probabilistic):
    """The first emitted token after a one-token draft follows p (chi-square, fixed seeds), whether the draft
    carries its q (rule u <= p / q) or is deterministic; acceptance is sum(min(p, q)) (q one-hot: p(x))."""
    vocab, trials = 6, 6000
    target = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    q = torch.tensor([0.30, 0.10, 0.10, 0.10, 0.30, 0.10])
    draft_tokens = torch.multinomial(q, trials, replacement=True, generator=torch.Generator().manual_seed(1))
    if not probabilistic:
        draft_tokens = torch.full((trials,), 4)
    logits = target.log().repeat(2 * trials, 1)  # [2 * trials, vocab]: the draft row and the bonus row of each
    seeds = [seed for seed in range(trials) for _ in range(2)]
    metadata = _metadata(2 * trials, temperature=1.0, seeds=seeds, positions=[5, 6] * trials)
    drafts = [[int(t)] for t in draft_tokens]
    out = verify(logits, metadata, drafts, [q[None, :] if probabilistic else None] * trials)
    first = out.sampler_output.sampled_token_ids.reshape(trials, 2)[:, 0]
    counts = torch.bincount(first, minlength=vocab).double()
    assert _chi_square_p_value(counts, target.double()) > 1e-3
    accepted = (out.num_emitted == 2).double().mean().item()
    expected = torch.minimum(target, q).sum().item() if probabilistic else target[4].item()
    assert abs(accepted - expected) < 4 * (expected * (1 - expected) / trials) ** 0.5


def test_a_seeded_row_emits_what_sampling_without_speculation_gives():
    """A deterministic draft verified on a random row emits, at every position it reaches, the token the ordinary
    sampler draws there with the same seed."""
    from deepinfer_core.sampling.sampler import sample

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=gen)
    metadata = _metadata(4, temperature=0.9, seeds=[11] * 4, positions=[7, 8, 9, 10])
    plain = sample(logits, metadata).sampled_token_ids.tolist()
    out = verify(logits, metadata, [plain[:2] + [(plain[2] + 1) % 50]])
    assert out.num_emitted.tolist() == [3]
    assert out.sampler_output.sampled_token_ids.tolist()[:3] == plain[:3]


# ------------------------------------------------------------------------------------- rollback
def test_rollback_leaves_the_state_of_a_run_that_never_saw_the_rejected_tokens(folder):
    """Prefill 13 tokens, then one step with the next token and 5 draft tokens, 1 accepted and the rest rolled back;
    the first rejected one (position 15) completes a CSA and an HCA window. Against a run that computed only the
    accepted ones: the sliding rings and compressor carries are equal, and the next step, which completes those
    windows again, gives the same logits (so the compressed entries were rewritten before anything read them)."""
    llm = _llm(folder, enforce_eager=True)
    model = llm.model
    prompt = torch.randint(2, VOCAB, (13,), generator=torch.Generator().manual_seed(4)).tolist()
    step = [9, 17, 23, 31, 40, 51]  # positions 13..18: CSA (ratio 4) and HCA (ratio 8) windows end at 15
    states = []
    for tokens in (step, step[:2]):
        state = model.new_state(num_slots=2, num_blocks=8, block_size=8)
        model.forward(ForwardBatch.build([prompt], [0], [1], [[0, 1, 2]]), state)
        saved = model.save_draft_state(state, [1], [list(range(14, 14 + len(tokens) - 1))])
        model.forward(ForwardBatch.build([tokens], [13], [1], [[0, 1, 2]], logits="all"), state)
        if len(tokens) == len(step):
            model.rollback_draft_state(state, saved, torch.tensor([15]))  # keep 13 and 14
        states.append(state)
    full, short = states
    for layer in full.swa:
        torch.testing.assert_close(full.swa[layer][1], short.swa[layer][1], atol=1e-5, rtol=0)
    for name in ("carry", "index_carry"):
        for layer, carry in getattr(full, name).items():
            torch.testing.assert_close(carry.rows[1], getattr(short, name)[layer].rows[1], atol=1e-5, rtol=0)
    rejected_rows = [p % 8 for p in (15, 16, 17, 18)]  # the short run wrote them in the prefill only: exact
    for layer in full.swa:
        assert torch.equal(full.swa[layer][1, rejected_rows], short.swa[layer][1, rejected_rows])
    nxt = [[5, 6, 7, 8, 9, 10]]  # positions 15..20: writes the windows ending at 15 again, then reads them
    a = model.forward(ForwardBatch.build(nxt, [15], [1], [[0, 1, 2]], logits="all"), full).logits
    b = model.forward(ForwardBatch.build(nxt, [15], [1], [[0, 1, 2]], logits="all"), short).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------- the engine
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_outputs_equal_without_speculation(folder, async_scheduling):
    """A batch of prompts of several lengths, chunked prefill (budget 16), n = 2, a repeated prompt (prefix hit)."""
    prompts = _repetitive_prompts([9, 23, 14, 31], seed=1)
    prompts.append(list(prompts[1]))  # prefix-cache hit on the second prompt's blocks
    base = _generate(_llm(folder, max_num_batched_tokens=16, async_scheduling=async_scheduling), prompts, GREEDY)
    llm = _llm(folder, max_num_batched_tokens=16, async_scheduling=async_scheduling, speculative_config=NGRAM)
    spec = _generate(llm, prompts, GREEDY)
    assert_same_or_near_tie(base, spec)
    metrics = {m.name: m.value for m in llm.get_metrics()}
    assert metrics["deepinfer:spec_decode_num_accepted_tokens"] > 0
    assert llm.engine.state_manager.hits > 0
    pair = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2, logprobs=2)
    assert_same_or_near_tie(_generate(_llm(folder), prompts[:2], pair), _generate(llm, prompts[:2], pair))
    llm.engine.state_manager.check_invariants([])


def test_greedy_outputs_equal_through_preemption(folder):
    from deepinfer_core.models.deepseek_v4.state import DeepseekV4State

    probe = _llm(folder)
    per_block = DeepseekV4State.bytes_per_block(probe.model.config, 8, torch.float32)
    per_slot = DeepseekV4State.bytes_per_slot(probe.model.config, 8, torch.float32)
    budget = 4 * per_slot + 10 * per_block  # 4 sequences want up to 4 x 7 blocks
    prompts = _repetitive_prompts([27, 30, 25, 29], seed=6)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    base = _generate(_llm(folder, max_num_seqs=4), prompts, params)
    llm = _llm(folder, max_num_seqs=4, kv_cache_memory_bytes=budget, speculative_config=NGRAM)
    assert_same_or_near_tie(base, _generate(llm, prompts, params))
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.state_manager.check_invariants([])


def test_seeded_sampling_is_reproducible_and_matches_no_speculation(folder):
    prompts = _repetitive_prompts([12, 20], seed=2)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True, seed=7, n=2,
                            repetition_penalty=1.1)
    llm = _llm(folder, speculative_config=NGRAM)
    first, again = _generate(llm, prompts, params), _generate(llm, prompts, params)
    tokens = [[c.token_ids for c in o.outputs] for o in first]
    assert tokens == [[c.token_ids for c in o.outputs] for o in again]
    assert tokens == [[c.token_ids for c in o.outputs] for o in _generate(_llm(folder), prompts, params)]


class ScriptedProposer(Proposer):
    """Drafts the known greedy continuation for ``right`` tokens, then a wrong token (cut to ``max_draft_len``)."""

    def __init__(self, continuation: list[int], prompt_len: int, right: int = 2):
        self.continuation, self.prompt_len, self.right = continuation, prompt_len, right

    def propose(self, batch):
        drafts = []
        for seq in batch.sequences:
            done = len(seq.token_ids) - self.prompt_len
            draft = self.continuation[done:done + self.right]
            if done + self.right < len(self.continuation):
                draft = draft + [(self.continuation[done + self.right] + 1) % VOCAB]
            drafts.append(Draft(draft[:seq.max_draft_len], num_proposed=len(draft)))
        return drafts


def test_metrics_count_a_constructed_case(folder):
    prompt = _repetitive_prompts([10], seed=3)[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    continuation = _generate(_llm(folder), [prompt], params)[0].outputs[0].token_ids
    llm = _llm(folder, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    llm.engine.speculator.proposer = ScriptedProposer(continuation, len(prompt))
    assert _generate(llm, [prompt], params)[0].outputs[0].token_ids == continuation
    # drafts after 1, 4, 7 and 10 tokens: [right, right, wrong] x 3 (3 tokens each), then [right] (room for 1)
    metrics = {m.name: m.value for m in llm.get_metrics()}
    assert metrics["deepinfer:spec_decode_num_drafts"] == 4
    assert metrics["deepinfer:spec_decode_num_draft_tokens"] == 3 + 3 + 3 + 2
    assert metrics["deepinfer:spec_decode_num_verified_tokens"] == 3 + 3 + 3 + 1
    assert metrics["deepinfer:spec_decode_num_accepted_tokens"] == 2 + 2 + 2 + 1
    assert metrics["deepinfer:spec_decode_num_accepted_tokens_per_pos"] == [4, 3, 0]
    assert llm.engine.num_steps == 5


def test_a_proposer_breaking_the_contract_is_named(folder):
    from deepinfer_core.spec_decode import ProposerError

    class TooLong(Proposer):
        def propose(self, batch):
            return [Draft([2] * (s.max_draft_len + 1)) for s in batch.sequences]

    llm = _llm(folder, speculative_config=NGRAM)
    llm.engine.speculator.proposer = TooLong()
    with pytest.raises(ProposerError, match=r"'ngram' drafted 4 tokens .* more than its max_draft_len 3"):
        _generate(llm, [[5, 6, 7]], SamplingParams(max_tokens=8, ignore_eos=True))


@pytest.mark.parametrize("stop", ["string", "token"])
def test_a_stop_inside_an_accepted_draft_drops_the_later_tokens(folder, stop):
    """The second step takes output tokens 1-5 (4 accepted draft tokens and the bonus); a stop at token 3 (a stop
    string ending there, or a stop token id) ends the request there, as without speculation."""
    prompt = _repetitive_prompts([10], seed=5)[0]
    free = _generate(_llm(folder), [prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    continuation = free.outputs[0].token_ids
    if stop == "string":
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[free.outputs[0].text.split()[3]])
    else:
        params = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[continuation[3]])
    base = _generate(_llm(folder), [prompt], params)[0].outputs[0]
    llm = _llm(folder, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    llm.engine.speculator.proposer = ScriptedProposer(continuation, len(prompt), right=4)
    ours = _generate(llm, [prompt], params)[0].outputs[0]
    assert (ours.token_ids, ours.text, ours.finish_reason, ours.stop_reason) == (
        base.token_ids, base.text, base.finish_reason, base.stop_reason)
    assert base.finish_reason == "stop" and len(base.token_ids) < 16


def test_batch_invariant_mode_makes_speculation_bitwise(folder):
    """With batch-invariant ops a verification step's rows equal one-token steps' bit for bit: the same tokens and
    the same logprobs, no near-tie allowance."""
    pytest.importorskip("deepinfer_batch_invariant")
    prompts = _repetitive_prompts([9, 23, 14], seed=1)
    base = _generate(_llm(folder, batch_invariant=True), prompts, GREEDY)
    llm = _llm(folder, batch_invariant=True, speculative_config=NGRAM)
    spec = _generate(llm, prompts, GREEDY)
    assert {m.name: m.value for m in llm.get_metrics()}["deepinfer:spec_decode_num_accepted_tokens"] > 0
    for b, s in zip(base, spec):
        assert b.outputs[0].token_ids == s.outputs[0].token_ids
        assert [lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)] == [
            lp[t].logprob for lp, t in zip(s.outputs[0].logprobs, s.outputs[0].token_ids)]


def test_static_decode_steps_run_beside_static_verification(folder):
    """With graphs (their static-shape path, eager on CPU) a step whose decodes draft nothing replays a decode graph
    and a step verifying drafts a verification graph (``engine/verify_graphs.py``; tests/test_verify_graphs.py checks
    it against eager verification); outputs equal those without speculation."""
    prompts = _repetitive_prompts([9, 23, 14, 31], seed=1)
    base = _generate(_llm(folder, cuda_graph_sizes=[1, 2, 4, 8]), prompts, GREEDY)
    llm = _llm(folder, cuda_graph_sizes=[1, 2, 4, 8], speculative_config=NGRAM)
    assert_same_or_near_tie(base, _generate(llm, prompts, GREEDY))
    assert llm.engine.runner.decode_graphs.num_replays > 0
    assert llm.engine.runner.verify_graphs.num_replays > 0
    assert {m.name: m.value for m in llm.get_metrics()}["deepinfer:spec_decode_num_drafts"] > 0


def test_structured_output_requests_run_beside_drafting_ones():
    """A grammar-constrained request (the structured-output plugin's two-phase processor) beside drafting ones keeps
    its constraint; all outputs equal those without speculation."""
    pytest.importorskip("deepinfer_structured_output")
    from deepinfer_core import StructuredOutputsParams

    prompts = ["for i in range(10):\n    print(i)\nfor i in range(10):\n", "def f(x):", "import os\nimport os\n"]
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    choice = SamplingParams(temperature=0, max_tokens=24,
                            structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue"]))
    params = [plain, choice, plain]
    base = LLM(enforce_eager=True).generate(prompts, params, use_tqdm=False)
    llm = LLM(enforce_eager=True, speculative_config=NGRAM)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    assert spec[1].outputs[0].text in ("red", "green", "blue")
    assert {m.name: m.value for m in llm.get_metrics()}["deepinfer:spec_decode_num_accepted_tokens"] > 0


def test_generate_command_takes_a_speculative_config(folder, capsys):
    from deepinfer_core.cli.main import main

    command = ["generate", "--model", str(folder), "--json", "--temperature", "0", "--max-tokens", "12",
               "w5 w6 w7 w5 w6 w7 w5"]
    assert main(command) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*command, "--speculative-config", json.dumps(NGRAM)]) == 0
    ours = json.loads(capsys.readouterr().out)[0]["outputs"][0]
    assert (ours["token_ids"], ours["text"]) == (plain[0]["outputs"][0]["token_ids"], plain[0]["outputs"][0]["text"])
    for bad, message in (("{method: ngram}", "is not valid JSON"), ("[3]", "is a JSON list"),
                         ('{"method": "eagle", "num_speculative_tokens": 2}', "'eagle' is not registered")):
        assert main([*command, "--speculative-config", bad]) == 2
        assert message in capsys.readouterr().err


def test_prefix_cache_registers_only_accepted_blocks(folder):
    """Drafts with a wrong token rejected at every step, crossing block ends: the prefix cache ends up with exactly
    the blocks (hash chains) a run without speculation registers, none over a rejected token; a second request
    sharing the prompt and output then hits them."""
    prompt = _repetitive_prompts([11], seed=8)[0]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    base = _llm(folder)
    continuation = _generate(base, [prompt], params)[0].outputs[0].token_ids
    llm = _llm(folder, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    llm.engine.speculator.proposer = ScriptedProposer(continuation, len(prompt), right=1)
    assert _generate(llm, [prompt], params)[0].outputs[0].token_ids == continuation
    metrics = {m.name: m.value for m in llm.get_metrics()}
    assert metrics["deepinfer:spec_decode_num_accepted_tokens"] < metrics["deepinfer:spec_decode_num_verified_tokens"]
    assert set(llm.engine.state_manager.cached) == set(base.engine.state_manager.cached)
    again = _generate(llm, [prompt + continuation[:20]], SamplingParams(temperature=0, max_tokens=4))[0]
    assert again.num_cached_tokens == 32  # 34 tokens: four full blocks of 8 before the last token


def test_bench_reports_the_timed_runs_speculation(capsys):
    """``deepinfer bench --speculative-config``: the timed run's drafts (warm-up left out), acceptance length and
    verified tokens per step, in the result and the table; a bad config exits 2."""
    from deepinfer_core.bench import runner
    from deepinfer_core.bench.report import format_report
    from deepinfer_core.cli.main import main

    config = runner.BenchConfig(input_len=16, output_len=24, num_prompts=2, max_num_seqs=2, warmup=1,
                                enforce_eager=True, speculative_config=NGRAM)
    result = runner.run_bench(config)
    figures = result["engine"]["speculative"]
    engine = result["engine"]["engine_metrics"]
    assert 0 < figures["num_drafts"] < engine["deepinfer:spec_decode_num_drafts"]  # the warm-up's are not counted
    assert figures["acceptance_length"] == 1 + figures["num_accepted_tokens"] / figures["num_drafts"]
    assert figures["verified_per_step"] == figures["num_verified_tokens"] / result["engine"]["steps"]
    assert sum(figures["accepted_per_pos"]) == figures["num_accepted_tokens"]
    assert "speculative decoding (ngram, k = 3): acceptance length" in format_report(result)
    assert main(["bench", "--speculative-config", '{"method": "ngram"}']) == 2
    assert "num_speculative_tokens must be an integer >= 1" in capsys.readouterr().err


def test_bench_takes_real_prompts_from_a_file(tmp_path):
    """``--prompts FILE``: the first num_prompts non-empty lines, tokenized and cut to input_len; ngram drafts on
    repetitive code are accepted; too few lines and --compare-hf are refused by name."""
    from deepinfer_core.bench import runner

    path = tmp_path / "prompts.txt"
    path.write_text("for i in range(10): print(i); for i in range(10): print(i); for i in range(10):\n\n"
                    "x = 1; y = 2; x = 1; y = 2; x = 1; y =\n" + "def f(x): return x\n")
    config = runner.BenchConfig(input_len=24, output_len=16, num_prompts=2, max_num_seqs=2, warmup=0,
                                enforce_eager=True, speculative_config=NGRAM, prompts_file=str(path))
    result = runner.run_bench(config)
    assert result["engine"]["prompt_tokens"] <= 2 * 24 and result["engine"]["num_requests"] == 2
    assert result["engine"]["speculative"]["num_accepted_tokens"] > 0
    with pytest.raises(ValueError, match=r"has 3 non-empty lines, --num-prompts asks for 4"):
        runner.run_bench(dataclasses.replace(config, num_prompts=4))
    with pytest.raises(ValueError, match="leave out --num-iters, --prefix-share and --compare-hf"):
        dataclasses.replace(config, compare_hf=True).validate()


def test_bench_compares_speculation_with_baselines_in_one_run(tmp_path, capsys, monkeypatch):
    """``--compare-speculative``: every run on the same prompts in one process, the speculative_config run last and
    as the result's engine; speedups over the none run, its tokens kept by greedy runs; a duplicate baseline runs
    once; bad baselines and a none run DEEPINFER_USE_NEXTN_DECODE would change are refused before any work."""
    from deepinfer_core.bench import runner
    from deepinfer_core.bench.report import format_report
    from deepinfer_core.cli.main import main

    path = tmp_path / "prompts.txt"
    path.write_text("for i in range(10): print(i); for i in range(10): print(i); for i in range(10):\n"
                    "x = 1; y = 2; x = 1; y = 2; x = 1; y =\n")
    lookup = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    config = runner.BenchConfig(input_len=24, output_len=12, num_prompts=2, max_num_seqs=2, warmup=0,
                                enforce_eager=True, speculative_config=NGRAM, prompts_file=str(path),
                                compare_speculative=["none", lookup, "ngram", dict(NGRAM)])
    result = runner.run_bench(config)
    runs = result["speculative_comparison"]["runs"]
    assert [run["label"] for run in runs] == ["none", "ngram k=3 prompt_lookup_max=2", "ngram k=3",
                                              "ngram k=3 prompt_lookup_max=3"]
    none, main_run = runs[0], runs[-1]
    assert none["speedup_vs_none"] == 1.0 and none["acceptance_length"] is None and none["steps"] >= 12
    assert all(run["step_time_p50_s"] > 0 for run in runs)
    assert main_run["output_throughput"] == result["engine"]["output_throughput"]
    assert main_run["speedup_vs_none"] == main_run["output_throughput"] / none["output_throughput"]
    assert main_run["num_accepted_tokens"] == result["engine"]["speculative"]["num_accepted_tokens"] > 0
    assert main_run["verified_per_draft"] == main_run["num_verified_tokens"] / main_run["num_drafts"]
    assert main_run["steps"] <= none["steps"]  # the same tokens, some accepted from drafts
    assert all(run["same_outputs_as_none"] == 2 for run in runs)
    table = format_report(result)
    assert "speculative decoding compared" in table and "ngram k=3 prompt_lookup_max=2" in table
    assert "requests with the none run's tokens: ngram k=3 prompt_lookup_max=2 2/2, ngram k=3 2/2, ngram" in table
    json.dumps(result)
    with pytest.raises(ValueError, match="give --speculative-config"):
        dataclasses.replace(config, speculative_config=None).validate()
    assert main(["bench", "--speculative-config", json.dumps(NGRAM), "--compare-speculative", "{no json"]) == 2
    assert "--compare-speculative '{no json' is not valid JSON" in capsys.readouterr().err
    with pytest.raises(ValueError, match="method 'ngrm' is not registered"):
        dataclasses.replace(config, compare_speculative=["none", "ngrm"]).validate()
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "5")
    with pytest.raises(ValueError, match="unset the variable"):
        config.validate()


def test_prompt_logprobs_and_the_length_limit_hold_under_speculation(folder):
    """Prompt logprobs come out as without speculation, and drafts never run past max_model_len: the request ends
    with finish_reason "length" after the same tokens."""
    prompts = _repetitive_prompts([14, 20], seed=9)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)]
    base = _llm(folder, max_model_len=40).generate([{"prompt_token_ids": p} for p in prompts], params,
                                                   use_tqdm=False)
    llm = _llm(folder, max_model_len=40, speculative_config=NGRAM)
    spec = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_same_or_near_tie(base, spec)
    assert [len(p) + len(o.outputs[0].token_ids) for p, o in zip(prompts, spec)] == [40, 40]
    assert all(o.outputs[0].finish_reason == "length" for o in spec)
    ours = [None if e is None else {t: lp.logprob for t, lp in e.items()} for e in spec[0].prompt_logprobs]
    theirs = [None if e is None else {t: lp.logprob for t, lp in e.items()} for e in base[0].prompt_logprobs]
    assert ours == theirs
    assert {m.name: m.value for m in llm.get_metrics()}["deepinfer:spec_decode_num_drafts"] > 0


class UniformProposer(Proposer):
    """Drafts ``max_draft_len`` tokens drawn uniformly (seeded by the sequence's length), with their ``draft_probs``;
    every few drafts the known greedy continuation instead, so some are accepted."""

    def __init__(self, continuation: list[int], prompt_len: int):
        self.continuation, self.prompt_len = continuation, prompt_len

    def propose(self, batch):
        drafts = []
        for seq in batch.sequences:
            n = seq.max_draft_len
            gen = torch.Generator().manual_seed(len(seq.token_ids))
            tokens = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
            if len(seq.token_ids) % 2:
                done = len(seq.token_ids) - self.prompt_len
                tokens = (self.continuation[done:done + n] + tokens)[:n]
            drafts.append(Draft(tokens, torch.full((n, VOCAB), 1.0 / VOCAB)))
        return drafts


def test_drafts_with_probabilities_run_through_the_engine(folder):
    """Drafts carrying q: greedy rows keep them while they equal the argmax (outputs as without speculation); seeded
    random rows (the u <= p / q rule) give the same output on every run."""
    prompt = _repetitive_prompts([12], seed=10)[0]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    base = _generate(_llm(folder), [prompt], greedy)
    llm = _llm(folder, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    llm.engine.speculator.proposer = UniformProposer(base[0].outputs[0].token_ids, len(prompt))
    assert_same_or_near_tie(base, _generate(llm, [prompt], greedy))
    accepted = {m.name: m.value for m in llm.get_metrics()}["deepinfer:spec_decode_num_accepted_tokens"]
    assert accepted > 0
    seeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=4)
    llm.engine.speculator.proposer = UniformProposer([], len(prompt))
    first, again = _generate(llm, [prompt], seeded), _generate(llm, [prompt], seeded)
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids
    assert len(first[0].outputs[0].token_ids) == 16

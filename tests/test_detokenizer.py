"""Incremental detokenization, stop strings and finish checks, on a tiny in-test byte-level BPE."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from deepinfer_core.engine.detokenizer import (
    IncrementalDetokenizer,
    SequenceDetokenizer,
    decode_token,
    find_stop_string,
    stop_prefix_holdback,
)
from deepinfer_core.engine.stop import check_stop
from deepinfer_core.outputs import CompletionOutput, Logprob, sample_logprobs_dict
from deepinfer_core.sampling import SamplingParams

EOS, STOP = 0, 1  # special token ids of the test tokenizer


def _train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<eos>", "<stop>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["hello world, the end is here", "héllo wörld 你好 世界", "stop STOP END end ### done"] * 10
    tok.train_from_iterator(corpus, trainer)
    assert tok.token_to_id("<eos>") == EOS and tok.token_to_id("<stop>") == STOP
    return tok


TOK = _train_tokenizer()


def ids(*pieces: str) -> list[int]:
    """Token ids of the pieces, encoded separately (so token boundaries fall between pieces)."""
    return [i for p in pieces for i in TOK.encode(p).ids]


class Completion:
    """One completion as the engine drives it: each token's stop decision (``check_stop``, the scheduler's), then
    its text and stop strings (``SequenceDetokenizer``, the output processor's)."""

    def __init__(self, tokenizer, params: SamplingParams, prompt=(), max_model_len=None):
        self.params, self.num_prompt, self.max_model_len = params, len(prompt), max_model_len
        self.token_ids: list[int] = []
        self.text_state = SequenceDetokenizer(tokenizer, params, prompt)

    def append(self, token: int, defer_text: bool = False):
        self.token_ids.append(token)
        stop = check_stop(self.params, self.num_prompt, self.token_ids, EOS, self.max_model_len)
        return self.text_state.append(token, stop, defer_text)

    def __getattr__(self, name):  # text, output_text, finish_reason, stop_reason, catch_up, has_deferred_text
        return getattr(self.text_state, name)


def run(token_ids, params: SamplingParams, prompt=(), **kw):
    """Feed ``token_ids`` until finished; return (sequence, deltas, tokens consumed)."""
    seq = Completion(TOK, params, prompt, **kw)
    deltas = []
    for n, t in enumerate(token_ids, 1):
        update = seq.append(t)
        deltas.append(update.delta_text)
        if update.finished:
            return seq, deltas, n
    return seq, deltas, len(token_ids)


# ---------------------------------------------------------------------------------------------
# incremental detokenization


def test_multibyte_character_split_across_tokens_is_emitted_whole():
    euro = TOK.encode("€").ids  # not in the training corpus: one token per UTF-8 byte
    assert len(euro) == 3 and "\ufffd" in TOK.decode(euro[:1])
    detok = IncrementalDetokenizer(TOK)
    assert [detok.add(i) for i in ids("a") + euro + ids("b")] == ["a", "", "", "€", "b"]


def test_emoji_split_across_byte_tokens():
    detok = IncrementalDetokenizer(TOK)
    out = [detok.add(i) for i in TOK.encode("x🙂y").ids]
    assert "".join(out) == "x🙂y"
    assert all("\ufffd" not in d for d in out)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([*"ab €é你好🙂\n", "hello", " world"]), max_size=30).map("".join))
def test_deltas_concatenate_to_full_decode(text):
    token_ids = TOK.encode(text).ids
    detok = IncrementalDetokenizer(TOK)
    deltas = [detok.add(i) for i in token_ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == TOK.decode(token_ids) == text


def test_prompt_context_does_not_leak_into_output():
    prompt = TOK.encode("hello world, the").ids
    detok = IncrementalDetokenizer(TOK, prompt)
    out = "".join(detok.add(i) for i in TOK.encode(" end is here").ids)
    assert out == " end is here"


def test_flush_emits_incomplete_character():
    detok = IncrementalDetokenizer(TOK)
    assert detok.add(TOK.encode("€").ids[0]) == ""
    assert detok.flush() == "\ufffd"


def test_skip_special_tokens():
    detok = IncrementalDetokenizer(TOK, skip_special_tokens=True)
    assert "".join(detok.add(i) for i in [*ids("a"), STOP, *ids("b")]) == "ab"
    detok = IncrementalDetokenizer(TOK, skip_special_tokens=False)
    assert "".join(detok.add(i) for i in [*ids("a"), STOP, *ids("b")]) == "a<stop>b"


def test_decode_token():
    assert decode_token(TOK, EOS) == "<eos>"
    assert decode_token(TOK, TOK.encode("hello").ids[0]) == TOK.decode([TOK.encode("hello").ids[0]])


# ---------------------------------------------------------------------------------------------
# stop strings


def test_stop_string_spanning_tokens_is_cut_and_never_streamed():
    token_ids = ids("the E", "N", "D more")  # "END" spans three tokens
    seq, deltas, used = run(token_ids, SamplingParams(stop=["END"], max_tokens=50))
    assert seq.finish_reason == "stop" and seq.stop_reason == "END"
    assert seq.text == "the " and "".join(deltas) == "the "
    assert seq.token_ids == token_ids[:used] and used < len(token_ids)


def test_include_stop_str_in_output():
    seq, deltas, _ = run(ids("the E", "ND more"), SamplingParams(stop=["END"], include_stop_str_in_output=True))
    assert seq.text == "the END" and "".join(deltas) == "the END"
    assert seq.stop_reason == "END"


def test_text_after_stop_string_in_same_token_is_dropped():
    seq, _, _ = run(ids("done###", "x"), SamplingParams(stop=["#"], max_tokens=50))
    assert seq.text == "done"


def test_partial_stop_string_is_held_back_then_released():
    params = SamplingParams(stop=["END"], max_tokens=50)
    seq = Completion(TOK, params)
    assert seq.append(ids("the")[0]).delta_text == "the"
    for i in ids(" EN"):
        seq.append(i)
    assert seq.output_text == "the " and seq.text == "the EN"
    update = seq.append(ids("d")[0])  # "ENd" is not "END": release the held text
    assert update.delta_text == "ENd" and not update.finished
    assert seq.output_text == "the ENd"


def test_earliest_ending_stop_string_wins():
    # both complete in one token; "bc" ends first although "abcd" starts first
    assert find_stop_string("xabcd", ["abcd", "bc"], 0) == (2, 4, "bc")
    assert find_stop_string("xabcd", ["cd", "abcd"], 0) == (1, 5, "abcd")  # same end: longer wins
    assert find_stop_string("xabcd", ["ab"], 4) is None  # ends before the new text


def test_stop_prefix_holdback():
    assert stop_prefix_holdback("hello EN", ["END", "###"]) == 2
    assert stop_prefix_holdback("hello ##", ["END", "###"]) == 2
    assert stop_prefix_holdback("hello", ["END"]) == 0
    assert stop_prefix_holdback("E", ["END", "E!"]) == 1


def _reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Character-by-character semantics: the first stop string to complete ends the text."""
    best = None
    for s in stops:
        start = text.find(s)
        if start != -1 and (best is None or (start + len(s), start) < (best[1], best[0])):
            best = (start, start + len(s), s)
    if best is None:
        return text, None
    return text[: best[1] if include else best[0]], best[2]


@settings(max_examples=150, deadline=None)
@given(
    text=st.lists(st.sampled_from([*"abé你 ", "END", "hello"]), min_size=1, max_size=40).map("".join),
    stops=st.lists(st.text(alphabet=st.sampled_from(list("abé你 END")), min_size=1, max_size=4), min_size=1,
                   max_size=3),
    include=st.booleans(),
)
def test_stop_strings_match_character_level_semantics(text, stops, include):
    token_ids = TOK.encode(text).ids
    params = SamplingParams(stop=stops, include_stop_str_in_output=include, max_tokens=len(token_ids))
    seq, deltas, _ = run(token_ids, params)
    want_text, want_stop = _reference_stop(text, stops, include)
    assert seq.text == want_text
    assert "".join(deltas) == want_text
    assert seq.stop_reason == want_stop
    assert seq.finish_reason == ("stop" if want_stop else "length")


# ---------------------------------------------------------------------------------------------
# stop tokens, EOS, lengths


def test_stop_token_id():
    seq, _, used = run([*ids("ab"), STOP, *ids("cd")], SamplingParams(stop_token_ids=[STOP], max_tokens=50))
    assert (seq.finish_reason, seq.stop_reason) == ("stop", STOP)
    assert seq.text == "ab" and seq.token_ids[-1] == STOP and used == len(ids("ab")) + 1


def test_stop_token_text_kept_with_include_stop_str():
    params = SamplingParams(stop_token_ids=[STOP], include_stop_str_in_output=True, skip_special_tokens=False)
    seq, _, _ = run([*ids("ab"), STOP], params)
    assert seq.text == "ab<stop>"


def test_eos_stops_with_no_stop_reason():
    seq, _, _ = run([*ids("ab"), EOS, *ids("cd")], SamplingParams(skip_special_tokens=False))
    assert (seq.finish_reason, seq.stop_reason) == ("stop", None)
    assert seq.text == "ab" and seq.token_ids[-1] == EOS


def test_ignore_eos_continues_to_max_tokens():
    token_ids = [*ids("a"), EOS, *ids("b"), EOS]
    seq, _, used = run(token_ids, SamplingParams(ignore_eos=True, max_tokens=4))
    assert (seq.finish_reason, seq.stop_reason) == ("length", None)
    assert used == 4 and seq.text == "ab"


def test_min_tokens_suppresses_eos_stop_ids_and_stop_strings():
    params = SamplingParams(min_tokens=3, stop=["x"], stop_token_ids=[STOP], max_tokens=10)
    token_ids = [EOS, STOP, *ids("x"), *ids("x")]
    seq, _, used = run(token_ids, params)
    assert used == 4 and seq.stop_reason == "x"
    assert seq.text == "x"  # the first "x" was inside min_tokens
    seq, _, used = run([*ids("a"), *ids("b"), *ids("c"), EOS], SamplingParams(min_tokens=3))
    assert used == 4 and seq.finish_reason == "stop"


def test_max_tokens_gives_length():
    seq, deltas, used = run(ids("hello world, the end is here"), SamplingParams(max_tokens=3))
    assert used == 3 and seq.finish_reason == "length" and seq.stop_reason is None
    assert "".join(deltas) == seq.text == TOK.decode(seq.token_ids)


def test_stop_string_on_last_token_beats_length():
    token_ids = ids("ab", "END")
    seq, _, _ = run(token_ids, SamplingParams(stop=["END"], max_tokens=len(token_ids)))
    assert (seq.finish_reason, seq.stop_reason, seq.text) == ("stop", "END", "ab")


def test_max_model_len_gives_length():
    prompt = ids("hello world")
    seq, _, used = run(ids("the end is here"), SamplingParams(max_tokens=None), prompt, max_model_len=len(prompt) + 2)
    assert used == 2 and seq.finish_reason == "length"


def test_held_back_text_is_flushed_at_length():
    token_ids = ids("ab", "EN")
    seq, deltas, _ = run(token_ids, SamplingParams(stop=["END"], max_tokens=len(token_ids)))
    assert seq.finish_reason == "length" and "".join(deltas) == "abEN" == seq.output_text


def test_append_after_finish_raises():
    seq, _, _ = run([*ids("a"), EOS], SamplingParams())
    with pytest.raises(RuntimeError, match="already finished"):
        seq.append(5)


def test_detokenize_false():
    seq, deltas, _ = run([*ids("ab"), EOS], SamplingParams(detokenize=False))
    assert seq.text == "" and set(deltas) == {""} and seq.finish_reason == "stop"
    with pytest.raises(ValueError, match="needs a tokenizer"):
        SequenceDetokenizer(None, SamplingParams())


def test_check_stop_directly():
    p = SamplingParams(stop_token_ids=[7], max_tokens=5, min_tokens=1)
    assert check_stop(p, 0, [], EOS, None) is None
    assert check_stop(p, 0, [7], EOS, None) is None  # index 1 <= min_tokens
    assert check_stop(p, 0, [3, 7], EOS, None) == ("stop", 7)
    assert check_stop(p, 0, [3, EOS], EOS, None) == ("stop", None)
    assert check_stop(p, 0, [3, 4, 5, 6, 8], EOS, None) == ("length", None)
    assert check_stop(p, 0, [3, EOS], None, None) is None
    assert check_stop(SamplingParams(max_tokens=None), 6, [3, 4], EOS, 8) == ("length", None)  # max_model_len
    assert check_stop(SamplingParams(max_tokens=None), 6, [3], EOS, 8) is None
    assert check_stop(SamplingParams(ignore_eos=True, max_tokens=9), 0, [EOS], EOS, None) is None
    assert check_stop(SamplingParams(max_tokens=2), 0, [3, EOS], EOS, None) == ("stop", None)  # stop beats length


# ---------------------------------------------------------------------------------------------
# outputs


def test_logprobs_dict_and_completion_output():
    d = sample_logprobs_dict(5, -2.0, 3, [9, 4, 5], [-0.5, -1.0, -2.0], decode=lambda i: f"<{i}>")
    assert list(d) == [5, 9, 4]
    assert d[5] == Logprob(-2.0, 3, "<5>") and d[9] == Logprob(-0.5, 1, "<9>")
    out = CompletionOutput(0, "hi", [5], -2.0, [d])
    assert not out.finished()
    out.finish_reason = "stop"
    assert out.finished()


# ---------------------------------------------------------------------------------------------
# deferred text (the engine decodes it while the device computes the next step)

_PIECES = [*"ab €é你好🙂\n", "hello", " world", "END"]


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.one_of(st.sampled_from(_PIECES).map(lambda p: TOK.encode(p).ids), st.just([EOS]), st.just([STOP])),
             max_size=25).map(lambda parts: [i for p in parts for i in p]),
    st.fixed_dictionaries({
        "stop": st.sampled_from([[], ["END"]]), "stop_token_ids": st.sampled_from([[], [STOP]]),
        "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
        "ignore_eos": st.booleans(), "min_tokens": st.integers(0, 3), "max_tokens": st.integers(3, 40),
    }),
    st.sets(st.integers(0, 40)),
)
def test_deferred_text_matches_immediate_text(token_ids, params, catch_up_after):
    """Whatever tokens arrive and whenever the engine catches up, a deferred sequence ends with the same tokens,
    text, finish and stop reasons as one detokenized token by token, and its streamed deltas add up to its text."""
    params = SamplingParams(**params)
    want, _, used = run(token_ids, params, prompt=ids("hello"))
    got = Completion(TOK, params, ids("hello"))
    streamed = []
    for n, token in enumerate(token_ids[:used]):
        update = got.append(token, defer_text=True)
        streamed.append(update.delta_text)
        if update.finished:
            assert not got.has_deferred_text  # a finished sequence has its whole text
            break
        assert got.has_deferred_text == (not params.stop)  # deferred exactly when no stop string can end it
        if n in catch_up_after:
            streamed.append(got.catch_up())
            assert not got.has_deferred_text
    streamed.append(got.catch_up())
    assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
        want.token_ids, want.text, want.finish_reason, want.stop_reason)
    assert "".join(streamed) == got.output_text


def test_text_is_deferred_only_without_stop_strings():
    seq = Completion(TOK, SamplingParams(max_tokens=10))
    assert seq.append(ids("a")[0], defer_text=True).delta_text == "" and seq.has_deferred_text and seq.text == ""
    assert seq.catch_up() == "a" and seq.text == "a" and not seq.has_deferred_text
    with_stop = Completion(TOK, SamplingParams(stop=["x"], max_tokens=10))
    with_stop.append(ids("a")[0], defer_text=True)
    assert not with_stop.has_deferred_text and with_stop.text == "a"  # a stop string needs the text at once

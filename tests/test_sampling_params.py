"""SamplingParams: defaults, normalisation, aliases and every validation error."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer_core.sampling import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.seed is None and p.stop == [] and p.stop_token_ids == []
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens and p.detokenize and not p.ignore_eos and not p.include_stop_str_in_output


def test_positional_arguments_are_rejected():
    with pytest.raises(TypeError):
        SamplingParams(2)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"n": 1.5}, "n must be an int, got 1.5"),
        ({"temperature": -1}, "temperature must be >= 0, got -1"),
        ({"temperature": float("nan")}, "temperature must not be NaN"),
        ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
        ({"top_p": 1.01}, "top_p must be in (0, 1], got 1.01"),
        ({"top_p": -0.5}, "top_p must be in (0, 1], got -0.5"),
        ({"top_k": -2}, "top_k must be 0 or -1 (off) or >= 1, got -2"),
        ({"top_k": 2.0}, "top_k must be an int, got 2.0"),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0 and finite, got 0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be > 0 and finite, got -1.0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be > 0 and finite, got inf"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"presence_penalty": -2.01}, "presence_penalty must be in [-2, 2], got -2.01"),
        ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2], got 3"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3"),
        ({"seed": 1.5}, "seed must be an int or None, got 1.5"),
        ({"seed": True}, "seed must be an int or None, got True"),
        ({"seed": 1, "seq_seed": 2}, "seed and seq_seed are aliases but differ: seed=1, seq_seed=2"),
        ({"max_tokens": 0}, "max_tokens must be >= 1 or None, got 0"),
        ({"max_tokens": 3.0}, "max_tokens must be an int or None, got 3.0"),
        ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be <= max_tokens (4), got 5"),
        ({"logprobs": -1}, "logprobs must be >= 0 or None, got -1"),
        ({"logprobs": 1.0}, "logprobs must be an int or None, got 1.0"),
        ({"prompt_logprobs": -3}, "prompt_logprobs must be >= 0 or None, got -3"),
        ({"stop": ["a", ""]}, "stop must not contain an empty string"),
        ({"stop": ""}, "stop must not contain an empty string"),
        ({"stop": ["a", 3]}, "stop must contain only strings, got 3"),
        ({"stop": 3}, "stop must be a str, a list of str or None, got 3"),
        ({"stop": "x", "detokenize": False}, "stop strings need detokenize=True"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids must contain ints >= 0, got -1"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids must contain ints >= 0, got '2'"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of int or None, got 5"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool, got 1"),
        ({"detokenize": "yes"}, "detokenize must be a bool, got 'yes'"),
        ({"skip_special_tokens": None}, "skip_special_tokens must be a bool, got None"),
        ({"include_stop_str_in_output": 0}, "include_stop_str_in_output must be a bool, got 0"),
    ],
)
def test_bad_values_raise_value_error_naming_them(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError):
        SamplingParams(best_of=3)  # type: ignore[call-arg]


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_off_is_zero_or_minus_one(top_k):
    assert SamplingParams(top_k=top_k).top_k == 0


def test_stop_string_becomes_list_and_none_empty():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []


def test_greedy_resets_filters():
    p = SamplingParams(temperature=0, top_p=0.5, top_k=3, min_p=0.2)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert p.sampling_type == "greedy"
    assert SamplingParams(temperature=0.7).sampling_type == "random"


def test_seed_aliases():
    assert SamplingParams(seq_seed=7).seed == 7
    assert SamplingParams(seed=7).seq_seed == 7
    assert SamplingParams(seed=7, seq_seed=7).seed == 7
    assert SamplingParams(seed=None).seed is None


def test_max_tokens_none_allows_any_min_tokens():
    assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000


def test_clone_is_deep_and_equal():
    p = SamplingParams(stop=["a"], stop_token_ids=[3], seed=1)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("b")
    q.stop_token_ids.append(4)
    assert p.stop == ["a"] and p.stop_token_ids == [3]


def test_dataclasses_replace_revalidates():
    p = SamplingParams(temperature=0.5)
    assert dataclasses.replace(p, top_k=4).top_k == 4
    with pytest.raises(ValueError, match="top_p must be in"):
        dataclasses.replace(p, top_p=2.0)


def test_all_stop_token_ids():
    p = SamplingParams(stop_token_ids=[5, 6])
    assert p.all_stop_token_ids(2) == {2, 5, 6}
    assert p.all_stop_token_ids(None) == {5, 6}
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).all_stop_token_ids(2) == {5}


@given(
    temperature=st.floats(0, 10),
    top_p=st.floats(0, 1, exclude_min=True),
    top_k=st.integers(-1, 1000),
    min_p=st.floats(0, 1),
    pres=st.floats(-2, 2),
    freq=st.floats(-2, 2),
    rep=st.floats(1e-3, 10),
    max_tokens=st.integers(1, 100),
    data=st.data(),
)
def test_valid_values_are_accepted(temperature, top_p, top_k, min_p, pres, freq, rep, max_tokens, data):
    min_tokens = data.draw(st.integers(0, max_tokens))
    p = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, presence_penalty=pres,
        frequency_penalty=freq, repetition_penalty=rep, max_tokens=max_tokens, min_tokens=min_tokens,
    )
    assert p.top_k >= 0 and p.min_tokens == min_tokens and p.max_tokens == max_tokens
    if temperature > 0:
        assert (p.top_p, p.min_p) == (top_p, min_p)

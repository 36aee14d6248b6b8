"""What ``LLM`` refuses up front (float token ids, text that is not UTF-8, a max_model_len past the model's positions)
and ``LLM.stream``, the step-by-step ``generate``."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from v4_factory import tiny_checkpoint

from deepinfer_core.engine_args import EngineArgsError
from deepinfer_core.llm import LLM
from deepinfer_core.sampling.params import SamplingParams

pytest.importorskip("transformers")

MAX_POSITIONS = 4096  # tiny_hf_config's max_position_embeddings


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_requests")
    tiny_checkpoint(folder)
    return folder


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(str(checkpoint), max_num_seqs=4, seed=0)


def test_a_float_token_id_is_refused_for_its_prompt_only(llm):
    params = SamplingParams(max_tokens=2, temperature=0)
    outputs = llm.generate([{"prompt_token_ids": [3, 1.7, 5]}, {"prompt_token_ids": [3, 1.0]},
                            {"prompt_token_ids": [3, np.int64(4), 5]}, {"prompt_token_ids": [3, True]}], params,
                           use_tqdm=False)
    assert outputs[0].error == "prompt token id 1.7 at position 1 is not an integer; token ids are ints"
    assert outputs[0].outputs == [] and outputs[0].prompt_token_ids is None
    assert "1.0 at position 1 is not an integer" in outputs[1].error  # a float that happens to be whole too
    assert outputs[2].error is None and outputs[2].prompt_token_ids == [3, 4, 5]  # integer numpy scalars are ints
    assert len(outputs[2].outputs[0].token_ids) == 2
    assert "True at position 1 is not an integer" in outputs[3].error


def test_text_that_is_not_utf8_is_refused_by_name(llm):
    text = b"w1 \xff w2".decode("utf-8", "surrogateescape")  # what Python makes of a non-UTF-8 command-line byte
    outputs = llm.generate([text, "w1 w2"], SamplingParams(max_tokens=1), use_tqdm=False)
    assert outputs[0].error == "the text is not valid UTF-8 (byte 0xff at character 3); pass UTF-8 text"
    assert outputs[0].prompt == text and outputs[1].error is None


def test_max_model_len_past_the_models_positions_is_refused_before_loading(checkpoint, monkeypatch):
    monkeypatch.delenv("DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(EngineArgsError) as caught:
        LLM(str(checkpoint), max_model_len=99999)
    message = str(caught.value)
    assert f"max_model_len=99999 is longer than the model's max_position_embeddings={MAX_POSITIONS}" in message
    assert "DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN=1" in message


def test_the_override_accepts_it_with_a_warning(checkpoint, monkeypatch, caplog):
    monkeypatch.setenv("DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN", "1")
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        llm = LLM(str(checkpoint), max_model_len=MAX_POSITIONS + 8, max_num_seqs=1)
    assert llm.max_model_len == MAX_POSITIONS + 8
    assert "running anyway (DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN=1)" in caplog.text


def test_stream_grows_each_prompts_output_to_what_generate_returns(llm):
    prompts = ["w1 w2 w3", {"prompt_token_ids": [3, 0.5]}, "w4"]
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=7, n=2, ignore_eos=True)
    snapshots = list(llm.stream(prompts, params))
    final = llm.generate(prompts, params, use_tqdm=False)
    assert len(snapshots) >= 6  # one per engine step
    assert [o.finished for o in snapshots[0]] == [False, True, False]  # the refused prompt is done from the start
    assert snapshots[1][1].error == final[1].error
    for i in (0, 2):
        for j in range(2):
            seen = [s[i].outputs[j] for s in snapshots]
            lengths = [len(c.token_ids) for c in seen]
            assert lengths == sorted(lengths) and lengths[0] < lengths[-1] == 6
            assert all(final[i].outputs[j].text.startswith(c.text) for c in seen)  # only ever grows
            assert seen[-1].text == final[i].outputs[j].text
            assert list(seen[-1].token_ids) == list(final[i].outputs[j].token_ids)
        assert snapshots[-1][i].finished and not snapshots[0][i].finished


def _random_prompt(length: int, seed: int) -> dict:
    """``length`` random token ids of the tiny checkpoint's vocabulary (64), away from its special ids."""
    gen = np.random.default_rng(seed)
    return {"prompt_token_ids": gen.integers(3, 64, length).tolist()}


def test_num_cached_tokens_counts_a_repeated_prompts_prefix_hit(llm):
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    prompt = _random_prompt(50, seed=34)
    block = llm.engine.config.block_size
    fresh, = llm.generate(prompt, params, use_tqdm=False)
    again, = llm.generate(prompt, params, use_tqdm=False)
    assert fresh.num_cached_tokens == 0
    assert again.num_cached_tokens == (50 - 1) // block * block  # whole blocks, one token at least left to compute
    assert 0 < again.num_cached_tokens < 50 and again.num_cached_tokens % block == 0
    group, = llm.generate(prompt, SamplingParams(max_tokens=2, n=2, seed=1, ignore_eos=True), use_tqdm=False)
    assert group.num_cached_tokens == again.num_cached_tokens  # one value per request, as vLLM reports
    streamed = [outputs[0].num_cached_tokens for outputs in llm.stream([prompt], params)]
    assert streamed[-1] == again.num_cached_tokens and len(streamed) >= 2


def test_num_cached_tokens_is_0_with_prefix_caching_off(checkpoint):
    llm = LLM(str(checkpoint), max_num_seqs=2, seed=0, enable_prefix_caching=False)
    prompt = _random_prompt(50, seed=35)
    params = SamplingParams(max_tokens=1, temperature=0)
    outputs = [llm.generate(prompt, params, use_tqdm=False)[0] for _ in range(2)]
    assert [o.num_cached_tokens for o in outputs] == [0, 0] and outputs[1].error is None

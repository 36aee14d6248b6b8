"""``LLM(..., enable_swa_replay=True)`` on tiny models (fp32, CPU): what a hit adopts and recomputes, and how close
its outputs stay to exact reuse."""

from __future__ import annotations

import dataclasses
import sysconfig
from pathlib import Path

import pytest
import torch
from deepinfer_swa_replay import measure, stats

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.state_manager import chain_hashes

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
WINDOW = 8  # the factory's sliding window
BLOCK = 8  # the factory's compression ratios are 4 and 8
VOCAB = 64


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _llm(folder, **kwargs) -> LLM:
    return LLM(str(folder), block_size=BLOCK, max_num_seqs=4, **kwargs)


def _recording(llm: LLM) -> list[list[tuple[str, int, int]]]:
    """Every step's chunks as (request id, start, tokens), recorded as the engine plans them."""
    return pytest.importorskip("v4_factory").record_steps(llm)


def _same(a, b) -> bool:
    """Two outputs with the same tokens and bit-identical logprobs."""
    return a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs


def test_a_hit_adopts_up_to_l_minus_window_plus_6_and_replays_exactly_the_window(tiny_ckpt):
    llm = _llm(tiny_ckpt, enable_swa_replay=True)
    prompt = _tokens(110, seed=1)
    llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)  # caches 104 tokens of it (13 blocks)
    steps = _recording(llm)
    again, = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    adopted = (110 - (WINDOW + 6)) // BLOCK * BLOCK  # 96 of the 104 cached tokens
    assert again.num_cached_tokens == adopted  # what the request took from the cache, not what the cache held
    (_, start, computed), = steps[0]
    assert (start, computed) == (adopted - WINDOW, 110 - adopted + WINDOW)
    assert adopted - start == WINDOW  # the replayed span: the window, not layers x window + carry (64 here)
    assert llm.model.prefix_replay_span() == 6 * WINDOW + 2 * BLOCK
    counts = stats(llm.context)
    assert (counts.hits_adopted, counts.tokens_offered, counts.tokens_adopted, counts.tokens_replayed) == (
        1, 104, adopted, WINDOW)


def test_the_request_reads_only_the_adopted_blocks(tiny_ckpt):
    llm = _llm(tiny_ckpt, enable_swa_replay=True)
    prompt = _tokens(110, seed=2)
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)
    cached = [llm.engine.state_manager.cached[h] for h in chain_hashes(prompt, BLOCK)]
    admitted = []
    admit = llm.engine.scheduler._admit

    def spy(request, budget, chunks):
        chunk = admit(request, budget, chunks)
        if chunk is not None:
            admitted.append((list(request.block_ids), request.num_cached_tokens, request.replay_until,
                             request.sliding_floor))
        return chunk

    llm.engine.scheduler._admit = spy
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)
    (blocks, num_cached, replay_until, floor), = admitted
    assert blocks[:12] == cached[:12] and cached[12] not in blocks  # block 12 (tokens 96..103) is not adopted
    assert (num_cached, replay_until, floor) == (96, 96, 96 - WINDOW)


def test_hits_not_above_the_window_are_not_adopted(tiny_ckpt):
    llm, cold = _llm(tiny_ckpt, enable_swa_replay=True), _llm(tiny_ckpt, enable_prefix_caching=False)
    prompt = _tokens(29, seed=3)  # 24 tokens cached; 29 - 14 = 15 -> 8 tokens, not above the window of 8
    llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    steps = _recording(llm)
    again = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    assert steps[0] == [(steps[0][0][0], 0, 29)]
    assert stats(llm.context).hits_dropped == 1 and stats(llm.context).hits_adopted == 0
    assert _same(again[0], cold.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0])


def _exact_reuse_against_cold(folder, **options) -> list[tuple[object, object]]:
    """(after a hit, cold) outputs of a repeated prompt and of a prompt sharing 120 tokens, without bounded replay;
    both hits replay from a start above token 0 (H - span)."""
    llm, cold = _llm(folder, **options), _llm(folder, enable_prefix_caching=False, **options)
    prompts = [_tokens(150, seed=4), _tokens(150, seed=4)[:120] + _tokens(40, seed=5)]
    llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, use_tqdm=False)
    steps = _recording(llm)
    after = [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [s[0][1] for s in steps if s and s[0][2] > 1] == [144 - 64, 120 - 64]
    return [(a, cold.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0]) for a, p in zip(after, prompts)]


def test_without_the_plugin_outputs_after_a_hit_equal_a_cold_run(tiny_ckpt):
    """The exact rebuild (the default): the same tokens; logprobs equal to float32 rounding (the cached compressed
    entries came from a GEMM over another number of rows than the cold run's)."""
    for after, cold in _exact_reuse_against_cold(tiny_ckpt):
        assert after.outputs[0].token_ids == cold.outputs[0].token_ids
        for mine, theirs in zip(after.outputs[0].logprobs, cold.outputs[0].logprobs):
            assert mine.keys() == theirs.keys()
            assert all(abs(mine[t].logprob - theirs[t].logprob) <= 1e-5 for t in mine)


def test_without_the_plugin_a_hit_is_bit_identical_in_batch_invariant_mode(tiny_ckpt):
    pytest.importorskip("deepinfer_batch_invariant")
    assert all(_same(after, cold) for after, cold in _exact_reuse_against_cold(tiny_ckpt, batch_invariant=True))


def test_with_the_plugin_outputs_after_a_hit_differ_from_exact_reuse(tiny_ckpt):
    """Not bit-identical by design: the window KV before the hit is rebuilt from the window alone."""
    exact, replay = _llm(tiny_ckpt), _llm(tiny_ckpt, enable_swa_replay=True)
    prompts = [_tokens(110, seed=s) for s in (6, 7)]
    result = measure(exact, replay, prompts, max_tokens=8, top_k=5)
    assert stats(replay.context).hits_adopted == 2
    assert result.max_first_token_diff > 1e-3


def test_a_cached_block_holds_no_sliding_window_kv(tiny_ckpt):
    """The sliding rings live in the per-sequence slot: a cached block holds compressed entries and indexer keys
    only, so its size does not depend on the window, with or without the plugin."""
    from deepinfer_core.models.deepseek_v4.state import DeepseekV4State

    llm = _llm(tiny_ckpt, enable_swa_replay=True)
    state, config = llm.engine.runner.state, llm.model.config
    paged = {g.name for g in state.groups if g.paged}
    assert paged and all(name.endswith((":compressed", ":index_keys")) for name in paged)
    assert all(ring.shape[:2] == (state.num_slots, WINDOW) for ring in state.swa.values())
    assert all(t.shape[0] == state.num_blocks for t in (*state.compressed.values(), *state.index_keys.values()))
    wider = dataclasses.replace(config, sliding_window=4 * WINDOW)
    per_block = DeepseekV4State.bytes_per_block(config, BLOCK, torch.float32)
    assert per_block == DeepseekV4State.bytes_per_block(wider, BLOCK, torch.float32)
    assert DeepseekV4State.bytes_per_slot(wider, BLOCK, torch.float32) > DeepseekV4State.bytes_per_slot(
        config, BLOCK, torch.float32)


HELDOUT = ("inspect.py", "http/cookies.py", "modulefinder.py")  # held out of the tiny model's training text
#: Measured on the embedded tiny model (fp32, Python 3.11.7's copies of the files): largest first-token difference
#: 0.0016 (mean 0.0007), every greedy token the same. The bounds leave room for another Python's copies.
MAX_FIRST_TOKEN_DIFF = 0.02
MIN_GREEDY_AGREEMENT = 0.9


def test_the_embedded_model_stays_close_to_exact_reuse_on_held_out_text():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    exact = LLM(dtype="float32")
    replay = LLM(dtype="float32", enable_swa_replay=True, enable_prefix_state_cache=False)  # no exact restore first
    texts = [exact.get_tokenizer().encode((stdlib / rel).read_text(encoding="utf-8"))
             for rel in HELDOUT if (stdlib / rel).is_file()]
    if not texts:
        pytest.skip("none of the held-out standard library files is here")
    result = measure(exact, replay, [ids[:256 + 134] for ids in texts], max_tokens=8, top_k=20)
    assert stats(replay.context).tokens_adopted == 256 * len(texts)
    assert 0 < result.max_first_token_diff < MAX_FIRST_TOKEN_DIFF
    assert result.greedy_agreement >= MIN_GREEDY_AGREEMENT

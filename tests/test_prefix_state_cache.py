"""The prefix state cache's device tier (``engine/prefix_state_cache.py``), on by default: a hit restored from a
boundary's kept state computes only the tokens after it and equals a cold run (fp32, CPU, a tiny V4 model)."""

from __future__ import annotations

import math

import pytest
import torch
from v4_factory import ALL_TYPES, record_prompt_chunks, record_steps, tiny_checkpoint

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.prefix_state_cache import (
    DEVICE_METRICS,
    PREFIX_STATE_SPLIT_MIN_TOKENS,
    PrefixStateCache,
    PrefixStateStats,
    partial_key,
)
from deepinfer_core.engine.state_manager import chain_hashes
from deepinfer_core.engine_args import EngineArgsError
from deepinfer_core.metrics import MetricsRegistry

pytest.importorskip("transformers")

BLOCK = 8
MIN_CHUNK = 8  # the factory's window and carry spans: the shortest static chunk (a split's shortest part)
VOCAB = 64
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prefix_state") / "ckpt"
    tiny_checkpoint(folder, layer_types=ALL_TYPES * 2, hc_mult=2)
    return folder


def _llm(folder, **kwargs) -> LLM:
    kwargs.setdefault("block_size", BLOCK)
    kwargs.setdefault("max_num_seqs", 4)
    return LLM(str(folder), **kwargs)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _metrics(llm: LLM) -> dict[str, float]:
    return {name.removeprefix("deepinfer:prefix_state_cache_"): value for name, value in
            ((m.name, m.value) for m in llm.get_metrics()) if name.startswith("deepinfer:prefix_state_cache_")}


def _assert_same(got, want) -> None:
    """Same greedy tokens, logprobs of the same top tokens within fp32 rounding."""
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for mine, theirs in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
        assert mine.keys() == theirs.keys()
        assert all(abs(mine[t].logprob - theirs[t].logprob) <= 1e-5 for t in mine)


def _slot(value: float) -> list[torch.Tensor]:
    return [torch.full((8, 8), value), torch.full((4, 8), value)]  # 384 bytes


def test_the_store_is_an_lru_within_its_bytes_and_keeps_entries_without_a_ttl():
    clock = [0.0]
    cache = PrefixStateCache(capacity_bytes=2 * 384, clock=lambda: clock[0])
    cache.store(b"a", _slot(1.0))
    cache.store(b"b", _slot(2.0))
    clock[0] = 1e9  # no TTL on the device tier
    assert cache.find([b"x", b"a"])[0] == 1  # a is now the most recently used
    cache.store(b"c", _slot(3.0))
    assert list(cache.entries) == [b"a", b"c"] and cache.stats.evictions.value == 1
    assert cache.ttl_s == math.inf and cache.stats.expirations.value == 0
    target = _slot(0.0)
    cache.restore(cache.find([b"c"])[1], target)
    assert all(torch.equal(t, s) for t, s in zip(target, _slot(3.0)))
    assert cache.store(b"big", [torch.zeros(1000)]) is None and len(cache) == 2
    stats, registry = PrefixStateStats(), MetricsRegistry()
    stats.stores.inc(2)
    stats.register(registry)
    assert registry.get(DEVICE_METRICS["stores"][0]).value == 2


def test_states_inside_a_block_are_indexed_by_their_parent_until_evicted():
    """Entries inside a block are found by their parent hash and token count (``partial_lengths``), which follows
    eviction; their key differs from a full block's hash of the same tokens."""
    cache = PrefixStateCache(capacity_bytes=2 * 384)
    first, second = partial_key(b"p", [3, 4]), partial_key(b"p", [5, 6, 7])
    cache.store(first, _slot(1.0), (b"p", 2))
    cache.store(second, _slot(2.0), (b"p", 3))
    assert dict(cache.partial_lengths[b"p"]) == {2: 1, 3: 1}
    cache.store(b"boundary", _slot(3.0))  # evicts the first
    assert dict(cache.partial_lengths[b"p"]) == {3: 1} and cache.find([first]) is None
    cache.store(b"other", _slot(4.0))  # evicts the second
    assert cache.partial_lengths == {} and cache.stats.evictions.value == 2
    assert partial_key(b"", list(range(BLOCK))) != chain_hashes(list(range(BLOCK)), BLOCK)[0]


def _record_chunks(llm) -> list[tuple[str, int, int]]:
    """A list that fills with ``(request id, start, tokens)`` of every chunk ``llm``'s engine plans from now on."""
    chunks: list[tuple[str, int, int]] = []
    schedule = llm.engine.scheduler.schedule

    def recorded():
        output = schedule()
        chunks.extend((c.request.request_id, c.start, c.num_tokens) for c in output.chunks)
        return output

    llm.engine.scheduler.schedule = recorded
    return chunks


@pytest.mark.parametrize("length", [7, 33, 40, 45, 61, 64])
def test_the_same_prompt_again_computes_only_its_last_token_and_equals_a_cold_run(ckpt, length):
    """With the split on for every length, an L-token prompt is prefilled up to L - 1 and its last token runs alone;
    the state there (slot and partial block) is kept, and the same prompt again computes only its last token, as a
    cold run would answer (L inside the first block, one past a boundary, a multiple of the block, in between)."""
    llm, cold = _llm(ckpt, prefix_state_split_min_tokens=1), _llm(ckpt, enable_prefix_caching=False)
    prompt = {"prompt_token_ids": _tokens(length, seed=length)}
    chunks = _record_chunks(llm)
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert [c[1:] for c in chunks[:3]] == [(0, length - 1), (length - 1, 1), (length, 1)]
    del chunks[:]
    got = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert chunks[0][1:] == (length - 1, 1) and all(n == 1 for _, _, n in chunks)
    assert (first.num_cached_tokens, got.num_cached_tokens) == (0, length - 1)
    assert _metrics(llm)["hits"] == 1 and _metrics(llm)["stores"] >= 1
    want = cold.generate(prompt, GREEDY, use_tqdm=False)[0]
    _assert_same(first, want)
    _assert_same(got, want)


def test_a_longer_prompt_starting_with_the_kept_tokens_is_restored_there(ckpt):
    """A prompt whose first tokens are another prompt's all but last (45 - 1 = 44, inside the sixth block) is
    restored at 44 and computes the rest, as a cold run."""
    llm, cold = _llm(ckpt, prefix_state_split_min_tokens=1), _llm(ckpt, enable_prefix_caching=False)
    base = _tokens(45, seed=5)
    llm.generate({"prompt_token_ids": base}, GREEDY, use_tqdm=False)
    longer = {"prompt_token_ids": base[:44] + _tokens(9, seed=6)}
    got = llm.generate(longer, GREEDY, use_tqdm=False)[0]
    assert got.num_cached_tokens == 44 and _metrics(llm)["hits"] == 1
    _assert_same(got, cold.generate(longer, GREEDY, use_tqdm=False)[0])


def test_a_split_prompts_last_token_runs_with_the_next_prompt_step(ckpt):
    """Without mixed chunks, decodes wait for a step without prompt work; a prompt's last token left by the split is
    prompt work: it runs in the very next step, beside another prompt's chunk, and samples its first token there."""
    llm = _llm(ckpt, prefix_state_split_min_tokens=1, max_num_batched_tokens=64)
    steps = record_steps(llm)
    prompts = [{"prompt_token_ids": _tokens(n, seed=n)} for n in (40, 30)]
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    first, second = (f"{o.request_id}-0" for o in got)  # the engine's request of each prompt's sample 0
    assert steps[0] == [(first, 0, 39), (second, 0, 25)]
    assert steps[1] == [(first, 39, 1), (second, 25, 5)]
    want = _llm(ckpt, enable_prefix_caching=False).generate(prompts, GREEDY, use_tqdm=False)
    for a, b in zip(got, want, strict=True):
        _assert_same(a, b)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_hits_in_a_batch_with_n_2_seeds_and_prompt_logprobs_equal_a_cold_run(ckpt, async_scheduling):
    """Kept prompts sent again in one batch: greedy, n = 2 seeded sampling, and one asking for prompt logprobs (no
    restore: it computes every prompt row, its prompt not split), beside a fresh prompt; all as a cold engine."""
    llm = _llm(ckpt, prefix_state_split_min_tokens=1, async_scheduling=async_scheduling)
    cold = _llm(ckpt, enable_prefix_caching=False, async_scheduling=async_scheduling)
    prompts = [{"prompt_token_ids": _tokens(n, seed=n)} for n in (40, 29, 37)]
    llm.generate(prompts, GREEDY, use_tqdm=False)
    seeded = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=10, ignore_eos=True, logprobs=3)
    with_prompt = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=3)
    batch = prompts + [{"prompt_token_ids": _tokens(26, seed=26)}]
    params = [GREEDY, seeded, with_prompt, GREEDY]
    chunks = _record_chunks(llm)
    got = llm.generate(batch, params, use_tqdm=False)
    want = cold.generate(batch, params, use_tqdm=False)
    assert [o.num_cached_tokens for o in got] == [39, 28, 0, 0]
    assert any(n == 37 for _, _, n in chunks)  # the prompt-logprobs request computed its whole prompt in one chunk
    _assert_same(got[0], want[0])
    for a, b in zip(got[1].outputs, want[1].outputs, strict=True):
        assert a.token_ids == b.token_ids
        assert all(abs(x[t].logprob - y[t].logprob) <= 1e-5 for x, y, t in zip(a.logprobs, b.logprobs, b.token_ids))
    assert len(got[2].prompt_logprobs) == 37
    for x, y in zip(got[2].prompt_logprobs[1:], want[2].prompt_logprobs[1:], strict=True):
        assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) <= 1e-5 for t in x)
    _assert_same(got[2], want[2])
    _assert_same(got[3], want[3])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_next_turns_in_a_batch_are_restored_and_equal_a_cold_run(ckpt, async_scheduling):
    """Three conversations, then their next turns (prompt, 8 output tokens, new tokens) in one batch beside a fresh
    prompt: each next turn is restored at the boundary its first turn's decode filled, by default settings."""
    llm = _llm(ckpt, async_scheduling=async_scheduling)
    cold = _llm(ckpt, enable_prefix_caching=False, async_scheduling=async_scheduling)
    firsts = [_tokens(n, seed=n) for n in (40, 35, 29)]
    outs = llm.generate([{"prompt_token_ids": p} for p in firsts], GREEDY, use_tqdm=False)
    follows = [p + list(o.outputs[0].token_ids[:8]) + _tokens(7, seed=i) for i, (p, o) in
               enumerate(zip(firsts, outs))] + [_tokens(30, seed=99)]
    prompts = [{"prompt_token_ids": p} for p in follows]
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    want = cold.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in got] == [48, 40, 32, 0]
    assert _metrics(llm)["hits"] == 3
    for a, b in zip(got, want, strict=True):
        _assert_same(a, b)


@pytest.mark.parametrize("split", [4096, 1])
def test_preempted_requests_come_back_restored(ckpt, split):
    """Four requests in room for two: the preempted ones come back restored at the last boundary a step of theirs
    ended on (or, with every prompt split, inside a block), and finish with a cold engine's tokens."""
    probe = _llm(ckpt).model.state_bytes(BLOCK, torch.float32)
    budget = 4 * probe.per_slot + 10 * probe.per_block  # 4 sequences want 4 x 6 blocks
    prompts = [{"prompt_token_ids": _tokens(n, seed=n)} for n in (30, 33, 29, 31)]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=1)
    tight = _llm(ckpt, kv_cache_memory_bytes=budget, prefix_state_split_min_tokens=split)
    got = tight.generate(prompts, params, use_tqdm=False)
    want = _llm(ckpt, enable_prefix_caching=False).generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0 and _metrics(tight)["hits"] > 0
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert all(abs(x[t].logprob - y[t].logprob) <= 1e-5
                   for x, y, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, b.outputs[0].token_ids))
    tight.engine.state_manager.check_invariants([])


def test_eviction_under_a_small_budget_falls_back_to_the_exact_rebuild(ckpt):
    """Room for one entry (a slot and a block: a state kept inside a block): the second prompt's store evicts the
    first's. The second again is restored at 44 (all but its last token); the first again misses and is rebuilt by
    the exact replay (from token 0 before its 40-token hit), as a cold run, and its state at 44 is kept again."""
    probe = _llm(ckpt).model.state_bytes(BLOCK, torch.float32)
    entry = probe.per_slot + probe.per_block
    llm = _llm(ckpt, prefix_state_cache_bytes=entry, prefix_state_split_min_tokens=1)
    cold = _llm(ckpt, enable_prefix_caching=False)
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=5)  # no decode boundary
    first, second = ({"prompt_token_ids": _tokens(45, seed=s)} for s in (1, 2))
    llm.generate(first, short, use_tqdm=False)
    llm.generate(second, short, use_tqdm=False)
    chunks = record_prompt_chunks(llm)
    restored = llm.generate(second, short, use_tqdm=False)[0]
    rebuilt = llm.generate(first, short, use_tqdm=False)[0]
    metrics = _metrics(llm)
    assert (metrics["evictions"], metrics["hits"], metrics["misses"]) == (2, 1, 1)
    assert chunks == [(0, 44)]  # the restore computes one token; the rebuild is split again
    assert (restored.num_cached_tokens, rebuilt.num_cached_tokens) == (44, 40)
    _assert_same(restored, cold.generate(second, short, use_tqdm=False)[0])
    _assert_same(rebuilt, cold.generate(first, short, use_tqdm=False)[0])
    assert metrics["bytes"] == entry


def test_on_by_default_off_without_prefix_caching_and_only_long_prompts_are_split(ckpt):
    llm = _llm(ckpt)
    assert llm.engine.state_cache is not None and llm.engine.state_cache.split_min_tokens == PREFIX_STATE_SPLIT_MIN_TOKENS
    chunks = record_prompt_chunks(llm)
    llm.generate({"prompt_token_ids": _tokens(40, seed=3)}, GREEDY, use_tqdm=False)
    long = {"prompt_token_ids": _tokens(PREFIX_STATE_SPLIT_MIN_TOKENS, seed=4)}
    llm.generate(long, GREEDY, use_tqdm=False)
    assert chunks == [(0, 40), (0, PREFIX_STATE_SPLIT_MIN_TOKENS - 1)]  # the long prompt's last token runs alone
    chunks.clear()
    again = llm.generate(long, GREEDY, use_tqdm=False)[0]
    assert chunks == [] and again.num_cached_tokens == PREFIX_STATE_SPLIT_MIN_TOKENS - 1
    assert _llm(ckpt, enable_prefix_caching=False).engine.state_cache is None
    assert _llm(ckpt, enable_prefix_state_cache="false").engine.state_cache is None
    assert _llm(ckpt, prefix_state_split_min_tokens=0).engine.state_cache.split_min_tokens == 0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"enable_prefix_state_cache": "maybe"}, "enable_prefix_state_cache must be True, False or None"),
    ({"enable_prefix_state_cache": True, "enable_prefix_caching": False}, "needs enable_prefix_caching=True"),
    ({"prefix_state_cache_bytes": 0}, "prefix_state_cache_bytes must be a positive integer"),
    ({"prefix_state_cache_bytes": 1 << 20, "enable_prefix_state_cache": False}, "give one of them"),
    ({"prefix_state_cache_bytes": 1 << 20, "enable_prefix_caching": False}, "enable_prefix_caching=False turns off"),
    ({"prefix_state_cache_bytes": 1 << 20, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "prefix_state_cache_bytes asks for the prefix state cache"),
    ({"prefix_state_split_min_tokens": -1}, "prefix_state_split_min_tokens must be an integer >= 0"),
    ({"enable_prefix_state_cache": True, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "draft state"),
])
def test_bad_arguments_are_refused_naming_them(ckpt, kwargs, message):
    with pytest.raises(EngineArgsError, match=message):
        _llm(ckpt, **kwargs)


def test_the_split_and_the_restored_hit_run_the_last_token_through_the_decode_graph():
    """The embedded model (block 128) with decode and prefill graphs (run eagerly on CPU): a 512-token prompt is
    prefilled to 511 through the 512 bucket's graph and its last token runs through the one-sequence decode graph;
    sent again it is restored at 511 and every step of it is a decode graph's, and the outputs equal a cold eager
    run."""
    kwargs = {"max_model_len": 1024, "max_num_seqs": 2, "kv_cache_memory_bytes": 64 << 20, "dtype": "float32"}
    llm = LLM(cuda_graph_sizes=[1], prefill_graph_buckets=[128, 512], prefix_state_split_min_tokens=1, **kwargs)
    cold = LLM(enable_prefix_caching=False, **kwargs)
    prompt = {"prompt_token_ids": torch.randint(5, 1000, (512,), generator=torch.Generator().manual_seed(4)).tolist()}
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=5)
    prefill, decode = llm.engine.runner.prefill_graphs, llm.engine.runner.decode_graphs
    chunks = _record_chunks(llm)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c[1:] for c in chunks] == [(0, 511), (511, 1), (512, 1), (513, 1)]
    assert (prefill.num_replays, decode.num_replays) == (1, 3)
    got = llm.generate(prompt, params, use_tqdm=False)[0]
    assert got.num_cached_tokens == 511 and (prefill.num_replays, decode.num_replays) == (1, 6)
    want = cold.generate(prompt, params, use_tqdm=False)[0]
    _assert_same(first, want)
    _assert_same(got, want)

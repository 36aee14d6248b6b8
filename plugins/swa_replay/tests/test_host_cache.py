"""The SWA host cache: ``SwaHostCache`` (size cap, TTL, LRU) and ``LLM(..., enable_swa_host_cache=True)`` on a tiny
model (fp32, CPU): a hit restored from host memory computes only the tokens after it and equals exact reuse."""

from __future__ import annotations

import pytest
import torch
from deepinfer_swa_replay import SwaHostCache, SwaHostCacheOptionError, host_cache_stats
from deepinfer_swa_replay.stats import HOST_CACHE_METRICS, HostCacheStats

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine_context import EngineContext
from deepinfer_core.metrics import MetricsRegistry
from deepinfer_core.plugins import configure_plugins, get_plugin_manager

WINDOW = BLOCK = 8  # the factory's sliding window; its compression ratios are 4 and 8
VOCAB = 64
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _slot(value: float) -> list[torch.Tensor]:
    """A stand-in slot state: a ring and a carry, 64 + 32 float32 values (384 bytes)."""
    return [torch.full((8, 8), value), torch.full((4, 8), value)]


def test_an_entry_round_trips_and_is_found_longest_first():
    cache = SwaHostCache(capacity_bytes=10_000, ttl_s=10, clock=Clock())
    cache.store(b"a", _slot(1.0))
    cache.store(b"b", _slot(2.0))
    index, entry = cache.find([b"x", b"b", b"a"])
    assert index == 1 and entry.nbytes == 384
    target = _slot(0.0)
    cache.restore(entry, target)
    assert all(torch.equal(t, s) for t, s in zip(target, _slot(2.0)))
    assert cache.find([b"x"]) is None
    assert (cache.stats.stores.value, cache.nbytes, cache.stats.host_bytes.value) == (2, 768, 768)


def test_the_size_cap_evicts_the_least_recently_used():
    cache = SwaHostCache(capacity_bytes=2 * 384, ttl_s=10, clock=Clock())
    cache.store(b"a", _slot(1.0))
    cache.store(b"b", _slot(2.0))
    cache.find([b"a"])  # a is now the most recently used
    cache.store(b"c", _slot(3.0))
    assert list(cache.entries) == [b"a", b"c"] and cache.stats.evictions.value == 1 and cache.nbytes == 768
    assert cache.store(b"big", [torch.zeros(1000)]) is None  # larger than the whole cap: not kept, nothing evicted
    assert list(cache.entries) == [b"a", b"c"]


def test_entries_expire_after_the_ttl_since_stored_or_used():
    clock = Clock()
    cache = SwaHostCache(capacity_bytes=10_000, ttl_s=180, clock=clock)
    cache.store(b"a", _slot(1.0))
    clock.now = 100.0
    cache.store(b"b", _slot(2.0))
    clock.now = 179.0
    assert cache.find([b"a"])[0] == 0  # used at 179: lives until 359
    clock.now = 280.0  # b (stored at 100) is 180 s old
    assert cache.find([b"b"]) is None and cache.stats.expirations.value == 1
    clock.now = 359.0
    assert cache.find([b"a"]) is None and cache.stats.expirations.value == 2 and cache.nbytes == 0


def test_counters_move_into_a_metrics_registry_keeping_their_counts():
    stats, registry = HostCacheStats(), MetricsRegistry()
    stats.hits.inc(2)
    stats.register(registry)
    stats.hits.inc()
    assert registry.get(HOST_CACHE_METRICS["hits"][0]).value == 3
    assert {m.name for m in registry.snapshot()} >= {name for name, _ in HOST_CACHE_METRICS.values()}


@pytest.mark.parametrize(("options", "message"), [
    ({"enable_swa_host_cache": True, "swa_host_cache_bytes": "lots"}, "swa_host_cache_bytes must be a positive int"),
    ({"enable_swa_host_cache": True, "swa_host_cache_ttl_s": -1}, "swa_host_cache_ttl_s must be a positive float"),
    ({"swa_host_cache_ttl_s": 60}, "swa_host_cache_ttl_s needs enable_swa_host_cache=true"),
    ({"enable_swa_host_cache": 1, "swa_host_cache_split_prefill": "sometimes"},
     "swa_host_cache_split_prefill must be a boolean"),
    ({"enable_swa_host_cache": "maybe"}, "enable_swa_host_cache must be a boolean"),
])
def test_bad_options_are_refused_naming_the_option(options, message):
    with pytest.raises(SwaHostCacheOptionError, match=message):
        configure_plugins(get_plugin_manager(), context=EngineContext("cpu", options))


def test_options_set_the_cap_and_the_ttl():
    context = configure_plugins(get_plugin_manager(), context=EngineContext("cpu", {
        "enable_swa_host_cache": "true", "swa_host_cache_bytes": "1048576", "swa_host_cache_ttl_s": "30"}))
    cache = context.plugin_state["swa_host_cache"].cache
    assert (cache.capacity_bytes, cache.ttl_s, cache.pin_memory) == (1 << 20, 30.0, False)  # pinned on CUDA only
    assert host_cache_stats(EngineContext("cpu", {})) is None


# ------------------------------------------------------------------------------------------------ end to end
def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _llm(folder, **kwargs) -> LLM:
    """An engine without the core's device tier: the host tier alone, or exact reuse by the rebuild."""
    kwargs.setdefault("enable_prefix_state_cache", False)
    return LLM(str(folder), block_size=BLOCK, max_num_seqs=4, **kwargs)


def _first_chunks(llm: LLM) -> list[tuple[int, int]]:
    """(start, tokens) of every prompt chunk (more than one token) the engine plans from now on."""
    return pytest.importorskip("v4_factory").record_prompt_chunks(llm)


def _turns(llm: LLM) -> tuple[object, object]:
    """A 40-token prompt generating 12 tokens (its state stored at 40 and 48), then the next turn: that prompt, its
    first 8 output tokens and 10 new ones (58 tokens, a prefix hit at 48). Returns both outputs."""
    prompt = _tokens(40, seed=11)
    first = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    follow = prompt + list(first.outputs[0].token_ids[:8]) + _tokens(10, seed=12)
    return first, llm.generate({"prompt_token_ids": follow}, GREEDY, use_tqdm=False)[0]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_hit_restored_from_host_memory_computes_only_the_rest_and_equals_exact_reuse(tiny_ckpt, async_scheduling):
    cached = _llm(tiny_ckpt, enable_swa_host_cache=True, async_scheduling=async_scheduling)
    exact = _llm(tiny_ckpt, async_scheduling=async_scheduling)
    chunks = _first_chunks(cached)
    (_, got), (_, want) = _turns(cached), _turns(exact)
    stats = host_cache_stats(cached.context)
    assert chunks == [(0, 40), (48, 10)]  # no replay: the second turn computes from the restored boundary
    assert got.num_cached_tokens == want.num_cached_tokens == 48
    assert (stats.hits.value, stats.misses.value) == (1, 0) and stats.stores.value >= 2
    if hasattr(cached, "get_metrics"):  # the engine's metrics registry holds the same counters
        metrics = {m.name: m.value for m in cached.get_metrics()}
        assert metrics[HOST_CACHE_METRICS["hits"][0]] == 1 and metrics[HOST_CACHE_METRICS["misses"][0]] == 0
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for mine, theirs in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
        assert mine.keys() == theirs.keys()
        assert all(abs(mine[t].logprob - theirs[t].logprob) <= 1e-5 for t in mine)


def test_a_restored_hit_is_bit_identical_to_exact_reuse_in_batch_invariant_mode(tiny_ckpt):
    pytest.importorskip("deepinfer_batch_invariant")
    got = _turns(_llm(tiny_ckpt, enable_swa_host_cache=True, batch_invariant=True))[1]
    want = _turns(_llm(tiny_ckpt, batch_invariant=True))[1]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids and got.outputs[0].logprobs == want.outputs[0].logprobs


def test_a_hit_without_an_entry_is_a_miss_and_falls_back_to_the_rebuild(tiny_ckpt):
    """The same 40-token prompt again hits 32 cached tokens; no step ended there, so nothing was stored: a miss,
    then the exact rebuild (from token 0 here) with its outputs."""
    llm, exact = _llm(tiny_ckpt, enable_swa_host_cache=True), _llm(tiny_ckpt)
    prompt = {"prompt_token_ids": _tokens(40, seed=13)}
    for engine in (llm, exact):
        engine.generate(prompt, GREEDY, use_tqdm=False)
    chunks = _first_chunks(llm)
    got, want = (engine.generate(prompt, GREEDY, use_tqdm=False)[0] for engine in (llm, exact))
    stats = host_cache_stats(llm.context)
    assert chunks == [(0, 40)] and (stats.hits.value, stats.misses.value) == (0, 1)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_an_expired_entry_is_not_restored(tiny_ckpt):
    llm = _llm(tiny_ckpt, enable_swa_host_cache=True, swa_host_cache_ttl_s=180)
    cache = llm.context.plugin_state["swa_host_cache"].cache
    clock = cache.clock = Clock()
    prompt = _tokens(40, seed=11)
    first = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    clock.now = 181.0
    chunks = _first_chunks(llm)
    follow = prompt + list(first.outputs[0].token_ids[:8]) + _tokens(10, seed=12)
    llm.generate({"prompt_token_ids": follow}, GREEDY, use_tqdm=False)
    stats = host_cache_stats(llm.context)
    assert stats.expirations.value >= 2 and (stats.hits.value, stats.misses.value) == (0, 1)
    assert chunks[0][0] < 48  # rebuilt by replay instead


def test_preempted_requests_come_back_through_the_host_cache(tiny_ckpt):
    """Four requests in room for two: the preempted ones come back with a hit at the last block boundary a step of
    theirs ended on, restored from host memory, and finish with the tokens of an engine with room for all."""
    from deepinfer_core.models.deepseek_v4.state import DeepseekV4State

    config = _llm(tiny_ckpt).model.config
    budget = 4 * DeepseekV4State.bytes_per_slot(config, BLOCK, torch.float32) + 10 * DeepseekV4State.bytes_per_block(
        config, BLOCK, torch.float32)  # 4 sequences want 4 x 6 blocks
    prompts = [{"prompt_token_ids": _tokens(n, seed=n)} for n in (30, 33, 29, 31)]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=1)
    tight = _llm(tiny_ckpt, kv_cache_memory_bytes=budget, enable_swa_host_cache=True)
    got = tight.generate(prompts, params, use_tqdm=False)
    want = _llm(tiny_ckpt).generate(prompts, params, use_tqdm=False)
    stats = host_cache_stats(tight.context)
    assert tight.engine.scheduler.num_preemptions > 0 and stats.hits.value > 0
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert all(abs(x[t].logprob - y[t].logprob) <= 1e-5
                   for x, y, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, b.outputs[0].token_ids))
    tight.engine.state_manager.check_invariants([])


def test_a_split_prefill_lets_the_same_prompt_again_be_restored(tiny_ckpt):
    """With ``swa_host_cache_split_prefill`` a 40-token prompt is prefilled as [0, 32) and [32, 40) (the tiny model's
    shortest static chunk is 8 tokens), so its state at 32 is kept; sent again, it hits 32 cached tokens, is restored
    there and computes only its last 8 tokens, with exact reuse's outputs. A 44-token prompt is split on the last
    boundary that leaves a tail of at least 8 tokens: [0, 32) and [32, 44)."""
    llm = _llm(tiny_ckpt, enable_swa_host_cache=True, swa_host_cache_split_prefill=True)
    exact = _llm(tiny_ckpt)
    prompt = {"prompt_token_ids": _tokens(40, seed=14)}
    chunks = _first_chunks(llm)
    llm.generate(prompt, GREEDY, use_tqdm=False)
    got = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    llm.generate({"prompt_token_ids": _tokens(44, seed=15)}, GREEDY, use_tqdm=False)
    assert chunks == [(0, 32), (32, 8), (32, 8), (0, 32), (32, 12)]
    assert host_cache_stats(llm.context).hits.value == 1 and got.num_cached_tokens == 32
    exact.generate(prompt, GREEDY, use_tqdm=False)
    want = exact.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for mine, theirs in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
        assert all(abs(mine[t].logprob - theirs[t].logprob) <= 1e-5 for t in mine)

"""Data parallelism with expert parallelism on CPU over gloo: the all-to-all op against the one-process experts,
LLM(data_parallel_size=N, enable_expert_parallel=True) against one process (greedy tokens equal, logprobs within
1e-5) at 2 and 4 ranks with prefix caching and preemption, and a rank that raises, stalls or dies.

Every test here starts processes; each bounds them (``DEEPINFER_DISTRIBUTED_TIMEOUT``, joins with timeouts).
Select them with ``-m distributed``."""

from __future__ import annotations

import os
import time

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.distributed.launcher import RankFailedError
from deepinfer_core.distributed.placement import outstanding_tokens, spread_requests

pytestmark = pytest.mark.distributed

TIMEOUT_S = 60  # every collective and the ranks' start-up; a test that hangs fails after this


@pytest.fixture(autouse=True)
def _bounded(monkeypatch):
    monkeypatch.setenv("DEEPINFER_DISTRIBUTED_TIMEOUT", str(TIMEOUT_S))


# ---------------------------------------------------------------------------------------------- placement
def test_requests_spread_by_outstanding_tokens():
    costs = [outstanding_tokens(p, m, n, 1024) for p, m, n in [(100, 10, 1), (10, 10, 1), (50, 50, 2), (5, None, 1)]]
    assert costs == [110, 20, 200, 1024]
    assert spread_requests(costs, 2) == [1, 1, 1, 0]  # 1024 alone; 200 + 110 + 20 beside it
    assert spread_requests([5, 5, 5, 5, 5], 2) == [0, 1, 0, 1, 0]  # equal costs: input order, lower rank first
    assert spread_requests([3, 1], 4) == [0, 1]  # ranks 2 and 3 get nothing (they run idle steps)


# ---------------------------------------------------------------------------------------------- the op
def _op_rank(rank: int, world: int, store: str, results) -> None:
    """One rank: the expert-parallel op over its experts against the one-process ``moe_experts`` on its tokens."""
    import torch.distributed as dist

    from deepinfer_core.ops import reference
    from deepinfer_core.ops.expert_parallel import ExpertShard, moe_experts_expert_parallel

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=__import__("datetime").timedelta(seconds=TIMEOUT_S))
        gen = torch.Generator().manual_seed(0)
        E, D, I, k, limit = 2 * world, 16, 8, 3, 7.0
        w1, w3 = torch.randn(E, I, D, generator=gen), torch.randn(E, I, D, generator=gen)
        w2 = torch.randn(E, D, I, generator=gen)
        tokens = [5, 0, 9, 1][:world]  # rank 1 has no tokens: it only serves the others
        xs = [torch.randn(t, D, generator=gen) for t in tokens]
        ids = [torch.randint(0, E, (t, k), generator=gen) for t in tokens]  # repeats inside a token too
        weights = [torch.rand(t, k, generator=gen) for t in tokens]
        first, count = 2 * rank, 2
        local = (w1[first:first + 2].clone(), w2[first:first + 2].clone(), w3[first:first + 2].clone())
        shard = ExpertShard(rank, world, first, count, local,
                            lambda rows, i, w: reference.moe_experts(rows, i, w, *local, limit))
        with torch.inference_mode():
            got = moe_experts_expert_parallel(xs[rank], ids[rank], weights[rank], shard, limit)
        want = reference.moe_experts(xs[rank], ids[rank], weights[rank], w1, w2, w3, limit)
        results.put((rank, tuple(got.shape), (got - want).abs().max().item() if want.numel() else 0.0, None))
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, None, None, repr(exc)))


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_op_matches_one_process_experts(world, tmp_path):
    context = torch.multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_op_rank, args=(r, world, str(tmp_path / "store"), results), daemon=True)
                 for r in range(world)]
    for p in processes:
        p.start()
    try:
        replies = sorted(results.get(timeout=TIMEOUT_S) for _ in range(world))
    finally:
        for p in processes:
            p.join(10)
            if p.is_alive():
                p.kill()
    tokens = [5, 0, 9, 1]
    for rank, shape, diff, error in replies:
        assert error is None, error
        assert shape == (tokens[rank], 16)
        assert diff <= 1e-5, (rank, diff)


# ---------------------------------------------------------------------------------------------- LLM parity
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
SAMPLED = SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, logprobs=1)  # unseeded: seeds by arrival


def _prompts(lengths, seed, prefix=()):
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": list(prefix) + torch.randint(2, 60, (n,), generator=gen).tolist()} for n in lengths]


def _assert_same(reference, outputs):
    assert [o.request_id for o in outputs] == [o.request_id for o in reference]
    for want, got in zip(reference, outputs):
        assert got.prompt_token_ids == want.prompt_token_ids and got.error == want.error
        for a, b in zip(want.outputs, got.outputs, strict=True):
            assert b.token_ids == a.token_ids and b.text == a.text and b.finish_reason == a.finish_reason
            for pa, pb in zip(a.logprobs, b.logprobs, strict=True):
                assert pa.keys() == pb.keys()
                assert max(abs(pa[t].logprob - pb[t].logprob) for t in pa) <= 1e-5
                assert [pa[t].rank for t in pa] == [pb[t].rank for t in pb]


def _compare(model, kwargs, batches, world, params=(GREEDY, GREEDY)):
    """Each batch through one process, then through ``world`` ranks of one LLM; returns the ranks' stats."""
    one = LLM(model, **kwargs)
    reference = [one.generate(prompts, p, use_tqdm=False) for prompts, p in zip(batches, params)]
    assert one.engine.scheduler.num_preemptions > 0 and one.engine.state_manager.hits > 0
    start = time.monotonic()
    ranks = LLM(model, data_parallel_size=world, enable_expert_parallel=True, **kwargs)
    try:
        stats = []
        for prompts, want, p in zip(batches, reference, params):
            _assert_same(want, ranks.generate(prompts, p, use_tqdm=False))
            stats = ranks._parallel.stats
    finally:
        ranks.shutdown()
    assert time.monotonic() - start < TIMEOUT_S
    assert all(not p.is_alive() for p in ranks._parallel._processes)
    return stats


@pytest.mark.parametrize("world", [2, 4])
def test_default_model_matches_one_process(world):
    """The embedded tiny model (4 experts: one per rank at 4 ranks); blocks of 128 tokens, state for 4 of them per
    engine; prompts of about 250 tokens share their first block (prefix hits) and cross into a third block while
    decoding (preemption)."""
    shared = _prompts([130], seed=1)[0]["prompt_token_ids"]
    batches = [_prompts([122, 124, 120, 125, 121, 123], seed=2, prefix=shared) + _prompts([9, 3], seed=3),
               _prompts([124, 125, 4], seed=4, prefix=shared)]
    per = LLM(dtype="float32", enforce_eager=True).model.state_bytes(128, torch.float32)
    kwargs = {"dtype": "float32", "max_num_seqs": 4, "kv_cache_memory_bytes": 4 * per.per_slot + 4 * per.per_block}
    stats = _compare(None, kwargs, batches, world)
    assert sum(s["preemptions"] for s in stats) > 0 and sum(s["prefix_hits"] for s in stats) > 0


@pytest.fixture(scope="module")
def mixed_ckpt(tmp_path_factory):
    pytest.importorskip("transformers")
    from v4_factory import ALL_TYPES, tiny_checkpoint

    folder = tmp_path_factory.mktemp("dp") / "ckpt"
    tiny_checkpoint(folder, layer_types=ALL_TYPES * 2, hc_mult=2)  # sliding, CSA, HCA twice; a hash layer first
    return str(folder)


@pytest.mark.parametrize("world", [2, 4])
def test_mixed_layers_match_one_process(world, mixed_ckpt):
    """Sliding, CSA and HCA layers with a hash-routed MoE layer, greedy then unseeded sampling; blocks of 8 tokens; prompts share a 72-token
    prefix (past the 64-token replay span, so hits replay from a nonzero start) and the state holds 12 blocks, so
    sequences crossing into their next block while decoding preempt."""
    shared = _prompts([72], seed=5)[0]["prompt_token_ids"]
    batches = [_prompts([7, 7, 6, 5, 7, 4, 6, 7], seed=6, prefix=shared),
               _prompts([30, 5], seed=7) + _prompts([7, 6, 5], seed=8, prefix=shared)]
    probe = LLM(mixed_ckpt, block_size=8, enforce_eager=True).model.state_bytes(8, torch.float32)
    kwargs = {"block_size": 8, "max_num_seqs": 4, "kv_cache_memory_bytes": 4 * probe.per_slot + 12 * probe.per_block}
    stats = _compare(mixed_ckpt, kwargs, batches, world, params=(GREEDY, SAMPLED))
    assert sum(s["preemptions"] for s in stats) > 0 and sum(s["prefix_hits"] for s in stats) > 0
    assert sum(s["requests"] for s in stats) == 5


# ---------------------------------------------------------------------------------------------- failures
FAULTY = """
import os, time
import torch.distributed as dist
from deepinfer_core.hookspecs import hookimpl
DEEPINFER_HOOK_API_VERSION = 1

@hookimpl
def deepinfer_before_step(engine, scheduler_output):
    if dist.is_initialized() and dist.get_rank() == 1 and engine.num_steps >= 1:
        if os.environ.get("FAULTY_RANK_STALLS"):
            time.sleep(600)
        raise RuntimeError("rank 1 gave up on purpose")
"""


@pytest.fixture
def faulty_plugin(make_distribution, monkeypatch):
    """A plugin that makes rank 1 raise (or stall, with FAULTY_RANK_STALLS=1) in its second step."""
    site = make_distribution("deepinfer-faulty", entry_points={"deepinfer.plugins": {"faulty": "faulty_plugin"}},
                             modules={"faulty_plugin": FAULTY})
    monkeypatch.setenv("DEEPINFER_PLUGINS", "faulty")
    return site


def _two_ranks() -> LLM:
    return LLM(dtype="float32", data_parallel_size=2, enable_expert_parallel=True, max_num_seqs=2)


def _all_stopped(llm: LLM) -> bool:
    return all(not p.is_alive() for p in llm._parallel._processes)


def test_a_rank_that_raises_fails_generate_and_stops_every_rank(faulty_plugin):
    llm = _two_ranks()
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="(?s)rank 1 of 2 failed.*rank 1 gave up on purpose"):
        llm.generate(_prompts([5, 6, 7, 8], seed=0), GREEDY, use_tqdm=False)
    assert time.monotonic() - start < TIMEOUT_S / 2  # reported at once, not after rank 0's collective times out
    assert _all_stopped(llm)
    with pytest.raises(RankFailedError, match="stopped"):
        llm.generate(_prompts([5], seed=0), GREEDY, use_tqdm=False)


def test_a_stalled_rank_times_out_the_others_collectives(faulty_plugin, monkeypatch):
    monkeypatch.setenv("FAULTY_RANK_STALLS", "1")
    monkeypatch.setenv("DEEPINFER_DISTRIBUTED_TIMEOUT", "20")  # start-up of two ranks fits in it
    llm = _two_ranks()
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 0 of 2 failed") as failure:
        llm.generate(_prompts([5, 6, 7, 8], seed=0), GREEDY, use_tqdm=False)
    assert 20 <= time.monotonic() - start < 50
    assert "timed out" in str(failure.value).lower() or "timeout" in str(failure.value).lower()
    assert _all_stopped(llm)


def test_a_rank_that_dies_fails_generate_and_stops_every_rank():
    llm = _two_ranks()
    victim = llm._parallel._processes[0]
    os.kill(victim.pid, 9)
    victim.join(TIMEOUT_S)
    with pytest.raises(RankFailedError, match=r"rank 0 of 2 died \(exit code -9\)"):
        llm.generate(_prompts([5, 6], seed=0), GREEDY, use_tqdm=False)
    assert _all_stopped(llm)


# ---------------------------------------------------------------------------------------------- torchrun
def test_torchrun_generate_prints_what_one_process_prints():
    """``torchrun --nproc-per-node 2 -m deepinfer_core.cli generate --enable-expert-parallel``: one rank per process,
    rank 0 prints, the text equals one process's."""
    import subprocess
    import sys

    flags = ["generate", "--dtype", "float32", "--temperature", "0", "--max-tokens", "6", "def f(x):", "a b c"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single = subprocess.run([sys.executable, "-m", "deepinfer_core.cli", *flags], check=False, capture_output=True,
                            text=True, timeout=TIMEOUT_S, env=env)
    ranks = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "-m", "deepinfer_core.cli", *flags, "--enable-expert-parallel"],
                           check=False, capture_output=True, text=True, timeout=2 * TIMEOUT_S, env=env)
    assert single.returncode == 0 and ranks.returncode == 0, ranks.stderr[-2000:]
    assert ranks.stdout == single.stdout and "completion" in single.stdout


def test_one_rank_is_the_one_process_path():
    """data_parallel_size=1 (with or without expert parallelism) starts nothing and joins no process group; the MoE
    layers keep the one-process experts op."""
    import torch.distributed as dist

    llm = LLM(dtype="float32", enable_expert_parallel=True)
    assert llm._parallel is None and not dist.is_initialized()
    assert {layer.ffn.experts_op for layer in llm.model.layers} == {"moe_experts"}

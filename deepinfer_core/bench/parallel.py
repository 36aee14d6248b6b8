"""``deepinfer bench --data-parallel-size N``: the engine's runs over N ranks that ``LLM`` starts (docs/distributed.md).

The process that starts the ranks sees each ``generate`` call whole, not the ranks' steps. A run therefore records
its total time (throughputs), the lockstep iterations the ranks took (``steps``), the prompt tokens each request
took from the prefix cache, and each rank's statistics with its engine's metrics (``ranks``; rank 0's, EPLB's
``moe_lb`` among them, also as ``engine_metrics``), but no per-request first-token or per-step times: those rows
read "-".
Every prompt goes to every rank; each rank runs its share (spread by outstanding tokens).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.bench.runner import (
    BenchConfig,
    Log,
    RunTimes,
    prefix_state_args,
    random_prompts,
    recording_gc_pauses,
    stats,
    summarize,
)
from deepinfer_core.sampling.params import SamplingParams

_UNTIMED = ("ttft_s", "tpot_s", "latency_s", "ttft_hit_s", "ttft_miss_s")  # per request: not seen from the parent


def run_engine_ranks(folder: Path, config: BenchConfig, prompts: Sequence[Sequence[int]], vocab_size: int,
                     log: Log) -> tuple[dict[str, Any], torch.device, torch.dtype]:
    """``run_engine``'s result over ``config.data_parallel_size`` ranks (the ranks are stopped before returning)."""
    from deepinfer_core.llm import LLM

    log(f"starting {config.data_parallel_size} ranks ...")
    t0 = time.perf_counter()
    llm = LLM(folder, backend=config.backend, dtype=config.dtype, max_model_len=config.model_len,
              max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens, seed=config.seed,
              enforce_eager=config.enforce_eager, enable_mixed_chunk=config.enable_mixed_chunk,
              async_scheduling=config.async_scheduling, data_parallel_size=config.data_parallel_size,
              enable_expert_parallel=config.enable_expert_parallel, load_format=config.load_format,
              **prefix_state_args(config), **dict(config.options or {}))
    try:
        load_time = time.perf_counter() - t0
        prefix = prompts[0][:config.prefix_len]
        for i in range(config.warmup):
            log(f"engine warmup {i + 1}/{config.warmup} ...")
            warm = random_prompts(len(prompts), len(prompts[0]), vocab_size, config.seed + 1, prefix)
            time_ranks(llm, warm, config.output_len, f"warmup{i}")
        runs = []
        for i in range(config.num_iters):
            log(f"engine: timed run {i + 1}/{config.num_iters} over {config.data_parallel_size} ranks ...")
            run_prompts = prompts if i == 0 else random_prompts(len(prompts), len(prompts[0]), vocab_size,
                                                                config.seed + 1 + i, prefix)
            runs.append(time_ranks(llm, run_prompts, config.output_len, f"bench{i or ''}"))
        ranks = llm._parallel.stats
    finally:
        llm.shutdown()
    totals = [max(run.finished.values()) - run.start for run in runs]
    median = sorted(range(len(runs)), key=totals.__getitem__)[len(runs) // 2]
    metrics = summarize(runs[median], [len(p) for p in prompts], load_time, totals)
    metrics.update({key: stats([]) for key in _UNTIMED}, step_times_s=[], iteration_first_token_s=[],
                   ranks=ranks, engine_metrics=ranks[0]["metrics"])
    first = ranks[0]
    outputs = [runs[0].outputs[f"bench-{i}"] for i in range(len(prompts))]
    device = torch.device(first["device"])
    return {"metrics": metrics, "outputs": outputs, "graph_replays": {"decode": 0, "prefill": 0},
            "max_num_batched_tokens": first["max_num_batched_tokens"], "async_scheduling": first["async_scheduling"],
            "op_sources": {}}, device, getattr(torch, first["dtype"])


def time_ranks(llm, prompts: Sequence[Sequence[int]], output_len: int, tag: str) -> RunTimes:
    """One ``generate`` over the ranks: every request finishes when the call returns; ``steps`` is the lockstep
    iterations it took (engine plus idle steps, the same on every rank)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    before = _iterations(llm._parallel.stats)
    times = RunTimes(start=time.perf_counter())
    with recording_gc_pauses(times.gc_pauses):
        outputs = llm.generate([{"prompt_token_ids": list(ids)} for ids in prompts], params, use_tqdm=False)
    end = time.perf_counter()
    times.steps = _iterations(llm._parallel.stats) - before
    for i, output in enumerate(outputs):
        key = f"{tag}-{i}"
        times.first_token[key] = times.finished[key] = end
        times.outputs[key] = list(output.outputs[0].token_ids)
        times.cached_tokens[key] = output.num_cached_tokens
    return times


def _iterations(ranks: list[dict[str, Any]]) -> int:
    return ranks[0]["steps"] + ranks[0]["idle_steps"] if ranks else 0

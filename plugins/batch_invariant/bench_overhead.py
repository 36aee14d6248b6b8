"""Overhead of batch-invariant mode on CPU: ``deepinfer bench`` with and without it, in one process.

    python plugins/batch_invariant/bench_overhead.py [--preset tiny] [--rounds 2] [--input-len 128] ...

Runs the core's offline benchmark (``deepinfer_core.bench.runner.run_bench``, greedy, EOS ignored) on the
same preset checkpoint and prompts, alternating plain / batch-invariant (``DEEPINFER_BATCH_INVARIANT=1``,
read by the plugin each time an engine is configured) for ``--rounds`` rounds, and prints the best
and the median time of each mode and their ratios. Run it on an otherwise idle machine; a shared CPU makes the
numbers noisy (set ``OMP_NUM_THREADS`` to compare thread counts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
from deepinfer_batch_invariant.plugin import ENV

from deepinfer_core.bench.runner import BenchConfig, run_bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    config = {"preset": args.preset, "input_len": args.input_len, "output_len": args.output_len,
              "num_prompts": args.num_prompts, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens, "cache_dir": args.cache_dir, "warmup": 1}
    results: dict[str, list[dict]] = {"plain": [], "batch_invariant": []}
    for round_ in range(args.rounds):
        for mode in ("plain", "batch_invariant"):
            if mode == "plain":
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = "1"
            metrics = run_bench(BenchConfig(**config))["engine"]
            results[mode].append(metrics)
            print(f"round {round_ + 1} {mode:16s} total {metrics['total_time_s']:.3f} s, "
                  f"{metrics['output_throughput']:.1f} out tok/s, TTFT {metrics['ttft_s']['mean']:.3f} s, "
                  f"TPOT {metrics['tpot_s']['mean'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    os.environ.pop(ENV, None)
    best = {mode: min(runs, key=lambda m: m["total_time_s"]) for mode, runs in results.items()}
    ratio = best["batch_invariant"]["total_time_s"] / best["plain"]["total_time_s"]
    median = {mode: statistics.median(m["total_time_s"] for m in runs) for mode, runs in results.items()}
    summary = {
        "config": config, "torch_threads": torch.get_num_threads(),
        "best_total_time_s": {m: r["total_time_s"] for m, r in best.items()},
        "best_ttft_mean_s": {m: r["ttft_s"]["mean"] for m, r in best.items()},
        "best_tpot_mean_s": {m: r["tpot_s"]["mean"] for m, r in best.items()},
        "time_ratio_batch_invariant_over_plain": ratio,
        "median_total_time_s": median,
        "median_time_ratio": median["batch_invariant"] / median["plain"],
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"summary": summary, "runs": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Overhead of batch-invariant mode: the plain path and the mode at several batch sizes, in one process.

    python plugins/batch_invariant/bench_overhead.py                       # CPU: tiny preset, batch 16
    python plugins/batch_invariant/bench_overhead.py --preset v4-flash-8l64e --backend nvidia_sm100 \\
        --dtype bfloat16 --input-len 1024 --output-len 128 --batches 1 16 64 256      # the H200 table

One engine per mode (``LLM(..., batch_invariant=False)`` / ``True``: the plugin's option, the same switch as
``DEEPINFER_BATCH_INVARIANT``), each built once with room for the largest batch and run at every batch size
(``--batches``): per batch a warm-up run (every graph and kernel the timed run needs), then ``--num-iters`` timed runs
of fresh random prompts (greedy, EOS ignored, all added at once, stepped to the end, as ``deepinfer bench`` times a
run). ``--rounds`` repeats both modes, alternating which goes first. Prints per batch the plain and batch-invariant
time (the median of the timed runs, best round), their output tok/s and the time ratio; ``--json`` writes every run.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from typing import Any

import torch

from deepinfer_core.bench.runner import BenchConfig, model_folder, random_prompts, time_engine

MODES = {"plain": False, "batch_invariant": True}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    config = BenchConfig(preset=args.preset, input_len=args.input_len, output_len=args.output_len,
                         max_num_seqs=max(args.batches), backend=args.backend, dtype=args.dtype,
                         cache_dir=args.cache_dir, max_num_batched_tokens=args.max_num_batched_tokens)
    config.validate()
    folder = model_folder(config, log=_log)
    runs: dict[str, dict[int, list[float]]] = {mode: {b: [] for b in args.batches} for mode in MODES}
    for round_ in range(args.rounds):
        order = list(MODES) if round_ % 2 == 0 else list(reversed(MODES))
        for mode in order:
            for batch, times in run_mode(folder, config, MODES[mode], args).items():
                best = statistics.median(times)
                runs[mode][batch].append(best)
                _log(f"round {round_ + 1} {mode:15s} batch {batch:4d}: {best:.3f} s "
                     f"({batch * args.output_len / best:.1f} output tok/s)")
    summary = summarize(runs, args.output_len)
    print(table(summary))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"config": vars(args), "runs_s": runs, "summary": summary}, f, indent=2)
    return 0


def run_mode(folder, config: BenchConfig, batch_invariant: bool, args: argparse.Namespace) -> dict[int, list[float]]:
    """One engine in the given mode, every batch size of ``args.batches`` through it: batch -> timed run times (s)."""
    from deepinfer_core.llm import LLM

    _log(f"loading the engine (batch_invariant={batch_invariant}) ...")
    llm = LLM(folder, backend=config.backend, dtype=config.dtype, max_model_len=config.input_len + config.output_len,
              max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
              seed=config.seed, batch_invariant=batch_invariant)
    device, vocab = llm.backend.device, llm.model.vocab_size
    times: dict[int, list[float]] = {}
    try:
        for batch in args.batches:
            for i in range(args.warmup + args.num_iters):
                prompts = random_prompts(batch, config.input_len, vocab, config.seed + 1 + i + 1000 * batch)
                run = time_engine(llm, prompts, config.output_len, f"b{batch}-{i}")
                if i >= args.warmup:
                    times.setdefault(batch, []).append(max(run.finished.values()) - run.start)
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return times


def summarize(runs: dict[str, dict[int, list[float]]], output_len: int) -> list[dict[str, Any]]:
    """Per batch: each mode's best round (its timed runs' median), output tok/s, and the time ratio."""
    rows = []
    for batch in runs["plain"]:
        plain, invariant = min(runs["plain"][batch]), min(runs["batch_invariant"][batch])
        rows.append({"batch": batch, "plain_s": plain, "batch_invariant_s": invariant,
                     "plain_output_tok_s": batch * output_len / plain,
                     "batch_invariant_output_tok_s": batch * output_len / invariant,
                     "time_ratio": invariant / plain})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The summary as a Markdown table (docs/batch-invariant.md's overhead table)."""
    lines = ["| batch | plain (s) | batch-invariant (s) | plain tok/s | batch-invariant tok/s | time ratio |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['plain_s']:.3f} | {r['batch_invariant_s']:.3f} | "
                     f"{r['plain_output_tok_s']:.1f} | {r['batch_invariant_output_tok_s']:.1f} | "
                     f"**{r['time_ratio']:.2f}x** |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--backend", default=None, help="engine backend (default: automatic)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batches", type=int, nargs="+", default=[16], help="batch sizes (requests run together)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per batch size and mode")
    parser.add_argument("--num-iters", type=int, default=1, help="timed runs per batch size and mode (median)")
    parser.add_argument("--rounds", type=int, default=1, help="both modes this many times, alternating the order")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--cache-dir", default=None, help="where presets are written (deepinfer bench's default)")
    parser.add_argument("--json", help="also write every run and the summary here")
    return parser


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())

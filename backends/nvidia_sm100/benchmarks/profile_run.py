"""Where a whole bench run's time goes, step by step: the run of ``deepinfer bench`` (every prompt added at once,
then ``engine.step()`` to the end) under torch.profiler, after one warmup run. GPU only.

    python backends/nvidia_sm100/benchmarks/profile_run.py --num-prompts 8 --input-len 1024 --output-len 1
    python backends/nvidia_sm100/benchmarks/profile_run.py --num-prompts 64 --output-len 128 --runs 2

For each profiled run (the first right after the warmup, as the bench's first timed run): its total and first token,
then every ``engine.step()`` call with its host start and end (ms from the run's start) and the device's busy time
and kernels inside it (``--steps`` of them, first and last), then where the device sat idle over the whole run and
what the host did meanwhile (``trace_gaps.gap_report``); with ``--kernels N``, the N ops with the most device time. A step whose host span far exceeds its device time is
bound by the host; idle time before the first kernel is the run's set-up.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from trace_gaps import DEVICE_CATEGORIES, STEP_MARK, _busy, _events, gap_report

from deepinfer_core.bench import presets
from deepinfer_core.bench.runner import random_prompts, time_engine
from deepinfer_core.llm import LLM

CALL_MARK = "engine.step"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=1)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--backend", default="nvidia_sm100")
    parser.add_argument("--preset", default="v4-flash-8l64e")
    parser.add_argument("--runs", type=int, default=1, help="profiled runs, one after another (default 1)")
    parser.add_argument("--steps", type=int, default=8, help="engine steps listed from each end of a run")
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="also list the run's N ops with the most device time (torch.profiler's table)")
    args = parser.parse_args()
    folder = presets.ensure_preset(args.preset)
    llm = LLM(folder, backend=args.backend, dtype="bfloat16" if torch.cuda.is_available() else "float32", max_model_len=args.input_len + args.output_len,
              max_num_seqs=args.num_prompts, max_num_batched_tokens=args.max_num_batched_tokens)
    vocab = llm.model.config.vocab_size
    engine = llm.engine
    engine.step = _marked(engine.step)  # instrumentation only: each call shows in the trace
    time_engine(llm, random_prompts(args.num_prompts, args.input_len, vocab, 1), args.output_len, "warm")
    for run in range(args.runs):
        prompts = random_prompts(args.num_prompts, args.input_len, vocab, 2 + run)  # no prefix hits
        _sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with record_function(STEP_MARK):
                times = time_engine(llm, prompts, args.output_len, f"run{run}")
            _sync()
        trace = os.path.join(tempfile.gettempdir(), f"trace-run-{args.num_prompts}x{args.input_len}-{run}.json")
        prof.export_chrome_trace(trace)
        total = max(times.finished.values()) - times.start
        print(f"\n=== run {run}: {args.num_prompts} x {args.input_len} -> {args.output_len}: total {total * 1e3:.1f} ms, "
              f"first token {times.first_token_s() * 1e3:.1f} ms, {times.steps} steps (trace {trace})")
        print(step_report(trace, args.steps))
        print(gap_report(trace, top=10))
        if args.kernels:
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=args.kernels,
                                            max_name_column_width=70))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _marked(step):
    @functools.wraps(step)
    def marked(*args, **kwargs):
        with record_function(CALL_MARK):
            return step(*args, **kwargs)
    return marked


def step_report(trace_path: str, each_end: int) -> str:
    """Every ``engine.step()`` call of the trace (the first and last ``each_end``): host span against device time."""
    events = _events(trace_path)
    run = min(e["ts"] for e in events if e.get("name") == STEP_MARK)
    calls = sorted((e for e in events if e.get("name") == CALL_MARK and e.get("cat") in ("user_annotation", "cpu_op")),
                   key=lambda e: e["ts"])
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    header = (f"{'call':>5} {'host start':>11} {'host end':>9} {'device busy':>12} {'kernels':>8}  (ms; device time "
              "from the previous call's end to this one's)")
    lines = [header]
    previous_end = run
    for i, call in enumerate(calls):
        end = call["ts"] + call["dur"]
        inside = [(e["ts"], e["ts"] + e["dur"]) for e in device if previous_end <= e["ts"] < end]
        if i < each_end or i >= len(calls) - each_end:
            lines.append(f"{i:5d} {(call['ts'] - run) / 1e3:11.2f} {(end - run) / 1e3:9.2f} "
                         f"{_busy(inside) / 1e3:12.2f} {len(inside):8d}")
        elif i == each_end:
            lines.append("  ...")
        previous_end = end
    return "\n".join(lines)


if __name__ == "__main__":
    main()

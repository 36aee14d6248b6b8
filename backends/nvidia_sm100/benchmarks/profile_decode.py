"""Where a decode step's time goes on the bench preset: host wall time per step vs GPU kernel time, and the
top kernels (torch.profiler). GPU only.

    python backends/nvidia_sm100/benchmarks/profile_decode.py [--batches 1 64] [--input-len 1024]
    python backends/nvidia_sm100/benchmarks/profile_decode.py --preset v4-flash-8l64e-1m --input-len 131072 \
        --batches 1 --max-num-batched-tokens 16384   (decode at a 128K context)
    python backends/nvidia_sm100/benchmarks/profile_decode.py --prefill 8 [--input-len 1024]   (one prefill step)
    python backends/nvidia_sm100/benchmarks/profile_decode.py --prefill 8 --decoding 248
        (one step of batch 256's prefill phase: 8 prompts prefilled while 248 sequences decode)

A decode profile also reports how each step's time splits across its two streams (``timeline.py``: the main
stream's busy time, its idle time while the side stream ran and while every stream was idle; read it with
``DEEPINFER_NVIDIA_PDL=0``) and its weight budget (``weight_budget.py``: the weight products' time against the HBM
floor of the bytes they read, and the step with them at that floor). A prefill profile also reports where the GPU sat idle during the step and what the host
did meanwhile
(``trace_gaps.py``), the host's functions by cumulative time, and with ``--sync-debug`` every operation that
synchronised the host with the device (``torch.cuda.set_sync_debug_mode("warn")``).

If GPU busy time per step is far below the wall time, the step is bound by the host (Python, launches,
synchronisations): CUDA graphs and fewer, fused ops are the lever. If they are close, kernels are.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
import time
import warnings
import zlib

import torch
from timeline import timeline_report
from torch.profiler import ProfilerActivity, profile, record_function
from trace_gaps import STEP_MARK, gap_report
from weight_budget import budget_report

from deepinfer_core.bench import presets, roofline
from deepinfer_core.bench.runner import random_prompts, stored_quantization
from deepinfer_core.engine_args import DUMMY, LOAD_FORMATS
from deepinfer_core.llm import LLM
from deepinfer_core.sampling.params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="v4-flash-8l64e",
                        help="bench preset (v4-flash-8l64e-1m for contexts past 65,536 positions)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--backend", default="nvidia_sm100")
    parser.add_argument("--enforce-eager", action="store_true", help="profile eager steps instead of graph replays")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192,
                        help="token budget per step; batch x input-len prefills every prompt in one step, so decode "
                             "meets one batch size only (what a compiled step, ~1 min per size, wants)")
    parser.add_argument("--prefill", type=int, default=0, metavar="N",
                        help="profile one step that prefills N prompts of --input-len tokens instead of decode")
    parser.add_argument("--decoding", type=int, default=0, metavar="M",
                        help="prefill: M sequences (--input-len prompts) decode in the profiled steps too")
    parser.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                        help="dummy: the preset's weights drawn at load time, none written (deepinfer bench's)")
    parser.add_argument("--sync-debug", action="store_true",
                        help="prefill: warn at every host-device synchronisation of one step (with its stack)")
    args = parser.parse_args()
    folder = presets.ensure_preset(args.preset, weights=args.load_format != DUMMY)
    top = max(max(args.batches), args.prefill + args.decoding)
    llm = LLM(folder, backend=args.backend, dtype="bfloat16", max_model_len=args.input_len + 64, max_num_seqs=top,
              max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
              enable_mixed_chunk=args.decoding > 0, load_format=args.load_format)
    engine = llm.engine
    if args.prefill:
        profile_prefill(llm, args.prefill, args.input_len, args.sync_debug, args.decoding)
        return
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    summary = []
    for batch in args.batches:
        for i, ids in enumerate(random_prompts(batch, args.input_len, llm.model.config.vocab_size, batch)):
            engine.add_request(f"b{batch}-{i}", None, ids, params)
        while not all(r.output_token_ids for rs in engine.groups.values() for r in rs):
            engine.step()  # prefill
        start = time.perf_counter()
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
        print(f"\n=== batch {batch}: first 5 decode steps (graph capture, compiles) {time.perf_counter() - start:.1f} s")
        print_graph_breaks()
        t0 = time.perf_counter()
        n = 10
        for _ in range(n):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / n
        host = cProfile.Profile()  # where the host's share of a step goes (Python, launches, copies, syncs)
        host.enable()
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
        host.disable()
        print(f"\n=== batch {batch}: host functions over 5 steps (cumulative, top 22)")
        pstats.Stats(host).sort_stats("cumulative").print_stats(22)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                engine.step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        gpu = kernel_seconds(events) / 3
        launches = sum(e.count for e in device_events(events)) / 3
        print(f"\n=== batch {batch}: decode step wall {wall * 1e3:.2f} ms, GPU kernel time {gpu * 1e3:.2f} ms, "
              f"{launches:.0f} kernels/step")
        print(events.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60))
        print_kernels_by_count(events, steps=3)
        trace = os.path.join(tempfile.gettempdir(), f"trace-decode-b{batch}.json")
        prof.export_chrome_trace(trace)
        print(f"\n=== batch {batch}: the streams of a decode step (trace {trace})")
        print(timeline_report(trace, steps=3))
        floor = weight_floor_s(llm, folder, args.load_format, batch)
        if floor is not None:
            print(f"\n=== batch {batch}: the weight budget of a decode step")
            print(budget_report(trace, 3, floor))
        summary.append((batch, wall, gpu, launches))
        while engine.has_unfinished():
            engine.step()
    print("\n| batch | step wall | GPU kernel time | kernels/step |\n|---|---|---|---|")
    for batch, wall, gpu, launches in summary:
        print(f"| {batch} | {wall * 1e3:.2f} ms | {gpu * 1e3:.2f} ms | {launches:.0f} |")


def profile_prefill(llm, prompts: int, length: int, sync_debug: bool = False, decoding: int = 0) -> None:
    """One step that prefills ``prompts`` prompts of ``length`` tokens (after one such warm-up step), while
    ``decoding`` sequences decode in it: wall time, tokens/s, the kernels by time, the device's idle gaps with the
    host's work during them, the host's functions."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    vocab = llm.model.config.vocab_size
    background = [f"decoding-{i}" for i in range(decoding)]
    for name, ids in zip(background, random_prompts(decoding, length, vocab, 7)):
        engine.add_request(name, None, ids, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    while not all(r.output_token_ids for name in background for r in engine.groups[name]):
        engine.step()  # their prefill, then they decode beside each profiled step

    def one_step(tag: str) -> float:
        for i, ids in enumerate(random_prompts(prompts, length, vocab, zlib.crc32(tag.encode()))):  # no prefix hits
            engine.add_request(f"{tag}-{i}", None, ids, params)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with record_function(STEP_MARK):
            engine.step()
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        while any(f"{tag}-{i}" in engine.groups for i in range(prompts)):  # a finished group leaves ``groups``
            engine.step()
        return seconds

    one_step("warm")
    wall = one_step("timed")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        one_step("profiled")
    events = prof.key_averages()
    gpu = kernel_seconds(events)
    beside = f" beside {decoding} decodes ({llm.engine.runner.num_mixed_steps} mixed steps)" if decoding else ""
    print(f"\n=== prefill {prompts} x {length} tokens in one step{beside}: wall {wall * 1e3:.1f} ms "
          f"({prompts * length / wall:,.0f} tok/s), GPU kernel time {gpu * 1e3:.1f} ms")
    print(events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70))
    trace = os.path.join(tempfile.gettempdir(), f"trace-prefill-{prompts}x{length}.json")
    prof.export_chrome_trace(trace)
    print(f"\n=== prefill {prompts} x {length}: device idle (trace {trace})")
    print(gap_report(trace))
    host = cProfile.Profile()
    host.enable()
    one_step("host")
    host.disable()
    print(f"\n=== prefill {prompts} x {length}: host functions over one step (cumulative, top 30)")
    pstats.Stats(host).sort_stats("cumulative").print_stats(30)
    print(f"\n=== prefill {prompts} x {length}: host functions over one step (own time, top 30)")
    pstats.Stats(host).sort_stats("tottime").print_stats(30)
    if sync_debug:
        print(f"\n=== prefill {prompts} x {length}: host-device synchronisations in one step")
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            one_step("sync")
        torch.cuda.set_sync_debug_mode(0)
        for w in caught:
            print(f"{w.filename}:{w.lineno}: {str(w.message)[:200]}")
        print(f"{len(caught)} synchronising calls")


def weight_floor_s(llm, folder, load_format: str, batch: int) -> float | None:
    """Seconds a decode step of ``batch`` tokens takes to read its weights at the device's measured bandwidth (the
    roofline's weight bytes, embedding rows aside), or None on a device without measured peaks."""
    peak = roofline.device_peak(llm.backend.device)
    if peak is None:
        return None
    config = llm.model.config
    quantized = stored_quantization(folder, config, load_format)
    bytes_ = roofline.model_bytes(config, llm.dtype, quantized=quantized)
    return (bytes_.weight_bytes_touched(batch) - batch * bytes_.embed_row_bytes) / peak.bandwidth


def print_graph_breaks(limit: int = 12) -> None:
    """Why TorchDynamo split the compiled decode step (``DEEPINFER_NVIDIA_COMPILE_STEP=1``), most frequent first."""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    if breaks:
        print(f"graph breaks: {sum(breaks.values())}")
        for reason, count in breaks.most_common(limit):
            print(f"{count:6d}  {reason[:160]}")


def device_events(events) -> list:
    """The kernels (and device copies) among profiler events; an eager op's row repeats its kernels' device time."""
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]


def kernel_seconds(events) -> float:
    """Device time of the kernels alone (summing every row would count an eager step's kernels twice)."""
    return sum(e.self_device_time_total for e in device_events(events)) / 1e6


def print_kernels_by_count(events, steps: int, limit: int = 40) -> None:
    """GPU kernels per step by launch count (where the launches of a step come from), with their time."""
    kernels = device_events(events)
    kernels.sort(key=lambda e: e.count, reverse=True)
    print(f"{'launches/step':>13} {'us/step':>9}  kernel")
    for e in kernels[:limit]:
        print(f"{e.count / steps:13.1f} {e.self_device_time_total / steps:9.1f}  {e.key[:110]}")


if __name__ == "__main__":
    main()

"""Where a decode step's time goes across its two streams (from a torch.profiler trace of graph replays).

``timeline_report(trace_path, steps)`` splits the device's kernels (and copies) of ``steps`` consecutive steps by the
stream they ran on and, per step on average: the step's span (first kernel start to last kernel end); the main
stream's (the one with most kernels) busy time; and its idle time split in two: while the other streams ran (the main
stream waiting on a join, or on nothing it needs) and while every stream was idle (launch and dependency latency
between kernels, the part fewer or shorter chains remove). Then the main stream's longest gaps, each with the kernels
around it and what the side stream ran meanwhile. Read it from a profile with ``DEEPINFER_NVIDIA_PDL=0``: with
programmatic dependent launch a kernel starts before its predecessor ends and waits inside, so busy and idle blur.
Where the trace reports a graph's kernels on the stream it was launched on, every kernel counts as main-stream work
and the split shows busy and all-idle time only. Usable as a script on a saved trace: ``python timeline.py trace.json
[steps]``.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


@dataclass(frozen=True)
class Span:
    """One device event: ``[start, end)`` in microseconds on ``stream``."""

    name: str
    stream: int
    start: float
    end: float


def device_spans(trace_path: str | Path) -> list[Span]:
    """The trace's kernels, copies and memsets, by start time."""
    data = json.loads(Path(trace_path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    spans = [Span(e["name"], int(e.get("args", {}).get("stream", e.get("tid", 0))), e["ts"], e["ts"] + e["dur"])
             for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES and "dur" in e]
    return sorted(spans, key=lambda s: s.start)


def _union(spans: list[Span], lo: float, hi: float) -> list[tuple[float, float]]:
    """The merged busy intervals of ``spans`` clipped to ``[lo, hi)``."""
    merged: list[list[float]] = []
    for s in sorted(spans, key=lambda s: s.start):
        a, b = max(s.start, lo), min(s.end, hi)
        if b <= a:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _covered(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in intervals)


def split_steps(spans: list[Span], steps: int) -> list[list[Span]]:
    """``spans`` cut into ``steps`` consecutive steps of equal kernel count (graph replays repeat one sequence)."""
    per = len(spans) // steps
    return [spans[i * per:(i + 1) * per] for i in range(steps)]


def _by_stream(step: list[Span]) -> tuple[int, dict[int, list[Span]]]:
    """The main stream (the one with most kernels) and the step's spans by stream."""
    by_stream: dict[int, list[Span]] = defaultdict(list)
    for s in step:
        by_stream[s.stream].append(s)
    return max(by_stream, key=lambda k: len(by_stream[k])), by_stream


def step_breakdown(step: list[Span]) -> dict[str, float | int]:
    """One step's span, its main stream's busy time, and the main stream's idle time while another stream ran and
    while every stream was idle (microseconds); the main stream and the kernel counts per stream."""
    main, by_stream = _by_stream(step)
    lo, hi = min(s.start for s in step), max(s.end for s in step)
    main_busy = _union(by_stream[main], lo, hi)
    others = _union([s for s in step if s.stream != main], lo, hi)
    idle_side_busy = 0.0
    cursor = lo
    for a, b in main_busy + [(hi, hi)]:
        idle_side_busy += _covered(others, cursor, a)
        cursor = b
    busy = sum(b - a for a, b in main_busy)
    return {"span": hi - lo, "main_busy": busy, "main_idle_side_busy": idle_side_busy,
            "all_idle": hi - lo - busy - idle_side_busy, "main_stream": main, "main_kernels": len(by_stream[main]),
            "side_kernels": len(step) - len(by_stream[main])}


def main_gaps(step: list[Span], top: int) -> list[tuple[float, Span, Span, list[Span]]]:
    """The main stream's ``top`` longest gaps: (gap us, the kernel that ended last before it, the kernel after it,
    the other streams' kernels that ran in the gap). Kernels of one stream that overlap (a CUDA graph's branches,
    where the trace reports them all on the stream the graph was launched on) leave no gap."""
    main, by_stream = _by_stream(step)
    ordered = by_stream[main]
    gaps, last = [], ordered[0]
    for after in ordered[1:]:
        if after.start > last.end:
            beside = [s for s in step if s.stream != main and s.end > last.end and s.start < after.start]
            gaps.append((after.start - last.end, last, after, beside))
        if after.end > last.end:
            last = after
    return sorted(gaps, key=lambda g: g[0], reverse=True)[:top]


def timeline_report(trace_path: str | Path, steps: int, top: int = 10) -> str:
    """The report of the trace at ``trace_path`` holding ``steps`` decode steps (module docstring), as text."""
    spans = device_spans(trace_path)
    if len(spans) < steps or steps < 1:
        return f"{len(spans)} device events in the trace: too few for {steps} steps"
    cut = split_steps(spans, steps)
    rows = [step_breakdown(step) for step in cut]
    keys = ("span", "main_busy", "main_idle_side_busy", "all_idle")
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
    first = rows[0]
    summary = (f"per step (mean of {steps}): span {mean['span']:.1f} us; main stream ({first['main_kernels']} "
               f"kernels) busy {mean['main_busy']:.1f} us, idle while the side stream ran ({first['side_kernels']} "
               f"kernels) {mean['main_idle_side_busy']:.1f} us, every stream idle {mean['all_idle']:.1f} us")
    lines = [summary, f"main stream's longest gaps (step 1 of {steps}):"]
    for gap, before, after, beside in main_gaps(cut[0], top):
        names = ", ".join(s.name[:40] for s in beside[:3]) + (" ..." if len(beside) > 3 else "")
        lines.append(f"  {gap:7.1f} us  {before.name[:40]} -> {after.name[:40]}"
                     + (f"  | side: {len(beside)} ({names})" if beside else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    print(timeline_report(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1))

"""Where the GPU sits idle inside a profiled step, and what the host was doing then (from a torch.profiler trace).

``gap_report(trace_path)`` reads the Chrome trace that ``prof.export_chrome_trace`` wrote: the device's busy time
(kernels, copies, memsets) against the span from the step's ``record_function`` mark (``STEP_MARK``) to its last
device event; the idle before the first kernel; the longest gaps between device events, each with the kernel that
ended it and the host ops and runtime calls that ran during it; and the CUDA runtime calls by total time (a
``cudaStreamSynchronize``, a blocking ``cudaMemcpy`` or a ``cudaFree`` there is a host wait the step did not need).
Usable as a script on a saved trace: ``python trace_gaps.py trace.json``.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

STEP_MARK = "deepinfer.step"
DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATEGORIES = {"cpu_op", "cuda_runtime", "cuda_driver"}


def _events(trace_path: str | Path) -> list[dict]:
    data = json.loads(Path(trace_path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _step_window(events: list[dict]) -> tuple[float, float] | None:
    marks = [e for e in events if e.get("name") == STEP_MARK and e.get("cat") in ("user_annotation", "cpu_op")]
    if not marks:
        return None
    start = min(e["ts"] for e in marks)
    return start, max(e["ts"] + e["dur"] for e in marks)


def _busy(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def gap_report(trace_path: str | Path, top: int = 8, min_gap_us: float = 20.0) -> str:
    """The idle report of the trace at ``trace_path`` (module docstring), as text."""
    events = _events(trace_path)
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES]
    if not device:
        return "no device events in the trace"
    window = _step_window(events)
    step_start = window[0] if window else device[0]["ts"]
    device = [e for e in device if e["ts"] + e["dur"] >= step_start]
    end = max(e["ts"] + e["dur"] for e in device)
    busy = _busy([(e["ts"], e["ts"] + e["dur"]) for e in device])
    lines = [(f"step span {(end - step_start) / 1e3:.2f} ms (from the '{STEP_MARK}' mark to the last device event), "
             f"device busy {busy / 1e3:.2f} ms, idle {(end - step_start - busy) / 1e3:.2f} ms; "
             f"before the first device event {(device[0]['ts'] - step_start) / 1e3:.2f} ms")]
    gaps, reach = [], device[0]["ts"] + device[0]["dur"]
    for e in device[1:]:
        if e["ts"] - reach >= min_gap_us:
            gaps.append((e["ts"] - reach, reach, e))
        reach = max(reach, e["ts"] + e["dur"])
    lines.append(f"{len(gaps)} gaps of >= {min_gap_us:.0f} us between device events: "
                 f"{sum(g for g, _, _ in gaps) / 1e3:.2f} ms")
    for gap, start, after in sorted(gaps, key=lambda g: g[0], reverse=True)[:top]:
        lines.append(f"  {gap:9.1f} us gap at +{(start - step_start) / 1e3:.2f} ms, then {after['name'][:70]}")
        for e in _longest_overlapping(host, start, start + gap, 4):
            lines.append(f"      {e['cat']:12} {e['dur']:9.1f} us  {e['name'][:80]}")
    lines.append("CUDA runtime / driver calls in the step by total time (count, total us):")
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in host:
        if e["cat"] in ("cuda_runtime", "cuda_driver") and step_start <= e["ts"] <= end:
            totals[e["name"]][0] += 1
            totals[e["name"]][1] += e["dur"]
    for name, (count, total) in sorted(totals.items(), key=lambda kv: kv[1][1], reverse=True)[:top]:
        lines.append(f"  {count:6d} {total:10.1f}  {name}")
    return "\n".join(lines)


def _longest_overlapping(host: list[dict], start: float, end: float, limit: int) -> list[dict]:
    """The host events that overlap ``[start, end)`` longest (the host's business while the device waited)."""
    def overlap(e: dict) -> float:
        return min(end, e["ts"] + e["dur"]) - max(start, e["ts"])

    hits = [e for e in host if overlap(e) > 0]
    return sorted(hits, key=lambda e: (overlap(e), -e["dur"]), reverse=True)[:limit]


if __name__ == "__main__":
    print(gap_report(sys.argv[1]))

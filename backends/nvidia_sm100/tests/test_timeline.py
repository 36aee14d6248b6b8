"""``benchmarks/timeline.py`` on a hand-made two-stream trace (CPU only: it reads JSON)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from timeline import step_breakdown, timeline_report


def _kernel(name: str, stream: int, start: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": dur, "args": {"stream": stream}}


def _step(t0: float) -> list[dict]:
    """Main stream 7: a [0, 10), b [12, 20), c [30, 35); side stream 9: s [14, 26) (so main waits 20 -> 26 on it)."""
    return [_kernel("a", 7, t0, 10), _kernel("b", 7, t0 + 12, 8), _kernel("s", 9, t0 + 14, 12),
            _kernel("c", 7, t0 + 30, 5), {"ph": "X", "cat": "cpu_op", "name": "host", "ts": t0, "dur": 3}]


def test_step_breakdown_splits_the_main_streams_idle_time(tmp_path):
    events = _step(0.0) + _step(100.0)
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    from timeline import device_spans, split_steps

    steps = split_steps(device_spans(trace), 2)
    assert [len(s) for s in steps] == [4, 4]
    row = step_breakdown(steps[1])
    assert row["main_stream"] == 7 and row["main_kernels"] == 3 and row["side_kernels"] == 1
    assert row["span"] == 35 and row["main_busy"] == 23
    assert row["main_idle_side_busy"] == 6  # 20 -> 26 while s runs
    assert row["all_idle"] == 6  # 10 -> 12 and 26 -> 30
    report = timeline_report(trace, 2)
    assert "span 35.0 us" in report and "every stream idle 6.0 us" in report
    assert "10.0 us  b -> c  | side: 1 (s)" in report


def test_overlapping_kernels_of_one_stream_leave_no_gap():
    """A graph's branches reported on one stream overlap: a gap runs from the latest end, not the previous kernel's."""
    from timeline import Span, main_gaps

    step = [Span("a", 7, 0, 10), Span("x", 7, 5, 15), Span("b", 7, 20, 25)]
    ((gap, before, after, beside),) = main_gaps(step, top=5)
    assert (gap, before.name, after.name, beside) == (5, "x", "b", [])
    assert step_breakdown(step)["all_idle"] == 5

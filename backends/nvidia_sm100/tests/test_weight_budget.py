"""``benchmarks/weight_budget.py`` on a hand-made trace (CPU only: it reads JSON)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from weight_budget import OTHER, budget_report, category


@pytest.mark.parametrize(("name", "kind"), [
    ("_up_row_kernel", "experts"), ("_down_pick_kernel", "experts"), ("_down_kernel_0d1d2", "experts"),
    ("_row_kernel", "linears and head"), ("_gemv_row_kernel", "linears and head"),
    ("_fp8_tc_kernel", "linears and head"), ("_sum_splits_kernel", "linears and head"),
    ("nvjet_tst_128x64_64x8_1x2_h_bz_coopA_NTN", "linears and head"), ("_combine_kernel", OTHER),
    ("_align_kernel", OTHER), ("_sparse_split_kernel", OTHER), ("_hc_mix_kernel", OTHER)])
def test_kernels_fall_into_their_category(name, kind):
    assert category(name) == kind


def _kernel(name: str, start: float, dur: float, stream: int = 7) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": dur, "args": {"stream": stream}}


def test_the_bound_replaces_the_weight_products_by_their_floor(tmp_path):
    step = [_kernel("_hc_mix_kernel", 0, 5), _kernel("_row_kernel", 6, 20), _kernel("_up_row_kernel", 27, 30),
            _kernel("_rope_kernel", 30, 4, stream=9), _kernel("_down_row_kernel", 58, 12), _kernel("_gemv_row_kernel",
                                                                                                   71, 9)]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": step + [{**e, "ts": e["ts"] + 100} for e in step]}))
    report = budget_report(str(trace), 2, 25e-6)  # span 80, weights 20 + 30 + 12 + 9 = 71, floor 25
    assert "| experts | 42.0 |" in report and "| linears and head | 29.0 |" in report and "| rest | 9.0 |" in report
    assert "71.0 us against a floor of 25.0 us (35%)" in report
    assert "at least 34.0 us (the span is 80.0 us)" in report

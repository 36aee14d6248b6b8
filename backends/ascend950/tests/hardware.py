"""Skip logic of the hardware tests (markers ``npu`` and ``ci_npu``): run only where the probe finds an Ascend 950."""

from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=1)
def npu_unavailable_reason() -> str | None:
    """None on an Ascend 950 host with CANN and torch_npu; else the skip reason (the probe's own reason)."""
    from deepinfer_ascend950.probe import run_probe

    result = run_probe()
    return None if result.available else f"needs an Ascend 950 NPU with CANN and torch_npu; {result.reason}"


def hardware_marks() -> list:
    """``pytestmark`` of a hardware test module: both markers, and a skip carrying the probe's reason."""
    reason = npu_unavailable_reason()
    return [pytest.mark.npu, pytest.mark.ci_npu, pytest.mark.skipif(reason is not None, reason=reason or "")]

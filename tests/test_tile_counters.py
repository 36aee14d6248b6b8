"""``deepinfer_core.tile_counters``: zeroed int32 counters per (device, stream priority) for kernels whose programs
meet in the kernel."""

from __future__ import annotations

import torch

from deepinfer_core.tile_counters import TileCounters


def test_one_zeroed_buffer_per_device_and_priority_within_its_slots():
    counters = TileCounters(64)
    first = counters.get(torch.device("cpu"), 10)
    assert first.shape == (64,) and first.dtype == torch.int32 and not first.any()
    first[3] = 1  # a launch that left a count behind would show in the same buffer
    assert counters.get(torch.device("cpu"), 64) is first and counters.buffers() == [first]
    assert counters.get(torch.device("cpu"), 65) is None  # more tiles than slots: the caller's second kernel
    assert TileCounters(64).get(torch.device("cpu"), 1) is not first  # each owner keeps its own

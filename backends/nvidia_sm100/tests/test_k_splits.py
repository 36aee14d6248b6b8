"""``kernels/k_splits.py``: K splits that meet in the kernel (``store_split``): the last split of a tile to finish adds
the partials in split order, whatever order the splits finish in, and leaves its arrival counter at zero. On the GPU
(many tiles racing) where there is one; without, in a child pytest process under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the test extra installs triton")
import triton
import triton.language as tl
from deepinfer_nvidia_sm100.kernels import k_splits
from interpreted import DEVICE, kernel_runs_here, run_under_interpreter, starts_the_interpreter

ORDER_SENSITIVE = (1e8, 1.0, -1e8, 1.0)  # float32 in split order: ((1e8 + 1) - 1e8) + 1 = 1; any other order: 0 or 2


@starts_the_interpreter
def test_k_splits_under_triton_interpreter():
    run_under_interpreter(__file__)


@triton.jit
def _meet_kernel(values_ptr, part_ptr, out_ptr, counter_ptr, stride_ps, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (tile, split): the split's value (times the tile's number + 1) in every column, met by ``store_split``."""
    tile, split = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    acc = tl.zeros((1, BLOCK), dtype=tl.float32) + tl.load(values_ptr + split) * (tile + 1)
    at = tile * BLOCK + cols
    k_splits.store_split(acc, part_ptr + at, out_ptr + at, counter_ptr + tile, split, stride_ps, cols < BLOCK, SPLITS)


@kernel_runs_here
def test_splits_meet_in_split_order_and_reset_their_counters():
    """512 tiles of 4 splits whose float32 sum depends on the order: every tile adds them in split order (1, not 0
    or 2), twice in a row (the counters are back at zero after each launch)."""
    tiles, block = 512, 32
    values = torch.tensor(ORDER_SENSITIVE, dtype=torch.float32, device=DEVICE)
    splits = values.numel()
    counters = k_splits.arrival_counters(torch.device(DEVICE), tiles)
    assert not counters.any()
    for _ in range(2):
        part = torch.full((splits, tiles * block), float("nan"), device=DEVICE)
        out = torch.zeros(tiles, block, device=DEVICE)
        _meet_kernel[(tiles, splits)](values, part, out, counters, part.stride(0), SPLITS=splits, BLOCK=block)
        want = torch.arange(1, tiles + 1, device=DEVICE, dtype=torch.float32)[:, None].expand(tiles, block)
        assert torch.equal(out, want)
        assert not counters[:tiles].any()


def test_arrival_counters_one_buffer_per_device_and_priority():
    """One zeroed buffer per (device, stream priority), kept across calls; None (the partials then added by a second
    kernel) for more tiles than it holds."""
    device = torch.device("cpu")
    first = k_splits.arrival_counters(device, 8)
    assert first.numel() == k_splits.COUNTERS.slots and first.dtype == torch.int32 and not first.any()
    assert k_splits.arrival_counters(device, k_splits.COUNTERS.slots) is first
    assert k_splits.arrival_counters(device, k_splits.COUNTERS.slots + 1) is None
    assert any(buffer is first for buffer in k_splits.COUNTERS.buffers())

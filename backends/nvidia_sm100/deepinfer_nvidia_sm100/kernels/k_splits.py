"""Splitting a product's inputs (``K``) across programs: more programs for few output tiles, each split's float32
sums added in split order (deterministic): by the kernel's own last program of each tile (``store_split``, arrival
counters from ``arrival_counters``) or afterwards by a second kernel (``fp8_linear._sum_splits_kernel``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.tile_counters import TileCounters


def parts(K: int, step: int, most: int) -> tuple[int, int]:
    """``K`` inputs in at most ``most`` parts of whole ``step`` slices: ``(parts, inputs a part)``; the last part
    may be shorter, no part is empty."""
    per_part = triton.cdiv(triton.cdiv(K, step), most) * step
    return triton.cdiv(K, per_part), per_part


def partials(splits: int, shape: tuple[int, ...], out: torch.Tensor) -> torch.Tensor:
    """Where a kernel's K splits write: float32 sums ``[splits, *shape]``, or, for one split, ``out`` itself (the
    kernel writes its own output; nothing is allocated)."""
    if splits == 1:
        return out
    return torch.empty(splits, *shape, dtype=torch.float32, device=out.device)


COUNTERS = TileCounters(8192)  # the arrival counters of launches whose K splits meet in the kernel (``store_split``)


def arrival_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """Zeroed int32 counters for ``tiles`` output tiles whose K splits meet in the kernel (``store_split``), one
    buffer per (device, stream priority) (``TileCounters.get``), or None: a second kernel then adds the partials (the
    same sums). Every launch leaves the ones it used at zero. (The batch-invariant plugin's split-K GEMM keeps its
    own ``TileCounters`` the same way.)"""
    return COUNTERS.get(device, tiles)


@triton.jit
def last_to_arrive(counter, arrivals):
    """Counts this program at ``counter`` once its partial sums are stored (every thread's, released with the count)
    and tells whether it is the last of ``arrivals`` programs there: that one then reads the others' partials
    (through L2, ``cache_modifier=".cg"``: other SMs wrote them) and calls ``reset``."""
    tl.debug_barrier()  # every thread's partial stored before the arrival counts (the release covers them)
    return tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == arrivals - 1


@triton.jit
def reset(counter):
    """The counter back at zero for the next launch (``last_to_arrive``'s last program, once it is done)."""
    tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def store_split(acc, part_at, out_at, counter, split, stride_ps, mask, SPLITS: tl.constexpr):
    """One split's float32 sums ``acc`` of a tile to the partials (``part_at`` at split 0, ``stride_ps`` apart);
    the tile's last split to arrive (``counter``, this tile's arrival counter) adds the ``SPLITS`` partials in split
    order, writes them to ``out_at`` in its dtype and sets the counter back to zero. The result does not depend on
    which split finishes last."""
    tl.store(part_at + split * stride_ps, acc, mask=mask)
    if last_to_arrive(counter, SPLITS):
        total = tl.load(part_at, mask=mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLITS):
            total += tl.load(part_at + s * stride_ps, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(out_at, total.to(out_at.dtype.element_ty), mask=mask)
        reset(counter)


@triton.jit
def split_range(split, k_per_split, K, SPLITS: tl.constexpr):
    """The inputs ``(begin, end)`` of split ``split``: all ``K`` for one split (a loop with constant bounds, as
    without splits)."""
    if SPLITS == 1:
        return 0, K
    else:
        begin = split * k_per_split
        return begin, tl.minimum(begin + k_per_split, K)

"""Splitting a product's inputs (``K``) across programs: more programs for few output tiles, each split's float32
sums added afterwards in split order (the kernels' own ``_sum_splits_kernel``: deterministic)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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


@triton.jit
def split_range(split, k_per_split, K, SPLITS: tl.constexpr):
    """The inputs ``(begin, end)`` of split ``split``: all ``K`` for one split (a loop with constant bounds, as
    without splits)."""
    if SPLITS == 1:
        return 0, K
    else:
        begin = split * k_per_split
        return begin, tl.minimum(begin + k_per_split, K)

"""Ops ``apply_rope`` / ``apply_rope_`` as one Triton kernel: the pass-through channels copied (``apply_rope``; in
place they are not touched, so a 512-channel head with 64 rotary channels moves an eighth of its bytes), the
trailing rotary pairs rotated.

Compiled by TorchInductor, the reference's stack / flatten / concatenate becomes a kernel that moves the whole
tensor at a fraction of the copy bandwidth. Here every row is
read and written once, in contiguous runs; the rotation is the reference's in fp32, rounded once to the
tensor's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.ops.table import written_back
from deepinfer_nvidia_sm100.kernels import pdl
from deepinfer_nvidia_sm100.kernels.compiled import opaque_under_compile


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, rows, rows_per_token, DIM, NOPE, HALF, sign,
                 BLOCK_R: tl.constexpr, NOPE_P2: tl.constexpr, HALF_P2: tl.constexpr, COPY: tl.constexpr,
                 PDL: tl.constexpr = False):
    """Rows ``[BLOCK_R]`` of ``x [rows, DIM]``: channels ``< NOPE`` copied (``COPY``; in place ``out`` is ``x`` and
    they stay), pairs ``(NOPE + 2i, NOPE + 2i + 1)`` rotated by the angle of row's token (``cos`` / ``sin [tokens,
    HALF]``; ``sign`` -1 rotates backwards)."""
    pdl.begin(PDL)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    in_r = r < rows
    row = r.to(tl.int64)[:, None] * DIM  # [BR, 1]
    token = (r // rows_per_token).to(tl.int64)[:, None] * HALF  # [BR, 1]
    if COPY:
        ch = tl.arange(0, NOPE_P2)[None, :]  # [1, NP]
        keep = in_r[:, None] & (ch < NOPE)
        tl.store(out_ptr + row + ch, tl.load(x_ptr + row + ch, mask=keep), mask=keep)
    ch = tl.arange(0, 2 * HALF_P2)[None, :]  # [1, 2 HP]: the rotary channels, read and written as contiguous runs
    rot = in_r[:, None] & (ch < 2 * HALF)
    at = row + NOPE + ch
    pairs = tl.reshape(tl.load(x_ptr + at, mask=rot, other=0.0).to(tl.float32), (BLOCK_R, HALF_P2, 2))
    even, odd = tl.split(pairs)  # [BR, HP] each: channels NOPE + 2i and NOPE + 2i + 1
    pair = tl.arange(0, HALF_P2)[None, :]  # [1, HP]
    angle = in_r[:, None] & (pair < HALF)
    cos = tl.load(cos_ptr + token + pair, mask=angle, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token + pair, mask=angle, other=0.0).to(tl.float32) * sign
    rotated = tl.reshape(tl.join(even * cos - odd * sin, odd * cos + even * sin), (BLOCK_R, 2 * HALF_P2))
    tl.store(out_ptr + at, rotated.to(out_ptr.dtype.element_ty), mask=rot)


@opaque_under_compile("apply_rope", lambda x, cos, sin, inverse=False: x.new_empty(x.shape))
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``reference.apply_rope``: interleaved RoPE on the trailing ``2 * cos.shape[-1]`` channels of ``x [T, ..., dim]``
    (``cos`` / ``sin``: ``[T, rope_dim // 2]``); a new tensor."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _rotate(x, cos, sin, inverse, out)
    return out


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``reference.apply_rope_``: ``apply_rope`` written into ``x``, whose other channels are not read or written;
    returns ``x``."""
    if not x.is_contiguous():
        return written_back(apply_rope)(x, cos, sin, inverse)
    _rotate_in_place(x, cos, sin, inverse)
    return x


@opaque_under_compile("apply_rope_", lambda x, cos, sin, inverse: None, mutates_args=("x",))
def _rotate_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> None:
    _rotate(x, cos, sin, inverse, x)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool, out: torch.Tensor) -> None:
    """The kernel over contiguous ``x`` into ``out`` (``x`` itself: in place, the pass-through channels stay)."""
    dim, half = x.shape[-1], cos.shape[-1]
    rows = x.numel() // dim
    if rows == 0:
        return
    nope = dim - 2 * half
    copy = out.data_ptr() != x.data_ptr()
    nope_p2 = triton.next_power_of_2(max(nope, 1)) if copy else 1
    block_r = max(1, min(16, 2048 // max(nope_p2, 2 * half)))
    _rope_kernel[(triton.cdiv(rows, block_r),)](
        x, cos.contiguous(), sin.contiguous(), out, rows, rows // cos.shape[0], dim, nope, half,
        -1.0 if inverse else 1.0, BLOCK_R=block_r, NOPE_P2=nope_p2, HALF_P2=triton.next_power_of_2(half), COPY=copy,
        num_warps=4, **pdl.launch())

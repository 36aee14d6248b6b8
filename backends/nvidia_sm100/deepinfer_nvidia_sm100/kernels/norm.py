"""Ops ``rms_norm`` and ``unweighted_rms_norm`` as one Triton kernel (and ``rms_norm_rope``: the norm, then RoPE on
the normed rows' trailing channels, in the same pass).

A program normalises ``ROWS`` whole rows held in registers, with the reference's arithmetic: fp32 sum of squares,
``rms_norm`` scales by the weight in fp32 and rounds once, ``unweighted_rms_norm`` rounds the scale to the input
dtype first (as the reference multiplies in that dtype). It is as fast as the per-op compiled reference at decode
sizes (launch-bound) and faster on long prefill rows, near the copy bandwidth (``benchmarks/bench_norm.py`` times both).

In the op table by default; ``DEEPINFER_NVIDIA_NORM=0`` takes the compiled reference instead. Inside a decode step
compiled whole (``DEEPINFER_NVIDIA_COMPILE_STEP=1``) the reference op is traced, so Inductor fuses each norm with
the ops around it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.ops import reference as ref
from deepinfer_nvidia_sm100 import envs
from deepinfer_nvidia_sm100.kernels import pdl
from deepinfer_nvidia_sm100.kernels.compiled import reference_under_compile

MAX_WIDTH = 16384  # a row lives in registers


def enabled() -> bool:
    """Whether ``DEEPINFER_NVIDIA_NORM`` puts these ops in the op table (on by default)."""
    return envs.DEEPINFER_NVIDIA_NORM


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, cos_ptr, sin_ptr, rows, rows_per_token, D, x_row_stride, HALF, eps,
                     ROWS: tl.constexpr, BLOCK_D: tl.constexpr, WEIGHTED: tl.constexpr, ROPE: tl.constexpr,
                     PDL: tl.constexpr = False):
    """Rows ``[ROWS]`` of ``x [rows, D]`` (rows ``x_row_stride`` apart: a column block of a wider projection is read in
    place) into contiguous ``out``: ``x * rsqrt(mean(x^2) + eps)``, times ``w [D]`` when ``WEIGHTED``; with
    ``ROPE``, the rounded result's trailing ``2 * HALF`` channels then rotated in interleaved pairs by the angle of
    the row's token (``cos`` / ``sin [tokens, HALF]``, ``rows_per_token`` rows each), as ``apply_rope_`` would."""
    pdl.begin(PDL)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [R]
    cols = tl.arange(0, BLOCK_D)  # [BD]
    mask = (r[:, None] < rows) & (cols[None, :] < D)
    at = r[:, None].to(tl.int64) * D + cols[None, :]
    x = tl.load(x_ptr + r[:, None].to(tl.int64) * x_row_stride + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)  # [R, BD]
    scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)  # [R]
    out_ty = out_ptr.dtype.element_ty
    if WEIGHTED:
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)  # [BD]
        y = w[None, :] * (x * scale[:, None])
    else:
        y = x * scale.to(out_ty).to(tl.float32)[:, None]
    if ROPE:
        even, odd = tl.split(tl.reshape(y.to(out_ty).to(tl.float32), (ROWS, BLOCK_D // 2, 2)))  # [R, BD / 2] each
        pair = tl.arange(0, BLOCK_D // 2)[None, :] - (D // 2 - HALF)  # [1, BD / 2]: the pair's angle, < 0: no rope
        turn = (r[:, None] < rows) & (pair >= 0) & (pair < HALF)
        angle = (r // rows_per_token).to(tl.int64)[:, None] * HALF + pair
        cos = tl.load(cos_ptr + angle, mask=turn, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + angle, mask=turn, other=0.0).to(tl.float32)
        y = tl.reshape(tl.join(even * cos - odd * sin, odd * cos + even * sin), (ROWS, BLOCK_D))
    tl.store(out_ptr + at, y.to(out_ty), mask=mask)


# The batch-invariant launch (``launch(..., invariant=True)``): one row per program and the row count not
# specialised, so every row runs the same compiled code in the same place of its tile, whatever the batch.
_rms_norm_kernel_per_row = triton.jit(do_not_specialize=["rows", "rows_per_token"])(_rms_norm_kernel.fn)


def launch(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor | None = None,
           sin: torch.Tensor | None = None, invariant: bool = False) -> torch.Tensor:
    """The norm kernel on the rows of ``x`` (``covered(x)``): weighted where ``weight`` is given, RoPE after it where
    ``cos`` / ``sin`` are; ``invariant``: one row per program, for the batch-invariant mode."""
    dim = x.shape[-1]
    if not (x.dim() == 2 and x.stride(-1) == 1):  # 2-D rows may be apart (a projection's column block), else packed
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.numel() // dim if dim else 0
    if rows == 0:
        return out
    block_d = triton.next_power_of_2(dim)
    per_program = 1 if invariant else max(1, min(16, 2048 // block_d))
    warps = 4 if block_d <= 2048 else 8 if block_d <= 8192 else 16
    rope = cos is not None
    kernel = _rms_norm_kernel_per_row if invariant else _rms_norm_kernel
    kernel[(triton.cdiv(rows, per_program),)](
        x, weight if weight is not None else x, out, cos.contiguous() if rope else x, sin.contiguous() if rope else x,
        rows, rows // cos.shape[0] if rope else 1, dim, x.stride(0) if x.dim() == 2 else dim,
        cos.shape[-1] if rope else 0, eps, ROWS=per_program,
        BLOCK_D=block_d, WEIGHTED=weight is not None, ROPE=rope, num_warps=warps, **pdl.launch())
    return out


def covered(x: torch.Tensor) -> bool:
    """Whether the kernel takes these rows (else the reference op runs)."""
    return 0 < x.shape[-1] <= MAX_WIDTH


@reference_under_compile(ref.rms_norm)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``reference.rms_norm``: RMSNorm over the last dim in fp32, scaled by ``weight``, in ``x``'s dtype."""
    if not covered(x):
        return ref.rms_norm(x, weight, eps)
    return launch(x, weight.contiguous(), eps)


@reference_under_compile(ref.unweighted_rms_norm)
def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``reference.unweighted_rms_norm``: the fp32 RMS scale rounded to ``x``'s dtype, times ``x``."""
    if not covered(x):
        return ref.unweighted_rms_norm(x, eps)
    return launch(x, None, eps)


@reference_under_compile(ref.rms_norm_rope)
def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """``reference.rms_norm_rope`` in one launch: the norm (``unweighted_rms_norm`` where ``weight`` is None), then
    RoPE on the rounded result's trailing ``2 * cos.shape[-1]`` channels, one read and one write of ``x``."""
    if not covered(x) or x.shape[-1] % 2 or x.numel() // x.shape[-1] % max(cos.shape[0], 1):
        from deepinfer_nvidia_sm100.kernels.rope import apply_rope_

        return ref.normed_rope(rms_norm, unweighted_rms_norm, apply_rope_)(x, weight, eps, cos, sin)
    return launch(x, None if weight is None else weight.contiguous(), eps, cos, sin)

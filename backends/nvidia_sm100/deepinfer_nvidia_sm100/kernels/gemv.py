"""Ops ``linear`` and ``grouped_linear`` for decode-sized inputs (at most 16 rows) as one Triton kernel (off by default).

At batch 1 the attention projections read ~1.8 GB of bf16 weights per step of the bench preset (floor ~0.41 ms on
the H200) and cuBLAS took ~0.66 ms for them plus ~75 split-K reduce / copy launches (docs/performance.md 4.7, 4.8).
Here each program owns ``BLOCK_N`` output columns over the whole ``K`` (no split-K, so one launch and no partials)
and multiplies 16-row tiles of the inputs (rows past the batch masked) with ``tl.dot``, fp32 accumulation, one
rounding to the output dtype, as ``F.linear``. ``grouped_linear`` runs the groups on the grid's second axis.

Off by default: ``DEEPINFER_NVIDIA_GEMV=1`` puts it in the op table. On the H200 (``benchmarks/bench_gemv.py``,
docs/performance.md 4.9) it was within 10% of cuBLAS either way (faster on ``wo_b`` and the CSA ``w_input``, slower
on ``wq_b``), so cuBLAS stays the default. Narrow outputs (fewer than ``MIN_COLUMNS``: too few programs to read
the weight at full bandwidth) and other inputs keep the reference op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer_core.ops import reference as ref
from deepinfer_nvidia_sm100.kernels.compiled import env_flag, opaque_under_compile

ENV = "DEEPINFER_NVIDIA_GEMV"
MAX_ROWS = 16  # the tl.dot tile's M: decode batches up to 16 rows
MIN_COLUMNS = 2048  # at BLOCK_N 32, at least 64 programs stream the weight
BLOCK_N, BLOCK_K = 32, 256
_DTYPES = (torch.bfloat16, torch.float16)


def enabled() -> bool:
    """Whether ``DEEPINFER_NVIDIA_GEMV`` puts these ops in the op table (off by default)."""
    return env_flag(ENV, "0")


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_xg, stride_wn, stride_om, stride_og,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (column block, group g): ``out[m, g, n] = sum_k x[m, g, k] * w[g * N + n, k]`` for the ``M`` rows."""
    group = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rows = tl.arange(0, BLOCK_M)  # [BM]
    in_n, in_m = cols < N, rows < M
    x_base = x_ptr + group * stride_xg + rows[:, None].to(tl.int64) * stride_xm  # [BM, 1]
    w_base = w_ptr + (group * N + cols[:, None].to(tl.int64)) * stride_wn  # [BN, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)  # [BK]
        in_k = ks < K
        x = tl.load(x_base + ks[None, :], mask=in_m[:, None] & in_k[None, :], other=0.0)  # [BM, BK]
        w = tl.load(w_base + ks[None, :], mask=in_n[:, None] & in_k[None, :], other=0.0)  # [BN, BK]
        acc = tl.dot(x, tl.trans(w), acc)  # [BM, BN]
    out = out_ptr + group * stride_og + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


@triton.jit
def _gemv_row_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_xg, stride_wn, stride_og,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """Program (column block, group g) for one input row: ``out[g, n] = sum_k x[g, k] * w[g * N + n, k]``.

    No ``tl.dot`` (its 16-row tile is all padding at one row): an fp32 ``[BLOCK_N, BLOCK_K]`` product accumulated
    over ``K``, summed once at the end. ``EVEN`` (``N % BLOCK_N == 0`` and ``K % BLOCK_K == 0``) drops the masks."""
    group = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    in_n = cols < N
    x_base = x_ptr + group * stride_xg
    w_base = w_ptr + (group * N + cols[:, None].to(tl.int64)) * stride_wn  # [BN, 1]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)  # [BK]
        if EVEN:
            x = tl.load(x_base + ks)
            w = tl.load(w_base + ks[None, :], eviction_policy="evict_first")
        else:
            in_k = ks < K
            x = tl.load(x_base + ks, mask=in_k, other=0.0)
            w = tl.load(w_base + ks[None, :], mask=in_n[:, None] & in_k[None, :], other=0.0,
                        eviction_policy="evict_first")
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]  # [BN, BK]
    out = tl.sum(acc, axis=1)  # [BN]
    tl.store(out_ptr + group * stride_og + cols, out.to(out_ptr.dtype.element_ty), mask=in_n)


@dataclass(frozen=True)
class RowConfig:
    """Launch parameters of ``_gemv_row_kernel``."""

    block_n: int
    block_k: int
    warps: int
    stages: int


def row_config(n: int, k: int) -> RowConfig:
    """The one-row kernel's launch for a ``[n, k]`` weight (per group)."""
    return RowConfig(block_n=8, block_k=512 if k >= 512 else 256, warps=4, stages=3)


def launch_row(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, groups: int,
               config: RowConfig | None = None) -> None:
    """``x [groups, K]`` (unit last stride), ``weight [groups * N, K]`` -> ``out [groups, N]`` (unit last stride)."""
    k, n = x.shape[-1], out.shape[-1]
    config = config or row_config(n, k)
    even = n % config.block_n == 0 and k % config.block_k == 0
    _gemv_row_kernel[(triton.cdiv(n, config.block_n), groups)](
        x, weight, out, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN=even, num_warps=config.warps, num_stages=config.stages)


def _covered(x: torch.Tensor, weight: torch.Tensor, rows: int, columns: int) -> bool:
    return (x.dtype in _DTYPES and weight.dtype == x.dtype and weight.is_contiguous()
            and 0 < rows <= MAX_ROWS and columns >= MIN_COLUMNS)


def _launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, groups: int) -> None:
    """``x [M, groups, K]`` (last dim contiguous), ``weight [groups * N, K]`` -> ``out [M, groups, N]``."""
    rows, _, k = x.shape
    n = out.shape[-1]
    if rows == 1:
        launch_row(x[0], weight, out[0], groups)
        return
    _gemv_kernel[(triton.cdiv(n, BLOCK_N), groups)](
        x, weight, out, rows, n, k, x.stride(0), x.stride(1), weight.stride(0), out.stride(0), out.stride(1),
        BLOCK_M=MAX_ROWS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4, num_stages=4)


@opaque_under_compile("gemv_linear", lambda x, weight: x.new_empty(*x.shape[:-1], weight.shape[0]))
def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``reference.linear`` (``x [..., K] @ weight[N, K].T``): the kernel for at most 16 rows, else ``F.linear``."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not _covered(x, weight, rows, weight.shape[0]):
        return ref.linear(x, weight)
    flat = x.reshape(rows, 1, x.shape[-1]).contiguous()  # [M, 1, K]
    out = torch.empty(rows, 1, weight.shape[0], dtype=x.dtype, device=x.device)  # [M, 1, N]
    _launch(flat, weight, out, 1)
    return out.view(*x.shape[:-1], weight.shape[0])


@opaque_under_compile("gemv_grouped_linear",
                      lambda x, weight, groups: x.new_empty(x.shape[0], groups, weight.shape[0] // groups))
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """``reference.grouped_linear`` (``x [T, groups, K]``, ``weight [groups * N, K]`` -> ``[T, groups, N]``): the
    kernel for at most 16 tokens, else the reference op."""
    per_group = weight.shape[0] // groups
    if not _covered(x, weight, x.shape[0], per_group * groups):
        return ref.grouped_linear(x, weight, groups)
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape[0], groups, per_group, dtype=x.dtype, device=x.device)
    _launch(x, weight, out, groups)
    return out

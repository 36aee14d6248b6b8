"""Ops ``linear`` and ``grouped_linear`` for one input row (a batch-1 decode step) as one Triton kernel.

At batch 1 a decode step of the bench preset reads ~1.8 GB of dense projection weights; cuBLAS takes them as
split-K GEMVs (a GEMV kernel plus a reduction kernel each: 32 reductions per step). Here each program owns
``block_n`` output columns over the whole ``K``: an fp32 ``[block_n, block_k]`` product accumulated over ``K`` and
summed once (no ``tl.dot``: its 16-row tile would be all padding), one rounding to the output dtype, as
``F.linear``; ``grouped_linear`` runs the groups on the grid's second axis. The launch (``row_config``) is the
fastest of ``benchmarks/sweep_gemv.py``'s configurations for each preset projection, weights read from HBM.

On by default; ``DEEPINFER_NVIDIA_GEMV=0`` keeps cuBLAS. More rows, narrower outputs than ``MIN_COLUMNS`` and other
dtypes take cuBLAS (``F.linear``, ``blas.grouped_linear``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer_core.ops import reference as ref
from deepinfer_nvidia_sm100 import envs
from deepinfer_nvidia_sm100.kernels import blas, pdl
from deepinfer_nvidia_sm100.kernels.compiled import opaque_under_compile

MIN_COLUMNS = 64  # the narrowest output it takes: the router (64 experts), 32 programs of two columns
_DTYPES = (torch.bfloat16, torch.float16)


def enabled() -> bool:
    """Whether ``DEEPINFER_NVIDIA_GEMV`` puts these ops in the op table (on by default)."""
    return envs.DEEPINFER_NVIDIA_GEMV


@triton.jit
def _gemv_row_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_xg, stride_wn, stride_og,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr = False):
    """Program (column block, group g) for one input row: ``out[g, n] = sum_k x[g, k] * w[g * N + n, k]``.

    No ``tl.dot`` (its 16-row tile is all padding at one row): an fp32 ``[BLOCK_N, BLOCK_K]`` product accumulated
    over ``K``, summed once at the end. ``EVEN`` (``N % BLOCK_N == 0`` and ``K % BLOCK_K == 0``) drops the masks."""
    pdl.begin(PDL)
    group = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    in_n = cols < N
    x_base = x_ptr + group * stride_xg
    w_base = w_ptr + (group * N + cols[:, None].to(tl.int64)) * stride_wn  # [BN, 1]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)  # [BK]
        w = weight_tile(w_base, ks, K, in_n, EVEN)
        acc += w.to(tl.float32) * input_tile(x_base, ks, K, EVEN).to(tl.float32)[None, :]  # [BN, BK]
    out = tl.sum(acc, axis=1)  # [BN]
    tl.store(out_ptr + group * stride_og + cols, out.to(out_ptr.dtype.element_ty), mask=in_n)


@triton.jit
def weight_tile(w_base, ks, K, in_n, EVEN: tl.constexpr):
    """Weight columns ``ks`` of the program's rows, ``[BN, BK]`` (zeros past ``N`` / ``K`` unless ``EVEN``)."""
    if EVEN:
        return tl.load(w_base + ks[None, :], eviction_policy="evict_first")
    return tl.load(w_base + ks[None, :], mask=in_n[:, None] & (ks < K)[None, :], other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def input_tile(x_base, ks, K, EVEN: tl.constexpr):
    """Input elements ``ks``, ``[BK]`` (zeros past ``K`` unless ``EVEN``)."""
    if EVEN:
        return tl.load(x_base + ks)
    return tl.load(x_base + ks, mask=ks < K, other=0.0)


@dataclass(frozen=True)
class RowConfig:
    """Launch parameters of ``_gemv_row_kernel``."""

    block_n: int
    block_k: int
    warps: int
    stages: int


def row_config(n: int, k: int, groups: int = 1) -> RowConfig:
    """The launch for a ``[groups * n, k]`` weight, from ``benchmarks/sweep_gemv.py``: two columns a
    program (most programs in flight) where ``K`` is at most 4096; wider tiles for the 8192-wide ``wo_b`` and the
    grouped ``wo_a`` (few columns per group)."""
    if groups > 1:
        return RowConfig(block_n=16, block_k=512, warps=4, stages=4)
    if k >= 8192:
        return RowConfig(block_n=16, block_k=1024, warps=8, stages=4)
    if k >= 4096:
        return RowConfig(block_n=2, block_k=1024, warps=4, stages=2)
    return RowConfig(block_n=2, block_k=min(512, triton.next_power_of_2(k)), warps=2, stages=4)


def launch_row(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, groups: int,
               config: RowConfig | None = None) -> None:
    """``x [groups, K]`` (unit last stride), ``weight [groups * N, K]`` -> ``out [groups, N]`` (unit last stride)."""
    k, n = x.shape[-1], out.shape[-1]
    config = config or row_config(n, k, groups)
    even = n % config.block_n == 0 and k % config.block_k == 0
    _gemv_row_kernel[(triton.cdiv(n, config.block_n), groups)](
        x, weight, out, n, k, x.stride(0), weight.stride(0), out.stride(0), BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, EVEN=even, num_warps=config.warps, num_stages=config.stages, **pdl.launch())


def covered(x: torch.Tensor, weight: torch.Tensor, rows: int, columns: int) -> bool:
    """Whether the kernel takes this product (else cuBLAS): one row of a 16-bit dtype, a contiguous weight of at
    least ``MIN_COLUMNS`` outputs per group."""
    return (x.dtype in _DTYPES and weight.dtype == x.dtype and weight.is_contiguous() and rows == 1
            and columns >= MIN_COLUMNS)


@opaque_under_compile("gemv_linear", lambda x, weight: x.new_empty(*x.shape[:-1], weight.shape[0]))
def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``reference.linear`` (``x [..., K] @ weight[N, K].T``): the kernel for one row, else ``F.linear``."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not covered(x, weight, rows, weight.shape[0]):
        return ref.linear(x, weight)
    flat = x.reshape(1, x.shape[-1])
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()  # [1, K]
    out = torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)  # [1, N]
    launch_row(flat, weight, out, 1)
    return out.view(*x.shape[:-1], weight.shape[0])


@opaque_under_compile("gemv_grouped_linear",
                      lambda x, weight, groups: x.new_empty(x.shape[0], groups, weight.shape[0] // groups))
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """``reference.grouped_linear`` (``x [T, groups, K]``, ``weight [groups * N, K]`` -> ``[T, groups, N]``): the
    kernel for one token, else the strided cuBLAS batched GEMM (``blas.grouped_linear``)."""
    per_group = weight.shape[0] // groups
    if not covered(x, weight, x.shape[0], per_group):
        return blas.grouped_linear(x, weight, groups)
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(1, groups, per_group, dtype=x.dtype, device=x.device)
    launch_row(x[0], weight, out[0], groups)
    return out

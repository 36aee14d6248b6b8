"""fp8 block linear layers (ops ``linear_fp8_block``, ``grouped_linear_fp8_block``, ``swiglu_mlp_fp8_block``) as
Triton kernels reading the e4m3 weights and their block scales as stored.

Kernels picked by the number of rows ``M`` (``linear_path``):

* ``M == 1`` (batch-1 decode): ``_row_kernel``, a one-row product like ``gemv._gemv_row_kernel`` (no ``tl.dot``),
  the weight decoded in registers (weight-only).
* ``1 < M < FP8_TC_MIN_ROWS`` (small decode batches; memory bound): ``_split_k_kernel``, which reads each weight once for
  all the rows: 256 weight rows a program (64 for narrow outputs), decoded in registers (exactly) and multiplied
  on the left of a ``tl.dot`` with the batch (``SPLIT_K_SWAP``: on SM90 a wgmma with the weights in registers,
  the batch padded to 16 rather than 64), fp32 accumulation. ``K`` is split
  (``_splits``) until the grid has ``MIN_PROGRAMS`` programs, so that every SM streams weights even for narrow
  outputs; the splits' float32 partials are summed in split order (deterministic) by ``_sum_splits_kernel``, or
  with ``DEEPINFER_NVIDIA_FP8_SPLITS_MEET`` by the last split of each tile to finish, in the kernel
  (``k_splits.store_split``: no second launch).
  Exact weights, activations as they are: the reference op's math. (``_weight_only_kernel``, the decode-batch
  kernel before it, one column tile over the whole ``K``, stays as ``WEIGHT_ONLY`` for comparison.)
* ``M >= FP8_TC_MIN_ROWS`` (decode batches of 16+ and prefill): ``_fp8_tc_kernel``, fp8 tensor cores (wgmma on SM90,
  tcgen05 on SM100): ``quantize_activations`` first turns every row's ``B1`` inputs of a block into e4m3 with
  one fp32 scale (``amax / 448``: DeepSeek's per-token per-128 activations, once per row, not once per column
  tile), then each ``K`` block's fp8 product (fp32 accumulate) is scaled by the row's and the weight block's scales;
  ``K`` split as above when the output has few tiles.
  Activations are quantized: its error against the reference op is what docs/quantization.md records.
* ``M >= DEQUANT_MIN_ROWS`` (long prefill chunks), bf16 activations, V4-Flash's 128 x 128 blocks and ``K`` a
  multiple of 512 (``scaled_mm_fits``): ``SCALED_MM``, cuBLAS's blockwise fp8 GEMM (``torch._scaled_mm`` with the
  activations quantized per token and 128 inputs as above, the weight's own block scales as float32; SM90 from CUDA
  12.9): fp8 tensor cores at cuBLAS's rate. Other blocks, widths and dtypes (or ``DEEPINFER_NVIDIA_FP8_SCALED_MM=0``):
  ``DEQUANT``, the weight decoded once to the activations' dtype (``dequantized``: the reference op's weight, bit
  for bit), then cuBLAS (``torch.bmm``): exact (decoding reads the fp8 weight and writes it at twice its size once
  per call, a few % of a product of that many rows).

``FP8_TC_MIN_ROWS`` is the measured crossover (``benchmarks/bench_quant.py``); ``DEEPINFER_NVIDIA_FP8_TC=0`` keeps
the weight-only kernels at every size. Blocks must be powers of two of at least 16 (32 for the tensor-core
kernel); other blocks, and activations other than bf16 / fp16 / fp32, take the reference op.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer_core.ops import reference as ref
from deepinfer_core.quant.scales import scale_to_float
from deepinfer_nvidia_sm100 import envs
from deepinfer_nvidia_sm100.kernels import dequant, k_splits, moe, moe_quant, pdl
from deepinfer_nvidia_sm100.kernels.compiled import opaque_under_compile

ROW_MAX_ROWS = 1  # products of at most this many rows take the one-row kernel (0: the split-K kernel from 1 row;
# on sm_90a it spends ~3.0 instructions a weight against the row kernel's ~7.5: bench_quant.py's 1-row sweep decides)
FP8_TC_MIN_ROWS = 16  # rows from which the fp8 tensor-core kernel beats the weight-only one (bench_quant.py fp8 on an
# H200, 2026-12-02: faster at 16 rows for 5 of the preset's 6 weights, at 64 for all)
DEQUANT_MIN_ROWS = 1024  # rows from which the weight decoded once to the activations' dtype, then cuBLAS, wins
# (c407f82 on the H200: 1,024 rows in bf16 ~120 us against fp8 tensor cores ~280-330 us; decoding wo_b ~25 us)
FP8_MAX: tl.constexpr = tl.constexpr(448.0)  # largest finite e4m3 magnitude
FP8_TC_MIN_BLOCK = 32  # an fp8 tensor-core product takes at least 32 inputs
ROW, SPLIT_K, WEIGHT_ONLY, FP8_TC, DEQUANT, SCALED_MM = "row", "split_k", "weight_only", "fp8_tc", "dequant", "scaled_mm"
SCALED_MM_BLOCK = (128, 128)  # the weight blocks cuBLAS's blockwise scaling takes (activations: 1 x 128)
SCALED_MM_ROW_ALIGN = 16  # rows of a SCALED_MM product are padded to a multiple of this (cuBLAS refused 1,337)
SCALED_MM_K_BLOCKS_ALIGN = 4  # cuBLAS reads 128 x 128 weight scales as [round_up(K / 128, 4), N / 128]: whole here
_SCALED_MM_REFUSED: set[tuple[int, int, int]] = set()  # (groups, N, K) of products cuBLAS refused: DEQUANT there
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def tensor_cores_enabled() -> bool:
    """Whether large batches take the fp8 tensor-core kernel (``DEEPINFER_NVIDIA_FP8_TC``, on by default)."""
    return envs.DEEPINFER_NVIDIA_FP8_TC


def scaled_mm_fits(x: torch.Tensor, N: int, K: int, block: tuple[int, int]) -> bool:
    """Whether a ``DEQUANT`` product of ``x [M, groups, K]`` with ``N`` outputs per group can take ``SCALED_MM``:
    bf16 on an SM90+ GPU, ``SCALED_MM_BLOCK`` blocks whole in ``N`` and ``K``, ``K``'s blocks a multiple of
    ``SCALED_MM_K_BLOCKS_ALIGN``, not switched off, and a shape cuBLAS has not refused (it declines some small ones,
    e.g. 128 x 128 weights: ``launch`` then decodes the weight and remembers the shape).

    cuBLAS takes no leading dimension for block scales: it reads the weight's as ``[round_up(K / 128, 4), N / 128]``
    with stride ``[1, round_up(K / 128, 4)]`` (cuBLAS's "scaling factors layouts"; PyTorch #166752). Where ``K /
    128`` is not a multiple of 4 the stored scales are read from the wrong places without any error (the tiny
    model's 256-wide layers gave sums off by up to 240 on the H200): such products take ``DEQUANT``."""
    return (envs.DEEPINFER_NVIDIA_FP8_SCALED_MM and x.dtype == torch.bfloat16 and x.is_cuda
            and tuple(block) == SCALED_MM_BLOCK and N % block[0] == 0
            and K % (block[1] * SCALED_MM_K_BLOCKS_ALIGN) == 0
            and (x.shape[1], N, K) not in _SCALED_MM_REFUSED
            and not pdl._interpreted() and torch.cuda.get_device_capability(x.device)[0] >= 9)


def picked_path(x: torch.Tensor, N: int, block: tuple[int, int]) -> str | None:
    """The kernel ``matmul`` runs ``x [M, groups, K]`` through: ``linear_path``'s, ``DEQUANT`` turned into
    ``SCALED_MM`` where ``scaled_mm_fits``."""
    path = linear_path(x.shape[0], x.dtype, block)
    return SCALED_MM if path == DEQUANT and scaled_mm_fits(x, N, x.shape[-1], block) else path


def linear_path(rows: int, dtype: torch.dtype, block: tuple[int, int]) -> str | None:
    """Which kernel a product of ``rows`` rows takes (``ROW``, ``SPLIT_K``, ``FP8_TC``, ``DEQUANT``, which ``matmul``
    turns into ``SCALED_MM`` where ``scaled_mm_fits``; ``WEIGHT_ONLY`` only when asked for), or None for the
    reference op (a block that is not a power of two of at least 16, another dtype)."""
    if dtype not in _DTYPES or any(b < 16 or b & (b - 1) for b in block):
        return None
    if rows <= ROW_MAX_ROWS:
        return ROW
    if rows >= DEQUANT_MIN_ROWS:
        return DEQUANT
    if (rows >= FP8_TC_MIN_ROWS and dtype != torch.float32 and block[1] >= FP8_TC_MIN_BLOCK
            and tensor_cores_enabled()):
        return FP8_TC
    return SPLIT_K


@triton.jit
def _row_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N, K, k_per_split, stride_xg, stride_wn, stride_sn, stride_os,
                stride_og, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
                UE8M0: tl.constexpr, SPLITS: tl.constexpr = 1, PDL: tl.constexpr = False):
    """Program (column block, group g, K split) of one input row: ``out[g, n] = sum_k x[g, k] * W[g * N + n, k]``;
    with ``SPLITS`` > 1 each split's float32 sums over its ``k_per_split`` inputs go to ``out`` at ``split``
    (``stride_os``: the partials ``_sum_splits_kernel`` adds up)."""
    pdl.begin(PDL)
    group, split = tl.program_id(1).to(tl.int64), tl.program_id(2)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    in_n = cols < N
    rows = group * N + cols  # [BN] weight rows
    w_rows = w_ptr + rows[:, None] * stride_wn  # [BN, 1]
    s_rows = s_ptr + (rows // B0)[:, None] * stride_sn
    acc = dequant.row_acc(BLOCK_N, BLOCK_K, 1, B1)
    k_begin, k_end = k_splits.split_range(split, k_per_split, K, SPLITS)
    for k0 in range(k_begin, k_end, BLOCK_K):
        acc = dequant.row_product(acc, x_ptr + group * stride_xg, w_rows, s_rows, k0, K, in_n, 1, BLOCK_K, B1, UE8M0)
    tl.store(out_ptr + split * stride_os + group * stride_og + cols,
             dequant.row_total(acc, 1).to(out_ptr.dtype.element_ty), mask=in_n)


@triton.jit
def _weight_only_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_xg, stride_wn, stride_sn,
                        stride_om, stride_og, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        B0: tl.constexpr, B1: tl.constexpr, UE8M0: tl.constexpr, PRECISION: tl.constexpr,
                        SWAP: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (row block, column block, group): ``out = x @ W^T`` with each fp8 weight tile decoded to ``x``'s
    dtype in registers (``BLOCK_K`` divides ``B1``); ``SWAP``: as ``out^T = W @ x^T`` (``dequant.fp8_dot_swapped``,
    the weights the left operand), transposed once after the loop."""
    pdl.begin(PDL)
    group = tl.program_id(2).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_rows = x_ptr + group * stride_xg + offs_m[:, None].to(tl.int64) * stride_xm  # [BM, 1]
    rows = group * N + offs_n  # [BN] weight rows
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_rows = w_ptr + rows.to(tl.int64) * stride_wn  # [BN]
    s_rows = s_ptr + (rows // B0) * stride_sn
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        if SWAP:
            a_t = tl.load(tl.trans(x_rows) + offs_k[:, None], mask=m_mask[None, :] & k_mask[:, None], other=0.0)
            acc = dequant.fp8_dot_swapped(acc, a_t, w_rows, s_rows, offs_k, k0, n_mask[:, None] & k_mask[None, :],
                                          n_mask, B1, UE8M0, PRECISION)  # [BN, BM]
        else:
            a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
            acc = dequant.fp8_dot(acc, a, w_ptr, s_ptr, offs_k, rows, k0, stride_wn, stride_sn,
                                  n_mask[None, :] & k_mask[:, None], n_mask, B0, B1, UE8M0, PRECISION)
    if SWAP:
        acc = tl.trans(acc)  # [BM, BN]
    tl.store(out_ptr + group * stride_og + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _scaled_weight_tile(w_rows, s_rows, k0, K, n_mask, dt: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, B1: tl.constexpr, UE8M0: tl.constexpr):
    """The weights ``[BN, BK]`` of the slice from ``k0`` as ``dt``: each e4m3 value times its block's scale in
    float32, rounded once to ``dt``: the reference op's weights bit for bit. ``w_rows`` / ``s_rows``: ``[BN, 1]``
    pointers to the rows' weights and scales; a slice spans one block (``BK <= B1``) or whole blocks."""
    if BLOCK_K <= B1:
        ks = k0 + tl.arange(0, BLOCK_K)  # [BK]
        w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & (ks < K)[None, :], other=0.0,
                    eviction_policy="evict_first")  # [BN, BK] e4m3
        live = (k0 + tl.arange(0, 1) < K)[None, :]  # [1, 1]: the slice starts before K
        scale = dequant.block_scale(tl.load(s_rows + k0 // B1, mask=n_mask[:, None] & live, other=0),
                                    UE8M0)  # [BN, 1]
        return (w.to(tl.float32) * scale).to(dt)
    else:
        starts = k0 + tl.arange(0, BLOCK_K // B1) * B1  # [NB] each block's first input
        ks = starts[:, None] + tl.arange(0, B1)[None, :]  # [NB, B1]
        w = tl.load(w_rows[:, :, None] + ks[None, :, :], mask=n_mask[:, None, None] & (ks < K)[None, :, :],
                    other=0.0, eviction_policy="evict_first")  # [BN, NB, B1] e4m3
        in_k = n_mask[:, None] & (starts < K)[None, :]  # [BN, NB]
        scale = dequant.block_scale(tl.load(s_rows + starts[None, :] // B1, mask=in_k, other=0), UE8M0)  # [BN, NB]
        return tl.reshape((w.to(tl.float32) * scale[:, :, None]).to(dt), (BLOCK_N, BLOCK_K))


@triton.jit
def _split_k_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_xg, stride_wn, stride_sn,
                    stride_om, stride_og, part_ptr, counter_ptr, stride_ps, stride_pm, stride_pg,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, B0: tl.constexpr,
                    B1: tl.constexpr, UE8M0: tl.constexpr, PRECISION: tl.constexpr, SWAP: tl.constexpr,
                    F16: tl.constexpr = False, SPLITS: tl.constexpr = 1, MEET: tl.constexpr = False,
                    PDL: tl.constexpr = False):
    """Program (column block x row block, ``K`` split, group): ``x[rows] @ W[cols, split]^T``, one ``tl.dot`` per
    slice of ``BLOCK_K`` inputs (or per scale block inside it) with fp32 accumulation, written to ``out`` (with
    ``SPLITS`` > 1 through float32 partials added in split order: ``_store_tile``). The row blocks of a column block
    are consecutive programs (their weight tile is read once from HBM). ``SWAP``: as ``out^T = W @ x^T`` (the
    weights the left operand: on SM90 a wgmma with them in registers, 64 weight rows a warpgroup by the few
    activation rows).

    Weights: ue8m0 blocks with bf16 / fp32 activations take ``_post_scaled_slice`` (e4m3 values converted as they
    are, the block's power of two applied to the product: exact); others ``_scaled_weight_tile`` (each weight times
    its scale rounded to the activations' dtype: the reference op's weights). ``F16`` (bf16 activations, ue8m0):
    the product in fp16 (``_post_scaled_slice``)."""
    pdl.begin(PDL)
    dt = x_ptr.dtype.element_ty
    SUB: tl.constexpr = min(BLOCK_K, B1)  # inputs of a slice inside one scale block
    m_tiles = tl.cdiv(M, BLOCK_M)
    pid_n, pid_m = tl.program_id(0) // m_tiles, tl.program_id(0) % m_tiles
    split, group = tl.program_id(1), tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    rows = group * N + offs_n  # [BN] weight rows
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    s_rows = s_ptr + (rows // B0)[:, None] * stride_sn  # [BN, 1]
    x_rows = x_ptr + group * stride_xg + offs_m.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = split * k_per_split
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):  # the last split's slices past K load nothing
        k0 = tl.multiple_of(k0, BLOCK_K)  # k_per_split is a multiple of BLOCK_K: 16-byte weight vectors
        if UE8M0 and (dt == tl.bfloat16 or dt == tl.float32):
            for j in tl.static_range(BLOCK_K // SUB):
                acc = _post_scaled_slice(acc, x_rows, w_rows, s_rows, k0 + j * SUB, K, m_mask, n_mask, SUB, B1, F16,
                                         PRECISION, SWAP)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :],
                        other=0.0)  # [BM, BK]
            w = _scaled_weight_tile(w_rows, s_rows, k0, K, n_mask, dt, BLOCK_N, BLOCK_K, B1, UE8M0)  # [BN, BK]
            if SWAP:
                acc = tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)  # [BN, BM]
            else:
                acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)  # [BM, BN]
    if SWAP:
        acc = tl.trans(acc)  # [BM, BN]
    _store_tile(acc, out_ptr, part_ptr, counter_ptr, split, group, offs_m, offs_n, m_mask, n_mask, stride_om,
                stride_og, stride_ps, stride_pm, stride_pg, SPLITS, MEET)


@triton.jit
def _post_scaled_slice(acc, x_rows, w_rows, s_rows, k0, K, m_mask, n_mask, SUB: tl.constexpr, B1: tl.constexpr,
                       F16: tl.constexpr, PRECISION: tl.constexpr, SWAP: tl.constexpr):
    """``acc`` plus the product of the ``SUB`` inputs from ``k0`` (inside one scale block), the e4m3 weights
    converted as they are and the block's ue8m0 power of two applied to the product (exact). ``F16``: bf16
    activations as fp16 times a power of two per row (``_as_f16``) and the weights converted to fp16 (one
    conversion per pair of weights, none to bf16), the row's power of two applied to the product too."""
    offs_k = k0 + tl.arange(0, SUB)
    k_mask = offs_k < K
    a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, SUB]
    w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                eviction_policy="evict_first")  # [BN, SUB] e4m3
    live = (k0 + tl.arange(0, 1) < K)[None, :]  # [1, 1]: the slice starts before K (the last split's may not)
    scale = dequant.ue8m0(tl.load(s_rows + k0 // B1, mask=n_mask[:, None] & live, other=0))  # [BN, 1]
    if F16:
        a, a_scale = _as_f16(a)  # [BM, SUB] fp16, [1, BM] powers of two
        w = w.to(tl.float16)
    else:
        w = w.to(a.dtype)
        a_scale = tl.full((1, 1), 1.0, tl.float32)
    if SWAP:
        return acc + tl.dot(w, tl.trans(a), input_precision=PRECISION) * (scale * a_scale)  # [BN, BM]
    else:
        return acc + tl.dot(a, tl.trans(w), input_precision=PRECISION) * tl.trans(scale * a_scale)  # [BM, BN]


@triton.jit
def _as_f16(a):
    """bf16 rows ``a [BM, SUB]`` as fp16 ``a16`` and float32 powers of two ``up [1, BM]``, ``a = a16 * up``: each row
    scaled so that its largest magnitude lies in [2^14, 2^15) (an all-zero row by 2^100). Exact for every value
    above 2^-32 of its row's largest (bf16's 8 significant bits fit fp16's 11; smaller ones round as fp16
    subnormals, off by less than 2^-39 of the largest)."""
    af = a.to(tl.float32)
    amax = tl.max(tl.abs(af), axis=1)  # [BM]
    exponent = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased float32 exponent
    shift = tl.minimum(tl.maximum(exponent - 141, -100), 100)  # amax * 2^-shift in [2^14, 2^15)
    down = ((127 - shift) << 23).to(tl.float32, bitcast=True)  # [BM] 2^-shift
    up = ((127 + shift) << 23).to(tl.float32, bitcast=True)
    return (af * down[:, None]).to(tl.float16), up[None, :]


@triton.jit
def _store_tile(acc, out_ptr, part_ptr, counter_ptr, split, group, offs_m, offs_n, m_mask, n_mask, stride_om,
                stride_og, stride_ps, stride_pm, stride_pg, SPLITS: tl.constexpr, MEET: tl.constexpr):
    """``acc [BM, BN]`` (float32) to ``out`` at (rows, ``group``, columns) in ``out``'s dtype; with ``SPLITS`` > 1
    to the float32 partials ``part [SPLITS, M, groups, N]`` at ``split``, added up by the tile's last split to
    finish (``MEET``: its arrival counter one per program of grid axis 0 and group, ``k_splits.store_split``) or by
    ``_sum_splits_kernel`` afterwards."""
    mask = m_mask[:, None] & n_mask[None, :]
    rows = offs_m[:, None].to(tl.int64)
    out_at = out_ptr + group * stride_og + rows * stride_om + offs_n[None, :]
    part_at = part_ptr + group * stride_pg + rows * stride_pm + offs_n[None, :]
    if SPLITS == 1:
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=mask)
    elif MEET:
        counter = counter_ptr + group * tl.num_programs(0) + tl.program_id(0)
        k_splits.store_split(acc, part_at, out_at, counter, split, stride_ps, mask, SPLITS)
    else:
        tl.store(part_at + split * stride_ps, acc, mask=mask)


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, N, groups, stride_ps, stride_om, stride_og, SPLITS: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row x group, column block): ``out = sum_s part[s]`` over the float32 partials ``[SPLITS, M, groups,
    N]`` (contiguous), added in split order (the result does not depend on which split finished first)."""
    pdl.begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    src = part_ptr + row * N + cols
    total = tl.load(src, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        total += tl.load(src + s * stride_ps, mask=mask, other=0.0)
    m, g = row // groups, row % groups
    tl.store(out_ptr + m * stride_om + g * stride_og + cols, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def round_to_e4m3(v):
    """float32 ``v`` (``|v| <= 448``) rounded to the nearest e4m3 value, ties to even, still float32: normal
    values keep 3 mantissa bits, values below 2^-6 become multiples of 2^-9 (e4m3's subnormals). The conversion to
    fp8 after it is then exact, on any hardware and in Triton's interpreter (whose own rounding drops a carry into
    the exponent)."""
    sign = (v.to(tl.int32, bitcast=True) >> 31) << 31  # kept: a value rounding to zero stays signed, as in torch
    magnitude = tl.abs(v)
    bits = magnitude.to(tl.int32, bitcast=True)
    kept = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # the mantissa rounded to 3 bits, ties to even
    subnormal = (magnitude + 16384.0) - 16384.0  # the float32 ulp of 2^14 is 2^-9
    rounded = tl.where(magnitude < 0.015625, subnormal, kept.to(tl.float32, bitcast=True))
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_scaled(x):
    """Each row of float32 ``x [R, C]`` as e4m3 values (float32, ``round_to_e4m3``) and its float32 scale
    ``amax / 448`` (1 for an all-zero row), ``x ~ q * scale[:, None]``: ``(q, scale [R])``."""
    amax = tl.max(tl.abs(x), axis=1)  # [R]
    scale = tl.where(amax > 0, amax / FP8_MAX, 1.0)
    return round_to_e4m3(tl.minimum(tl.maximum(x / scale[:, None], -FP8_MAX), FP8_MAX)), scale


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, blocks, stride_xm, stride_xg, stride_qm, stride_qg, stride_sm,
                          stride_sg, stride_sb, B1: tl.constexpr, BLOCKS: tl.constexpr, PDL: tl.constexpr = False,
                          PAIRS_SPLIT: tl.constexpr = False):
    """Program (row, group, run of ``BLOCKS`` K blocks): each ``B1`` inputs of the row as e4m3 ``q`` and one float32
    scale ``s = amax / 448`` (1 for an all-zero block), ``x ~ q * s``. ``PAIRS_SPLIT``: ``q`` holds each 32 inputs'
    even ones, then their odd ones (``pairs_split_order``)."""
    pdl.begin(PDL)
    row, group = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    b = tl.program_id(2) * BLOCKS + tl.arange(0, BLOCKS)  # [BLOCKS]
    offs_k = b[:, None] * B1 + tl.arange(0, B1)[None, :]  # [BLOCKS, B1]
    mask = (b < blocks)[:, None] & (offs_k < K)
    x = tl.load(x_ptr + row * stride_xm + group * stride_xg + offs_k, mask=mask, other=0.0).to(tl.float32)
    q, scale = e4m3_scaled(x)
    offs_q = pairs_split_order(offs_k) if PAIRS_SPLIT else offs_k
    tl.store(q_ptr + row * stride_qm + group * stride_qg + offs_q, q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row * stride_sm + group * stride_sg + b * stride_sb, scale, mask=b < blocks)


@triton.jit
def pairs_split_order(k):
    """Where input ``k`` goes when each 32 inputs are stored as their 16 even ones, then their 16 odd ones (the order
    of ``moe_mxfp4_fp8_decode``'s products: a packed MXFP4 byte's low nibble is an even input, its high one the next
    odd input)."""
    p = k % 32
    return k - p + 16 * (p % 2) + p // 2


QUANTIZE_ELEMENTS = 2048  # inputs one program of _quantize_rows_kernel quantizes


def quantize_activations(x: torch.Tensor, block: int, scales_by_column: bool = False, pairs_split: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, groups, K]`` (unit last stride) as e4m3 ``[M, groups, K]`` and float32 scales ``[M, groups,
    ceil(K / block)]``, one per row and ``block`` inputs (``amax / 448``; values rounded to nearest, ties to even).
    ``scales_by_column``: the scales stored column by column (strides ``(1, blocks * M, M)``: each group's
    ``[M, blocks]`` column-major, as cuBLAS's blockwise ``torch._scaled_mm`` reads them). ``pairs_split``: the values
    of each 32 inputs stored even ones first (``pairs_split_order``; ``K`` and ``block`` multiples of 32)."""
    M, groups, K = x.shape
    blocks = triton.cdiv(K, block)
    q = torch.empty(M, groups, K, dtype=torch.float8_e4m3fn, device=x.device)
    if scales_by_column:
        s = torch.empty(groups, blocks, M, dtype=torch.float32, device=x.device).permute(2, 0, 1)
    else:
        s = torch.empty(M, groups, blocks, dtype=torch.float32, device=x.device)
    per_program = max(1, min(QUANTIZE_ELEMENTS // block, triton.next_power_of_2(blocks)))
    if M:
        _quantize_rows_kernel[(M, groups, triton.cdiv(blocks, per_program))](
            x, q, s, K, blocks, x.stride(0), x.stride(1), q.stride(0), q.stride(1), s.stride(0), s.stride(1),
            s.stride(2), B1=block, BLOCKS=per_program, PAIRS_SPLIT=pairs_split, num_warps=4, **pdl.launch())
    return q, s


@triton.jit
def _fp8_tc_kernel(xq_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_xg, stride_xsm,
                   stride_xsg, stride_wn, stride_sn, stride_om, stride_og, part_ptr, counter_ptr, stride_ps, stride_pm,
                   stride_pg, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
                   UE8M0: tl.constexpr, GROUP_M: tl.constexpr, ONE_SCALE: tl.constexpr = False,
                   EVEN_K: tl.constexpr = False, SPLITS: tl.constexpr = 1, MEET: tl.constexpr = False,
                   PDL: tl.constexpr = False):
    """Program (output tile, group): ``out = x @ W^T`` on fp8 tensor cores from ``x``'s e4m3 values ``xq`` and
    per-row block scales ``xs`` (``quantize_activations``), one ``B1``-wide ``K`` block a step: ``dot(xq, w)`` in
    fp32, times the row's and the weight block's scales, accumulated in fp32. Tiles run ``GROUP_M`` row blocks
    per column block (consecutive programs share their weight and activation tiles in L2). Grid axis 1 splits
    ``K`` into ``SPLITS`` of ``k_per_split`` inputs each (a multiple of ``B1``), their float32 sums added in split
    order (``_store_tile``).

    ``ONE_SCALE``: the tile's rows lie in one ``B0`` block, so a K step has one weight scale, folded into the rows'
    scales (one multiply a row, then one FMA an output; a ue8m0 scale is a power of two: the same result).
    ``EVEN_K``: every split's steps lie inside ``K`` (no K masks)."""
    pdl.begin(PDL)
    split, group = tl.program_id(1), tl.program_id(2).to(tl.int64)
    pid_m, pid_n = moe_quant.tile_of(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_rows = xq_ptr + group * stride_xg + offs_m[:, None].to(tl.int64) * stride_xm  # [BM, 1]
    xs_rows = xs_ptr + group * stride_xsg + offs_m.to(tl.int64) * stride_xsm  # [BM]
    rows = group * N + offs_n  # [BN] weight rows
    w_rows = w_ptr + rows[None, :] * stride_wn  # [1, BN]
    s_rows = s_ptr + (rows // B0) * stride_sn  # [BN]
    s_tile = s_ptr + ((group * N + pid_n * BLOCK_N) // B0) * stride_sn  # ONE_SCALE: the tile's scale row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = split * k_per_split
    for k0 in range(k_lo, k_lo + k_per_split, B1):
        k0 = tl.multiple_of(k0, B1)
        offs_k = k0 + tl.arange(0, B1)
        if EVEN_K:
            a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)  # [BM, B1] e4m3
            w = tl.load(w_rows + offs_k[:, None], mask=n_mask[None, :], other=0.0)  # [B1, BN] e4m3
            a_scale = tl.load(xs_rows + k0 // B1, mask=m_mask, other=0.0)  # [BM]
        else:
            k_mask = offs_k < K
            a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_rows + offs_k[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0)
            live = k0 + tl.arange(0, 1) < K  # [1]: the slice starts before K (the last split's may not)
            a_scale = tl.load(xs_rows + k0 // B1, mask=m_mask & live, other=0.0)
        if ONE_SCALE:
            step = k0 + tl.arange(0, 1)  # [1]
            w_scale = dequant.block_scale(tl.load(s_tile + step // B1, mask=step < K, other=0), UE8M0)  # [1]
            acc += tl.dot(a, w, out_dtype=tl.float32) * (a_scale * w_scale)[:, None]
        else:
            w_scale = dequant.block_scale(tl.load(s_rows + k0 // B1, mask=n_mask & (k0 + tl.arange(0, 1) < K), other=0),
                                          UE8M0)  # [BN]
            acc += tl.dot(a, w, out_dtype=tl.float32) * a_scale[:, None] * w_scale[None, :]
    _store_tile(acc, out_ptr, part_ptr, counter_ptr, split, group, offs_m, offs_n, m_mask, n_mask, stride_om,
                stride_og, stride_ps, stride_pm, stride_pg, SPLITS, MEET)


# Launches: (BLOCK_N, BLOCK_K, num_warps, num_stages) of the row kernel; (BLOCK_M, BLOCK_N, num_warps, num_stages)
# of the weight-only and tensor-core kernels by rows (the first whose row bound holds; BLOCK_K: min(128, B1) / B1);
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the split-K kernel. A split-K or tensor-core launch may end
# with its number of K splits (else ``_splits`` picks it).
ROW_TILE = (8, 2048, 8, 3)  # 8 rows x 16 scale blocks of 128 fp8 inputs (bench_quant's one-row sweep on the H200,
# 2026-12-04: wo_b 11.8 us against 17.9 us for (16, 1024, 8, 3), wq_a+wkv 5.5 against 7.8; pipelined K loops and
# fewer rows with K split were slower); rows doubled where K is shorter (``_row_launch``)
SPLIT_K_TILES = ((16, 16, 256, 128, 8, 4), (32, 32, 256, 128, 8, 3), (None, 64, 256, 128, 8, 3))  # 256 weight rows
# a program amortize the activations' conversion: ~3.0 / 3.8 / 5.2 instructions a weight on sm_90a against 3.4 /
# 4.6 / 11 for 64 or 128 (BLOCK_N halves for narrow outputs: _split_k_launch)
WEIGHT_ONLY_TILES = ((16, 16, 64, 4, 4), (64, 64, 64, 4, 3), (None, 64, 128, 4, 3))  # (max rows, BM, BN, warps, st.)
FP8_TC_TILES = ((1024, 64, 128, 4, 3), (None, 128, 128, 8, 3))
SWAP_AB_MAX_ROWS = 0  # weight-only tiles of at most this many rows multiply with the weights on the left (off:
# on the H200 the swapped 16-row wo_b tile took 53.2 us, unswapped 36.5 us)
SPLIT_K_SWAP = True  # the split-K kernel multiplies with the weights on the left (64 weight rows a warpgroup x
# the batch)
SPLIT_K_F16 = True  # ... and bf16 activations with ue8m0 weights as fp16 products (_post_scaled_slice)
FP8_TC_GROUP_M = 8  # row blocks the tensor-core kernel runs down each column block before the next
MIN_PROGRAMS = 264  # two per SM of an H200: weight-only launches narrow their column tiles down to 16 to reach it,
# split-K and tensor-core launches split K
MIN_SPLIT_STEPS = 4  # slices of BLOCK_K inputs each K split runs at least
SUM_BLOCK = 1024  # outputs one program of _sum_splits_kernel adds up
SPLITS_MEET: bool | None = None  # K splits added in the kernel (``_meeting``); None: DEEPINFER_NVIDIA_FP8_SPLITS_MEET


def _tile(tiles, rows: int) -> tuple[int, ...]:
    return next(t[1:] for t in tiles if t[0] is None or rows <= t[0])


def _weight_only_tile(rows: int, columns: int, groups: int) -> tuple[int, int, int, int]:
    """``WEIGHT_ONLY_TILES``' launch with ``BLOCK_N`` halved (down to 16) while the grid has fewer than
    ``MIN_PROGRAMS`` programs: a decode batch's ``[64, 4096]`` output in 64 x 64 tiles would leave most SMs idle
    (memory bound, every SM has to stream weights)."""
    block_m, block_n, warps, stages = _tile(WEIGHT_ONLY_TILES, rows)
    while block_n > 16 and triton.cdiv(rows, block_m) * triton.cdiv(columns, block_n) * groups < MIN_PROGRAMS:
        block_n //= 2
    return block_m, block_n, warps, stages


def _splits(programs: int, K: int, step: int) -> int:
    """How many parts ``K`` is split into (a power of two): the fewest that give at least ``MIN_PROGRAMS`` programs
    (every SM streams weights), keeping at least ``MIN_SPLIT_STEPS`` slices of ``step`` inputs per part."""
    steps, splits = triton.cdiv(K, step), 1
    while programs * splits < MIN_PROGRAMS and steps >= 2 * splits * MIN_SPLIT_STEPS:
        splits *= 2
    return splits


def _split_k_launch(M: int, N: int, K: int, groups: int, B1: int, tile: tuple | None) -> tuple[tuple, int, int]:
    """The split-K launch ``(BM, BN, BK, warps, stages)`` (``SPLIT_K_TILES``' by rows, ``BN`` halved down to 64
    while even the most K splits would leave fewer than ``MIN_PROGRAMS / 2`` programs), its number of K splits and
    inputs per split (a multiple of ``BK``)."""
    if tile is None:
        block_m, block_n, block_k, warps, stages = _tile(SPLIT_K_TILES, M)
        most_splits = max(1, triton.cdiv(K, block_k) // MIN_SPLIT_STEPS)
        while block_n > 64 and triton.cdiv(M, block_m) * triton.cdiv(N, block_n) * groups * most_splits < \
                MIN_PROGRAMS // 2:
            block_n //= 2  # too few column tiles even split: narrower ones
        tile = (block_m, block_n, block_k, warps if block_n > 64 else 4, stages)
    block_m, block_n, block_k = tile[:3]
    programs = triton.cdiv(M, block_m) * triton.cdiv(N, block_n) * groups
    splits = tile[5] if len(tile) > 5 else _splits(programs, K, block_k)
    return tile[:5], *k_splits.parts(K, block_k, splits)


def _row_launch(N: int, K: int, groups: int, tile: tuple | None) -> tuple[tuple, int, int]:
    """The row kernel's launch ``(BN, BK, warps, stages)``, its number of K splits and inputs per split: ``tile`` as
    given (its fifth element the splits), or ``ROW_TILE`` with ``BK`` halved and ``BN`` doubled while a slice would
    span twice ``K`` (wq_b's 1,024 inputs: 16 rows of 1,024), so every thread loads weights."""
    if tile is not None:
        return tile[:4], *k_splits.parts(K, tile[1], tile[4] if len(tile) > 4 else 1)
    block_n, block_k, warps, stages = ROW_TILE
    while block_k >= 2 * K and block_n < N:
        block_n, block_k = 2 * block_n, block_k // 2
    return (block_n, block_k, warps, stages), *k_splits.parts(K, block_k, 1)


def _sum_splits(part: torch.Tensor, out: torch.Tensor, splits: int) -> None:
    """``out = part.sum(0)`` in split order (nothing to do for one split)."""
    if splits == 1:
        return
    M, groups, N = out.shape
    _sum_splits_kernel[(M * groups, triton.cdiv(N, SUM_BLOCK))](
        part, out, N, groups, part.stride(0), out.stride(0), out.stride(1), SPLITS=splits, BLOCK=SUM_BLOCK,
        num_warps=4, **pdl.launch())


def launch(path: str, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
           out: torch.Tensor, groups: int, tile: tuple[int, ...] | None = None) -> None:
    """``out [M, groups, N] = x [M, groups, K] @ W_g^T`` per group through the ``path`` kernel (``x`` / ``out`` with
    unit last stride, any other strides; ``weight [groups * N, K]``). ``tile`` fixes the launch (``ROW_TILE``'s or
    the dot tiles' form; ``benchmarks/bench_quant.py`` sweeps them)."""
    M, _, K = x.shape
    N = out.shape[-1]
    raw, is_ue8m0 = dequant.scale_operand(scale)
    consts = {"B0": block[0], "B1": block[1], "UE8M0": is_ue8m0, **pdl.launch()}
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    if path == ROW:
        (block_n, block_k, warps, stages), splits, per_split = _row_launch(N, K, groups, tile)
        part = k_splits.partials(splits, out.shape, out)
        _row_kernel[(triton.cdiv(N, block_n), groups, splits)](
            x, weight, raw, part, N, K, per_split, x.stride(1), weight.stride(0), raw.stride(0),
            part.stride(0) if splits > 1 else 0, part.stride(-2), BLOCK_N=block_n, BLOCK_K=block_k, SPLITS=splits,
            num_warps=warps, num_stages=stages, **consts)
        _sum_splits(part, out, splits)
    elif path == SPLIT_K:
        (block_m, block_n, block_k, warps, stages), splits, per_split = _split_k_launch(M, N, K, groups, block[1],
                                                                                        tile)
        grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n), splits, groups)
        part, counters, meet = _meeting(out, splits, grid)
        _split_k_kernel[grid](x, weight, raw, out, M, N, K, per_split, x.stride(0), x.stride(1), weight.stride(0),
                              raw.stride(0), out.stride(0), out.stride(1), part, counters, *part.stride()[:3],
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
                              SWAP=SPLIT_K_SWAP, F16=SPLIT_K_F16 and x.dtype == torch.bfloat16 and is_ue8m0,
                              SPLITS=splits, MEET=meet, num_warps=warps, num_stages=stages, **consts)
        if not meet:
            _sum_splits(part, out, splits)
    elif path == WEIGHT_ONLY:
        block_m, block_n, warps, stages = tile or _weight_only_tile(M, N, groups)
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), groups)
        args = (x, weight, raw, out, M, N, K, x.stride(0), x.stride(1), weight.stride(0), raw.stride(0),
                out.stride(0), out.stride(1))
        _weight_only_kernel[grid](*args, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=min(128, block[1]),
                                  PRECISION=precision, SWAP=block_m <= SWAP_AB_MAX_ROWS, num_warps=warps,
                                  num_stages=stages, **consts)
    elif path == SCALED_MM:
        try:
            _launch_scaled_mm(x, weight, scale, out, groups)
        except RuntimeError:  # CUBLAS_STATUS_NOT_SUPPORTED: this shape takes the decoded weight from now on
            _SCALED_MM_REFUSED.add((groups, N, K))
            launch(DEQUANT, x, weight, scale, block, out, groups)
    elif path == DEQUANT:
        dense = dequantized(weight, scale, block, x.dtype).view(groups, N, K)  # [g, N, K]
        torch.bmm(x.transpose(0, 1), dense.transpose(1, 2), out=out.transpose(0, 1))  # [g, M, K] @ [g, K, N]
    else:
        _launch_fp8_tc(x, weight, raw, block, out, groups, tile or _tile(FP8_TC_TILES, M), consts)


DEQUANT_TILE = (64, 128)  # (rows, columns) of a weight one program of dequant._fp8_block_kernel decodes


def dequantized(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """``weight [out, in]`` decoded to ``dtype``: each e4m3 value times its block's scale in float32, rounded once
    (the reference op's weight, bit for bit), by ``dequant._fp8_block_kernel``."""
    raw, is_ue8m0 = dequant.scale_operand(scale)
    rows, cols = weight.shape
    out = torch.empty(rows, cols, dtype=dtype, device=weight.device)
    grid = (triton.cdiv(rows, DEQUANT_TILE[0]), triton.cdiv(cols, DEQUANT_TILE[1]), 1)
    dequant._fp8_block_kernel[grid](weight, raw, out, rows, cols, raw.shape[-1], B0=block[0], B1=block[1],
                                    UE8M0=is_ue8m0, BLOCK_R=DEQUANT_TILE[0], BLOCK_C=DEQUANT_TILE[1])
    return out


def _launch_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                      groups: int) -> None:
    """``SCALED_MM``: the activations quantized per token and 128 inputs (scales column-major, as cuBLAS reads
    them; rows padded to ``SCALED_MM_ROW_ALIGN``, which cuBLAS needs of the scales' leading dimension, the padding
    rows' products never read), then one blockwise ``torch._scaled_mm`` per group with the weight's block scales as
    float32."""
    M = x.shape[0]
    N = out.shape[-1]
    padded = triton.cdiv(M, SCALED_MM_ROW_ALIGN) * SCALED_MM_ROW_ALIGN
    if padded != M:
        x = torch.cat([x, x.new_zeros(padded - M, *x.shape[1:])])  # [padded, g, K]
    xq, xs = quantize_activations(x, SCALED_MM_BLOCK[1], scales_by_column=True)  # [padded, g, K], [padded, g, K / 128]
    block_scales = scale_to_float(scale)  # [g N / 128, K / 128] float32
    per_group = N // SCALED_MM_BLOCK[0]
    for g in range(groups):
        a = xq[:, g] if groups == 1 else xq[:, g].contiguous()  # [padded, K] row-major
        w_scale = block_scales[g * per_group:(g + 1) * per_group].t()  # [K / 128, N / 128]
        args = (a, weight[g * N:(g + 1) * N].t())
        if groups == 1 and padded == M:  # written in place
            torch._scaled_mm(*args, scale_a=xs[:, g], scale_b=w_scale, out_dtype=out.dtype, out=out[:, 0])
        else:
            out[:, g].copy_(torch._scaled_mm(*args, scale_a=xs[:, g], scale_b=w_scale, out_dtype=out.dtype)[:M])


def _launch_fp8_tc(x: torch.Tensor, weight: torch.Tensor, raw: torch.Tensor, block: tuple[int, int],
                   out: torch.Tensor, groups: int, tile: tuple[int, ...], consts: dict) -> None:
    """The activations quantized (``quantize_activations``), then ``_fp8_tc_kernel``, K split as ``_splits`` picks
    (or ``tile``'s fifth entry) when the output has too few tiles to fill the GPU."""
    M, _, K = x.shape
    N = out.shape[-1]
    block_m, block_n, warps, stages = tile[:4]
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    splits = tile[4] if len(tile) > 4 else _splits(tiles * groups, K, block[1])
    per_split = triton.cdiv(triton.cdiv(K, splits), block[1]) * block[1]
    splits = triton.cdiv(K, per_split)
    xq, xs = quantize_activations(x, block[1])
    one_scale = block[0] % block_n == 0 and (groups == 1 or N % block[0] == 0)  # no tile straddles a B0 block
    grid = (tiles, splits, groups)
    part, counters, meet = _meeting(out, splits, grid)
    _fp8_tc_kernel[grid](
        xq, xs, weight, raw, out, M, N, K, per_split, xq.stride(0), xq.stride(1), xs.stride(0), xs.stride(1),
        weight.stride(0), raw.stride(0), out.stride(0), out.stride(1), part, counters, *part.stride()[:3],
        BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=FP8_TC_GROUP_M, ONE_SCALE=one_scale, EVEN_K=K % per_split == 0,
        SPLITS=splits, MEET=meet, num_warps=warps, num_stages=stages, **consts)
    if not meet:
        _sum_splits(part, out, splits)


def _meeting(out: torch.Tensor, splits: int, grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Where a launch's K splits meet (``_store_tile``): the float32 partials ``[splits, *out.shape]`` (``out``
    itself for one split), the arrival counters (one per program of grid axes 0 and 2, ``k_splits.arrival_counters``)
    and whether there are any (else ``_sum_splits`` adds the partials after the launch)."""
    part = k_splits.partials(splits, out.shape, out)
    meet = splits > 1 and (envs.DEEPINFER_NVIDIA_FP8_SPLITS_MEET if SPLITS_MEET is None else SPLITS_MEET)
    counters = k_splits.arrival_counters(out.device, grid[0] * grid[2]) if meet else None
    return part, part if counters is None else counters, counters is not None


def matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], groups: int = 1,
           path: str | None = None, tile: tuple[int, ...] | None = None) -> torch.Tensor:
    """``x [M, groups, K]`` -> ``[M, groups, N]`` through the kernel ``linear_path`` picks (or ``path``, with
    ``tile``'s launch)."""
    N = weight.shape[0] // groups
    path = path or picked_path(x, N, block)
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape[0], groups, N, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        launch(path, x, weight.contiguous(), scale.contiguous(), block, out, groups, tile)
    return out


def linear_fp8_block(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     block: tuple[int, int]) -> torch.Tensor:
    """``reference.linear_fp8_block`` (``x [..., in]``, e4m3 ``weight [out, in]``, block ``scale``)."""
    if linear_path(x.numel() // max(x.shape[-1], 1), x.dtype, block) is None:
        return ref.linear_fp8_block(x, weight, scale, block)
    return _linear(x, weight, scale, block[0], block[1])


@opaque_under_compile("linear_fp8_block",
                      lambda x, weight, scale, block_rows, block_cols: x.new_empty(*x.shape[:-1], weight.shape[0]))
def _linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_rows: int,
            block_cols: int) -> torch.Tensor:
    flat = x.reshape(-1, 1, x.shape[-1])  # [M, 1, K]
    return matmul(flat, weight, scale, (block_rows, block_cols)).view(*x.shape[:-1], weight.shape[0])


def grouped_linear_fp8_block(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                             groups: int) -> torch.Tensor:
    """``reference.grouped_linear_fp8_block``: ``x [T, groups, in]``, ``weight [groups * out, in]`` ->
    ``[T, groups, out]``, the groups on the grid's last axis."""
    if linear_path(x.shape[0], x.dtype, block) is None:
        return ref.grouped_linear_fp8_block(x, weight, scale, block, groups)
    return _grouped_linear(x, weight, scale, block[0], block[1], groups)


@opaque_under_compile("grouped_linear_fp8_block",
                      lambda x, weight, scale, block_rows, block_cols, groups:
                      x.new_empty(x.shape[0], groups, weight.shape[0] // groups))
def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_rows: int, block_cols: int,
                    groups: int) -> torch.Tensor:
    return matmul(x, weight, scale, (block_rows, block_cols), groups)


def swiglu_mlp_fp8_block(x: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                         w3: torch.Tensor, s3: torch.Tensor, block: tuple[int, int], limit: float) -> torch.Tensor:
    """``reference.swiglu_mlp_fp8_block`` (the shared expert): one token through ``moe_quant``'s row kernels as a
    one-expert MoE (two launches); more through ``linear_fp8_block`` for ``w1`` and ``w3`` (one product where they,
    and their scales, lie one after the other in memory), ``moe.swiglu``, then ``w2``."""
    if x.dim() != 2 or linear_path(x.shape[0], x.dtype, block) is None:
        return ref.swiglu_mlp_fp8_block(x, w1, s1, w2, s2, w3, s3, block, limit)
    return _swiglu_mlp(x, w1, s1, w2, s2, w3, s3, block[0], block[1], limit)


@functools.lru_cache(maxsize=16)
def _one_expert(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing of a one-expert MoE (expert 0, weight 1: ``[1, 1]`` ids and weights), made once per device: a
    batch-1 decode step replays no fill kernels for it."""
    return (torch.zeros(1, 1, dtype=torch.long, device=device), torch.ones(1, 1, dtype=torch.float32, device=device))


@opaque_under_compile("swiglu_mlp_fp8_block",
                      lambda x, w1, s1, w2, s2, w3, s3, block_rows, block_cols, limit: x.new_empty(x.shape))
def _swiglu_mlp(x: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                w3: torch.Tensor, s3: torch.Tensor, block_rows: int, block_cols: int, limit: float) -> torch.Tensor:
    block = (block_rows, block_cols)
    if x.shape[0] == 1:
        stacked = (t.unsqueeze(0) for t in (w1, s1, w2, s2, w3, s3))
        return moe_quant._run(moe_quant.FP8, x, *_one_expert(x.device), *stacked, block, limit)
    inter = w1.shape[0]
    both, both_scale = moe._rows_together(w1, w3), moe._rows_together(s1, s3)
    if both is not None and both_scale is not None and inter % block_rows == 0:
        gate_up = matmul(x.unsqueeze(1), both, both_scale, block)[:, 0]  # [T, 2 I]
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
    else:
        gate, up = (matmul(x.unsqueeze(1), w, s, block)[:, 0] for w, s in ((w1, s1), (w3, s3)))
    return matmul(moe.swiglu(gate, up, limit).unsqueeze(1), w2, s2, block)[:, 0]

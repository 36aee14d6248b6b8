"""Routed experts with quantized weights (ops ``moe_experts_mxfp4`` and ``moe_experts_fp8_block``): the Triton MoE
of ``moe.py`` reading the stored bytes.

Same layout and steps as ``moe.moe_experts`` (``moe.align``'s sorted, padded assignments; an up kernel with the
SwiGLU epilogue; a down kernel with the routing weight; ``moe._combine``), and the same one-token path (two row
kernels by expert id); only the weight tiles differ. Each tile is loaded as stored and decoded in registers
(``dequant.py``), then fed to ``tl.dot`` in the activations' dtype: no dequantized copy of any weight is ever
written.

* MXFP4 (``[E, rows, cols / 2]`` bytes, ue8m0 ``[E, rows, cols / 32]``): a byte holds inputs ``2i`` (low nibble)
  and ``2i + 1``. With bf16 activations (``scaled_dot``) a ``BLOCK_K`` slice is one ``tl.dot_scaled`` over
  contiguous inputs (the compiler expands the nibbles to bf16 and applies each scale once per 32 inputs); otherwise
  its ``BLOCK_K / 2`` bytes are decoded into the even and the odd inputs' weights, multiplied by the even and the
  odd activation columns (two dots of ``BLOCK_K / 2``). The one-token kernels apply each scale once per group.
* fp8 e4m3 blocks (``[E, rows, cols]``, ue8m0 or float32 ``[E, ceil(rows / B0), ceil(cols / B1)]``): ``BLOCK_K``
  divides ``B1``, so one scale per output row and tile (ue8m0: applied to the tile's product, not to each weight);
  the one-token kernels read whole scale blocks per slice.

Rounding follows the reference ops: the dequantized weight is rounded to the activations' dtype before the product
(exact for MXFP4 and ue8m0, whose values fit bf16, so skipped there), the rest as ``moe.py``. No host synchronisation: CUDA graphs
capture it.

MXFP4 with bf16 activations leaves these kernels at two sizes: decode batches of 2+ tokens go to
``moe_mxfp4_decode`` (the codes expanded straight into the MMA's register operand), prefill sizes to
``moe_mxfp4_prefill`` (the layer's experts as e4m3 rows for the call, fp8 tensor cores; activations quantized).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100 import envs
from deepinfer_nvidia_sm100.kernels import (
    dequant,
    k_splits,
    moe,
    moe_mxfp4_decode,
    moe_mxfp4_fp8_decode,
    moe_mxfp4_prefill,
    pdl,
)
from deepinfer_nvidia_sm100.kernels.compiled import opaque_under_compile

MXFP4, FP8 = 0, 1  # the ``FMT`` of the kernels
MXFP4_BLOCK = (1, 32)  # (rows, inputs) per MXFP4 scale, as the kernels' B0 / B1


@triton.jit
def tile_of(pid, blocks_m, blocks_n, GROUP_M: tl.constexpr):
    """(row block, column block) of a program ``pid`` of a 1-D grid over ``blocks_m x blocks_n`` output tiles,
    ``GROUP_M`` row blocks at a time down each column block: consecutive programs share their activation rows and
    (row blocks of one expert) their weight tile in L2. ``GROUP_M`` 1: each row block's column blocks in turn."""
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(blocks_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows, (pid % per_group) // rows


@triton.jit
def _up_kernel(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, h_ptr, assign_ptr, block_expert_ptr, D, I, top_k, limit,
               blocks, stride_xt, stride_we, stride_wi, stride_se, stride_si, stride_hm,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FMT: tl.constexpr,
               B0: tl.constexpr, B1: tl.constexpr, UE8M0: tl.constexpr, PRECISION: tl.constexpr,
               SCALED: tl.constexpr = False, SWAP: tl.constexpr = False, GROUP_M: tl.constexpr = 1,
               PDL: tl.constexpr = False):
    """Program (block of sorted rows, tile of I): ``h = silu(clamp(x w1^T)) * clamp(x w3^T)`` as ``moe._up_kernel``,
    ``w1`` / ``w3`` (``[E, I, D / 2]`` MXFP4 or ``[E, I, D]`` fp8, same strides, scales likewise) decoded per
    tile; ``SCALED`` (MXFP4, bf16 activations): ``dequant.mxfp4_dot_scaled`` over contiguous inputs, ``SWAP``
    its transposed form (``[BN, BM]`` accumulators, transposed once after the loop)."""
    pdl.begin(PDL)
    pid_m, pid_n = tile_of(tl.program_id(0), blocks, tl.cdiv(I, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(assign_ptr + offs_m)
    valid = assign >= 0
    x_rows = x_ptr + tl.where(valid, assign // top_k, 0)[:, None].to(tl.int64) * stride_xt  # [BM, 1]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    w1, w3 = w1_ptr + expert.to(tl.int64) * stride_we, w3_ptr + expert.to(tl.int64) * stride_we
    s1, s3 = s1_ptr + expert.to(tl.int64) * stride_se, s3_ptr + expert.to(tl.int64) * stride_se
    if SWAP:
        acc1 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w1_cols = w1 + offs_n[None, :].to(tl.int64) * stride_wi  # [1, BN]
    w3_cols = w3 + offs_n[None, :].to(tl.int64) * stride_wi
    s1_rows = s1 + offs_n[:, None].to(tl.int64) * stride_si  # [BN, 1]
    s3_rows = s3 + offs_n[:, None].to(tl.int64) * stride_si
    for k0 in range(0, D, BLOCK_K):
        if SWAP:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a_t = tl.load(tl.trans(x_rows) + offs_k[:, None], mask=valid[None, :] & (offs_k < D)[:, None],
                          other=0.0)  # [BK, BM]
            if FMT == 0:
                acc1 = dequant.mxfp4_dot_scaled_swapped(acc1, a_t, tl.trans(w1_cols), s1_rows, k0, D, n_mask,
                                                        BLOCK_K)
                acc3 = dequant.mxfp4_dot_scaled_swapped(acc3, a_t, tl.trans(w3_cols), s3_rows, k0, D, n_mask,
                                                        BLOCK_K)
            else:
                mask = n_mask[:, None] & (offs_k < D)[None, :]
                fp8_scales = (offs_n // B0).to(tl.int64) * stride_si  # [BN]
                acc1 = dequant.fp8_dot_swapped(acc1, a_t, w1 + offs_n.to(tl.int64) * stride_wi, s1 + fp8_scales,
                                               offs_k, k0, mask, n_mask, B1, UE8M0, PRECISION)
                acc3 = dequant.fp8_dot_swapped(acc3, a_t, w3 + offs_n.to(tl.int64) * stride_wi, s3 + fp8_scales,
                                               offs_k, k0, mask, n_mask, B1, UE8M0, PRECISION)
        elif SCALED:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_rows + offs_k[None, :], mask=valid[:, None] & (offs_k < D)[None, :], other=0.0)  # [BM, BK]
            acc1 = dequant.mxfp4_dot_scaled(acc1, a, w1_cols, s1_rows, k0, D, n_mask, BLOCK_K)
            acc3 = dequant.mxfp4_dot_scaled(acc3, a, w3_cols, s3_rows, k0, D, n_mask, BLOCK_K)
        elif FMT == 0:
            pairs = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # [BK / 2] byte columns
            k_mask = pairs < D // 2
            a_mask = valid[:, None] & k_mask[None, :]
            a_even = tl.load(x_rows + 2 * pairs[None, :], mask=a_mask, other=0.0)  # [BM, BK / 2]
            a_odd = tl.load(x_rows + 2 * pairs[None, :] + 1, mask=a_mask, other=0.0)
            acc1 = dequant.mxfp4_dot(acc1, a_even, a_odd, w1, s1, k0, D, offs_n, n_mask, stride_wi, stride_si, BLOCK_K,
                                     PRECISION)
            acc3 = dequant.mxfp4_dot(acc3, a_even, a_odd, w3, s3, k0, D, offs_n, n_mask, stride_wi, stride_si, BLOCK_K,
                                     PRECISION)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < D
            a = tl.load(x_rows + offs_k[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
            mask = n_mask[None, :] & k_mask[:, None]
            acc1 = dequant.fp8_dot(acc1, a, w1, s1, offs_k, offs_n, k0, stride_wi, stride_si, mask, n_mask, B0, B1,
                                   UE8M0, PRECISION)
            acc3 = dequant.fp8_dot(acc3, a, w3, s3, offs_k, offs_n, k0, stride_wi, stride_si, mask, n_mask, B0, B1,
                                   UE8M0, PRECISION)
    if SWAP:
        acc1, acc3 = tl.trans(acc1), tl.trans(acc3)  # [BM, BN]
    dt = h_ptr.dtype.element_ty
    h = moe._swiglu(acc1.to(dt).to(tl.float32), acc3.to(dt).to(tl.float32), limit, dt)
    tl.store(h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + offs_n[None, :], h.to(dt),
             mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(h_ptr, w2_ptr, s2_ptr, y_ptr, weights_ptr, assign_ptr, block_expert_ptr, D, I,
                 blocks, stride_hm, stride_we, stride_wd, stride_se, stride_sd, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FMT: tl.constexpr,
                 B0: tl.constexpr, B1: tl.constexpr, UE8M0: tl.constexpr, PRECISION: tl.constexpr,
                 SCALED: tl.constexpr = False, SWAP: tl.constexpr = False, GROUP_M: tl.constexpr = 1,
               PDL: tl.constexpr = False):
    """Program (block of sorted rows, tile of D): ``y = (h w2^T) * routing weight`` as ``moe._down_kernel``."""
    pdl.begin(PDL)
    pid_m, pid_n = tile_of(tl.program_id(0), blocks, tl.cdiv(D, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(assign_ptr + offs_m)
    valid = assign >= 0
    h_rows = h_ptr + offs_m[:, None].to(tl.int64) * stride_hm  # [BM, 1]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < D
    w2 = w2_ptr + expert.to(tl.int64) * stride_we
    s2 = s2_ptr + expert.to(tl.int64) * stride_se
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w2_cols = w2 + offs_n[None, :].to(tl.int64) * stride_wd  # [1, BN]
    s2_rows = s2 + offs_n[:, None].to(tl.int64) * stride_sd  # [BN, 1]
    for k0 in range(0, I, BLOCK_K):
        if SWAP:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a_t = tl.load(tl.trans(h_rows) + offs_k[:, None], mask=valid[None, :] & (offs_k < I)[:, None], other=0.0)
            if FMT == 0:
                acc = dequant.mxfp4_dot_scaled_swapped(acc, a_t, tl.trans(w2_cols), s2_rows, k0, I, n_mask, BLOCK_K)
            else:
                acc = dequant.fp8_dot_swapped(acc, a_t, w2 + offs_n.to(tl.int64) * stride_wd,
                                              s2 + (offs_n // B0).to(tl.int64) * stride_sd, offs_k, k0,
                                              n_mask[:, None] & (offs_k < I)[None, :], n_mask, B1, UE8M0, PRECISION)
        elif SCALED:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(h_rows + offs_k[None, :], mask=valid[:, None] & (offs_k < I)[None, :], other=0.0)
            acc = dequant.mxfp4_dot_scaled(acc, a, w2_cols, s2_rows, k0, I, n_mask, BLOCK_K)
        elif FMT == 0:
            pairs = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            k_mask = pairs < I // 2
            a_mask = valid[:, None] & k_mask[None, :]
            a_even = tl.load(h_rows + 2 * pairs[None, :], mask=a_mask, other=0.0)
            a_odd = tl.load(h_rows + 2 * pairs[None, :] + 1, mask=a_mask, other=0.0)
            acc = dequant.mxfp4_dot(acc, a_even, a_odd, w2, s2, k0, I, offs_n, n_mask, stride_wd, stride_sd, BLOCK_K,
                                    PRECISION)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < I
            a = tl.load(h_rows + offs_k[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
            acc = dequant.fp8_dot(acc, a, w2, s2, offs_k, offs_n, k0, stride_wd, stride_sd,
                                  n_mask[None, :] & k_mask[:, None], n_mask, B0, B1, UE8M0, PRECISION)
    if SWAP:
        acc = tl.trans(acc)  # [BM, BN]
    dt = y_ptr.dtype.element_ty
    w = tl.load(weights_ptr + tl.where(valid, assign, 0), mask=valid, other=0.0)
    acc = acc.to(dt).to(tl.float32) * w.to(dt).to(tl.float32)[:, None]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc,
             mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _up_row_kernel(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, h_ptr, ids_ptr, D, I, limit,
                   stride_we, stride_wi, stride_se, stride_si, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   FMT: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr, UE8M0: tl.constexpr,
                   PDL: tl.constexpr = False, PTX: tl.constexpr = False, PIPELINE: tl.constexpr = 0):
    """Program (column block, pick j) of one token: ``moe._up_row_kernel`` on stored weights (``PTX``: MXFP4 codes
    of bf16 activations decoded and multiplied by ``dequant.mxfp4_row_sums``; ``PIPELINE`` > 1: the K loop
    software-pipelined over that many stages, its loads copied ahead into shared memory, ``row_pipeline``)."""
    pdl.begin(PDL)
    pick = tl.program_id(1)
    expert = tl.load(ids_ptr + pick).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    in_n = cols < I
    w_rows = expert * stride_we + cols[:, None].to(tl.int64) * stride_wi  # [BN, 1]
    s_row = cols // B0  # MXFP4: B0 = 1
    s_rows = expert * stride_se + s_row[:, None].to(tl.int64) * stride_si
    acc1 = dequant.row_acc(BLOCK_N, BLOCK_K, FMT, B1)
    acc3 = dequant.row_acc(BLOCK_N, BLOCK_K, FMT, B1)
    for k0 in tl.range(0, D, BLOCK_K, num_stages=PIPELINE):
        acc1 = dequant.row_product(acc1, x_ptr, w1_ptr + w_rows, s1_ptr + s_rows, k0, D, in_n, FMT, BLOCK_K, B1,
                                    UE8M0, PTX)
        acc3 = dequant.row_product(acc3, x_ptr, w3_ptr + w_rows, s3_ptr + s_rows, k0, D, in_n, FMT, BLOCK_K, B1,
                                    UE8M0, PTX)
    dt = h_ptr.dtype.element_ty
    h = moe._swiglu(dequant.row_total(acc1, FMT).to(dt).to(tl.float32),
                    dequant.row_total(acc3, FMT).to(dt).to(tl.float32), limit, dt)
    tl.store(h_ptr + pick * I + cols, h.to(dt), mask=in_n)


@triton.jit
def _down_row_kernel(h_ptr, w2_ptr, s2_ptr, out_ptr, ids_ptr, weights_ptr, D, I, top_k,
                     stride_we, stride_wd, stride_se, stride_sd, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     K_P2: tl.constexpr, FMT: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
                     UE8M0: tl.constexpr, PDL: tl.constexpr = False, PTX: tl.constexpr = False,
                     PIPELINE: tl.constexpr = 0):
    """Program (column block) of one token: ``moe._down_row_kernel`` on stored weights (the picks added in
    ascending expert order, rounded as ``moe._combine``). ``PIPELINE`` (``row_pipeline``): one loop over every
    (pick, slice) step, software-pipelined over that many stages across the picks (1: not pipelined)."""
    pdl.begin(PDL)
    j = tl.arange(0, K_P2)
    in_k = j < top_k
    rank = moe._expert_order(tl.load(ids_ptr + j, mask=in_k, other=0), in_k, K_P2)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    in_n = cols < D
    s_rows = s2_ptr + (cols // B0)[:, None].to(tl.int64) * stride_sd  # [BN, 1] (MXFP4: B0 = 1)
    w_rows = w2_ptr + cols[:, None].to(tl.int64) * stride_wd
    dt = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc = dequant.row_acc(BLOCK_N, BLOCK_K, FMT, B1)
    if PIPELINE:  # (a truth test: launches that leave PIPELINE out compile with None)
        slices = tl.cdiv(I, BLOCK_K)
        for step in tl.range(0, top_k * slices, num_stages=PIPELINE):  # slice step % slices of the pick ranked
            pick = tl.sum(tl.where((rank == step // slices) & in_k, j, 0), axis=0)  # step // slices
            expert = tl.load(ids_ptr + pick).to(tl.int64)
            acc = dequant.row_product(acc, h_ptr + pick * I, w_rows + expert * stride_we, s_rows + expert * stride_se,
                                      (step % slices) * BLOCK_K, I, in_n, FMT, BLOCK_K, B1, UE8M0, PTX)
            if step % slices == slices - 1:  # the pick's last slice
                total = _add_pick(total, acc, weights_ptr + pick, dt, FMT)
                acc = dequant.row_acc(BLOCK_N, BLOCK_K, FMT, B1)
    else:
        for r in range(top_k):
            pick = tl.sum(tl.where((rank == r) & in_k, j, 0), axis=0)
            expert = tl.load(ids_ptr + pick).to(tl.int64)
            acc = dequant.row_acc(BLOCK_N, BLOCK_K, FMT, B1)
            for k0 in range(0, I, BLOCK_K):
                acc = dequant.row_product(acc, h_ptr + pick * I, w_rows + expert * stride_we,
                                          s_rows + expert * stride_se, k0, I, in_n, FMT, BLOCK_K, B1, UE8M0, PTX)
            total = _add_pick(total, acc, weights_ptr + pick, dt, FMT)
    tl.store(out_ptr + cols, total.to(dt), mask=in_n)


@triton.jit
def _add_pick(total, acc, weight_ptr, dt: tl.constexpr, FMT: tl.constexpr):
    """``total`` plus one pick's sums ``acc`` (``row_product``'s accumulator) times its routing weight:
    ``_add_weighted``."""
    return _add_weighted(total, dequant.row_total(acc, FMT), weight_ptr, dt)


@triton.jit
def _add_weighted(total, sums, weight_ptr, dt: tl.constexpr):
    """``total`` plus one pick's float32 sums ``[BN]`` times its routing weight, each step rounded to ``dt`` as
    ``moe._combine`` rounds: ``[BN]``."""
    w = tl.load(weight_ptr).to(dt).to(tl.float32)
    part = (sums.to(dt).to(tl.float32) * w).to(dt).to(tl.float32)  # [BN]
    return (total + part).to(dt).to(tl.float32)


@triton.jit
def _down_pick_kernel(h_ptr, w2_ptr, s2_ptr, out_ptr, part_ptr, counter_ptr, ids_ptr, weights_ptr, D, I, top_k,
                      stride_we, stride_wd, stride_se, stride_sd, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      K_P2: tl.constexpr, FMT: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
                      UE8M0: tl.constexpr, PDL: tl.constexpr = False, PTX: tl.constexpr = False):
    """Program (column block, rank ``r``) of one token: the float32 sums over ``I`` of the pick ranked ``r``-th in
    ascending expert order to the partials ``part [top_k, D]`` at row ``r``; the column block's last program to
    finish (``k_splits.last_to_arrive``) adds the picks as ``_down_row_kernel`` does (in rank order, each times its
    routing weight, rounded as ``moe._combine``: the same bits) and writes ``out``. A column block's picks run on
    ``top_k`` programs side by side instead of one after another in one."""
    pdl.begin(PDL)
    j = tl.arange(0, K_P2)
    in_k = j < top_k
    rank = moe._expert_order(tl.load(ids_ptr + j, mask=in_k, other=0), in_k, K_P2)
    block, r = tl.program_id(0), tl.program_id(1)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    in_n = cols < D
    pick = tl.sum(tl.where((rank == r) & in_k, j, 0), axis=0)
    expert = tl.load(ids_ptr + pick).to(tl.int64)
    w_rows = w2_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wd  # [BN, 1]
    s_rows = s2_ptr + expert * stride_se + (cols // B0)[:, None].to(tl.int64) * stride_sd  # (MXFP4: B0 = 1)
    acc = dequant.row_acc(BLOCK_N, BLOCK_K, FMT, B1)
    for k0 in range(0, I, BLOCK_K):
        acc = dequant.row_product(acc, h_ptr + pick * I, w_rows, s_rows, k0, I, in_n, FMT, BLOCK_K, B1, UE8M0, PTX)
    tl.store(part_ptr + r * D + cols, dequant.row_total(acc, FMT), mask=in_n)
    counter = counter_ptr + block
    if k_splits.last_to_arrive(counter, top_k):
        dt = out_ptr.dtype.element_ty
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for q in range(top_k):
            sums = tl.load(part_ptr + q * D + cols, mask=in_n, other=0.0, cache_modifier=".cg")  # [BN]
            total = _add_weighted(total, sums, weights_ptr + tl.sum(tl.where((rank == q) & in_k, j, 0), axis=0), dt)
        tl.store(out_ptr + cols, total.to(dt), mask=in_n)
        k_splits.reset(counter)


ROW_PIPELINE: int | None = None  # the fp8 one-row kernels' pipeline stages; None: DEEPINFER_NVIDIA_ROW_PIPELINE
PICKS_APART: bool | None = None  # one token's down products by pick on programs of their own (``_down_pick_kernel``);
# None: DEEPINFER_NVIDIA_ROW_PICKS_APART


def row_pipeline(fmt: int) -> int:
    """Stages the one-row kernels of ``fmt`` pipeline their K loops over: their weight slices, scales and inputs
    copied ahead into shared memory (``tl.range``'s ``num_stages``); 0: each slice loaded when its products need it.
    fp8 rows only (the shared expert at one token, on the H200 13.6 us against 29.6 us unpipelined); MXFP4 rows
    never: pipelined they took 219 us a layer against 52 us (bench_quant.py mxfp4, 2026-12-04)."""
    if fmt == MXFP4:
        return 0
    return envs.DEEPINFER_NVIDIA_ROW_PIPELINE if ROW_PIPELINE is None else ROW_PIPELINE


ROW_DECODE_PTX = True  # bf16 MXFP4 rows decoded and multiplied by inline PTX (``dequant.mxfp4_row_sums``)
PTX_MIN_BYTES_A_THREAD = 16  # ... where a slice gives each thread at least this many packed bytes (``row_sums_ptx``)


def row_sums_ptx(x: torch.Tensor, block_n: int, block_k: int, warps: int) -> bool:
    """Whether the one-token MXFP4 row kernels of ``x``'s activations at tile ``(block_n, block_k)`` and ``warps``
    sum through ``dequant.mxfp4_row_sums`` (``ROW_DECODE_PTX``, bf16 on a GPU): only where each thread holds at least
    ``PTX_MIN_BYTES_A_THREAD`` packed bytes of a slice, as at every tile where it passed its tests on the H200 (16 to
    128 bytes). At tiles of 1 or 2 bytes a thread, fewer than the assembly's 4-byte pack, three tests failed there
    (2026-12-04); those tiles decode in Triton operations instead (the same values)."""
    return (ROW_DECODE_PTX and moe_mxfp4_decode.decode_mode(x) == moe_mxfp4_decode.PTX
            and block_n * block_k // 2 // (32 * warps) >= PTX_MIN_BYTES_A_THREAD)


ONE_TOKEN_ROW_KERNELS = True  # one token through the two row kernels; False: through the grouped kernels (16-row
# tiles, weights on the left), to be set from bench_quant.py's one-token sweep ("rows" vs "grouped")
# One-token launches (BLOCK_N, BLOCK_K, num_warps, num_stages): MXFP4 rows are a quarter of bf16 rows' bytes and fp8
# half, so a program takes more rows than ``gemv.row_config``'s two; fp8 slices span whole scale blocks (four of
# 128: 64 bytes in flight per thread and stage, as the bf16 GEMV's widest launch).
ROW_TILES = {MXFP4: (4, 1024, 4, 3), FP8: (16, 512, 4, 3)}  # 16-byte loads per thread; MXFP4: bench_quant's
# one-token sweep on the H200 (2026-12-02: 66.1 us against 84.9 us for (8, 512, 4, 3))
TILES = {
    # (max mean assignments per expert, (BLOCK_M, BLOCK_N, BLOCK_K, num_warps)): ``moe.TILES`` up to 256 tokens per
    # expert; beyond, 128 x 128 tiles, since every program expands its weight tiles again and a taller tile spreads
    # that over twice the rows (the best of the old kernel's sweep at 8,192 tokens; no spills, test_quant_compile).
    "decode": (16, moe.TILES["decode"]),
    "mid": (64, moe.TILES["mid"]),
    "prefill": (256, moe.TILES["prefill"]),
    "large": (None, (128, 128, 64, 8)),
}


TILE_GROUP_M, TILE_GROUP_MIN_ROWS = 8, 64  # tiles of 64+ rows run 8 row blocks down each column tile (``tile_of``)
SWAP_AB_MAX_ROWS = 0  # tiles of at most this many rows multiply with the weights on the left (MXFP4 through
# ``tl.dot_scaled``, fp8): ``acc^T = W x^T``, the expanded weights wgmma's register operand on SM90. Off: on the
# H200 (bench_quant, 2026-12-02) the swapped 16-row MXFP4 tile took 1,016 us at 16 tokens, unswapped 671 us


def scaled_dot(fmt: int, dtype: torch.dtype) -> bool:
    """Whether the grouped kernels multiply MXFP4 tiles through ``tl.dot_scaled`` (bf16 activations, unless
    ``DEEPINFER_NVIDIA_MXFP4_DOT_SCALED=0``); otherwise each tile is decoded to float32 by ``dequant.mxfp4_dot``
    (fp16 and fp32 activations always: ``dot_scaled`` would round them to bf16)."""
    return fmt == MXFP4 and dtype == torch.bfloat16 and envs.DEEPINFER_NVIDIA_MXFP4_DOT_SCALED


def _tiles(fmt: int, num_assign: int, num_experts: int, block: tuple[int, int]) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) of the grouped kernels by the mean assignments per expert
    (``TILES``), ``BLOCK_K`` dividing ``B1`` for fp8 (one scale block per slice) and at least 32 (whole MXFP4
    scale groups)."""
    per_expert = num_assign / max(num_experts, 1)
    block_m, block_n, block_k, warps = next(tile for bound, tile in TILES.values() if bound is None or
                                            per_expert <= bound)
    if fmt == FP8:
        block_k = min(block_k, block[1])
    return block_m, block_n, max(32, block_k), warps


def _run(fmt: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1, s1, w2, s2, w3, s3,
         block: tuple[int, int], limit: float, tile: tuple[int, int, int, int] | None = None,
         row_kernels: bool | None = None) -> torch.Tensor:
    """Both ops: MXFP4 at prefill sizes through ``moe_mxfp4_prefill``, at decode sizes through ``moe_mxfp4_fp8_decode``
    where switched on, else ``moe_mxfp4_decode`` (their ``used``; unless ``tile`` or
    ``row_kernels`` is given), one token through the row kernels (``row_kernels``, by default
    ``ONE_TOKEN_ROW_KERNELS``), otherwise align, up, down, combine. ``tile`` fixes the launch (the row kernels' ``ROW_TILES`` entry for one token, else ``_tiles``'
    (BLOCK_M, BLOCK_N, BLOCK_K, num_warps); ``benchmarks/bench_quant.py`` sweeps them and both one-token paths)."""
    T, top_k = ids.shape
    E, I = w1.shape[0], w1.shape[1]
    D = x.shape[1]
    if T == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    w1, w2, w3 = (w.contiguous().view(torch.uint8) if fmt == MXFP4 else w.contiguous() for w in (w1, w2, w3))
    (s1, ue8m0), (s2, _), (s3, _) = (dequant.scale_operand(s.contiguous()) for s in (s1, s2, s3))
    consts = {"FMT": fmt, "B0": block[0], "B1": block[1], "UE8M0": ue8m0}
    if fmt == MXFP4 and tile is None and row_kernels is None:  # the first path whose ``used`` holds
        if moe_mxfp4_prefill.used(T * top_k, x, w1, w2):
            return moe_mxfp4_prefill.run(x, ids, weights, w1, s1, w2, s2, w3, s3, limit)
        if moe_mxfp4_fp8_decode.used(T * top_k, x, w1, w2):
            return moe_mxfp4_fp8_decode.run(x, ids, weights, w1, s1, w2, s2, w3, s3, limit)
        if moe_mxfp4_decode.used(T, T * top_k, x, w1, w2, w3):
            return moe_mxfp4_decode.run(x, ids, weights, w1, s1, w2, s2, w3, s3, limit)
    row_kernels = ONE_TOKEN_ROW_KERNELS if row_kernels is None else row_kernels
    if T == 1 and top_k <= moe.ONE_TOKEN_MAX_TOP_K and row_kernels:
        return _one_token(x, ids, weights, w1, s1, w2, s2, w3, s3, D, I, limit, consts, tile)
    block_m, block_n, block_k, warps = tile or _tiles(fmt, T * top_k, E, block)
    sorted_assign, block_expert, dest = moe.align(ids, E, block_m)
    rows = sorted_assign.shape[0]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    stages = 2 if x.dtype == torch.float32 else 3
    h = torch.empty((rows, I), dtype=x.dtype, device=x.device)
    y = torch.empty((rows, D), dtype=x.dtype, device=x.device)
    tiles = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "PRECISION": precision, "num_warps": warps,
             "num_stages": stages, "SCALED": scaled_dot(fmt, x.dtype),
             "SWAP": (scaled_dot(fmt, x.dtype) or fmt == FP8) and block_m <= SWAP_AB_MAX_ROWS, **consts,
             **pdl.launch()}
    blocks = rows // block_m
    tiles["GROUP_M"] = TILE_GROUP_M if block_m >= TILE_GROUP_MIN_ROWS else 1
    _up_kernel[(blocks * triton.cdiv(I, block_n),)](
        x, w1, s1, w3, s3, h, sorted_assign, block_expert, D, I, top_k, float(limit), blocks, x.stride(0), w1.stride(0),
        w1.stride(1), s1.stride(0), s1.stride(1), h.stride(0), **tiles)
    _down_kernel[(blocks * triton.cdiv(D, block_n),)](
        h, w2, s2, y, weights.reshape(-1).contiguous(), sorted_assign, block_expert, D, I, blocks, h.stride(0),
        w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0), **tiles)
    return moe._combine(y, ids, dest, x)


def _one_token(x, ids, weights, w1, s1, w2, s2, w3, s3, D, I, limit, consts, tile=None) -> torch.Tensor:
    """One token: ``_up_row_kernel`` per (column block, pick), then ``_down_row_kernel`` per column block, each at
    ``tile`` (``ROW_TILES``' by default)."""
    top_k = ids.shape[1]
    block_n, block_k, warps, stages = tile or ROW_TILES[consts["FMT"]]
    flat_ids = ids.reshape(-1).contiguous()
    h = torch.empty(top_k, I, dtype=x.dtype, device=x.device)
    launch = {"num_warps": warps, "num_stages": stages, **consts,
              "PTX": row_sums_ptx(x, block_n, block_k, warps),
              "PIPELINE": row_pipeline(consts["FMT"]), **pdl.launch()}
    _up_row_kernel[(triton.cdiv(I, block_n), top_k)](
        x, w1, s1, w3, s3, h, flat_ids, D, I, float(limit), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1),
        BLOCK_N=block_n, BLOCK_K=block_k, **launch)
    out = torch.empty_like(x)
    blocks = triton.cdiv(D, block_n)
    apart = envs.DEEPINFER_NVIDIA_ROW_PICKS_APART if PICKS_APART is None else PICKS_APART
    counters = k_splits.arrival_counters(x.device, blocks) if apart and top_k > 1 else None
    args = (flat_ids, weights.reshape(-1).contiguous(), D, I, top_k, w2.stride(0), w2.stride(1), s2.stride(0),
            s2.stride(1))
    sizes = {"K_P2": triton.next_power_of_2(top_k), "BLOCK_N": block_n, "BLOCK_K": block_k}
    if counters is None:
        _down_row_kernel[(blocks,)](h, w2, s2, out, *args, **sizes, **launch)
    else:
        part = torch.empty(top_k, D, dtype=torch.float32, device=x.device)
        launch.pop("PIPELINE")
        _down_pick_kernel[(blocks, top_k)](h, w2, s2, out, part, counters, *args, **sizes, **launch)
    return out


@opaque_under_compile("moe_experts_mxfp4",
                      lambda x, ids, weights, w1, s1, w2, s2, w3, s3, limit: x.new_empty(x.shape))
def moe_experts_mxfp4(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor,
                      w2: torch.Tensor, s2: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor,
                      limit: float) -> torch.Tensor:
    """``reference.moe_experts_mxfp4``: packed ``w1`` / ``w3 [E, I, D / 2]``, ``w2 [E, D, I / 2]`` (uint8 / int8)
    with ue8m0 scales ``[E, rows, cols / 32]``, decoded in registers."""
    return _run(MXFP4, x, ids, weights, w1, s1, w2, s2, w3, s3, MXFP4_BLOCK, limit)


def moe_experts_fp8_block(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                          s1: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor,
                          block: tuple[int, int], limit: float) -> torch.Tensor:
    """``reference.moe_experts_fp8_block``: e4m3 ``w1`` / ``w3 [E, I, D]``, ``w2 [E, D, I]`` with ue8m0 or float32
    block scales, decoded in registers. Blocks that are not powers of two of at least 16 take the reference op."""
    if any(b < 16 or b & (b - 1) for b in block):
        from deepinfer_core.ops import reference as ref

        return ref.moe_experts_fp8_block(x, ids, weights, w1, s1, w2, s2, w3, s3, block, limit)
    return _moe_experts_fp8_block(x, ids, weights, w1, s1, w2, s2, w3, s3, block[0], block[1], limit)


@opaque_under_compile("moe_experts_fp8_block",
                      lambda x, ids, weights, w1, s1, w2, s2, w3, s3, block_rows, block_cols, limit:
                      x.new_empty(x.shape))
def _moe_experts_fp8_block(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                           s1: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor,
                           block_rows: int, block_cols: int, limit: float) -> torch.Tensor:
    return _run(FP8, x, ids, weights, w1, s1, w2, s2, w3, s3, (block_rows, block_cols), limit)

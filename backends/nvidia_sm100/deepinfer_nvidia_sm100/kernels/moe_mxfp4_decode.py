"""MXFP4 routed experts at decode sizes (up to a few dozen tokens per expert): ``moe_quant``'s grouped layout with
a cheaper expansion of the packed weights, so that the kernels are bound by reading the bytes rather than by
expanding them.

The bf16 kernels of ``moe.py`` are the model: ``_up_kernel`` / ``_down_kernel`` read each touched expert's weight
tile once for all its tokens (up to ``BLOCK_M``, sorted by ``moe.align``) and multiply on the tensor cores. Here a
tile is ``BLOCK_N`` weight rows x ``GROUPS`` ue8m0 scale groups (32 inputs, 16 bytes each); each group's bytes are
expanded in registers, in the MMA's operand layout, into two bf16 tiles, the group's even inputs' weights and its odd
inputs', already scaled (``dequant.mxfp4_bf16_pairs``: four bytes and their scales -> eight weights in 24
instructions), and multiplied with the group's even / odd activations: two ``tl.dot`` of K = 16 per group into one
float32 accumulator. No expanded weight ever reaches memory. Compiled for sm_90a, the 16 x 64 tile's loop takes ~7
instructions a weight with 100 registers (``moe_quant``'s ``tl.dot_scaled`` 16-row tile ~6.4 with 158, its float32
decode ~9.6); which is faster on the H200 is for ``benchmarks/bench_mxfp4_decode.py`` to say.

The activations are read in ``paired`` order (within every 32 inputs the 16 even ones, then the 16 odd ones), so that
a group's even / odd activations are two contiguous 16-element rows: ``run`` reorders ``x`` (one small copy) and
``_up_kernel`` writes ``h`` in that order for ``_down_kernel``.

``SWAP``: the weights are the left operand (``acc^T [BN, BM] = W x^T``): their rows fill the MMA's M, the tokens its
N (16 at least: one token too); otherwise the activations are the left operand.

``DECODE``: ``PTX`` (bf16 activations on a GPU), ``PORTABLE`` (the same bit placement in Triton operations; bf16),
``FLOAT32`` (any dtype, and Triton's interpreter, which runs no PTX: each weight decoded to float32, scaled and
rounded to the activations' dtype as the reference op rounds it). All three give the reference op's weights exactly.
Epilogues, rounding and the combine are ``moe_quant``'s. No host synchronisation: CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100 import envs
from deepinfer_nvidia_sm100.kernels import dequant, moe, pdl

GROUP_PAIRS = dequant.PACKED_PER_SCALE  # packed bytes of one scale group (16)
FLOAT32, PORTABLE, PTX = 0, 1, 2  # the kernels' ``DECODE``
BF16_DECODE = PTX  # how bf16 activations decode on a GPU (``PORTABLE``: without inline PTX)

MAX_PER_EXPERT = None  # mean assignments per expert up to which the MXFP4 op takes these kernels (0: never); None:
# ``DEEPINFER_NVIDIA_MXFP4_DECODE_MAX_PER_EXPERT`` (0: off by default, docs/quantization.md has the timings)
TILES = {  # (max mean assignments per expert, (BLOCK_M, BLOCK_N, GROUPS, num_warps, num_stages, SWAP)): the first
    # that holds, else the last. The 16 x 64 tile with the activations on the left compiles to the fewest
    # instructions a weight on sm_90a (~7; with the weights on the left ~8); 64-row tiles reach wgmma.
    "decode": (16, (16, 64, 4, 4, 3, False)),
    "mid": (64, (64, 64, 2, 4, 3, False)),
}
ONE_TOKEN = False  # one token through these kernels (four launches) rather than ``moe_quant``'s two row kernels


def used(num_tokens: int, num_assign: int, num_experts: int, x: torch.Tensor) -> bool:
    """Whether ``moe_quant``'s MXFP4 op takes these kernels: fp16 / fp32 activations, bf16 ones with a bf16 decode
    (on a GPU: Triton's interpreter multiplies bf16 tiles wrongly), at most ``MAX_PER_EXPERT`` assignments per expert
    on average, one token only with ``ONE_TOKEN``."""
    dtype_ok = x.dtype in (torch.float16, torch.float32) or (x.dtype == torch.bfloat16 and decode_mode(x) != FLOAT32)
    bound = envs.DEEPINFER_NVIDIA_MXFP4_DECODE_MAX_PER_EXPERT if MAX_PER_EXPERT is None else MAX_PER_EXPERT
    return dtype_ok and num_assign <= bound * num_experts and (num_tokens > 1 or ONE_TOKEN)


def tile(num_assign: int, num_experts: int) -> tuple[int, int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, GROUPS, num_warps, num_stages, SWAP) by the mean assignments per expert (``TILES``)."""
    per_expert = num_assign / max(num_experts, 1)
    return next((t for bound, t in TILES.values() if per_expert <= bound), list(TILES.values())[-1][1])


def decode_mode(x: torch.Tensor) -> int:
    """``DECODE`` for activations like ``x``: ``BF16_DECODE`` for bf16 on a GPU, otherwise ``FLOAT32``."""
    return BF16_DECODE if x.dtype == torch.bfloat16 and x.is_cuda and not pdl._interpreted() else FLOAT32


def paired(t: torch.Tensor) -> torch.Tensor:
    """``t [rows, K]`` (K a multiple of 32) with every 32 columns reordered: the 16 even ones, then the 16 odd."""
    rows, k = t.shape
    return t.reshape(rows, k // 32, 16, 2).transpose(2, 3).reshape(rows, k)


@triton.jit
def _weights(packed, raw_scale, dt: tl.constexpr, DECODE: tl.constexpr):
    """One scale group's weights in the activations' dtype ``dt``: ``(even, odd)``, shaped as ``packed`` (its bytes),
    ``raw_scale`` its ue8m0 bytes broadcast alike. ``DECODE``: ``PTX`` / ``PORTABLE`` (bf16 only: the bit placement of
    ``dequant.mxfp4_bf16_pairs``, in PTX or in Triton operations) or ``FLOAT32`` (``dequant.mxfp4_pair``, then
    rounded to ``dt`` as the reference rounds its weights)."""
    if DECODE == 2:
        return dequant.mxfp4_bf16_pairs(packed, dequant.ue8m0(raw_scale).to(tl.bfloat16))
    elif DECODE == 1:
        return dequant.mxfp4_bf16_pairs_portable(packed, dequant.ue8m0(raw_scale).to(tl.bfloat16))
    else:
        even, odd = dequant.mxfp4_pair(packed, dequant.ue8m0(raw_scale))
        return even.to(dt), odd.to(dt)


@triton.jit
def _product(acc, a_rows, w_cols, s_cols, n_mask, K, SWAP: tl.constexpr, GROUPS: tl.constexpr, EVEN: tl.constexpr,
             DECODE: tl.constexpr, PRECISION: tl.constexpr):
    """``acc += A W^T`` over all ``K`` inputs: ``a_rows [BM]`` pointers to the activation rows (in ``paired`` order;
    padding rows point at a real row: their results are never stored), ``w_cols`` / ``s_cols [BN]`` to the weight
    rows' packed bytes and scales (``n_mask``: real rows); ``GROUPS`` scale groups per loop iteration (``K`` a
    multiple of 32; ``EVEN``: of ``32 GROUPS``, and every weight row real: no masks). Per group: its bytes
    (``[BN, 16]`` if ``SWAP`` else ``[16, BN]``) expanded into the even and the odd inputs' weights, multiplied with
    the group's even / odd activations (``[16, BM]`` / ``[BM, 16]``, contiguous in ``paired`` order)."""
    pair = tl.arange(0, GROUP_PAIRS)  # [16]
    for k0 in range(0, K, GROUPS * 32):
        for g in tl.static_range(GROUPS):
            group = k0 // 32 + g
            pairs = group * GROUP_PAIRS + pair  # [16] byte columns
            if SWAP:
                a_at = a_rows[None, :] + (group * 32 + pair)[:, None]  # [16, BM]
                w_at = w_cols[:, None] + pairs[None, :]  # [BN, 16]
                w_mask = n_mask[:, None] & (group * 32 + pair < K)[None, :]
            else:
                a_at = a_rows[:, None] + (group * 32 + pair)[None, :]  # [BM, 16]
                w_at = w_cols[None, :] + pairs[:, None]  # [16, BN]
                w_mask = n_mask[None, :] & (group * 32 + pair < K)[:, None]
            if EVEN:
                raw_scale = tl.load(s_cols + group)  # [BN]
                packed = tl.load(w_at)
                a_even = tl.load(a_at)  # the group's inputs in ``paired`` order: evens, then odds
                a_odd = tl.load(a_at + GROUP_PAIRS)
            else:
                in_k = n_mask.to(tl.int32) * 0 + group * 32 < K  # [BN] (the interpreter takes no scalar mask)
                raw_scale = tl.load(s_cols + group, mask=n_mask & in_k, other=dequant.UE8M0_ONE)
                packed = tl.load(w_at, mask=w_mask, other=0)
                k_ok = group * 32 + pair < K  # [16]
                a_mask = k_ok[:, None] if SWAP else k_ok[None, :]
                a_even = tl.load(a_at, mask=a_mask, other=0.0)
                a_odd = tl.load(a_at + GROUP_PAIRS, mask=a_mask, other=0.0)
            if SWAP:
                even, odd = _weights(packed, tl.broadcast_to(raw_scale[:, None], packed.shape), a_even.dtype, DECODE)
                acc = tl.dot(even, a_even, acc, input_precision=PRECISION)
                acc = tl.dot(odd, a_odd, acc, input_precision=PRECISION)
            else:
                even, odd = _weights(packed, tl.broadcast_to(raw_scale[None, :], packed.shape), a_even.dtype, DECODE)
                acc = tl.dot(a_even, even, acc, input_precision=PRECISION)
                acc = tl.dot(a_odd, odd, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr):
    """The float32 accumulator: ``[BN, BM]`` if ``SWAP`` else ``[BM, BN]``."""
    if SWAP:
        return tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        return tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def _up_kernel(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, h_ptr, assign_ptr, block_expert_ptr, D, I, top_k, limit,
               stride_xt, stride_we, stride_wi, stride_se, stride_si, stride_hm,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, SWAP: tl.constexpr,
               EVEN: tl.constexpr, DECODE: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    """Program (block of sorted rows, tile of I): ``h = silu(clamp(x w1^T)) * clamp(x w3^T)`` as
    ``moe_quant._up_kernel``, ``w1`` / ``w3 [E, I, D / 2]`` MXFP4, scales ``[E, I, D / 32]``."""
    pdl.begin(PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(assign_ptr + offs_m)
    valid = assign >= 0
    x_rows = x_ptr + tl.where(valid, assign // top_k, 0).to(tl.int64) * stride_xt  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    w_at = expert.to(tl.int64) * stride_we + offs_n.to(tl.int64) * stride_wi  # [BN]
    s_at = expert.to(tl.int64) * stride_se + offs_n.to(tl.int64) * stride_si
    acc1 = _product(_zeros(BLOCK_M, BLOCK_N, SWAP), x_rows, w1_ptr + w_at, s1_ptr + s_at, n_mask, D, SWAP, GROUPS,
                    EVEN, DECODE, PRECISION)
    acc3 = _product(_zeros(BLOCK_M, BLOCK_N, SWAP), x_rows, w3_ptr + w_at, s3_ptr + s_at, n_mask, D, SWAP, GROUPS,
                    EVEN, DECODE, PRECISION)
    if SWAP:
        acc1, acc3 = tl.trans(acc1), tl.trans(acc3)  # [BM, BN]
    dt = h_ptr.dtype.element_ty
    h = moe._swiglu(acc1.to(dt).to(tl.float32), acc3.to(dt).to(tl.float32), limit, dt)
    h_cols = offs_n // 32 * 32 + offs_n % 2 * GROUP_PAIRS + offs_n % 32 // 2  # ``paired`` order for _down_kernel
    tl.store(h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + h_cols[None, :], h.to(dt),
             mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(h_ptr, w2_ptr, s2_ptr, y_ptr, weights_ptr, assign_ptr, block_expert_ptr, D, I,
                 stride_hm, stride_we, stride_wd, stride_se, stride_sd, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, SWAP: tl.constexpr,
                 EVEN: tl.constexpr, DECODE: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    """Program (block of sorted rows, tile of D): ``y = (h w2^T) * routing weight`` as ``moe_quant._down_kernel``,
    ``w2 [E, D, I / 2]`` MXFP4, scales ``[E, D, I / 32]``."""
    pdl.begin(PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(assign_ptr + offs_m)
    valid = assign >= 0
    h_rows = h_ptr + offs_m.to(tl.int64) * stride_hm  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < D
    w_at = w2_ptr + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64) * stride_wd  # [BN]
    s_at = s2_ptr + expert.to(tl.int64) * stride_se + offs_n.to(tl.int64) * stride_sd
    acc = _product(_zeros(BLOCK_M, BLOCK_N, SWAP), h_rows, w_at, s_at, n_mask, I, SWAP, GROUPS, EVEN, DECODE,
                   PRECISION)
    if SWAP:
        acc = tl.trans(acc)  # [BM, BN]
    dt = y_ptr.dtype.element_ty
    w = tl.load(weights_ptr + tl.where(valid, assign, 0), mask=valid, other=0.0)
    acc = acc.to(dt).to(tl.float32) * w.to(dt).to(tl.float32)[:, None]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc,
             mask=valid[:, None] & n_mask[None, :])


def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1, s1, w2, s2, w3, s3, limit: float,
        launch: tuple[int, int, int, int, int, bool] | None = None, decode: int | None = None) -> torch.Tensor:
    """The MXFP4 experts through these kernels: ``moe.align``, ``_up_kernel``, ``_down_kernel``, ``moe._combine``.
    ``w*`` packed bytes (uint8), ``s*`` ue8m0 bytes (uint8), contiguous; ``launch`` fixes (BLOCK_M, BLOCK_N, GROUPS,
    num_warps, num_stages, SWAP), by default ``tile``'s; ``decode`` the ``DECODE``, by default ``decode_mode``'s
    (``benchmarks/bench_quant.py`` sweeps both)."""
    T, top_k = ids.shape
    E, I, D = w1.shape[0], w1.shape[1], x.shape[1]
    block_m, block_n, groups, warps, stages, swap = launch or tile(T * top_k, E)
    sorted_assign, block_expert, dest = moe.align(ids, E, block_m)
    rows = sorted_assign.shape[0]
    h = torch.empty((rows, I), dtype=x.dtype, device=x.device)
    y = torch.empty((rows, D), dtype=x.dtype, device=x.device)
    even = D % (32 * groups) == 0 and I % (32 * groups) == 0 and D % block_n == 0 and I % block_n == 0
    consts = {"BLOCK_M": block_m, "BLOCK_N": block_n, "GROUPS": groups, "SWAP": swap, "EVEN": even,
              "DECODE": decode_mode(x) if decode is None else decode,
              "PRECISION": "ieee" if x.dtype == torch.float32 else "tf32", "num_warps": warps,
              "num_stages": stages, **pdl.launch()}
    blocks = rows // block_m
    xp = paired(x)
    _up_kernel[(blocks, triton.cdiv(I, block_n))](
        xp, w1, s1, w3, s3, h, sorted_assign, block_expert, D, I, top_k, float(limit), xp.stride(0), w1.stride(0),
        w1.stride(1), s1.stride(0), s1.stride(1), h.stride(0), **consts)
    _down_kernel[(blocks, triton.cdiv(D, block_n))](
        h, w2, s2, y, weights.reshape(-1).contiguous(), sorted_assign, block_expert, D, I, h.stride(0), w2.stride(0),
        w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0), **consts)
    return moe._combine(y, ids, dest, x)

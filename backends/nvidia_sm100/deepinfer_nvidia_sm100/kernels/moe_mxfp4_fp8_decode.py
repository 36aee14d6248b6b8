"""MXFP4 routed experts at decode sizes (one token included) on fp8 tensor cores: the packed codes expanded in
registers to e4m3, the activations quantized to e4m3 per 128 inputs, one fp8 product per 32-input scale group.

Why: SM90 has no block-scaled MMA. ``moe_mxfp4_decode`` expands every code to bf16 for bf16 products, two multiplies
per pair of codes (the exact 2^126 and the scale) besides the bit placement, and at decode sizes the issue of those
instructions, not the bytes, sets its pace. Here a code's sign and three magnitude bits placed into a byte are its
e4m3 value times 2^-6 (``dequant.e4m3_codes``: seven logic instructions for eight codes, exact), and the scale
multiplies the product's float32 sums once per group instead of every weight. Compiled for sm_90a the K loops issue
3.5 / 3.8 instructions a weight (up / down) at the default tile against 4.3 / 3.9 for ``moe_mxfp4_decode``'s, with
12 / 16 warps an SM against 8 / 12 (``benchmarks/sass_census.py mxfp4``).

A program: one block of ``moe.align``'s expert-sorted rows (``BLOCK_M``) by ``2 HALF`` weight rows (the up kernel's:
``HALF`` columns' rows of ``w1``, then of ``w3``: one accumulator), ``acc^T [2 HALF, BM] = W x^T`` with the weights
on the left (they fill the MMA's M, the block's rows its N). A K step covers 128 inputs, one activation scale
block: per 32-input group the rows' 16 packed bytes become 32 e4m3 weights, the even inputs' (low nibbles) then the
odd ones' (``_group_weights``), the activations are stored in that order (``fp8_linear.pairs_split_order``), and
the product's sums are multiplied by the group's power of two; then each step's sums by the activation row's scale,
the whole by 64.

Activations: ``x`` as e4m3 times one float32 scale per row and 128 inputs (``fp8_linear.quantize_activations``:
``amax / 448``, as DeepSeek's inference quantizes activations for its fp8 GEMMs), the SwiGLU output ``h`` the same
way per ``HALF`` inputs in the up kernel's epilogue (rounded first as ``moe._swiglu`` rounds it). That is an error
against the reference op (bf16 activations), measured in docs/quantization.md; the weights are exact. Outputs and the
combine are rounded as ``moe_quant``'s. Widths: multiples of 128 and of ``2 HALF`` (``fits``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100 import envs
from deepinfer_nvidia_sm100.kernels import dequant, fp8_linear, moe, moe_mxfp4_decode, pdl

HALF = 64  # weight rows a program is two halves of (up: w1's and w3's); h's activation scale block
WARPS = 4
STEP = 128  # inputs a K step: one activation scale block (four 32-input weight scale groups)
K_STEP: tl.constexpr = tl.constexpr(STEP)
TILES = ((None, 16, 3),)  # (max mean assignments per expert, BLOCK_M, num_stages): the first that holds (32 rows a
# block take 248 registers on sm_90a, 8 warps an SM, and 4.7 instructions a weight: more blocks of 16 instead)
MAX_PER_EXPERT = 32  # mean assignments per expert up to which the op takes these kernels
DOWN_MAX_REGISTERS = 128  # the down kernel held to this many registers a thread at ``HALF``: on sm_90a 127 without
# spills, 16 warps an SM (129 and 12 warps unheld); the up kernel's quantizing epilogue takes 168 (held to 128 it spills)
ENABLED: bool | None = None  # None: DEEPINFER_NVIDIA_MXFP4_FP8_DECODE


def fits(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, half: int = HALF) -> bool:
    """Whether activations ``x [T, D]`` and packed experts ``w1 [E, I, D / 2]``, ``w2 [E, D, I / 2]`` fit these
    kernels at ``2 half`` weight rows a program: bf16 (or fp16) activations, both widths multiples of ``STEP``,
    ``D`` of ``2 half`` and ``I`` of ``half``."""
    D, I = x.shape[1], w1.shape[1]
    widths = D % STEP == 0 and I % STEP == 0 and D % (2 * half) == 0 and I % half == 0
    return x.dtype in (torch.bfloat16, torch.float16) and widths


def used(num_assign: int, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether ``moe_quant``'s MXFP4 op takes these kernels: switched on (``DEEPINFER_NVIDIA_MXFP4_FP8_DECODE``),
    shapes that ``fit``, at most ``MAX_PER_EXPERT`` assignments per expert on average."""
    enabled = envs.DEEPINFER_NVIDIA_MXFP4_FP8_DECODE if ENABLED is None else ENABLED
    return enabled and fits(x, w1, w2) and num_assign <= MAX_PER_EXPERT * w1.shape[0]


def tile(num_assign: int, num_experts: int) -> tuple[int, int]:
    """(BLOCK_M, num_stages) by the mean assignments per expert (``TILES``)."""
    per_expert = num_assign / max(num_experts, 1)
    return next(t[1:] for t in TILES if t[0] is None or per_expert <= t[0])


@triton.jit
def _stacked(top, bottom, offsets, HALF: tl.constexpr, COLUMNS: tl.constexpr):
    """The loads of ``top`` and of ``bottom [HALF]`` (pointers to rows) at ``offsets [COLUMNS]``, stacked:
    ``[2 HALF, COLUMNS]``."""
    rows = tl.join(tl.load(top[:, None] + offsets[None, :]), tl.load(bottom[:, None] + offsets[None, :]))
    return tl.reshape(tl.permute(rows, (2, 0, 1)), (2 * HALF, COLUMNS))


@triton.jit
def _group_weights(w_top, w_bottom, start, HALF: tl.constexpr, PTX: tl.constexpr):
    """The weights of the 32-input group from input ``start`` as e4m3 (codes times 2^-6): ``[2 HALF, 32]``, columns
    the group's even inputs, then its odd ones; rows from ``w_top``, then ``w_bottom`` (``[HALF]`` pointers to packed
    byte rows)."""
    packed = _stacked(w_top, w_bottom, start // 2 + tl.arange(0, 16), HALF, 16)  # [2H, 16] bytes
    low, high = dequant.e4m3_codes(packed, PTX)  # [2H, 16] each: inputs 2j, 2j + 1
    return tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), (2 * HALF, 32))


@triton.jit
def _product(a_rows, as_rows, w_top, w_bottom, s_top, s_bottom, K, BLOCK_M: tl.constexpr, HALF: tl.constexpr,
             A_BLOCK: tl.constexpr, PTX: tl.constexpr):
    """``W x^T`` over ``K`` inputs: ``[2 HALF, BM]`` float32. ``a_rows`` / ``as_rows [BM]``: pointers to the activation
    rows' e4m3 values (each 32 stored even inputs first) and float32 scales (one per ``A_BLOCK`` inputs: 32, 64 or
    128); ``w_top`` / ``s_top [HALF]``: to the first weight rows' packed bytes and ue8m0 bytes, ``w_bottom`` /
    ``s_bottom`` to the others'."""
    acc = tl.zeros((2 * HALF, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, K_STEP):
        scales = dequant.ue8m0(_stacked(s_top, s_bottom, k0 // 32 + tl.arange(0, 4), HALF, 4))  # [2H, 4]: the step's
        s02, s13 = tl.split(tl.reshape(scales, (2 * HALF, 2, 2)))  # [2H, 2] each: groups 0 and 2, 1 and 3
        s0, s2 = tl.split(s02)
        s1, s3 = tl.split(s13)
        for b in tl.static_range(0, 4, A_BLOCK // 32):  # each activation scale block of the step, its first group
            step = tl.zeros((2 * HALF, BLOCK_M), dtype=tl.float32)
            for g in tl.static_range(b, b + A_BLOCK // 32):
                start = k0 + 32 * g
                a_t = tl.load(a_rows[None, :] + (start + tl.arange(0, 32))[:, None])  # [32, BM] e4m3
                scale = s0 if g == 0 else (s1 if g == 1 else (s2 if g == 2 else s3))  # [2H]
                step += tl.dot(_group_weights(w_top, w_bottom, start, HALF, PTX), a_t) * scale[:, None]
            acc += step * tl.load(as_rows + (k0 + 32 * b) // A_BLOCK)[None, :]
    return acc * dequant.E4M3_CODE_SCALE


@triton.jit
def _up_kernel(xq_ptr, xs_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, hq_ptr, hs_ptr, assign_ptr, block_expert_ptr, D, I,
               top_k, limit, stride_xq, stride_xs, stride_we, stride_wi, stride_se, stride_si, stride_hq, stride_hs,
               BLOCK_M: tl.constexpr, HALF: tl.constexpr, DT: tl.constexpr, PTX: tl.constexpr,
               PDL: tl.constexpr = False):
    """Program (block of sorted rows, ``HALF`` columns of I): ``h = silu(clamp(x w1^T)) * clamp(x w3^T)`` as
    ``moe_quant._up_kernel`` rounds it in the activations' dtype ``DT``, from ``x``'s e4m3 rows ``xq`` and scales
    ``xs`` (one per 128 inputs); then each row's ``HALF`` values as e4m3 ``hq`` (each 32 stored even inputs first)
    with one float32 scale in ``hs`` (``amax / 448``, ``fp8_linear.e4m3_scaled``). ``w1`` / ``w3 [E, I, D / 2]``
    packed bytes, scales ``[E, I, D / 32]``."""
    pdl.begin(PDL)
    pid_n = tl.program_id(1)
    expert, offs_m, assign, valid = moe.sorted_block(block_expert_ptr, assign_ptr, tl.program_id(0), BLOCK_M)
    if expert < 0:
        return
    token = tl.where(valid, assign // top_k, 0).to(tl.int64)  # padding rows read token 0, never stored
    cols = pid_n * HALF + tl.arange(0, HALF)  # [H] the tile's columns of I
    w_at = expert.to(tl.int64) * stride_we + cols.to(tl.int64) * stride_wi
    s_at = expert.to(tl.int64) * stride_se + cols.to(tl.int64) * stride_si
    acc = _product(xq_ptr + token * stride_xq, xs_ptr + token * stride_xs, w1_ptr + w_at, w3_ptr + w_at, s1_ptr + s_at,
                   s3_ptr + s_at, D, BLOCK_M, HALF, K_STEP, PTX)  # [2H, BM]
    acc1, acc3 = tl.split(tl.permute(tl.reshape(acc, (2, HALF, BLOCK_M)), (1, 2, 0)))  # [H, BM] each
    h = moe._swiglu(tl.trans(acc1).to(DT).to(tl.float32), tl.trans(acc3).to(DT).to(tl.float32), limit, DT)
    q, scale = fp8_linear.e4m3_scaled(h.to(DT).to(tl.float32))  # [BM, H], [BM]
    rows = offs_m.to(tl.int64)
    at = hq_ptr + rows[:, None] * stride_hq + fp8_linear.pairs_split_order(cols)[None, :]
    tl.store(at, q.to(tl.float8e4nv), mask=valid[:, None])
    tl.store(hs_ptr + rows * stride_hs + pid_n, scale, mask=valid)


@triton.jit
def _down_kernel(hq_ptr, hs_ptr, w2_ptr, s2_ptr, y_ptr, weights_ptr, assign_ptr, block_expert_ptr, D, I,
                 stride_hq, stride_hs, stride_we, stride_wd, stride_se, stride_sd, stride_ym, BLOCK_M: tl.constexpr,
                 HALF: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr = False):
    """Program (block of sorted rows, ``2 HALF`` columns of D): ``y = (h w2^T) * routing weight`` as
    ``moe_quant._down_kernel`` from ``h``'s e4m3 rows ``hq`` and scales ``hs`` (one per ``HALF`` inputs, as
    ``_up_kernel`` wrote them); ``w2 [E, D, I / 2]`` packed bytes, scales ``[E, D, I / 32]``."""
    pdl.begin(PDL)
    pid_n = tl.program_id(1)
    expert, offs_m, assign, valid = moe.sorted_block(block_expert_ptr, assign_ptr, tl.program_id(0), BLOCK_M)
    if expert < 0:
        return
    rows = offs_m.to(tl.int64)
    cols = (pid_n * 2 * HALF + tl.arange(0, HALF)).to(tl.int64)  # [H] the first half's columns of D
    w_rows = w2_ptr + expert.to(tl.int64) * stride_we + cols * stride_wd
    s_rows = s2_ptr + expert.to(tl.int64) * stride_se + cols * stride_sd
    acc = _product(hq_ptr + rows * stride_hq, hs_ptr + rows * stride_hs, w_rows, w_rows + HALF * stride_wd, s_rows,
                   s_rows + HALF * stride_sd, I, BLOCK_M, HALF, HALF, PTX)  # [2H, BM]
    routing = tl.load(weights_ptr + tl.where(valid, assign, 0), mask=valid, other=0.0)
    routing = routing.to(y_ptr.dtype.element_ty).to(tl.float32)
    moe_mxfp4_decode.store_y(acc, y_ptr, offs_m, valid, routing, pid_n * 2 * HALF, stride_ym, 2 * HALF)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _quantized(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [R, K]`` as e4m3 ``[R, K]``, each 32 inputs even ones first, and float32 scales ``[R, K / 128]``
    (``fp8_linear.quantize_activations``)."""
    q, s = fp8_linear.quantize_activations(t[:, None], STEP, pairs_split=True)
    return q[:, 0], s[:, 0]


def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1, s1, w2, s2, w3, s3, limit: float,
        launch: tuple[int, ...] | None = None) -> torch.Tensor:
    """The MXFP4 experts through these kernels: ``x`` quantized, ``moe.align``, ``_up_kernel`` (``h`` quantized in its
    epilogue), ``_down_kernel``, ``moe._combine``. ``w*`` packed bytes (uint8), ``s*`` ue8m0 bytes (uint8), contiguous, shapes
    that ``fit``; ``launch`` fixes (BLOCK_M, num_stages[, half]), by default ``tile``'s and ``HALF``
    (``benchmarks/bench_mxfp4_decode.py`` times others)."""
    T, top_k = ids.shape
    E, I, D = w1.shape[0], w1.shape[1], x.shape[1]
    block_m, stages, half = (*(launch or tile(T * top_k, E)), HALF)[:3]
    if not fits(x, w1, w2, half):
        raise ValueError(f"moe_mxfp4_fp8_decode: bf16 / fp16 activations and widths D={D}, I={I} that are multiples of "
                         f"{STEP} and {2 * half} only (got {x.dtype}); moe_quant's kernels take the rest")
    sorted_assign, block_expert, dest = moe.align(ids, E, block_m)
    rows, blocks = sorted_assign.shape[0], sorted_assign.shape[0] // block_m
    xq, xs = _quantized(x)
    hq = torch.empty((rows, I), dtype=torch.float8_e4m3fn, device=x.device)
    hs = torch.empty((rows, I // half), dtype=torch.float32, device=x.device)
    consts = {"BLOCK_M": block_m, "HALF": half, "PTX": not pdl._interpreted(), "num_warps": WARPS,
              "num_stages": stages, **pdl.launch()}
    _up_kernel[(blocks, I // half)](
        xq, xs, w1, s1, w3, s3, hq, hs, sorted_assign, block_expert, D, I, top_k, float(limit), xq.stride(0),
        xs.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1), hq.stride(0), hs.stride(0),
        DT=_TL_DTYPES[x.dtype], **consts)
    y = torch.empty((rows, D), dtype=x.dtype, device=x.device)
    _down_kernel[(blocks, D // (2 * half))](
        hq, hs, w2, s2, y, weights.reshape(-1).contiguous(), sorted_assign, block_expert, D, I, hq.stride(0),
        hs.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0),
        **consts, **({"maxnreg": DOWN_MAX_REGISTERS} if half == HALF else {}))
    return moe._combine(y, ids, dest, x)

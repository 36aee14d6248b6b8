"""MXFP4 routed experts, written for decode sizes (up to a few dozen tokens per expert) and tiled for prefill too:
``moe_quant``'s grouped layout with the packed weights expanded straight into the tensor cores' register operand, so
that the kernels are bound by reading the bytes (decode) or by the tensor cores (prefill) rather than by expanding
them.

The bf16 kernels of ``moe.py`` are the model: ``_up_kernel`` / ``_down_kernel`` read each touched expert's weight
tile once for all its tokens (up to ``BLOCK_M``, sorted by ``moe.align``) and multiply on the tensor cores. Here the
weights are the left operand (``acc^T [64, BM] = W x^T``: 64 weight rows fill the MMA's M, the tokens its N, one
token too; the up kernel's 64 rows are 32 columns' rows of ``w1`` and of ``w3``, one accumulator) and each thread
expands only the weights its own MMA fragment holds, in registers:

* A weight tile is ``[64 rows, BLOCK_K / 8]`` int32 words as stored (16-byte loads, eight codes a word). Each pair
  of words of one row and scale group becomes eight bf16x2 registers, already scaled (``dequant.mxfp4_word_codes``:
  ~2.8 instructions a weight).
* Their order inside the tile (``_fragment_tile``: joins, a reshape and a permute) is by construction the MMA
  operand's register layout (the wgmma / mma.sync A fragment: each lane ``l`` holds rows ``l / 4`` and ``l / 4 + 8``
  of its warp's 16, and inputs ``2 (l % 4) + {0, 1}`` and ``+ 8`` of every 16), so the compiler moves no weight
  through shared memory. For that, the inputs of every 128 are multiplied in *fragment order*: input ``p = 32 q + 8
  w + s`` (code ``s`` of word ``w`` of lane quarter ``q``) is product column ``16 s + 8 (w // 2) + 2 q + w % 2``, and
  the 64 weight rows load as ``_tile_rows`` lists them. ``run`` puts ``x`` in that order (``fragment_order``, one
  small copy) and ``_up_kernel`` writes ``h`` in it for ``_down_kernel``.

``DECODE``: ``PTX`` (bf16 activations on a GPU), ``PORTABLE`` (the same values in Triton operations; bf16),
``FLOAT32`` (any dtype, and Triton's interpreter, which runs no PTX: each weight decoded to float32, scaled and
rounded to the activations' dtype as the reference op rounds it). All three give the reference op's weights exactly.
Epilogues, rounding and the combine are ``moe_quant``'s. No host synchronisation: CUDA graphs capture it. Shapes:
both widths multiples of 128 (``fits``); others take ``moe_quant``'s kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100 import envs
from deepinfer_nvidia_sm100.kernels import dequant, moe, pdl

FLOAT32, PORTABLE, PTX = 0, 1, 2  # the kernels' ``DECODE``
BF16_DECODE = PTX  # how bf16 activations decode on a GPU (``PORTABLE``: without inline PTX)
TILE_ROWS = 64  # weight rows a program: one warpgroup's MMA M, four warps of 16 (the fragment layout assumes it)
WARPS = 4  # one warpgroup (with more, the compiler's MMA layout no longer matches the fragment order: ~2x the work)
FRAGMENT = 128  # inputs per fragment-order block: four lane quarters of 32 (the widths must be multiples of it)

MAX_PER_EXPERT = None  # mean assignments per expert up to which the MXFP4 op takes these kernels (0: never); None:
# ``DEEPINFER_NVIDIA_MXFP4_DECODE_MAX_PER_EXPERT`` (1,024 by default; docs/quantization.md has the timings)
TILES = {  # (max mean assignments per expert, (BLOCK_M, BLOCK_K, num_stages[, subtiles])): the first that holds, else
    # the last.
    # Measured on an H200 (bench_quant.py mxfp4, 2026-12-02; the v4-flash-8l64e-fp4 experts, one layer): two subtiles
    # fastest at every size from 16 tokens: (16, 256, 3, 2) 306.8 us at 16 tokens (one subtile 331.7) and 370.0 at 64
    # (376.5); (32, 256, 3, 2) 470.4 us at 256 (481.4); (64, 128, 3, 2) 1,605.9 us at 1,024 ((128, 128, 3): 1,644.7);
    # (128, 128, 3, 2) 8,510.0 us at 8,192 ((128, 128, 3): 9,632.9). The bound between the last two is not measured.
    "decode": (16, (16, 256, 3, 2)),
    "mid": (64, (32, 256, 3, 2)),
    "prefill": (256, (64, 128, 3, 2)),
    "large": (None, (128, 128, 3, 2)),
}
MAX_REGISTERS = None  # registers a thread the kernels are held to (``maxnreg``; None: the compiler's choice). On
# sm_90a the up kernel's (16, 256, 3, 2) takes 170, so an SM holds two of its programs (8 warps); held to 168 it
# compiles to 163 with the same loop and no spills, three programs (12 warps, as shared memory allows); sm_100a
# spills there. On the H200 (2026-12-04) 1% at 64 tokens, nothing at 16: left to the compiler


def fits(x: torch.Tensor, *packed: torch.Tensor) -> bool:
    """Whether activations ``x [T, D]`` and packed expert weights (``w1``, ``w2``, ``w3``: ``[E, I, D / 2]``,
    ``[E, D, I / 2]``) fit these kernels: both widths multiples of 128, the bytes readable as int32 words."""
    d, i = x.shape[1], packed[0].shape[1]
    return d % FRAGMENT == 0 and i % FRAGMENT == 0 and all(w.storage_offset() % 4 == 0 for w in packed)


def used(num_tokens: int, num_assign: int, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
         w3: torch.Tensor) -> bool:
    """Whether ``moe_quant``'s MXFP4 op takes these kernels: fp16 / fp32 activations, bf16 ones with a bf16 decode
    (on a GPU: Triton's interpreter multiplies bf16 tiles wrongly), weights that ``fit``, at most
    ``MAX_PER_EXPERT`` assignments per expert on average, two tokens or more (one token takes ``moe_quant``'s row
    kernels: on the H200 52.6 us a layer against 64.7 us here, 78.7-99.8 us with K split for more programs,
    bench_quant.py mxfp4, 2026-12-04)."""
    dtype_ok = x.dtype in (torch.float16, torch.float32) or (x.dtype == torch.bfloat16 and decode_mode(x) != FLOAT32)
    bound = envs.DEEPINFER_NVIDIA_MXFP4_DECODE_MAX_PER_EXPERT if MAX_PER_EXPERT is None else MAX_PER_EXPERT
    return dtype_ok and fits(x, w1, w2, w3) and num_assign <= bound * w1.shape[0] and num_tokens > 1


def tile(num_assign: int, num_experts: int) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_K, num_stages[, subtiles]) by the mean assignments per expert (``TILES``)."""
    per_expert = num_assign / max(num_experts, 1)
    return next(t for bound, t in TILES.values() if bound is None or per_expert <= bound)


def decode_mode(x: torch.Tensor) -> int:
    """``DECODE`` for activations like ``x``: ``BF16_DECODE`` for bf16 on a GPU, otherwise ``FLOAT32``."""
    return BF16_DECODE if x.dtype == torch.bfloat16 and x.is_cuda and not pdl._interpreted() else FLOAT32


def fragment_order(t: torch.Tensor) -> torch.Tensor:
    """``t [rows, K]`` (K a multiple of 128) with the inputs of every 128 in fragment order: column ``16 s + 8 h + 2 q
    + e`` holds input ``32 q + 16 h + 8 e + s``."""
    rows, k = t.shape
    return t.reshape(rows, k // FRAGMENT, 4, 2, 2, 8).permute(0, 1, 5, 3, 2, 4).reshape(rows, k)


@triton.jit
def fragment_column(n):
    """The fragment-order column of inputs ``n`` (``fragment_order``'s inverse map)."""
    p = n % 128
    return n - p + 16 * (p % 8) + 8 * (p // 16 % 2) + 2 * (p // 32) + p // 8 % 2


@triton.jit
def _tile_rows():
    """The 64 rows of a weight tile in load order: load row ``32 r + 8 w + l`` is tile row ``16 w + 8 r + l`` (``l``
    lane row, ``w`` warp, ``r`` register), so that ``_fragment_tile``'s row permute returns them in order."""
    i = tl.arange(0, 64)
    return 16 * (i // 8 % 4) + 8 * (i // 32) + i % 8


@triton.jit
def _fragment_tile(words, raw_scale, dt: tl.constexpr, BLOCK_K: tl.constexpr, DECODE: tl.constexpr):
    """The ``[64, BLOCK_K]`` weights (``dt``) of ``words [64, BLOCK_K / 8]`` (int32, rows in ``_tile_rows`` order)
    and their ue8m0 bytes ``raw_scale [64, BLOCK_K / 32]``, rows in order and columns in fragment order."""
    tl.static_assert(BLOCK_K % 128 == 0, "fragment order takes whole blocks of 128 inputs")
    if DECODE == 0:
        scale = dequant.ue8m0(raw_scale)
    else:
        scale = dequant.ue8m0(raw_scale).to(tl.bfloat16)
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (64, BLOCK_K // 32, 4)), (64, BLOCK_K // 8))  # per word
    if DECODE == 2:
        c0, c1, c2, c3, c4, c5, c6, c7 = dequant.mxfp4_word_codes(words, scale)
    else:
        c0, c1, c2, c3, c4, c5, c6, c7 = dequant.mxfp4_word_values(words, scale)
    v = tl.join(tl.join(tl.join(c0, c1), tl.join(c2, c3)), tl.join(tl.join(c4, c5), tl.join(c6, c7)))
    v = tl.reshape(v, (2, 4, 8, BLOCK_K // 128, 4, 2, 2, 2, 2, 2))  # [r, w, l, block, q, h, e, s0, s1, s2]
    v = tl.permute(v, (1, 0, 2, 3, 9, 8, 7, 5, 4, 6))  # [w, r, l, block, s2, s1, s0, h, q, e]
    return tl.reshape(v, (64, BLOCK_K)).to(dt)


@triton.jit
def _product(a_rows, w_rows, s_rows, w_next, s_next, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
             SUBTILES: tl.constexpr, DECODE: tl.constexpr, PRECISION: tl.constexpr):
    """``W a^T`` over the ``K`` inputs (whole ``BLOCK_K`` steps) for ``SUBTILES`` (1 or 2) weight tiles of
    64 rows, each ``[64, BLOCK_M]`` float32 (rows in tile order; the second zeros with one subtile), every
    activation tile loaded once for both: ``a_rows [BM]`` pointers to the activation rows (in fragment order;
    padding rows point at a real row: their results are never stored), ``w_rows`` / ``s_rows [64]`` to the first tile's rows' int32 words and ue8m0 bytes in
    ``_tile_rows`` order, the second tile's ``w_next`` / ``s_next`` elements further."""
    words_at = w_rows[:, None] + tl.arange(0, BLOCK_K // 8)[None, :]  # [64, BK / 8]
    scales_at = s_rows[:, None] + tl.arange(0, BLOCK_K // 32)[None, :]
    inputs = tl.arange(0, BLOCK_K)
    dt = a_rows.dtype.element_ty
    acc = tl.zeros((64, BLOCK_M), dtype=tl.float32)
    acc_next = tl.zeros((64, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = _fragment_tile(tl.load(words_at + k0 // 8), tl.load(scales_at + k0 // 32), dt, BLOCK_K, DECODE)
        a_t = tl.load(a_rows[None, :] + (k0 + inputs)[:, None])  # [BK, BM]
        acc = tl.dot(w, a_t, acc, input_precision=PRECISION)
        if SUBTILES == 2:
            w = _fragment_tile(tl.load(words_at + w_next + k0 // 8), tl.load(scales_at + s_next + k0 // 32), dt,
                               BLOCK_K, DECODE)
            acc_next = tl.dot(w, a_t, acc_next, input_precision=PRECISION)
    return acc, acc_next


@triton.jit
def _store_h(acc, h_ptr, offs_m, valid, first_col, stride_hm, limit):
    """A tile's ``[64, BM]`` sums (32 columns of ``w1``, then of ``w3``) through ``moe._swiglu`` into ``h``'s 32
    columns from ``first_col``, in fragment order for ``_down_kernel``."""
    acc1, acc3 = tl.split(tl.permute(tl.reshape(acc, (2, 32, acc.shape[1])), (1, 2, 0)))  # [32, BM] each
    dt = h_ptr.dtype.element_ty
    h = moe._swiglu(tl.trans(acc1).to(dt).to(tl.float32), tl.trans(acc3).to(dt).to(tl.float32), limit, dt)
    h_cols = fragment_column(first_col + tl.arange(0, 32))
    tl.store(h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + h_cols[None, :], h.to(dt), mask=valid[:, None])


@triton.jit
def _up_kernel(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, h_ptr, assign_ptr, block_expert_ptr, D, I, top_k, limit,
               stride_xt, stride_we, stride_wi, stride_se, stride_si, stride_hm,
               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DECODE: tl.constexpr, PRECISION: tl.constexpr,
               SUBTILES: tl.constexpr = 1, PDL: tl.constexpr = False):
    """Program (block of sorted rows, ``32 SUBTILES`` columns of I): ``h = silu(clamp(x w1^T)) * clamp(x w3^T)`` as
    ``moe_quant._up_kernel``, ``w1`` / ``w3 [E, I, D / 8]`` int32 words, scales ``[E, I, D / 32]``; ``x`` and ``h``
    in fragment order. A tile's 64 rows are 32 columns' rows of ``w1`` then of ``w3``: one accumulator."""
    pdl.begin(PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(assign_ptr + offs_m)
    valid = assign >= 0
    x_rows = x_ptr + tl.where(valid, assign // top_k, 0).to(tl.int64) * stride_xt  # [BM]
    rows = _tile_rows()
    first_col = pid_n * 32 * SUBTILES
    cols = (first_col + rows % 32).to(tl.int64)  # [64] each row's column of I
    first = rows < 32  # rows of w1, then of w3
    w_rows = tl.where(first, w1_ptr, w3_ptr) + expert.to(tl.int64) * stride_we + cols * stride_wi
    s_rows = tl.where(first, s1_ptr, s3_ptr) + expert.to(tl.int64) * stride_se + cols * stride_si
    acc, acc_next = _product(x_rows, w_rows, s_rows, 32 * stride_wi, 32 * stride_si, D, BLOCK_M, BLOCK_K, SUBTILES,
                             DECODE, PRECISION)  # [64, BM] each
    _store_h(acc, h_ptr, offs_m, valid, first_col, stride_hm, limit)
    if SUBTILES == 2:
        _store_h(acc_next, h_ptr, offs_m, valid, first_col + 32, stride_hm, limit)


@triton.jit
def store_y(acc, y_ptr, offs_m, valid, routing, first_col, stride_ym, COLUMNS: tl.constexpr = 64):
    """A tile's ``[COLUMNS, BM]`` sums times each row's routing weight (float32 of its ``y`` dtype rounding) into
    ``y``'s ``COLUMNS`` columns from ``first_col``, rounded as ``moe_quant._down_kernel`` rounds."""
    dt = y_ptr.dtype.element_ty
    out = tl.trans(acc).to(dt).to(tl.float32) * routing[:, None]  # [BM, COLUMNS]
    offs_n = first_col + tl.arange(0, COLUMNS)
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], out, mask=valid[:, None])


@triton.jit
def _down_kernel(h_ptr, w2_ptr, s2_ptr, y_ptr, weights_ptr, assign_ptr, block_expert_ptr, D, I,
                 stride_hm, stride_we, stride_wd, stride_se, stride_sd, stride_ym, BLOCK_M: tl.constexpr,
                 BLOCK_K: tl.constexpr, DECODE: tl.constexpr, PRECISION: tl.constexpr, SUBTILES: tl.constexpr = 1,
                 PDL: tl.constexpr = False):
    """Program (block of sorted rows, ``64 SUBTILES`` columns of D): ``y = (h w2^T) * routing weight`` as
    ``moe_quant._down_kernel``, ``w2 [E, D, I / 8]`` int32 words, scales ``[E, D, I / 32]``."""
    pdl.begin(PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(assign_ptr + offs_m)
    valid = assign >= 0
    h_rows = h_ptr + offs_m.to(tl.int64) * stride_hm  # [BM]
    first_col = pid_n * 64 * SUBTILES
    cols = (first_col + _tile_rows()).to(tl.int64)
    w_rows = w2_ptr + expert.to(tl.int64) * stride_we + cols * stride_wd
    s_rows = s2_ptr + expert.to(tl.int64) * stride_se + cols * stride_sd
    acc, acc_next = _product(h_rows, w_rows, s_rows, 64 * stride_wd, 64 * stride_sd, I, BLOCK_M, BLOCK_K, SUBTILES,
                             DECODE, PRECISION)
    routing = tl.load(weights_ptr + tl.where(valid, assign, 0), mask=valid, other=0.0)
    routing = routing.to(y_ptr.dtype.element_ty).to(tl.float32)
    store_y(acc, y_ptr, offs_m, valid, routing, first_col, stride_ym)
    if SUBTILES == 2:
        store_y(acc_next, y_ptr, offs_m, valid, routing, first_col + 64, stride_ym)


def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1, s1, w2, s2, w3, s3, limit: float,
        launch: tuple[int, ...] | None = None, decode: int | None = None,
        max_registers: int | None = None) -> torch.Tensor:
    """The MXFP4 experts through these kernels: ``moe.align``, ``_up_kernel``, ``_down_kernel``, ``moe._combine``.
    ``w*`` packed bytes (uint8), ``s*`` ue8m0 bytes (uint8), contiguous, widths that ``fit``; ``launch`` fixes
    (BLOCK_M, BLOCK_K, num_stages[, subtiles]) (subtiles: 64-row weight tiles a program, 1 or 2, each activation
    tile loaded once for them; 1 when left out), by default ``tile``'s;
    ``decode`` the ``DECODE``, by default ``decode_mode``'s; ``max_registers`` the kernels' ``maxnreg``, by default
    ``MAX_REGISTERS`` (``benchmarks/bench_quant.py`` sweeps all three)."""
    T, top_k = ids.shape
    E, I, D = w1.shape[0], w1.shape[1], x.shape[1]
    if not fits(x, w1, w2, w3):
        raise ValueError(f"moe_mxfp4_decode: widths D={D}, I={I} must be multiples of {FRAGMENT} and the packed "
                         "weights 4-byte aligned; moe_quant's grouped kernels take any shape")
    block_m, block_k, stages, *rest = launch or tile(T * top_k, E)
    subtiles = rest[0] if rest else 1
    if subtiles not in (1, 2) or len(rest) > 1:
        raise ValueError(f"moe_mxfp4_decode: a launch is (BLOCK_M, BLOCK_K, num_stages[, subtiles 1 or 2]), got "
                         f"{launch}")
    block_k = block_k if D % block_k == 0 and I % block_k == 0 else FRAGMENT  # whole steps over both widths
    sorted_assign, block_expert, dest = moe.align(ids, E, block_m)
    rows = sorted_assign.shape[0]
    h = torch.empty((rows, I), dtype=x.dtype, device=x.device)
    y = torch.empty((rows, D), dtype=x.dtype, device=x.device)
    w1, w2, w3 = (w.view(torch.int32) for w in (w1, w2, w3))  # eight codes a word
    consts = {"BLOCK_M": block_m, "BLOCK_K": block_k, "DECODE": decode_mode(x) if decode is None else decode,
              "PRECISION": "ieee" if x.dtype == torch.float32 else "tf32", "num_warps": WARPS,
              "SUBTILES": subtiles, "num_stages": stages, **pdl.launch()}
    max_registers = MAX_REGISTERS if max_registers is None else max_registers
    if max_registers is not None:
        consts["maxnreg"] = max_registers
    blocks = rows // block_m
    xf = fragment_order(x)
    _up_kernel[(blocks, I // (TILE_ROWS // 2 * subtiles))](
        xf, w1, s1, w3, s3, h, sorted_assign, block_expert, D, I, top_k, float(limit), xf.stride(0), w1.stride(0),
        w1.stride(1), s1.stride(0), s1.stride(1), h.stride(0), **consts)
    _down_kernel[(blocks, D // (TILE_ROWS * subtiles))](
        h, w2, s2, y, weights.reshape(-1).contiguous(), sorted_assign, block_expert, D, I, h.stride(0), w2.stride(0),
        w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0), **consts)
    return moe._combine(y, ids, dest, x)

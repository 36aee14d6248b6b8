"""Quantized weights decoded in registers: MXFP4 (two e2m1 codes a byte, one ue8m0 scale per 32 inputs) and fp8
e4m3 block weights (one ue8m0 or float32 scale per ``B0 x B1`` block).

The ``@triton.jit`` helpers turn stored bytes into float32 values inside a kernel, bit for bit what
``deepinfer_core.quant.mxfp4.dequantize`` / ``fp8_block.dequantize`` compute on the host: a ue8m0 byte ``b`` is the
float32 whose exponent field is ``b`` (``2^(b - 127)``; byte 0 is the subnormal ``2^-127``, byte 255 NaN), an e2m1
code's bits placed into a float32 (codes 0-7: 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign; ``mxfp4_pair``), and the
value is code x scale, exact float32 products. MXFP4 tiles load as ``[groups of 32 inputs, 16 bytes, ...]`` so that
each ue8m0 scale is loaded and decoded once per group, not once per byte; ``mxfp4_dot_scaled`` leaves the expansion
of bf16 products to ``tl.dot_scaled``. The kernels of ``moe_quant.py`` and ``fp8_linear.py`` use them on weight tiles; ``dequantize_mxfp4`` / ``dequantize_fp8_block`` run them over a whole tensor (a dense weight on the
device, and the exactness check of the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.quant import mxfp4

MXFP4_GROUP: tl.constexpr = tl.constexpr(mxfp4.GROUP)  # inputs per ue8m0 scale
PACKED_PER_SCALE: tl.constexpr = tl.constexpr(mxfp4.GROUP // 2)  # packed bytes per ue8m0 scale
UE8M0_ONE: tl.constexpr = tl.constexpr(127)  # the ue8m0 byte of 1.0: what a masked scale load returns
SIGN_BIT: tl.constexpr = tl.constexpr(0x80000000)  # float32 sign
E2M1_BITS: tl.constexpr = tl.constexpr(0x01C00000)  # float32 bits 22-24: an e2m1 code's exponent and mantissa
TWO_126: tl.constexpr = tl.constexpr(2.0**126)


@triton.jit
def ue8m0(byte):
    """float32 ``2^(byte - 127)`` of ue8m0 bytes (any integer tensor holding 0-255): the byte as the exponent field;
    byte 0 sets the mantissa's top bit instead (the subnormal ``2^-127``), byte 255 too (NaN)."""
    b = byte.to(tl.int32) & 0xFF
    special = (b == 0) | (b == 255)
    return ((b << 23) | tl.where(special, 0x400000, 0)).to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_pair(packed, scale):
    """The two float32 weights of each packed byte (low nibble: the even input, high nibble: the odd one), times
    its float32 ``scale`` (broadcast): ``(even, odd)``.

    A code's sign bit and three magnitude bits moved to float32 bits 31 and 22-24 make the float32 ``2^-126`` times
    its e2m1 value (exponent field ``e``, top mantissa bit ``m``: ``2^(e - 127) (1 + m / 2)``; for ``e = 0`` the
    subnormal ``m 2^-127``), so a nibble costs two shifts, two masks and an or, then an exact multiply by 2^126."""
    b = packed.to(tl.uint32)
    even = ((b << 28) & SIGN_BIT) | ((b << 22) & E2M1_BITS)
    odd = ((b << 24) & SIGN_BIT) | ((b << 18) & E2M1_BITS)
    return ((even.to(tl.float32, bitcast=True) * TWO_126) * scale,
            (odd.to(tl.float32, bitcast=True) * TWO_126) * scale)


# Two 32-bit words of packed bytes ($8, $9: eight e2m1 codes each, code i in bits 4i..4i+3, one row and one scale group)
# and their bf16 scale twice ($10) -> eight bf16x2 registers: $i holds code i of the first word (low half) and of the
# second (high half), times the scale. Per byte j: prmt puts byte j of each word at bits 0-7 / 16-23; a code n
# (masked to bits 0-3 / 16-19, or 4-7 / 20-23) times 0x1040 (0x104) is n << 6 plus n << 12, so one mask keeps its
# magnitude bits at bf16 bits 6-8 and its sign at bit 15: the bf16 of the code times 2^-126, made exact by a multiply
# by 2^126, then by the scale (exact: a power of two times an e2m1 code fits bf16).
_MXFP4_WORDS_PTX: tl.constexpr = tl.constexpr("{\n.reg .b32 t, u, c;\nmov.b32 c, 0x7e807e80;\n" + "".join(
    f"prmt.b32 t, $8, $9, {0x4400 + 0x1111 * j:#06x};\n"
    f"and.b32 u, t, 0x000F000F; mul.lo.u32 u, u, 0x1040; and.b32 u, u, 0x81C081C0; mul.rn.bf16x2 u, u, c; "
    f"mul.rn.bf16x2 ${2 * j}, u, $10;\n"
    f"and.b32 u, t, 0x00F000F0; mul.lo.u32 u, u, 0x104; and.b32 u, u, 0x81C081C0; mul.rn.bf16x2 u, u, c; "
    f"mul.rn.bf16x2 ${2 * j + 1}, u, $10;\n" for j in range(4)) + "}")


@triton.jit
def mxfp4_word_codes(words, scale):
    """The eight bf16 weights of each int32 word of packed bytes (code ``i``: bits ``4i .. 4i + 3``) times its bf16
    ``scale`` (same shape): a tuple of eight tensors shaped as ``words``, exactly the reference's weights, in about 2.8
    instructions a weight (inline PTX for sm_90+, two words an invocation; Triton's interpreter runs no PTX:
    ``mxfp4_word_values``)."""
    return tl.inline_asm_elementwise(_MXFP4_WORDS_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [words, scale],
                                     dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)


@triton.jit
def _word_code_bits(words, i: tl.constexpr):
    """Code ``i`` of each word placed as ``mxfp4_pair`` places it: float32 bits of the code times 2^-126."""
    n = ((words >> (4 * i)) & 0xF).to(tl.uint32)
    return (((n << 28) & SIGN_BIT) | ((n << 22) & E2M1_BITS)).to(tl.float32, bitcast=True)


# Four packed bytes ($4: byte j holds inputs 2j, low nibble, and 2j + 1) and those eight inputs as float32 (even
# $5-$8, odd $9-$12) -> $0-$3: running float32 sums of the products, $j the first j + 1 bytes' (so $3 is all eight).
# Per two bytes: prmt places byte j at bits 0-7 and byte j + 1 at 16-23; a nibble times 0x1040 (low) or 0x104 (high)
# gives a bf16x2 of two codes times 2^-126 (as in _MXFP4_WORDS_PTX), made exact by a multiply by 2^126; each half
# widened to float32 (a shift for the low half, a mask for the high) and fused into the running sum. About 4.25
# instructions a weight, products exact and summed in float32 in input order.
_MXFP4_ROW_SUMS_PTX: tl.constexpr = tl.constexpr(
    "{\n.reg .b32 t, u, v, c, w;\nmov.b32 c, 0x7e807e80;\n" + "".join(
        f"prmt.b32 t, $4, 0, {0x4040 + 0x0101 * (2 * p) + 0x0100:#06x};\n"
        "and.b32 u, t, 0x000F000F; mul.lo.u32 u, u, 0x1040; and.b32 u, u, 0x81C081C0; mul.rn.bf16x2 u, u, c;\n"
        "and.b32 v, t, 0x00F000F0; mul.lo.u32 v, v, 0x104; and.b32 v, v, 0x81C081C0; mul.rn.bf16x2 v, v, c;\n"
        + (f"shl.b32 w, u, 16; mul.rn.f32 ${2 * p}, w, ${5 + 2 * p};\n" if p == 0 else
           f"shl.b32 w, u, 16; fma.rn.f32 ${2 * p}, w, ${5 + 2 * p}, ${2 * p - 1};\n")
        + f"shl.b32 w, v, 16; fma.rn.f32 ${2 * p}, w, ${9 + 2 * p}, ${2 * p};\n"
        f"and.b32 w, u, 0xFFFF0000; fma.rn.f32 ${2 * p + 1}, w, ${6 + 2 * p}, ${2 * p};\n"
        f"and.b32 w, v, 0xFFFF0000; fma.rn.f32 ${2 * p + 1}, w, ${10 + 2 * p}, ${2 * p + 1};\n"
        for p in range(2)) + "}")


@triton.jit
def mxfp4_row_sums(packed, x_even, x_odd):
    """Running float32 sums of each four packed bytes' products with their inputs ``x_even`` / ``x_odd`` (float32,
    shaped as ``packed``): element ``4 i + j`` holds the sum over bytes ``4 i .. 4 i + j``, so every fourth element
    is the sum of eight weights' products (inline PTX, sm_90+; ``row_product``'s bf16 rows)."""
    return tl.inline_asm_elementwise(_MXFP4_ROW_SUMS_PTX, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [packed, x_even, x_odd],
                                     dtype=tl.float32, is_pure=True, pack=4)


@triton.jit
def mxfp4_word_values(words, scale):
    """``mxfp4_word_codes`` in Triton operations: the eight weights of each word as ``scale``'s dtype (bf16: the
    same bits as the PTX; float32: the reference's exact values)."""
    dt = scale.dtype
    s = scale.to(tl.float32)
    return ((_word_code_bits(words, 0) * TWO_126 * s).to(dt), (_word_code_bits(words, 1) * TWO_126 * s).to(dt),
            (_word_code_bits(words, 2) * TWO_126 * s).to(dt), (_word_code_bits(words, 3) * TWO_126 * s).to(dt),
            (_word_code_bits(words, 4) * TWO_126 * s).to(dt), (_word_code_bits(words, 5) * TWO_126 * s).to(dt),
            (_word_code_bits(words, 6) * TWO_126 * s).to(dt), (_word_code_bits(words, 7) * TWO_126 * s).to(dt))


# Four packed bytes ($2: byte j holds codes 2j, low nibble, and 2j + 1) -> $0: the e4m3 bytes of the four low
# nibbles, $1: of the four high nibbles, each in its byte's place. A code's sign goes to bit 7 and its three magnitude
# bits (exponent, mantissa) to bits 4-2: the e4m3 of the code times 2^-6, exact for every code (exponent field 0 is
# e4m3's subnormal as it is e2m1's: 0.5 is 2^-7 = 4 x 2^-9). Seven logic instructions for eight codes.
_E4M3_CODES_PTX: tl.constexpr = tl.constexpr(
    "{\n.reg .b32 a, b;\n"
    "shl.b32 a, $2, 2; and.b32 a, a, 0x1C1C1C1C; shl.b32 b, $2, 4; and.b32 b, b, 0x80808080; or.b32 $0, a, b;\n"
    "shr.b32 a, $2, 2; and.b32 a, a, 0x1C1C1C1C; and.b32 b, $2, 0x80808080; or.b32 $1, a, b;\n}")
E4M3_CODE_SCALE: tl.constexpr = tl.constexpr(64.0)  # an e4m3 byte of ``e4m3_codes`` is its code times 1 / 64


@triton.jit
def e4m3_codes(packed, PTX: tl.constexpr):
    """The codes of packed MXFP4 bytes (uint8, any shape) as fp8 e4m3 values times 2^-6 (``E4M3_CODE_SCALE``),
    exactly: ``(low nibbles' (even inputs), high nibbles' (odd inputs))``, each shaped as ``packed``. ``PTX``: inline
    assembly on four bytes a register (sm_90+); else the same bits in Triton operations (Triton's interpreter)."""
    if PTX:
        return tl.inline_asm_elementwise(_E4M3_CODES_PTX, "=r,=r,r", [packed], dtype=(tl.float8e4nv, tl.float8e4nv),
                                         is_pure=True, pack=4)
    else:
        b = packed.to(tl.uint8)
        low = ((b & 7) << 2) | ((b & 8) << 4)
        high = ((b >> 2) & 0x1C) | (b & 0x80)
        return low.to(tl.float8e4nv, bitcast=True), high.to(tl.float8e4nv, bitcast=True)


@triton.jit
def block_scale(raw, UE8M0: tl.constexpr):
    """A block scale as float32: ue8m0 bytes decoded, float32 scales as loaded."""
    if UE8M0:
        return ue8m0(raw)
    else:
        return raw.to(tl.float32)


@triton.jit
def mxfp4_dot(acc, a_even, a_odd, w_ptr, s_ptr, k0, K, offs_n, n_mask, w_stride, s_stride, BLOCK_K: tl.constexpr,
              PRECISION: tl.constexpr):
    """``acc [BM, BN] += a @ W[:, k0 : k0 + BLOCK_K]^T`` for one MXFP4 slice of rows ``offs_n [BN]`` (``w_ptr`` /
    ``s_ptr`` at the expert; ``K`` a multiple of 32); ``a_even`` / ``a_odd [BM, BK / 2]`` the slice's even / odd
    inputs. The packed bytes load as ``[groups, 16, BN]`` beside one ue8m0 scale per group and row."""
    groups = k0 // MXFP4_GROUP + tl.arange(0, BLOCK_K // MXFP4_GROUP)  # [G]
    in_g = groups < K // MXFP4_GROUP
    pairs = (groups * PACKED_PER_SCALE)[:, None, None] + tl.arange(0, PACKED_PER_SCALE)[None, :, None]  # [G, 16, 1]
    rows = offs_n.to(tl.int64)
    packed = tl.load(w_ptr + rows[None, None, :] * w_stride + pairs, mask=in_g[:, None, None] & n_mask[None, None, :],
                     other=0)  # [G, 16, BN]
    scale = ue8m0(tl.load(s_ptr + rows[None, :] * s_stride + groups[:, None], mask=in_g[:, None] & n_mask[None, :],
                          other=UE8M0_ONE))  # [G, BN]
    even, odd = mxfp4_pair(packed, scale[:, None, :])
    dt = a_even.dtype
    even = tl.reshape(even.to(dt), (BLOCK_K // 2, acc.shape[1]))  # [BK / 2, BN]
    odd = tl.reshape(odd.to(dt), (BLOCK_K // 2, acc.shape[1]))
    acc = tl.dot(a_even, even, acc, input_precision=PRECISION)
    return tl.dot(a_odd, odd, acc, input_precision=PRECISION)


@triton.jit
def mxfp4_dot_scaled(acc, a, w_cols, s_rows, k0, K, n_mask, BLOCK_K: tl.constexpr):
    """``acc [BM, BN] += a @ W[:, k0 : k0 + BLOCK_K]^T`` of bf16 activations ``a [BM, BK]`` (contiguous inputs,
    zeros past ``K``) as one ``tl.dot_scaled``: the packed bytes ``[BK / 2, BN]`` as e2m1 (low nibble first, as
    stored) and the ue8m0 bytes ``[BN, BK / 32]`` as its scales, so the compiler expands the nibbles to bf16 in
    registers (a lookup per byte), applies each scale once per 32 inputs and runs one tensor-core product over
    the slice. ``w_cols [1, BN]`` / ``s_rows [BN, 1]``: pointers to the rows' packed bytes and scales. The
    expanded weights are exactly the reference op's bf16 weights (e2m1 times a power of two fits bf16)."""
    pairs = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # [BK / 2] byte columns
    groups = k0 // MXFP4_GROUP + tl.arange(0, BLOCK_K // MXFP4_GROUP)  # [G]
    packed = tl.load(w_cols + pairs[:, None], mask=(pairs < K // 2)[:, None] & n_mask[None, :], other=0)
    scale = tl.load(s_rows + groups[None, :], mask=n_mask[:, None] & (groups < K // MXFP4_GROUP)[None, :],
                    other=UE8M0_ONE)  # [BN, G]
    return tl.dot_scaled(a, None, "bf16", packed, scale, "e2m1", acc)


@triton.jit
def mxfp4_dot_scaled_swapped(acc_t, a_t, w_rows, s_rows, k0, K, n_mask, BLOCK_K: tl.constexpr):
    """``mxfp4_dot_scaled`` transposed, for few activation rows: ``acc_t [BN, BM] += W[:, slice] @ a_t`` with the
    weights as the left operand (``[BN, BK / 2]`` bytes, their scales ``[BN, BK / 32]``) and ``a_t [BK, BM]`` the
    activations' transpose. On SM90 the expanded weights then feed wgmma from registers (64 weight rows x
    ``BM`` activation rows, no padding of a 16-row tile to 64) and only the small activation tile goes through
    shared memory. ``w_rows`` / ``s_rows``: ``[BN, 1]`` pointers to the rows' packed bytes and scales."""
    pairs = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # [BK / 2]
    groups = k0 // MXFP4_GROUP + tl.arange(0, BLOCK_K // MXFP4_GROUP)  # [G]
    packed = tl.load(w_rows + pairs[None, :], mask=n_mask[:, None] & (pairs < K // 2)[None, :], other=0)
    scale = tl.load(s_rows + groups[None, :], mask=n_mask[:, None] & (groups < K // MXFP4_GROUP)[None, :],
                    other=UE8M0_ONE)  # [BN, G]
    return tl.dot_scaled(packed, scale, "e2m1", a_t, None, "bf16", acc_t)


@triton.jit
def fp8_dot(acc, a, w_ptr, s_ptr, offs_k, offs_n, k0, w_stride, s_stride, mask, n_mask,
             B0: tl.constexpr, B1: tl.constexpr, UE8M0: tl.constexpr, PRECISION: tl.constexpr):
    """``acc += a @ W[:, offs_k]^T`` for one fp8 block slice (``offs_k`` inside one scale block, starting at ``k0``)
    of rows ``offs_n [BN]``; ``a [BM, BK]``."""
    w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * w_stride + offs_k[:, None], mask=mask, other=0.0)
    scale = block_scale(tl.load(s_ptr + (offs_n // B0) * s_stride + k0 // B1, mask=n_mask,
                                other=0), UE8M0)  # [BN]
    if UE8M0:  # e4m3 fits every activation dtype: one conversion per weight, the power of two after the product
        return acc + tl.dot(a, w.to(a.dtype), input_precision=PRECISION) * scale[None, :]
    else:  # float32 scales: the weight times its scale rounded to the activations' dtype first, as the reference
        return tl.dot(a, (w.to(tl.float32) * scale[None, :]).to(a.dtype), acc, input_precision=PRECISION)


@triton.jit
def fp8_dot_swapped(acc_t, a_t, w_rows, s_rows, offs_k, k0, mask, n_mask, B1: tl.constexpr, UE8M0: tl.constexpr,
                    PRECISION: tl.constexpr):
    """``fp8_dot`` transposed, for few activation rows: ``acc_t [BN, BM] += W[:, offs_k] @ a_t`` with the weight
    tile ``[BN, BK]`` as the left operand (on SM90: m64n16 wgmma with it in registers) and ``a_t [BK, BM]`` the
    activations' transpose; ``w_rows`` / ``s_rows``: ``[BN]`` pointers to the rows' weights and block scales."""
    w = tl.load(w_rows[:, None] + offs_k[None, :], mask=mask, other=0.0)  # [BN, BK]
    scale = block_scale(tl.load(s_rows + k0 // B1, mask=n_mask, other=0), UE8M0)  # [BN]
    if UE8M0:
        return acc_t + tl.dot(w.to(a_t.dtype), a_t, input_precision=PRECISION) * scale[:, None]
    else:
        return tl.dot((w.to(tl.float32) * scale[:, None]).to(a_t.dtype), a_t, acc_t, input_precision=PRECISION)


@triton.jit
def row_acc(BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FMT: tl.constexpr, B1: tl.constexpr):
    """The zero fp32 accumulator of ``row_product``: one sum per row and scale group of the slice, ``[BN, BK / 32]``
    (MXFP4) or ``[BN, BK / min(BK, B1)]`` (fp8)."""
    if FMT == 0:  # (if / else: a constexpr branch with a return and code after it would compile both)
        return tl.zeros([BLOCK_N, BLOCK_K // MXFP4_GROUP], dtype=tl.float32)
    else:
        return tl.zeros([BLOCK_N, BLOCK_K // min(BLOCK_K, B1)], dtype=tl.float32)


@triton.jit
def row_total(acc, FMT: tl.constexpr):
    """``row_product``'s accumulator summed per row: ``[BN]``."""
    return tl.sum(acc, axis=1)


@triton.jit
def mxfp4_codes(packed):
    """The e2m1 values (float32, unscaled) of each packed byte: ``(even, odd)``; ``mxfp4_pair``'s bit placement,
    then the exact multiply by 2^126."""
    b = packed.to(tl.uint32)
    even = ((b << 28) & SIGN_BIT) | ((b << 22) & E2M1_BITS)
    odd = ((b << 24) & SIGN_BIT) | ((b << 18) & E2M1_BITS)
    return even.to(tl.float32, bitcast=True) * TWO_126, odd.to(tl.float32, bitcast=True) * TWO_126


@triton.jit
def input_pairs(x_ptr, pairs, mask):
    """Inputs ``2 * pairs`` and ``2 * pairs + 1`` as float32 ``(even, odd)``: bf16 pairs as one 32-bit load each
    (a bf16 is the top half of its float32), other dtypes as two strided loads."""
    if x_ptr.dtype.element_ty == tl.bfloat16:
        words = tl.load(x_ptr.to(tl.pointer_type(tl.uint32)) + pairs, mask=mask, other=0)
        return (words << 16).to(tl.float32, bitcast=True), (words & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        return (tl.load(x_ptr + 2 * pairs, mask=mask, other=0.0).to(tl.float32),
                tl.load(x_ptr + 2 * pairs + 1, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def row_product(acc, x_ptr, w_rows, s_rows, k0, K, in_n, FMT: tl.constexpr, BLOCK_K: tl.constexpr,
                B1: tl.constexpr, UE8M0: tl.constexpr, PTX: tl.constexpr = False):
    """``acc += W[rows, slice] * x[slice]`` (``row_acc``'s shape) of one ``BLOCK_K`` slice from ``k0`` of a one-row
    product (``FMT`` 0: MXFP4, ``K`` a multiple of 32; 1: fp8 blocks, ``BLOCK_K`` inside one block or whole blocks;
    fp32 products);
    ``w_rows`` / ``s_rows``: ``[BN, 1]`` pointers to the rows' weights and scales; ``in_n``: the real rows.

    The weights are the reference op's: where rounding them to ``x``'s dtype is exact (MXFP4 and ue8m0-scaled fp8
    with bf16 activations, anything with fp32 ones) it is skipped, and the scale multiplies the sum of a scale
    group's products, once per group (per 32 inputs for MXFP4 with 16-bit activations; per block for ue8m0 fp8);
    fp32 MXFP4 rows scale every weight: their products may reach fp32's limits, as the extreme-scale tests do.
    ``PTX``: MXFP4 bf16 rows decoded and multiplied by ``mxfp4_row_sums``."""
    dt = x_ptr.dtype.element_ty
    if FMT == 0:
        groups = k0 // MXFP4_GROUP + tl.arange(0, BLOCK_K // MXFP4_GROUP)  # [G]
        in_g = groups < K // MXFP4_GROUP
        pairs = (groups * PACKED_PER_SCALE)[None, :, None] + tl.arange(0, PACKED_PER_SCALE)[None, None, :]  # [1, G, 16]
        packed = tl.load(w_rows[:, :, None] + pairs, mask=in_n[:, None, None] & in_g[None, :, None], other=0,
                         eviction_policy="evict_first")  # [BN, G, 16]
        scale = ue8m0(tl.load(s_rows + groups[None, :], mask=in_n[:, None] & in_g[None, :], other=UE8M0_ONE))
        rows0 = tl.zeros_like(packed).to(tl.int32)  # [BN, G, 16]: the inputs loaded in the weights' layout
        x_even, x_odd = input_pairs(x_ptr, pairs + rows0, in_g[None, :, None] & (rows0 == 0))
        if PTX and dt == tl.bfloat16:  # decode and products by ``mxfp4_row_sums``: every fourth running sum
            quads = tl.reshape(mxfp4_row_sums(packed, x_even, x_odd), (packed.shape[0], packed.shape[1], 4, 2, 2))
            _, last_pair = tl.split(quads)  # [BN, G, 4, 2]
            _, last = tl.split(last_pair)  # [BN, G, 4]: the sums of the group's four words
            return acc + tl.sum(last, axis=2) * scale  # [BN, G]
        else:
            even, odd = mxfp4_codes(packed)
            if dt == tl.float32:
                scale = scale[:, :, None]
                return acc + tl.sum((even * scale) * x_even + (odd * scale) * x_odd, axis=2)
            else:
                return acc + tl.sum(even * x_even + odd * x_odd, axis=2) * scale  # [BN, G]
    else:
        SUB: tl.constexpr = min(BLOCK_K, B1)  # inputs of one scale block in the slice
        starts = k0 + tl.arange(0, BLOCK_K // SUB) * SUB  # [NB] each scale block's first input
        ks = starts[:, None] + tl.arange(0, SUB)[None, :]  # [NB, SUB]
        in_k = ks < K
        w = tl.load(w_rows[:, :, None] + ks[None, :, :], mask=in_n[:, None, None] & in_k[None, :, :], other=0.0,
                    eviction_policy="evict_first")  # [BN, NB, SUB]
        scale = block_scale(tl.load(s_rows + starts[None, :] // B1, mask=in_n[:, None] & (starts < K)[None, :],
                                    other=0), UE8M0)  # [BN, NB]
        xk = tl.load(x_ptr + ks, mask=in_k, other=0.0).to(tl.float32)[None, :, :]  # [1, NB, SUB]
        if UE8M0 and (dt == tl.bfloat16 or dt == tl.float32):  # the power of two after the block's sum
            return acc + tl.sum(w.to(tl.float32) * xk, axis=2) * scale
        else:
            return acc + tl.sum((w.to(tl.float32) * scale[:, :, None]).to(dt).to(tl.float32) * xk, axis=2)


@triton.jit
def _mxfp4_kernel(packed_ptr, scale_ptr, out_ptr, n_bytes, BLOCK: tl.constexpr):
    """Program of ``BLOCK`` packed bytes of a flat ``[rows, cols / 2]`` weight: ``out[2i], out[2i + 1]`` (float32)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n_bytes
    even, odd = mxfp4_pair(tl.load(packed_ptr + i, mask=mask, other=0),
                           ue8m0(tl.load(scale_ptr + i // PACKED_PER_SCALE, mask=mask, other=UE8M0_ONE)))
    tl.store(out_ptr + 2 * i, even, mask=mask)
    tl.store(out_ptr + 2 * i + 1, odd, mask=mask)


@triton.jit
def _fp8_block_kernel(w_ptr, scale_ptr, out_ptr, rows, cols, scale_cols, B0: tl.constexpr, B1: tl.constexpr,
                      UE8M0: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program of a ``[BLOCK_R, BLOCK_C]`` tile of one ``[rows, cols]`` fp8 weight (grid axis 2: the leading index
    of a stacked one): ``out = w * scale[r // B0, c // B1]`` in float32."""
    lead = tl.program_id(2).to(tl.int64)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    at = lead * rows * cols + r[:, None].to(tl.int64) * cols + c[None, :]  # [BR, BC]
    s_rows = (rows + B0 - 1) // B0
    s_at = lead * s_rows * scale_cols + (r // B0)[:, None] * scale_cols + (c // B1)[None, :]
    s = block_scale(tl.load(scale_ptr + s_at, mask=mask, other=UE8M0_ONE if UE8M0 else 1.0), UE8M0)
    tl.store(out_ptr + at, tl.load(w_ptr + at, mask=mask, other=0.0).to(tl.float32) * s, mask=mask)


DEQUANT_BLOCK = 1024


def scale_operand(scale: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A block scale as a kernel reads it: ue8m0 as its bytes (``uint8``), float32 as it is; and whether ue8m0."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8), True
    if scale.dtype != torch.float32:
        raise TypeError(f"fp8 block scale of dtype {scale.dtype}: expected float8_e8m0fnu or float32")
    return scale, False


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The exact float32 weight ``[..., out, in]`` of ``packed [..., out, in / 2]`` (uint8 / int8) and ``scale
    [..., out, in / 32]`` (ue8m0), decoded by the kernels' own helpers (``mxfp4.dequantize`` on the device)."""
    packed, scale = packed.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8)
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.float32, device=packed.device)
    n = packed.numel()
    if n:
        _mxfp4_kernel[(triton.cdiv(n, DEQUANT_BLOCK),)](packed, scale, out, n, BLOCK=DEQUANT_BLOCK)
    return out


def dequantize_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The exact float32 weight ``[..., out, in]`` of an fp8 block weight (``fp8_block.dequantize`` on the
    device)."""
    weight = weight.contiguous()
    raw, is_ue8m0 = scale_operand(scale.contiguous())
    rows, cols = weight.shape[-2:]
    lead = weight.numel() // max(rows * cols, 1)
    out = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    if weight.numel():
        grid = (triton.cdiv(rows, 32), triton.cdiv(cols, 64), lead)
        _fp8_block_kernel[grid](weight, raw, out, rows, cols, raw.shape[-1], B0=block[0], B1=block[1],
                                UE8M0=is_ue8m0, BLOCK_R=32, BLOCK_C=64)
    return out

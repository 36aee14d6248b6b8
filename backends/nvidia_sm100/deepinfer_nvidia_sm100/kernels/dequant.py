"""Quantized weights decoded in registers: MXFP4 (two e2m1 codes a byte, one ue8m0 scale per 32 inputs) and fp8
e4m3 block weights (one ue8m0 or float32 scale per ``B0 x B1`` block).

The ``@triton.jit`` helpers turn stored bytes into float32 values inside a kernel, bit for bit what
``deepinfer_core.quant.mxfp4.dequantize`` / ``fp8_block.dequantize`` compute on the host: a ue8m0 byte ``b`` is the
float32 whose exponent field is ``b`` (``2^(b - 127)``; byte 0 is the subnormal ``2^-127``, byte 255 NaN), an e2m1
code is built from its exponent and mantissa bits (codes 0-7: 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign), and the
value is code x scale, one exact float32 product. The kernels of ``moe_quant.py`` and ``fp8_linear.py`` use them on
weight tiles; ``dequantize_mxfp4`` / ``dequantize_fp8_block`` run them over a whole tensor (a dense weight on the
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


@triton.jit
def ue8m0(byte):
    """float32 ``2^(byte - 127)`` of ue8m0 bytes (any integer tensor holding 0-255): the byte as the exponent field;
    byte 0 sets the mantissa's top bit instead (the subnormal ``2^-127``), byte 255 too (NaN)."""
    b = byte.to(tl.int32) & 0xFF
    special = (b == 0) | (b == 255)
    return ((b << 23) | tl.where(special, 0x400000, 0)).to(tl.float32, bitcast=True)


@triton.jit
def e2m1(code):
    """float32 value of e2m1 codes (integer tensor, 0-15): magnitude from exponent ``e`` (bits 1-2) and mantissa
    ``m`` (bit 0), ``m / 2`` when ``e`` is 0 else ``2^(e - 1) (1 + m / 2)``; bit 3 is the sign (code 8 is -0.0)."""
    c = code.to(tl.int32)
    e = (c >> 1) & 3
    m = c & 1
    bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return (bits | ((c >> 3) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_pair(packed, scale):
    """The two float32 weights of each packed byte (low nibble: the even input, high nibble: the odd one), times
    the byte's ue8m0 ``scale`` (same shape): ``(even, odd)``."""
    b = packed.to(tl.int32) & 0xFF
    s = ue8m0(scale)
    return e2m1(b & 15) * s, e2m1(b >> 4) * s


@triton.jit
def block_scale(raw, UE8M0: tl.constexpr):
    """A block scale as float32: ue8m0 bytes decoded, float32 scales as loaded."""
    if UE8M0:
        return ue8m0(raw)
    return raw.to(tl.float32)


@triton.jit
def mxfp4_dot(acc, a_even, a_odd, w_ptr, s_ptr, pairs, offs_n, w_stride, s_stride, mask, PRECISION: tl.constexpr):
    """``acc += a @ W[:, slice]^T`` for one MXFP4 slice: ``pairs [BK / 2]`` byte columns of rows ``offs_n [BN]``
    (``w_ptr`` / ``s_ptr`` at the expert), ``a_even`` / ``a_odd [BM, BK / 2]`` the slice's even / odd inputs."""
    packed = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * w_stride + pairs[:, None], mask=mask, other=0)
    scale = tl.load(s_ptr + offs_n[None, :].to(tl.int64) * s_stride + (pairs // PACKED_PER_SCALE)[:, None],
                    mask=mask, other=UE8M0_ONE)  # [BK / 2, BN]
    even, odd = mxfp4_pair(packed, scale)
    dt = a_even.dtype
    acc = tl.dot(a_even, even.to(dt), acc, input_precision=PRECISION)
    return tl.dot(a_odd, odd.to(dt), acc, input_precision=PRECISION)


@triton.jit
def fp8_dot(acc, a, w_ptr, s_ptr, offs_k, offs_n, k0, w_stride, s_stride, mask, n_mask,
             B0: tl.constexpr, B1: tl.constexpr, UE8M0: tl.constexpr, PRECISION: tl.constexpr):
    """``acc += a @ W[:, offs_k]^T`` for one fp8 block slice (``offs_k`` inside one scale block, starting at ``k0``)
    of rows ``offs_n [BN]``; ``a [BM, BK]``."""
    w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * w_stride + offs_k[:, None], mask=mask, other=0.0)
    scale = block_scale(tl.load(s_ptr + (offs_n // B0) * s_stride + k0 // B1, mask=n_mask,
                                other=0), UE8M0)  # [BN]
    return tl.dot(a, (w.to(tl.float32) * scale[None, :]).to(a.dtype), acc, input_precision=PRECISION)


@triton.jit
def row_product(acc, x_ptr, w_rows, s_rows, k0, K, in_n, FMT: tl.constexpr, BLOCK_K: tl.constexpr,
                B1: tl.constexpr, UE8M0: tl.constexpr):
    """``acc [BN, BK / 2 or BK] += W[rows, slice] * x[slice]`` of one ``BLOCK_K`` slice from ``k0`` of a one-row
    product (``FMT`` 0: MXFP4, 1: fp8 blocks; fp32 products, the weight rounded to ``x``'s dtype first);
    ``w_rows`` / ``s_rows``: ``[BN, 1]`` pointers to the rows' weights and scales; ``in_n``: the real rows."""
    dt = x_ptr.dtype.element_ty
    if FMT == 0:
        pairs = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # [BK / 2]
        in_k = pairs < K // 2
        mask = in_n[:, None] & in_k[None, :]
        even, odd = mxfp4_pair(tl.load(w_rows + pairs[None, :], mask=mask, other=0, eviction_policy="evict_first"),
                               tl.load(s_rows + (pairs // PACKED_PER_SCALE)[None, :], mask=mask, other=UE8M0_ONE))
        x_even = tl.load(x_ptr + 2 * pairs, mask=in_k, other=0.0).to(tl.float32)[None, :]
        x_odd = tl.load(x_ptr + 2 * pairs + 1, mask=in_k, other=0.0).to(tl.float32)[None, :]
        return acc + even.to(dt).to(tl.float32) * x_even + odd.to(dt).to(tl.float32) * x_odd
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = ks < K
        w = tl.load(w_rows + ks[None, :], mask=in_n[:, None] & in_k[None, :], other=0.0,
                    eviction_policy="evict_first")
        scale = block_scale(tl.load(s_rows + k0 // B1, mask=in_n[:, None], other=0),
                            UE8M0)  # [BN, 1]
        xk = tl.load(x_ptr + ks, mask=in_k, other=0.0).to(tl.float32)[None, :]
        return acc + (w.to(tl.float32) * scale).to(dt).to(tl.float32) * xk


@triton.jit
def _mxfp4_kernel(packed_ptr, scale_ptr, out_ptr, n_bytes, BLOCK: tl.constexpr):
    """Program of ``BLOCK`` packed bytes of a flat ``[rows, cols / 2]`` weight: ``out[2i], out[2i + 1]`` (float32)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n_bytes
    even, odd = mxfp4_pair(tl.load(packed_ptr + i, mask=mask, other=0),
                           tl.load(scale_ptr + i // PACKED_PER_SCALE, mask=mask, other=UE8M0_ONE))
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

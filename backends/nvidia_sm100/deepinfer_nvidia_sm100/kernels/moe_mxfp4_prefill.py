"""MXFP4 routed experts at prefill sizes on fp8 tensor cores: each layer's packed experts become e4m3 rows with one
float32 scale per row for the call, the activations e4m3 with one scale per row, and CUTLASS's fp8 grouped GEMM
(``torch._scaled_grouped_mm``, SM90 / SM100) multiplies them.

Why: SM90 has no block-scaled MMA, so ``moe_mxfp4_decode`` expands every code to bf16 and runs bf16 products; at
prefill sizes the products set the pace and that path cannot pass the bf16 experts. fp8 products run at twice the
bf16 rate; converting a layer's experts (read the packed bytes once, write e4m3 at twice their size) costs less
than the products save from a few hundred assignments per expert on (``used``; ``benchmarks/bench_quant.py`` times
both).

Weights (``to_e4m3_rows``): code ``c`` of a 32-input group with scale byte ``s`` is ``c 2^(s - 127)``; with the row's
largest byte ``m`` it is stored as the e4m3 ``c 2^(s - m + SHIFT)`` and the row's scale is ``2^(m - 127 - SHIFT)``.
``SHIFT`` 6 keeps the largest code (6 x 64 = 384) under e4m3's 448, and every code of a group within 14 binades of
the row's largest is exact in e4m3 (the smallest, 0.5 x 2^-8, is a multiple of e4m3's subnormal step 2^-9); groups
further down round to the nearest e4m3 value (``exact_rows`` counts the rows where that happens).

Activations: each row as e4m3 times ``amax / 448`` (``fp8_linear.quantize_activations`` with one block a row),
gathered into the grouped layout (``moe.align``), and the SwiGLU output the same way (``_swiglu_quantize_kernel``:
the bf16 rounding of the reference op, then the row's quantization). Both quantizations are errors against the
reference op: docs/quantization.md records them. Rounding of the outputs and the combine are ``moe``'s.

Memory: the converted experts live for the call (``EXPERT_CHUNK`` experts at a time: 1.6 GB for 64 of V4-Flash's);
with more experts than that, the rows of each chunk are read from the offsets on the host (one synchronisation a
call, never while a CUDA graph is captured: ``used`` says no then).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100 import envs
from deepinfer_nvidia_sm100.kernels import dequant, fp8_linear, moe, pdl

SHIFT_BINADES = 6  # binades between a row's largest group scale and its e4m3 values' scale
SHIFT: tl.constexpr = tl.constexpr(SHIFT_BINADES)
ROW_SCALE_STEP: tl.constexpr = tl.constexpr(2.0 ** -SHIFT_BINADES)  # the row scale per unit of its largest group's
EXPERT_CHUNK = 64  # experts converted at a time
CONVERT_ROWS = 8  # weight rows a program of _e4m3_rows_kernel converts
CONVERT_GROUPS = 64  # 32-input groups of those rows it converts per step


def available(x: torch.Tensor) -> bool:
    """Whether torch has the fp8 grouped GEMM for ``x``'s device: a CUDA tensor on SM90 or SM100 (its CUTLASS
    kernels), torch with ``_scaled_grouped_mm``, not Triton's interpreter."""
    return (x.is_cuda and hasattr(torch, "_scaled_grouped_mm") and not pdl._interpreted()
            and torch.cuda.get_device_capability(x.device)[0] in (9, 10))


def used(num_assign: int, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the MXFP4 op takes this path: bf16 activations, at least
    ``DEEPINFER_NVIDIA_MXFP4_FP8_MIN_PER_EXPERT`` assignments per expert on average (0: never), widths multiples
    of 32, and with more than ``EXPERT_CHUNK`` experts not while a CUDA graph is captured."""
    bound = envs.DEEPINFER_NVIDIA_MXFP4_FP8_MIN_PER_EXPERT
    experts, inter, dim = w1.shape[0], w1.shape[1], w2.shape[1]
    return (bound > 0 and x.dtype == torch.bfloat16 and num_assign >= bound * experts and inter % 32 == 0
            and dim % 32 == 0 and available(x)
            and (experts <= EXPERT_CHUNK or not torch.cuda.is_current_stream_capturing()))


@triton.jit
def _e4m3_rows_kernel(w_ptr, s_ptr, q_ptr, qs_ptr, N, K, row0, stride_we, stride_wn, stride_se, stride_sn,
                      stride_qe, stride_qn, stride_qse, GROUPS_P2: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_G: tl.constexpr, ROUND: tl.constexpr):
    """Program (block of ``BLOCK_R`` rows, expert ``e``): packed rows ``w[e, rows] [K / 2]`` with their ue8m0
    bytes ``s[e, rows] [K / 32]`` written as e4m3 ``q[e, row0 + rows] [K]`` and float32 ``qs[e, row0 + rows]``,
    ``w = q * qs`` (exact within the module docstring's 14 binades). ``BLOCK_G`` scale groups a step: 16-byte
    loads of a group's packed bytes, the even and odd codes interleaved back into input order; the conversion to
    e4m3 rounds to nearest, ties to even, in hardware (``ROUND``: by ``fp8_linear.round_to_e4m3`` first, for
    Triton's interpreter)."""
    e = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [R]
    in_r = rows < N
    groups = K // 32
    g_all = tl.arange(0, GROUPS_P2)
    s_rows = s_ptr + e * stride_se + rows[:, None].to(tl.int64) * stride_sn  # [R, 1]
    top = tl.max(tl.load(s_rows + g_all[None, :], mask=in_r[:, None] & (g_all < groups)[None, :],
                         other=0).to(tl.int32) & 0xFF, axis=1)  # [R] each row's largest scale byte
    tl.store(qs_ptr + e * stride_qse + row0 + rows, dequant.ue8m0(top) * ROW_SCALE_STEP, mask=in_r)
    w_rows = w_ptr + e * stride_we + rows[:, None, None].to(tl.int64) * stride_wn  # [R, 1, 1]
    q_rows = q_ptr + e * stride_qe + (row0 + rows)[:, None, None].to(tl.int64) * stride_qn  # [R, 1, 1]
    for g0 in range(0, groups, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)  # [G]
        in_g = in_r[:, None] & (g < groups)[None, :]  # [R, G]
        mask = in_g[:, :, None]  # [R, G, 1]
        packed = tl.load(w_rows + (g * 16)[None, :, None] + tl.arange(0, 16)[None, None, :], mask=mask,
                         other=0)  # [R, G, 16]
        byte = tl.load(s_rows + g[None, :], mask=in_g, other=0).to(tl.int32) & 0xFF  # [R, G]
        binades = tl.maximum(byte - top[:, None] + SHIFT + 127, 1)  # biased exponent of 2^(s - top + SHIFT)
        step = (binades << 23).to(tl.float32, bitcast=True)[:, :, None]  # [R, G, 1]
        even, odd = dequant.mxfp4_codes(packed)  # [R, G, 16] each: the e2m1 values
        even, odd = even * step, odd * step  # exact: a power of two times each code
        if ROUND:
            even, odd = fp8_linear.round_to_e4m3(even), fp8_linear.round_to_e4m3(odd)
        codes = tl.reshape(tl.join(even, odd), (BLOCK_R, BLOCK_G, 32))  # [R, G, 32] in input order
        cols = (g * 32)[None, :, None] + tl.arange(0, 32)[None, None, :]  # [1, G, 32]
        tl.store(q_rows + cols, codes.to(tl.float8e4nv), mask=mask)


def to_e4m3_rows(*parts: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed MXFP4 weights ``(w [E, N_i, K / 2], s [E, N_i, K / 32])``, stacked along the rows in the given order,
    as e4m3 ``[E, sum N_i, K]`` and float32 row scales ``[E, sum N_i]`` (the module docstring's conversion)."""
    experts, packed_k = parts[0][0].shape[0], parts[0][0].shape[2]
    total = sum(w.shape[1] for w, _ in parts)
    device = parts[0][0].device
    q = torch.empty(experts, total, 2 * packed_k, dtype=torch.float8_e4m3fn, device=device)
    qs = torch.empty(experts, total, dtype=torch.float32, device=device)
    row0 = 0
    for w, s in parts:
        w, s = w.view(torch.uint8), s.view(torch.uint8)
        rows = w.shape[1]
        _e4m3_rows_kernel[(triton.cdiv(rows, CONVERT_ROWS), experts)](
            w, s, q, qs, rows, 2 * packed_k, row0, w.stride(0), w.stride(1), s.stride(0), s.stride(1), q.stride(0),
            q.stride(1), qs.stride(0), GROUPS_P2=triton.next_power_of_2(s.shape[2]), BLOCK_R=CONVERT_ROWS,
            BLOCK_G=CONVERT_GROUPS, ROUND=pdl._interpreted(), num_warps=4)
        row0 += rows
    return q, qs


def exact_rows(s: torch.Tensor) -> torch.Tensor:
    """Per row of ``s [..., K / 32]`` (ue8m0 bytes), whether ``to_e4m3_rows`` keeps all its codes exact: every
    group's byte within 14 of the row's largest (a bound: a group further down may still hold only codes that
    round to themselves)."""
    b = s.view(torch.uint8).to(torch.int16)
    return (b.amax(-1) - b.amin(-1)) <= 8 + SHIFT_BINADES


@triton.jit
def _swiglu_quantize_kernel(gu_ptr, q_ptr, s_ptr, I, limit, stride_gu, stride_q, BLOCK: tl.constexpr):
    """Program (row): ``h = swiglu(gate, up)`` of the row's ``gate = gu[:I]`` and ``up = gu[I:2I]`` rounded to
    ``gu``'s dtype as ``moe.swiglu`` rounds it, then as e4m3 ``q`` with one float32 scale ``s`` (``amax / 448``)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + I + cols, mask=mask, other=0.0).to(tl.float32)
    dt = gu_ptr.dtype.element_ty
    h = moe._swiglu(gate, up, limit, dt).to(dt).to(tl.float32)
    q, scale = fp8_linear.e4m3_scaled(h[None, :])  # [1, BLOCK], [1]
    tl.store(q_ptr + row * stride_q + cols[None, :], q.to(tl.float8e4nv), mask=mask[None, :])
    tl.store(s_ptr + row + tl.arange(0, 1), scale)


def swiglu_quantized(gate_up: torch.Tensor, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up [P, 2I]`` (gate columns, then up) -> the SwiGLU rows as e4m3 ``[P, I]`` and float32 scales
    ``[P]``."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    q = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=gate_up.device)
    s = torch.empty(rows, dtype=torch.float32, device=gate_up.device)
    if rows:
        _swiglu_quantize_kernel[(rows,)](gate_up, q, s, inter, float(limit), gate_up.stride(0), q.stride(0),
                                         BLOCK=triton.next_power_of_2(inter), num_warps=4)
    return q, s


def quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` as e4m3 ``[T, K]`` and one float32 scale per row ``[T]``."""
    q, s = fp8_linear.quantize_activations(x[:, None], triton.next_power_of_2(x.shape[1]))
    return q[:, 0], s.view(-1)


def _chunks(offsets: torch.Tensor, experts: int, rows: int) -> list[tuple[int, int, int, int]]:
    """``(first expert, end expert, first row, end row)`` of each run of ``EXPERT_CHUNK`` experts over ``rows``
    grouped rows: one chunk of all rows, without reading the offsets, when the experts fit in one."""
    if experts <= EXPERT_CHUNK:
        return [(0, experts, 0, rows)]
    ends = offsets.tolist()  # the one host synchronisation
    return [(e0, min(e0 + EXPERT_CHUNK, experts), ends[e0 - 1] if e0 else 0, ends[min(e0 + EXPERT_CHUNK, experts) - 1])
            for e0 in range(0, experts, EXPERT_CHUNK)]


def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor,
        w2: torch.Tensor, s2: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor, limit: float) -> torch.Tensor:
    """``reference.moe_experts_mxfp4`` on fp8 tensor cores (``used`` says when): packed ``w1`` / ``w3 [E, I, D /
    2]``, ``w2 [E, D, I / 2]`` with their ue8m0 bytes; ``x [T, D]`` bf16."""
    experts = w1.shape[0]
    tokens, offsets, dest = moe.grouped_rows(ids, experts, moe.GROUP_ALIGN)  # [P], [E], [T * top_k]
    xq, xs = quantized_rows(x.contiguous())  # [T, D], [T]
    xq, xs = xq.index_select(0, tokens), xs.index_select(0, tokens)  # [P, D], [P]
    chunks = _chunks(offsets, experts, xq.shape[0])
    y = None if len(chunks) == 1 else torch.empty(xq.shape[0], x.shape[1], dtype=x.dtype, device=x.device)  # [P, D]
    for e0, e1, r0, r1 in chunks:
        ends = offsets[e0:e1] - r0  # [chunk]
        w13, s13 = to_e4m3_rows((w1[e0:e1], s1[e0:e1]), (w3[e0:e1], s3[e0:e1]))  # [chunk, 2I, D], [chunk, 2I]
        gate_up = torch._scaled_grouped_mm(xq[r0:r1], w13.transpose(1, 2), xs[r0:r1], s13, offs=ends,
                                           out_dtype=x.dtype)  # [rows, 2I]
        del w13
        hq, hs = swiglu_quantized(gate_up, limit)  # [rows, I], [rows]
        del gate_up
        w2q, s2q = to_e4m3_rows((w2[e0:e1], s2[e0:e1]))  # [chunk, D, I], [chunk, D]
        down = torch._scaled_grouped_mm(hq, w2q.transpose(1, 2), hs, s2q, offs=ends, out_dtype=x.dtype)  # [rows, D]
        if y is None:
            y = down
        else:
            y[r0:r1] = down
    return moe._combine(y, ids, dest, x, weights)

"""Op ``compressor_entries`` in two Triton launches: every window's slots pooled in one pass (gathered from this
step's rows or the carry, gated by a softmax over slots per channel), then the RMS norm kernel (``kernels/norm.py``).

The reference gathers each window into ``[N, slots, d]`` kv and gate tensors, then pools them: costly at decode,
where the heavily compressed layers pool 128 slots per window and a static decode step pools a window for every
sequence. Here each slot row is read once, the softmax runs online in fp32 (no intermediate rounding: within a
step of the dtype of the reference, which rounds the weights and the products), and nothing is written but the
pooled rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.ops import reference as ref
from deepinfer_nvidia_sm100.kernels import norm, pdl
from deepinfer_nvidia_sm100.kernels.compiled import opaque_under_compile

BLOCK_D = 128  # output channels per program
MAX_BLOCK_S = 16  # window slots per loop iteration
FEW_WINDOWS = 64  # below this many windows: narrower channel blocks, a whole window's slots per iteration
FEW_BLOCK_D, FEW_MAX_BLOCK_S = 32, 128


@triton.jit
def _pool_windows_kernel(raw_kv_ptr, raw_gate_ptr, carry_kv_ptr, carry_gate_ptr, from_new_ptr, new_rows_ptr,
                         carry_slots_ptr, carry_index_ptr, valid_ptr, ape_ptr, out_ptr,
                         span, d, ratio, width, raw_kv_stride, raw_gate_stride, carry_slot_stride, carry_row_stride,
                         slots_window_stride, slots_slot_stride,
                         OVERLAP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                         SPAN_P2: tl.constexpr, PDL: tl.constexpr = False):
    """Window ``program_id(0)``, channels ``[program_id(1) * BLOCK_D, +BLOCK_D)`` of ``out [N, d]``: slot ``j`` is
    row ``new_rows[n, j]`` of ``raw_kv`` / ``raw_gate [T, width]`` where ``from_new``, else the carry's
    ``[carry_slots, carry_index]`` (``carry_slots`` read through its strides: the model broadcasts one slot along a
    window); ``OVERLAP`` (CSA): slots ``>= ratio`` read the upper ``d`` channels. The gate gets
    ``ape [ratio, width]`` (rounded to the input dtype, as the reference adds it); slots not ``valid`` are skipped, and
    the slot loop starts at the block of the first valid slot (a static decode step's dummy windows pool their last
    slot only)."""
    pdl.begin(PDL)
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD] output channels
    c_ok = c < d
    dtype: tl.constexpr = raw_kv_ptr.dtype.element_ty
    m = tl.full([BLOCK_D], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    every = tl.arange(0, SPAN_P2)
    marks = tl.load(valid_ptr + n * span + every, mask=every < span, other=0)
    first = tl.min(tl.where(marks != 0, every, span), axis=0)  # span when no slot is valid
    for s0 in range((first // BLOCK_S) * BLOCK_S, span, BLOCK_S):
        j = s0 + tl.arange(0, BLOCK_S)  # [BS] slots
        plan = n * span + j
        j_ok = j < span
        ok = (tl.load(valid_ptr + plan, mask=j_ok, other=0) != 0) & j_ok
        fresh = (tl.load(from_new_ptr + plan, mask=j_ok, other=0) != 0)[:, None]  # [BS, 1]
        rows = tl.load(new_rows_ptr + plan, mask=j_ok, other=0).to(tl.int64)[:, None]
        slot = tl.load(carry_slots_ptr + n * slots_window_stride + j * slots_slot_stride, mask=j_ok,
                       other=0).to(tl.int64)[:, None]
        index = tl.load(carry_index_ptr + plan, mask=j_ok, other=0).to(tl.int64)[:, None]
        col = c[None, :]  # [1, BD] channel of the input width
        if OVERLAP:
            col = col + tl.where(j[:, None] >= ratio, d, 0)
        live = ok[:, None] & c_ok[None, :]  # [BS, BD]
        carried = slot * carry_slot_stride + index * carry_row_stride + col
        kv = tl.where(fresh, tl.load(raw_kv_ptr + rows * raw_kv_stride + col, mask=live & fresh, other=0.0),
                      tl.load(carry_kv_ptr + carried, mask=live & ~fresh, other=0.0).to(dtype)).to(tl.float32)
        gate = tl.where(fresh, tl.load(raw_gate_ptr + rows * raw_gate_stride + col, mask=live & fresh, other=0.0),
                        tl.load(carry_gate_ptr + carried, mask=live & ~fresh, other=0.0).to(dtype)).to(tl.float32)
        ape = tl.load(ape_ptr + (j % ratio)[:, None] * width + col, mask=live, other=0.0).to(dtype).to(tl.float32)
        gate = tl.where(live, (gate + ape).to(dtype).to(tl.float32), float("-inf"))
        top = tl.maximum(m, tl.max(gate, axis=0))  # [BD]
        shift = tl.where(top == float("-inf"), 0.0, top)
        scale = tl.exp(m - shift)
        weight = tl.exp(gate - shift[None, :])  # [BS, BD]
        den = den * scale + tl.sum(weight, axis=0)
        acc = acc * scale + tl.sum(weight * tl.where(live, kv, 0.0), axis=0)
        m = top
    pooled = tl.where(den > 0, acc / den, 0.0)
    tl.store(out_ptr + n * d + c, pooled.to(out_ptr.dtype.element_ty), mask=c_ok)


def _pooled_shape(raw_kv, raw_gate, carry_kv, carry_gate, from_new, new_rows, carry_slots, carry_index, valid, ape,
                  ratio, overlap):
    width = raw_kv.shape[-1]
    return raw_kv.new_empty(from_new.shape[0], width // 2 if overlap else width)


@opaque_under_compile("compressor_pool_windows", _pooled_shape)
def pool_windows(raw_kv: torch.Tensor, raw_gate: torch.Tensor, carry_kv: torch.Tensor, carry_gate: torch.Tensor,
                 from_new: torch.Tensor, new_rows: torch.Tensor, carry_slots: torch.Tensor, carry_index: torch.Tensor,
                 valid: torch.Tensor, ape: torch.Tensor, ratio: int, overlap: bool) -> torch.Tensor:
    """The pooled windows ``[N, d]`` before the norm (``reference.compressor_entries`` without its RMS norm)."""
    N = from_new.shape[0]
    return launch_pool(raw_kv, raw_gate, carry_kv, carry_gate, from_new, new_rows, carry_slots, carry_index, valid, ape,
                       ratio, overlap, few=N < FEW_WINDOWS)  # few, e.g. a batch-1 decode step: more, shorter programs


def launch_pool(raw_kv, raw_gate, carry_kv, carry_gate, from_new, new_rows, carry_slots, carry_index, valid, ape,
                ratio: int, overlap: bool, few: bool) -> torch.Tensor:
    """``pool_windows`` with the launch for ``few`` windows or for many, whatever the number of windows: a window's
    slots are then summed in blocks of one size (``invariant.py``: the batch-invariant mode always takes many)."""
    N, span = from_new.shape
    width = raw_kv.shape[-1]
    d = width // 2 if overlap else width
    out = torch.empty(N, d, device=raw_kv.device, dtype=raw_kv.dtype)
    if N == 0:
        return out
    raw_kv, raw_gate = _rows_contiguous(raw_kv), _rows_contiguous(raw_gate)
    if carry_kv.stride(-1) != 1 or carry_gate.stride() != carry_kv.stride():  # the kernel reads both with one stride
        carry_kv, carry_gate = carry_kv.contiguous(), carry_gate.contiguous()  # (the model's halves of one carry do)
    block_d = FEW_BLOCK_D if few else BLOCK_D
    block_s = min(FEW_MAX_BLOCK_S if few else MAX_BLOCK_S, triton.next_power_of_2(span))
    _pool_windows_kernel[(N, triton.cdiv(d, block_d))](
        raw_kv, raw_gate, carry_kv, carry_gate, from_new.contiguous().view(torch.uint8), new_rows.contiguous(),
        carry_slots, carry_index.contiguous(), valid.contiguous().view(torch.uint8), ape.contiguous(),
        out, span, d, ratio, width, raw_kv.stride(0), raw_gate.stride(0), carry_kv.stride(0), carry_kv.stride(1),
        carry_slots.stride(0), carry_slots.stride(1),  # a window's slot, usually broadcast along it: no copy
        OVERLAP=overlap, BLOCK_S=block_s, BLOCK_D=block_d, SPAN_P2=triton.next_power_of_2(span), num_warps=4,
        **pdl.launch())
    return out


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x [T, width]`` with unit channel stride (the model's column blocks of a fused projection already are)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def compressor_entries(raw_kv: torch.Tensor, raw_gate: torch.Tensor, carry_kv: torch.Tensor, carry_gate: torch.Tensor,
                       from_new: torch.Tensor, new_rows: torch.Tensor, carry_slots: torch.Tensor,
                       carry_index: torch.Tensor, valid: torch.Tensor, ape: torch.Tensor, norm_weight: torch.Tensor,
                       eps: float, ratio: int, overlap: bool) -> torch.Tensor:
    """``reference.compressor_entries``: ``pool_windows``, then the RMS norm (the Triton kernel unless
    ``DEEPINFER_NVIDIA_NORM=0``)."""
    pooled = pool_windows(raw_kv, raw_gate, carry_kv, carry_gate, from_new, new_rows, carry_slots, carry_index, valid,
                          ape, ratio, overlap)  # [N, d]
    return (norm.rms_norm if norm.enabled() else ref.rms_norm)(pooled, norm_weight, eps)


def compressor_entries_rope(raw_kv: torch.Tensor, raw_gate: torch.Tensor, carry_kv: torch.Tensor,
                            carry_gate: torch.Tensor, from_new: torch.Tensor, new_rows: torch.Tensor,
                            carry_slots: torch.Tensor, carry_index: torch.Tensor, valid: torch.Tensor,
                            ape: torch.Tensor, norm_weight: torch.Tensor, eps: float, ratio: int, overlap: bool,
                            cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``reference.compressor_entries_rope``: ``pool_windows``, then the norm and RoPE in one pass
    (``norm.rms_norm_rope``; two launches instead of three). In the op table with the norm kernels (with
    ``DEEPINFER_NVIDIA_NORM=0`` the table derives it from ``compressor_entries`` and ``apply_rope_``)."""
    pooled = pool_windows(raw_kv, raw_gate, carry_kv, carry_gate, from_new, new_rows, carry_slots, carry_index, valid,
                          ape, ratio, overlap)  # [N, d]
    return norm.rms_norm_rope(pooled, norm_weight, eps, cos, sin)

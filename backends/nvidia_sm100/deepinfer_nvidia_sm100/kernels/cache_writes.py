"""Op ``write_rows_`` (the cache writes: the sliding ring, the compressed stores, the compressor carries) as one
Triton kernel: each program copies ``BLOCK_M`` source rows to their ``[slot, index]`` places, cast on the way.

The reference gathers the source rows into a new tensor, then ``index_put``s it: two launches per write, 26 more
per decode step of the bench preset than this one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.ops import reference as ref
from deepinfer_nvidia_sm100.kernels import pdl
from deepinfer_nvidia_sm100.kernels.compiled import opaque_under_compile

BLOCK_M = 4  # rows per program


@triton.jit
def _write_rows_kernel(dst_ptr, slots_ptr, index_ptr, src_ptr, rows_ptr, M, width, dst_slot_stride, dst_index_stride,
                       src_stride, HAS_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Writes ``[program_id(0) * BLOCK_M, +BLOCK_M)``: ``dst[slots[m], index[m], :] = src[rows[m] or m, :]``."""
    pdl.begin(PDL)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    live = m < M
    row = tl.load(rows_ptr + m, mask=live, other=0) if HAS_ROWS else m
    place = (tl.load(slots_ptr + m, mask=live, other=0).to(tl.int64) * dst_slot_stride
             + tl.load(index_ptr + m, mask=live, other=0).to(tl.int64) * dst_index_stride)  # [BM]
    w = tl.arange(0, BLOCK_W)
    for start in range(0, width, BLOCK_W):
        cols = start + w
        mask = live[:, None] & (cols < width)[None, :]
        values = tl.load(src_ptr + row.to(tl.int64)[:, None] * src_stride + cols[None, :], mask=mask)
        tl.store(dst_ptr + place[:, None] + cols[None, :], values.to(dst_ptr.dtype.element_ty), mask=mask)


def write_rows_(dst: torch.Tensor, slots: torch.Tensor, index: torch.Tensor, src: torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:
    """``reference.write_rows_`` in one launch (rows with unit channel stride; otherwise the reference)."""
    if dst.stride(-1) != 1 or src.stride(-1) != 1 or dst.dim() != 3 or src.dim() != 2:
        return ref.write_rows_(dst, slots, index, src, rows)
    _write(dst, slots, index, src, rows)
    return dst


@opaque_under_compile("write_rows_", lambda dst, slots, index, src, rows: None, mutates_args=("dst",))
def _write(dst: torch.Tensor, slots: torch.Tensor, index: torch.Tensor, src: torch.Tensor,
           rows: torch.Tensor | None) -> None:
    M, width = slots.shape[0], src.shape[1]
    if M == 0:
        return
    _write_rows_kernel[(triton.cdiv(M, BLOCK_M),)](
        dst, slots.contiguous(), index.contiguous(), src, slots if rows is None else rows.contiguous(), M, width,
        dst.stride(0), dst.stride(1), src.stride(0), HAS_ROWS=rows is not None, BLOCK_M=BLOCK_M,
        BLOCK_W=min(1024, triton.next_power_of_2(width)), num_warps=4, **pdl.launch())

"""Op ``gather_keys`` as one Triton kernel: the attention's keys ``[S, Lw + E, d]`` written in one pass.

The reference gathers the ring (an ``index`` kernel that moves two bytes per thread), gathers this step's rows,
merges them with ``torch.where``, gathers the compressed entries and concatenates: five kernels and three full
copies of the keys, a large share of a batch-256 decode step.
Here each program copies ``BLOCK_K`` whole key rows from wherever they live (ring slot, step row or store block)
into the output, so every key is read once and written once, in contiguous rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.ops import reference as ref
from deepinfer_nvidia_sm100.kernels import pdl
from deepinfer_nvidia_sm100.kernels.compiled import opaque_under_compile

BLOCK_K = 8  # key rows per program


@triton.jit
def _gather_keys_kernel(ring_ptr, ring_slots_ptr, ring_index_ptr, new_ptr, new_rows_ptr, from_new_ptr,
                        store_ptr, blocks_ptr, rows_ptr, out_ptr, LW, E, D,
                        s_ring0, s_ring1, s_new, s_store0, s_store1, s_slots0, s_slots1, s_index0, s_index1,
                        s_rows0, s_rows1, s_from0, s_from1, s_blocks0, s_blocks1, s_erows0, s_erows1, s_out0, s_out1,
                        HAS_STORE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                        PDL: tl.constexpr = False):
    """Rows ``[BLOCK_K]`` of sequence ``program_id(0)``'s keys: window keys ``< LW`` from the ring or the step's
    rows, entries after them from the store (every index tensor with its own strides: some are expanded views)."""
    pdl.begin(PDL)
    s = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
    ch = tl.arange(0, BLOCK_D)[None, :]  # [1, BD]
    in_d = ch < D
    in_window = k < LW
    kw = tl.where(in_window, k, 0).to(tl.int64)  # [BK]
    step_row = tl.load(from_new_ptr + s * s_from0 + kw * s_from1, mask=in_window, other=0) != 0
    from_ring = in_window & ~step_row
    from_step = in_window & step_row
    slot = tl.load(ring_slots_ptr + s * s_slots0 + kw * s_slots1, mask=from_ring, other=0)
    index = tl.load(ring_index_ptr + s * s_index0 + kw * s_index1, mask=from_ring, other=0)
    row = tl.load(new_rows_ptr + s * s_rows0 + kw * s_rows1, mask=from_step, other=0)
    ring_at = (slot * s_ring0 + index * s_ring1)[:, None] + ch  # [BK, BD]
    keys = tl.load(ring_ptr + ring_at, mask=from_ring[:, None] & in_d, other=0.0)
    step = tl.load(new_ptr + (row * s_new)[:, None] + ch, mask=from_step[:, None] & in_d, other=0.0)
    keys = tl.where(from_step[:, None], step, keys)
    if HAS_STORE:
        is_entry = (k >= LW) & (k < LW + E)
        ke = tl.where(is_entry, k - LW, 0).to(tl.int64)
        block = tl.load(blocks_ptr + s * s_blocks0 + ke * s_blocks1, mask=is_entry, other=0)
        entry_row = tl.load(rows_ptr + s * s_erows0 + ke * s_erows1, mask=is_entry, other=0)
        store_at = (block * s_store0 + entry_row * s_store1)[:, None] + ch
        entry = tl.load(store_ptr + store_at, mask=is_entry[:, None] & in_d, other=0.0)
        keys = tl.where(is_entry[:, None], entry, keys)
        total = LW + E
    else:
        total = LW
    out_at = s * s_out0 + k.to(tl.int64)[:, None] * s_out1 + ch
    tl.store(out_ptr + out_at, keys, mask=(k < total)[:, None] & in_d)


def _fake(ring, ring_slots, ring_index, new_kv, new_rows, from_new, store=None, entry_blocks=None, entry_rows=None):
    entries = 0 if store is None else entry_blocks.shape[1]
    return new_kv.new_empty((ring_slots.shape[0], ring_slots.shape[1] + entries, new_kv.shape[-1]))


def supported(ring: torch.Tensor, new_kv: torch.Tensor, store: torch.Tensor | None) -> bool:
    """Whether the kernel covers these inputs (one dtype for ring, step rows and store; contiguous key rows)."""
    tensors = [ring, new_kv] + ([] if store is None else [store])
    return all(t.dtype == new_kv.dtype and t.stride(-1) == 1 for t in tensors) and new_kv.dim() == 2


def gather_keys(ring: torch.Tensor, ring_slots: torch.Tensor, ring_index: torch.Tensor, new_kv: torch.Tensor,
                new_rows: torch.Tensor, from_new: torch.Tensor, store: torch.Tensor | None = None,
                entry_blocks: torch.Tensor | None = None, entry_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``reference.gather_keys`` (same arguments, same result); inputs the kernel does not cover take the
    reference op."""
    if not supported(ring, new_kv, store):
        return ref.gather_keys(ring, ring_slots, ring_index, new_kv, new_rows, from_new, store, entry_blocks,
                               entry_rows)
    return _launch(ring, ring_slots, ring_index, new_kv, new_rows, from_new, store, entry_blocks, entry_rows)


@opaque_under_compile("gather_keys", _fake)
def _launch(ring: torch.Tensor, ring_slots: torch.Tensor, ring_index: torch.Tensor, new_kv: torch.Tensor,
            new_rows: torch.Tensor, from_new: torch.Tensor, store: torch.Tensor | None,
            entry_blocks: torch.Tensor | None, entry_rows: torch.Tensor | None) -> torch.Tensor:
    S, LW = ring_slots.shape
    D = new_kv.shape[-1]
    E = 0 if store is None else entry_blocks.shape[1]
    out = new_kv.new_empty((S, LW + E, D))  # [S, Lw + E, d]
    if out.numel() == 0:
        return out
    if store is None:  # the entry arguments are never read: any tensors of the right kind
        store, entry_blocks, entry_rows = ring, ring_slots, ring_slots
    grid = (S, triton.cdiv(LW + E, BLOCK_K))
    _gather_keys_kernel[grid](
        ring, ring_slots, ring_index, new_kv, new_rows, from_new.view(torch.uint8), store, entry_blocks, entry_rows,
        out, LW, E, D, ring.stride(0), ring.stride(1), new_kv.stride(0), store.stride(0), store.stride(1),
        *ring_slots.stride(), *ring_index.stride(), *new_rows.stride(), *from_new.stride(), *entry_blocks.stride(),
        *entry_rows.stride(), out.stride(0), out.stride(1),
        HAS_STORE=E > 0, BLOCK_K=BLOCK_K, BLOCK_D=triton.next_power_of_2(D), num_warps=4, **pdl.launch())
    return out

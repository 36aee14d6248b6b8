"""Per-step index layout: where each query, key, compressed entry and window lives.

Built once per step from a ``ForwardBatch`` and shared by every layer. It turns the flat,
unpadded token axis into padded per-sequence views (``[S, Lq, ...]``) and says, for every key the
attention may read, whether it comes from this step's tokens or from a sequence's state.

Every index tensor is built on the host from the batch's Python lists and then copied to the device
once (non-blocking; pinning each small tensor first measured slower on the H200, docs/performance.md). Building them with small device ops, or from device tensors,
would stall the host on every ``torch.tensor(..., device=cuda)`` copy and ``nonzero()``.
"""

from __future__ import annotations

import dataclasses

import torch

from deepinfer_core.forward_batch import ForwardBatch


@dataclasses.dataclass
class WindowPlan:
    """Compressor windows completed by this step, and where their ``span`` input slots come from.

    Window ``w`` of a sequence pools the tokens at positions ``(w + 1) * ratio - span + j`` for
    ``j`` in ``[0, span)``: rows of this step when the position is new, else the slot's carry.
    """

    from_new: torch.Tensor  # [N, span] bool
    new_rows: torch.Tensor  # [N, span] token rows (valid where from_new)
    carry_slots: torch.Tensor  # [N, span]
    carry_index: torch.Tensor  # [N, span] position % span
    valid: torch.Tensor  # [N, span] position >= 0
    entry_positions: torch.Tensor  # [N] first token of window w: w * ratio (its RoPE position)
    write_blocks: torch.Tensor  # [N] block holding entry w
    write_rows: torch.Tensor  # [N] row of entry w inside that block
    carry_write_rows: torch.Tensor  # [M] token rows whose raw inputs stay in the carry
    carry_write_slots: torch.Tensor  # [M]
    carry_write_index: torch.Tensor  # [M]

    @property
    def num_windows(self) -> int:
        return self.entry_positions.shape[0]


@dataclasses.dataclass
class EntryLayout:
    """Compressed entries each sequence can read after this step, padded to ``[S, E]``."""

    blocks: torch.Tensor  # [S, E]
    rows: torch.Tensor  # [S, E]
    visible: torch.Tensor  # [S, Lq, E] entry w visible to query p iff (w + 1) * ratio <= p + 1


class StepLayout:
    """Index tensors for one step of a batch (see module docstring)."""

    def __init__(self, batch: ForwardBatch, sliding_window: int, block_size: int, device: torch.device):
        self.batch = batch
        self.window = sliding_window
        self.block_size = block_size
        self.target_device = torch.device(device)
        self.device = torch.device("cpu")  # where index tensors are built (see module docstring)
        self.num_seqs = batch.num_seqs
        self.query_lens = batch.query_lens
        self.max_query_len = max(self.query_lens)
        self._build_queries()
        self._build_sliding_keys()
        self._entries: dict[int, EntryLayout] = {}
        self._windows: dict[tuple[int, int], WindowPlan] = {}

    # ------------------------------------------------------------------ queries
    def _tensor(self, values, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host-built index tensor on the target device (one non-blocking copy)."""
        if self.target_device.type == "cpu":
            return t
        return t.to(self.target_device, non_blocking=True)

    def _build_queries(self) -> None:
        S, Lq = self.num_seqs, self.max_query_len
        offsets = torch.arange(Lq, device=self.device)  # [Lq]
        starts = self._tensor(self.batch.query_start[:-1])  # [S]
        lens = self._tensor(self.query_lens)
        ctx = self._tensor(self.batch.context_lens)
        valid = offsets[None, :] < lens[:, None]  # [S, Lq]
        self._host_query_valid = valid
        self._host_query_positions = torch.where(valid, ctx[:, None] + offsets[None, :], -1)  # [S, Lq]
        token_seq = torch.repeat_interleave(torch.arange(S, device=self.device), lens)  # [T]
        token_offset = torch.arange(token_seq.shape[0], device=self.device) - starts[token_seq]  # [T]
        self._host_token_seq = token_seq
        self._host_positions = ctx[token_seq] + token_offset  # [T] == batch.positions, on the host
        self.query_valid = self._to_device(valid)
        self.query_rows = self._to_device(torch.where(valid, starts[:, None] + offsets[None, :], 0))  # [S, Lq]
        self.query_positions = self._to_device(self._host_query_positions)
        self.token_seq = self._to_device(token_seq)
        self.token_offset = self._to_device(token_offset)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Flat ``[T, ...]`` -> padded ``[S, Lq, ...]`` (padding rows repeat row 0; mask them)."""
        return x[self.query_rows]

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """Padded ``[S, Lq, ...]`` -> flat ``[T, ...]``."""
        return x[self.token_seq, self.token_offset]

    # ------------------------------------------------------------------ sliding window
    def _build_sliding_keys(self) -> None:
        W = self.window
        positions, from_new, new_rows, slots = [], [], [], []
        floors = self.batch.sliding_floor or [0] * self.num_seqs
        for s in range(self.num_seqs):
            ctx, n = self.batch.context_lens[s], self.query_lens[s]
            first = min(ctx, max(0, ctx - (W - 1), floors[s]))
            pos = torch.arange(first, ctx + n, device=self.device)  # ring tokens, then new tokens
            positions.append(pos)
            from_new.append(pos >= ctx)
            new_rows.append(self.batch.query_start[s] + (pos - ctx).clamp(min=0))
            slots.append(torch.full_like(pos, self.batch.slots[s]))
        key_positions = _pad_stack(positions, -1)  # [S, Lk]
        self.key_positions = self._to_device(key_positions)
        self.key_from_new = self._to_device(_pad_stack(from_new, False))
        self.key_new_rows = self._to_device(_pad_stack(new_rows, 0))
        self.key_slots = self._to_device(_pad_stack(slots, 0))
        self.key_ring_index = self._to_device(key_positions.clamp(min=0) % W)
        kp, qp = key_positions[:, None, :], self._host_query_positions[:, :, None]  # [S, 1, Lk], [S, Lq, 1]
        visible = (kp >= 0) & (kp <= qp) & (kp > qp - W) & self._host_query_valid[:, :, None]
        self.sliding_visible = self._to_device(visible)
        last = self._tensor([ctx + n for ctx, n in zip(self.batch.context_lens, self.query_lens)])
        token_seq, token_pos = self._host_token_seq, self._host_positions
        keep = token_pos >= (last[token_seq] - W)  # [T] tokens that stay in the ring
        rows = keep.nonzero().squeeze(-1)
        self.ring_write_rows = self._to_device(rows)
        self.ring_write_slots = self._to_device(self._tensor(self.batch.slots)[token_seq[rows]])
        self.ring_write_index = self._to_device(token_pos[rows] % W)

    def sliding_keys(self, ring: torch.Tensor, new_kv: torch.Tensor) -> torch.Tensor:
        """Keys ``[S, Lk, d]`` of every sequence's window: ring tokens, then this step's ``new_kv``."""
        from_ring = ring[self.key_slots, self.key_ring_index]  # [S, Lk, d]
        from_step = new_kv[self.key_new_rows]  # [S, Lk, d]
        return torch.where(self.key_from_new[..., None], from_step, from_ring)

    def write_ring(self, ring: torch.Tensor, new_kv: torch.Tensor) -> None:
        """Keep the last ``window`` tokens of each sequence in its ring (position % window)."""
        ring[self.ring_write_slots, self.ring_write_index] = new_kv[self.ring_write_rows]

    # ------------------------------------------------------------------ compressed entries
    def entries(self, ratio: int) -> EntryLayout:
        """Entries (after this step) readable by each sequence, for a compression ratio."""
        if ratio not in self._entries:
            self._entries[ratio] = self._build_entries(ratio)
        return self._entries[ratio]

    def _build_entries(self, ratio: int) -> EntryLayout:
        per_block = self.block_size // ratio
        blocks, rows = [], []
        for s in range(self.num_seqs):
            count = (self.batch.context_lens[s] + self.query_lens[s]) // ratio
            w = torch.arange(count, device=self.device)
            table = self._tensor(self.batch.block_tables[s] or [0])
            blocks.append(table[w // per_block])
            rows.append(w % per_block)
        blocks_t = _pad_stack(blocks, -1)  # [S, E]
        entry_ids = torch.arange(blocks_t.shape[1], device=self.device)  # [E]
        limit = (self._host_query_positions + 1).div(ratio, rounding_mode="floor")  # [S, Lq]
        visible = (entry_ids[None, None, :] < limit[:, :, None]) & (blocks_t[:, None, :] >= 0)
        visible = visible & self._host_query_valid[:, :, None]
        return EntryLayout(*(self._to_device(t) for t in (blocks_t.clamp(min=0), _pad_stack(rows, 0), visible)))

    def gather_entries(self, store: torch.Tensor, ratio: int) -> torch.Tensor:
        """Entries ``[S, E, d]`` from a paged store ``[num_blocks, rows_per_block, d]``."""
        layout = self.entries(ratio)
        return store[layout.blocks, layout.rows]

    # ------------------------------------------------------------------ compressor windows
    def windows(self, ratio: int, span: int) -> WindowPlan:
        """The compressor windows this step completes, for a ratio and carry span."""
        key = (ratio, span)
        if key not in self._windows:
            self._windows[key] = self._build_windows(ratio, span)
        return self._windows[key]

    def _build_windows(self, ratio: int, span: int) -> WindowPlan:
        per_block = self.block_size // ratio
        write_start = self.batch.compressed_write_start
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("pos", "ctx", "start", "slot", "entry", "block")}
        carry: dict[str, list[torch.Tensor]] = {"rows": [], "slots": [], "index": []}
        offsets = torch.arange(span, device=self.device)
        for s in range(self.num_seqs):
            ctx, n, slot = self.batch.context_lens[s], self.query_lens[s], self.batch.slots[s]
            first_w = max(ctx // ratio, -(-(write_start[s] if write_start else 0) // ratio))
            w = torch.arange(first_w, (ctx + n) // ratio, device=self.device)  # windows ending in this step
            pos = (w[:, None] + 1) * ratio - span + offsets[None, :]  # [n_w, span]
            parts["pos"].append(pos)
            parts["ctx"].append(torch.full_like(pos, ctx))
            parts["start"].append(torch.full_like(pos, self.batch.query_start[s]))
            parts["slot"].append(torch.full_like(pos, slot))
            parts["entry"].append(w)
            table = self._tensor(self.batch.block_tables[s] or [0])
            parts["block"].append(table[w // per_block] if w.numel() else w)
            tail = torch.arange(max(ctx, ctx + n - span), ctx + n, device=self.device)
            carry["rows"].append(self.batch.query_start[s] + tail - ctx)
            carry["slots"].append(torch.full_like(tail, slot))
            carry["index"].append(tail % span)
        pos = torch.cat(parts["pos"]).reshape(-1, span)
        ctx_t = torch.cat(parts["ctx"]).reshape(-1, span)
        entry = torch.cat(parts["entry"])
        from_new = pos >= ctx_t
        plan = WindowPlan(
            from_new=from_new,
            new_rows=torch.where(from_new, torch.cat(parts["start"]).reshape(-1, span) + pos - ctx_t, 0),
            carry_slots=torch.cat(parts["slot"]).reshape(-1, span),
            carry_index=pos.clamp(min=0) % span,
            valid=pos >= 0,
            entry_positions=entry * ratio,
            write_blocks=torch.cat(parts["block"]),
            write_rows=entry % per_block,
            carry_write_rows=torch.cat(carry["rows"]),
            carry_write_slots=torch.cat(carry["slots"]),
            carry_write_index=torch.cat(carry["index"]),
        )
        return WindowPlan(**{f.name: self._to_device(getattr(plan, f.name)) for f in dataclasses.fields(plan)})


def _pad_stack(tensors: list[torch.Tensor], value) -> torch.Tensor:
    """Stack 1-D tensors of different lengths into ``[len(tensors), max_len]`` padded with ``value``."""
    width = max((t.shape[0] for t in tensors), default=0)
    out = torch.full((len(tensors), width), value, dtype=tensors[0].dtype, device=tensors[0].device)
    for i, t in enumerate(tensors):
        out[i, : t.shape[0]] = t
    return out

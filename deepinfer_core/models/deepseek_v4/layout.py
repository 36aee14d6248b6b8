"""Per-step index layout: where each query, key, compressed entry and window lives.

Built once per step from a ``ForwardBatch`` and shared by every layer. It turns the flat,
unpadded token axis into padded per-sequence views (``[S, Lq, ...]``) and says, for every key the
attention may read, whether it comes from this step's tokens or from a sequence's state.

Every index tensor is built on the host from the batch's Python lists, every compressor's plan with the rest (the
model names them), and all of them are copied to the device together: one pinned buffer, one non-blocking copy (a
copy from pageable memory waits until the stream is idle, which would stall the host behind the step still running
once per tensor). Building them with small device ops, or from device tensors, would stall the host on every
``torch.tensor(..., device=cuda)`` copy and ``nonzero()``. The two visibility masks (``[S, Lq, Lk]`` and
``[S, Lq, E]``, the only ones that grow with the square of the step's tokens) are the exception: they are broadcast
comparisons of small per-row / per-key tensors already copied, so they are computed where the model runs.

Decode steps replayed from a CUDA graph use ``DecodeLayout`` instead: the same tensors at shapes fixed by a
``StaticShape`` alone (keys padded to the window, compressed entries to ``context_len // ratio``, one compressor
window per sequence, a dummy one writing the spare block where a sequence completes none), computed with
device ops from a few per-sequence tensors (``DecodeInputs``) inside the graph: the op table's ``decode_key_index``,
``decode_entry_places`` and ``decode_window_plan`` (~100 small integer kernels per step eagerly; a backend may fuse
them, the NVIDIA one compiles them). The host then only uploads those
(one copy through a ``StaticBuffers``) instead of building every index tensor each step.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from deepinfer_core.device_copy import to_device_together
from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.ops.reference import entry_places, window_plan
from deepinfer_core.ops.table import OpTable
from deepinfer_core.static_buffers import StaticBuffers


@dataclasses.dataclass(frozen=True)
class StaticShape:
    """Fixed sizes of a decode step (one token per sequence) whose index tensors must keep their shapes.

    ``context_len`` bounds every sequence's length after the step (a multiple of every ratio), so a
    sequence has at most ``context_len // ratio`` compressed entries. Dummy windows (sequences that
    complete none) read the carry of ``spare_slot`` and write row 0 of ``spare_block``: state no real
    sequence owns.
    """

    num_seqs: int
    key_width: int  # sliding keys per sequence: the window
    context_len: int
    spare_slot: int
    spare_block: int
    windows: tuple[tuple[int, int], ...]  # (ratio, span) of every compressor, built eagerly
    entry_ratios: tuple[int, ...]  # ratios of every compressed cache, built eagerly


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

    def __post_init__(self) -> None:
        self._entry_rope: dict = {}

    @property
    def num_windows(self) -> int:
        return self.entry_positions.shape[0]

    def forget_rope(self) -> None:
        """Drop the entry RoPE computed so far (``entry_rope`` computes it again)."""
        self._entry_rope = {}

    def entry_rope(self, ops, rope_args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """``ops.rope_cos_sin(entry_positions, *rope_args)``, computed once per plan (every compressor of a step
        with this plan's ratio and span rotates its entries at the same positions)."""
        key = (id(rope_args[0]), *rope_args[1:])
        if key not in self._entry_rope:
            self._entry_rope[key] = ops.rope_cos_sin(self.entry_positions, *rope_args)
        return self._entry_rope[key]


@dataclasses.dataclass
class EntryLayout:
    """Compressed entries each sequence can read after this step, padded to ``[S, E]``, and which of them each query
    row sees: entry ``w`` is visible to the query at position ``p`` iff ``(w + 1) * ratio <= p + 1`` (its whole window
    is at or before the query), so a row sees a prefix of the entries: ``counts`` of them."""

    blocks: torch.Tensor  # [S, E]
    rows: torch.Tensor  # [S, E]
    mask: torch.Tensor | None  # [S, Lq, E] bool, or None until ``visible`` builds it from ``counts``
    row_counts: torch.Tensor | None = None  # [S, Lq] int32, or None until ``counts`` sums ``mask``

    @property
    def visible(self) -> torch.Tensor:
        """``[S, Lq, E]`` bool: the entries each query row sees (built from ``counts`` on first use where the layout
        deferred it: ``StepLayout``'s ``counted_ratios``)."""
        if self.mask is None:
            entries = torch.arange(self.blocks.shape[1], device=self.row_counts.device)  # [E]
            self.mask = entries < self.row_counts[..., None]
        return self.mask

    @property
    def counts(self) -> torch.Tensor:
        """``[S, Lq]`` int32: how many entries (a prefix) each query row sees; 0 for padding rows."""
        if self.row_counts is None:
            self.row_counts = self.mask.sum(-1, dtype=torch.int32)
        return self.row_counts


class StepLayout:
    """Index tensors for one step of a batch (see module docstring).

    A captured prefill step (``engine/prefill_graphs.py``) builds it with ``buffers`` (its index tensors land in their
    fixed storage; the caller uploads them), ``written`` (per sequence, how many of its tokens write state: the rest
    pad the chunk to its bucket and only read, and the causal masks keep them out of every real token's view) and
    ``spare_block`` (where the windows of padding tokens write), and without ``masks`` (the graph computes them:
    ``build_masks``). A chunk that starts past token 0 (a replay after a prefix hit, a later chunk) also gives
    ``context_len``, a bound on its end: then every shape depends on the chunk's padded length and ``context_len``
    alone, not on where it starts: sliding keys span ``Lq + window - 1`` positions (ring keys, then the chunk's),
    entries ``context_len // ratio`` (the block table padded to ``context_len``), and the compressor plan has every
    window the chunk completes, those before ``compressed_write_start`` (their entries come from the cache) writing
    the spare block. A static verification step (``engine/verify_graphs.py``: several sequences of ``Lq`` tokens each,
    every token writing state) adds ``fixed_windows``: each sequence gets ``ceil(Lq / ratio)`` windows, as many as
    ``Lq`` tokens can complete wherever they start, those it does not complete being dummies that pool the carry and
    write the spare block. ``counted_ratios``: compressed caches whose entry visibility the model reads as per-row
    counts (``EntryLayout.counts``, ``[S, Lq]``): their ``[S, Lq, E]`` masks are built only where something asks for
    them.
    """

    def __init__(self, batch: ForwardBatch, sliding_window: int, block_size: int, device: torch.device,
                 windows: tuple[tuple[int, int], ...] = (), entry_ratios: tuple[int, ...] = (),
                 buffers: StaticBuffers | None = None, written: list[int] | None = None, spare_block: int = 0,
                 masks: bool = True, context_len: int | None = None, fixed_windows: bool = False,
                 counted_ratios: tuple[int, ...] = ()):
        self.batch = batch
        self.window = sliding_window
        self.block_size = block_size
        self.target_device = torch.device(device)
        self.device = torch.device("cpu")  # where index tensors are built (see module docstring)
        self.num_seqs = batch.num_seqs
        self.query_lens = batch.query_lens
        self.max_query_len = max(self.query_lens)
        # every sequence folds max_query_len tokens: padded and flat layouts are views of each other
        self.uniform = all(n == self.max_query_len for n in self.query_lens)
        self.buffers, self.spare_block = buffers, spare_block
        self.padded = written is not None and list(written) != list(self.query_lens)  # tokens that write no state
        self.written = written if self.padded else self.query_lens
        self.context_len = context_len
        self.fixed_windows = fixed_windows  # every sequence gets ceil(Lq / ratio) windows: a static multi-seq step
        self.counted_ratios = frozenset(counted_ratios)
        if fixed_windows and context_len is None:
            raise ValueError("fixed_windows is a static step's (give context_len, the bound its shapes are fixed by)")
        self._tables: torch.Tensor | None = None
        self._visible: dict[int, torch.Tensor] = {}  # ratio -> attention_visible of the layout's entries
        self._pending: list[tuple[object, str, torch.Tensor]] = []  # (owner, attribute, host tensor) to upload
        self._build_queries()
        self._build_sliding_keys()
        self._entries = {ratio: self._build_entries(ratio) for ratio in entry_ratios}
        self._windows = {(ratio, span): self._build_windows(ratio, span) for ratio, span in windows}
        self._upload()
        if masks:
            self.build_masks()

    # ------------------------------------------------------------------ queries
    def _tensor(self, values, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _stage(self, owner: object, name: str, host: torch.Tensor) -> None:
        """Set ``owner.<name>`` to the host-built index tensor now and to its device copy at ``_upload``."""
        setattr(owner, name, host)
        self._pending.append((owner, name, host))

    def _upload(self) -> None:
        """Every index tensor built since the last upload to the target device in one pinned, non-blocking copy: a
        copy from pageable memory would wait until the stream is idle, stalling the host once per tensor behind
        the step still running. With ``buffers``: into their fixed tensors (the caller
        uploads)."""
        pending, self._pending = self._pending, []
        hosts = [host for _, _, host in pending]
        copies = ([self.buffers.place(h) for h in hosts] if self.buffers is not None
                  else to_device_together(hosts, self.target_device))
        for (owner, name, _), copy in zip(pending, copies, strict=True):
            setattr(owner, name, copy)

    def _build_queries(self) -> None:
        batch = self.batch
        Lq = self.max_query_len
        offsets = torch.arange(Lq)  # [Lq]
        starts = self._tensor(batch.query_start[:-1])  # [S]
        lens = self._tensor(self.query_lens)
        ctx = self._tensor(batch.context_lens)
        valid = offsets[None, :] < lens[:, None]  # [S, Lq]
        self._host_ctx, self._host_starts, self._host_lens = ctx, starts, lens
        self._host_written = self._tensor(self.written) if self.padded else lens
        self._host_slots = self._tensor(batch.slots)  # [S]
        token_seq, token_offset = _segments(lens)  # [T]: each token's sequence and offset in its chunk
        self._stage(self, "query_valid", valid)
        self._stage(self, "query_rows", torch.where(valid, starts[:, None] + offsets[None, :], 0))  # [S, Lq]
        self._stage(self, "query_positions", torch.where(valid, ctx[:, None] + offsets[None, :], -1))  # [S, Lq]
        self._stage(self, "token_seq", token_seq)  # [T]
        self._stage(self, "token_offset", token_offset)  # [T]

    def _tail_writes(self, span: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's written tokens among the last ``span`` of each sequence: their rows, slots and
        ``position % span`` (what a ring of ``span`` entries per slot keeps)."""
        ctx, starts = self._host_ctx, self._host_starts
        end = ctx + self._host_written
        first = torch.maximum(ctx, end - span)  # [S]
        seq, offset = _segments(end - first)  # [M]
        positions = first[seq] + offset
        return starts[seq] + positions - ctx[seq], self._host_slots[seq], positions % span

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Flat ``[T, ...]`` -> padded ``[S, Lq, ...]`` (padding rows repeat row 0; mask them)."""
        if self.uniform:
            return x.reshape(self.num_seqs, self.max_query_len, *x.shape[1:])
        return x[self.query_rows]

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """Padded ``[S, Lq, ...]`` -> flat ``[T, ...]``."""
        if self.uniform:
            return x.reshape(-1, *x.shape[2:])
        return x[self.token_seq, self.token_offset]

    # ------------------------------------------------------------------ sliding window
    def _build_sliding_keys(self) -> None:
        W, batch = self.window, self.batch
        floors = batch.sliding_floor or [0] * self.num_seqs
        spans = []  # per sequence: first key position (ring tokens from there, then the new tokens)
        for s in range(self.num_seqs):
            ctx = batch.context_lens[s]
            spans.append(min(ctx, max(0, ctx - (W - 1), floors[s])))
        ends = [ctx + n for ctx, n in zip(batch.context_lens, self.query_lens)]
        width = max(end - first for first, end in zip(spans, ends))
        if self.context_len is not None:  # static: ring keys (at most W - 1), then the chunk's
            width = self.max_query_len + (W - 1 if self.context_len > self.max_query_len else 0)
        first, end = self._tensor(spans)[:, None], self._tensor(ends)[:, None]  # [S, 1]
        key_positions = first + torch.arange(width)[None, :]  # [S, Lk]
        key_positions = torch.where(key_positions < end, key_positions, -1)
        ctx, starts = self._host_ctx[:, None], self._host_starts[:, None]
        from_new = key_positions >= ctx  # [S, Lk]
        self._stage(self, "key_from_new", from_new)
        self._stage(self, "key_new_rows", torch.where(from_new, starts + key_positions - ctx, 0))
        self._stage(self, "key_slots", self._host_slots[:, None].expand(-1, width))
        self._stage(self, "key_ring_index", key_positions.clamp(min=0) % W)
        self._stage(self, "_key_positions", key_positions)  # [S, Lk]
        rows, slots, index = self._tail_writes(W)  # tokens that stay in the ring: the last W of each sequence
        self._stage(self, "ring_write_rows", rows)
        self._stage(self, "ring_write_slots", slots)
        self._stage(self, "ring_write_index", index)

    def build_masks(self) -> None:
        """The visibility masks, from index tensors already uploaded, on the target device (see module docstring).
        Anything computed from them or from the index tensors before is dropped (the masks joined per ratio, the
        compressors' entry RoPE): a captured prefill step builds them again at every replay."""
        self._visible = {}
        for plan in self._windows.values():
            plan.forget_rope()
        kp, qp, W = self._key_positions[:, None, :], self.query_positions[:, :, None], self.window  # [S,1,Lk] [S,Lq,1]
        self.sliding_visible = (kp >= 0) & (kp <= qp) & (kp > qp - W) & self.query_valid[:, :, None]  # [S, Lq, Lk]
        for ratio, entries in self._entries.items():
            self._entry_visibility(ratio, entries)

    def attention_keys(self, ops, ring: torch.Tensor, new_kv: torch.Tensor, store: torch.Tensor | None = None,
                       ratio: int | None = None) -> torch.Tensor:
        """Keys ``[S, Lk (+ E), d]`` through ``ops.gather_keys``: every sequence's window (ring tokens, then this step's
        ``new_kv``), then, with a paged ``store`` of compression ``ratio``, its compressed entries."""
        entries = None if store is None else self.entries(ratio)
        places = (None, None) if entries is None else (entries.blocks, entries.rows)
        return ops.gather_keys(ring, self.key_slots, self.key_ring_index, new_kv, self.key_new_rows, self.key_from_new,
                               store, *places)

    def attention_visible(self, ratio: int, entry_visible: torch.Tensor) -> torch.Tensor:
        """``[S, Lq, Lk + E]``: the sliding window's visibility, then ``entry_visible`` (``[S, Lq, E]``, a compressed
        cache of ``ratio``). Made once per step and ratio where that is the layout's own entry visibility (every
        HCA layer; CSA layers whose indexer selects every entry)."""
        if entry_visible is not self.entries(ratio).visible:
            return torch.cat([self.sliding_visible, entry_visible], dim=-1)
        if ratio not in self._visible:
            self._visible[ratio] = torch.cat([self.sliding_visible, entry_visible], dim=-1)
        return self._visible[ratio]

    def write_ring(self, ops, ring: torch.Tensor, new_kv: torch.Tensor) -> None:
        """Keep the last ``window`` tokens of each sequence in its ring (position % window), through
        ``ops.write_rows_``."""
        ops.write_rows_(ring, self.ring_write_slots, self.ring_write_index, new_kv, self.ring_write_rows)

    # ------------------------------------------------------------------ compressed entries
    def entries(self, ratio: int) -> EntryLayout:
        """Entries (after this step) readable by each sequence, for a compression ratio (built with the layout when
        the model named the ratio, else now: one more upload)."""
        if ratio not in self._entries:
            entries = self._build_entries(ratio)
            self._upload()
            self._entry_visibility(ratio, entries)
            self._entries[ratio] = entries
        return self._entries[ratio]

    def _build_entries(self, ratio: int) -> EntryLayout:
        """The entries' places (uploaded with the layout); their visibility mask comes after the upload."""
        per_block = self.block_size // ratio
        counts = [(ctx + n) // ratio for ctx, n in zip(self.batch.context_lens, self.query_lens)]
        width = max(counts) if self.context_len is None else self.context_len // ratio
        blocks, rows, _ = entry_places(self._block_tables(), torch.arange(width), self._tensor(counts), per_block)
        entries = EntryLayout(blocks, rows, None)
        self._stage(entries, "blocks", blocks)
        self._stage(entries, "rows", rows)
        return entries

    def _entry_visibility(self, ratio: int, entries: EntryLayout) -> None:
        """Set ``entries``' visibility: the per-row counts for a counted ratio (the mask deferred), else the mask."""
        width = entries.blocks.shape[1]
        if ratio in self.counted_ratios:
            entries.mask, entries.row_counts = None, self._entry_counts(ratio, width)
        else:
            entries.mask, entries.row_counts = self._entry_visible(ratio, width), None

    def _entry_counts(self, ratio: int, width: int) -> torch.Tensor:
        """``[S, Lq]`` int32: how many entries query p sees, ``(p + 1) // ratio`` (at most ``width``; 0 for padding):
        ``_entry_visible``'s rows, counted (on the target device)."""
        limit = (self.query_positions + 1).div(ratio, rounding_mode="floor").clamp(max=width)  # [S, Lq]
        return torch.where(self.query_valid, limit, 0).to(torch.int32)

    def _entry_visible(self, ratio: int, width: int) -> torch.Tensor:
        """``[S, Lq, E]``: entry w visible to query p iff (w + 1) * ratio <= p + 1 (on the target device)."""
        limit = (self.query_positions + 1).div(ratio, rounding_mode="floor")  # [S, Lq]; <= count per sequence
        ids = torch.arange(width, device=limit.device)  # [E]
        return (ids[None, None, :] < limit[:, :, None]) & self.query_valid[:, :, None]

    def _block_tables(self) -> torch.Tensor:
        """Every sequence's block table, padded with block 0: ``[S, max blocks]`` (built once per step)."""
        if self._tables is None:
            tables = self.batch.block_tables
            longest = max(1, max(len(t) for t in tables))
            self._tables = self._tensor([list(t) + [0] * (longest - len(t)) for t in tables])
        return self._tables

    def gather_entries(self, ops, store: torch.Tensor, ratio: int) -> torch.Tensor:
        """Entries ``[S, E, d]`` from a paged store ``[num_blocks, rows_per_block, d]`` of compression ``ratio``:
        ``ops.gather_keys`` with an empty window (its index tensors ``[S, 0]``; the ring and step rows are never
        read)."""
        entries = self.entries(ratio)
        no_window = entries.blocks[:, :0]  # [S, 0]
        return ops.gather_keys(store, no_window, no_window, store[0], no_window, no_window.bool(), store,
                               entries.blocks, entries.rows)

    # ------------------------------------------------------------------ compressor windows
    def windows(self, ratio: int, span: int) -> WindowPlan:
        """The compressor windows this step completes, for a ratio and carry span (built with the layout when the
        model named them, else now: one more upload)."""
        key = (ratio, span)
        if key not in self._windows:
            self._windows[key] = self._build_windows(ratio, span)
            self._upload()
        return self._windows[key]

    def _build_windows(self, ratio: int, span: int) -> WindowPlan:
        per_block = self.block_size // ratio
        ctx, starts = self._host_ctx, self._host_starts  # [S]
        write_start = self._tensor(self.batch.compressed_write_start or [0] * self.num_seqs)
        first_cached = -((-write_start) // ratio)  # [S]: windows before it come from the cache
        first_w = ctx // ratio if self.context_len is not None else torch.maximum(ctx // ratio, first_cached)  # [S]
        counts = ((ctx + self._host_lens) // ratio - first_w).clamp(min=0)  # [S]: windows ending now
        if self.fixed_windows:  # as many as Lq tokens can end wherever they start; the extra ones are dummies
            counts = torch.full_like(counts, -(-self.max_query_len // ratio))
        seq, offset = _segments(counts)
        entry = first_w[seq] + offset  # [N]
        tables = self._block_tables()
        plan = WindowPlan(*window_plan(entry, ctx[seq], starts[seq], self._host_slots[seq],
                                       tables[seq, (entry // per_block).clamp(max=tables.shape[1] - 1)],
                                       self._tail_writes(span), ratio, span, per_block, torch.arange(span)))
        if self.padded or self.context_len is not None:  # padding's and cached windows pool, write the spare block
            padding = (entry >= ((ctx + self._host_written) // ratio)[seq]) | (entry < first_cached[seq])  # [N]
            plan.write_blocks = torch.where(padding, self.spare_block, plan.write_blocks)
            plan.write_rows = torch.where(padding, 0, plan.write_rows)
            if self.fixed_windows:  # a dummy window past the step's rows pools its carry only
                plan.from_new &= ~padding[:, None]
                plan.new_rows = torch.where(plan.from_new, plan.new_rows, 0)
        for f in dataclasses.fields(plan):
            self._stage(plan, f.name, getattr(plan, f.name))
        return plan


@dataclasses.dataclass
class DecodeInputs:
    """What a static decode step's layout is computed from: per-sequence values as ``[S]`` int64 tensors (block
    tables ``[S, blocks]``, padded with 0), the fields of a one-token-per-sequence ``ForwardBatch``."""

    context_lens: torch.Tensor  # [S]: tokens already in each sequence's state (the new token's position)
    slots: torch.Tensor  # [S]
    block_tables: torch.Tensor  # [S, ceil(context_len / block_size)]
    sliding_floor: torch.Tensor  # [S]
    compressed_write_start: torch.Tensor  # [S]

    @classmethod
    def from_batch(cls, batch: ForwardBatch, static: StaticShape, block_size: int) -> DecodeInputs:
        """The host tensors of a padded one-token batch (``static.num_seqs`` sequences)."""
        if batch.num_seqs != static.num_seqs or batch.query_start != list(range(static.num_seqs + 1)):
            raise ValueError(f"a decode layout takes {static.num_seqs} sequences of one token each, "
                             f"got query lengths {batch.query_lens}")
        width = -(-static.context_len // block_size)
        tables = [list(t[:width]) + [0] * (width - len(t[:width])) for t in batch.block_tables]
        zeros = [0] * static.num_seqs
        return cls(*(torch.tensor(v, dtype=torch.long) for v in (
            batch.context_lens, batch.slots, tables, batch.sliding_floor or zeros, batch.compressed_write_start or zeros)))

    def place(self, buffers: StaticBuffers) -> DecodeInputs:
        """These tensors in ``buffers``' fixed device storage (in field order)."""
        return DecodeInputs(*(buffers.place(getattr(self, f.name)) for f in dataclasses.fields(self)))


class DecodeLayout(StepLayout):
    """``StepLayout`` of a static decode step, computed by device ops from ``DecodeInputs`` (so a CUDA graph
    computes it at replay). Shapes depend on the ``StaticShape`` only; values equal ``StepLayout``'s where that has
    them: keys padded to the window and entries to ``context_len // ratio`` are invisible, and the compressor plan
    has one window per sequence, in sequence order, a dummy (reading the spare slot's carry, writing the spare
    block) where a sequence completes none."""

    def __init__(self, inputs: DecodeInputs, sliding_window: int, block_size: int, static: StaticShape,
                 ops: OpTable | None = None):
        ctx = inputs.context_lens  # [S]
        device = ctx.device
        self.static, self.inputs = static, inputs
        self.ops = ops or OpTable()  # the index math: decode_key_index, decode_entry_places, decode_window_plan
        self.window, self.block_size = sliding_window, block_size
        self.target_device = self.device = device
        self.num_seqs, self.max_query_len = static.num_seqs, 1
        self.query_lens = [1] * static.num_seqs
        self.uniform = True
        self._seq = _arange(static.num_seqs, device)  # [S]: token row s is sequence s
        self.query_valid = _constant("true_column", static.num_seqs, device)  # [S, 1]
        self.query_rows = self._seq[:, None]  # [S, 1]
        self.query_positions = ctx[:, None]  # [S, 1]
        self.token_seq, self.token_offset = self._seq, _constant("zeros", static.num_seqs, device)  # [T]
        self._visible: dict[int, torch.Tensor] = {}
        self._build_decode_keys()
        self._entries = {ratio: self._decode_entries(ratio) for ratio in static.entry_ratios}
        self._windows = {(ratio, span): self._decode_windows(ratio, span) for ratio, span in static.windows}

    def _build_decode_keys(self) -> None:
        inputs, offsets = self.inputs, _arange(self.static.key_width, self.device)  # the window's keys at most
        (self.key_from_new, self.key_new_rows, self.key_ring_index, self.sliding_visible,
         self.ring_write_index) = self.ops.decode_key_index(inputs.context_lens, inputs.sliding_floor, self._seq,
                                                            offsets, self.window)  # [S, W] ... [S, 1, W], [S]
        self.key_slots = inputs.slots[:, None].expand_as(self.key_from_new)  # [S, W]
        self.ring_write_rows, self.ring_write_slots = self._seq, inputs.slots  # [S]

    def _decode_entries(self, ratio: int) -> EntryLayout:
        entry_ids = _arange(self.static.context_len // ratio, self.device)  # [E]
        blocks, rows, real = self.ops.decode_entry_places(self.inputs.context_lens, self.inputs.block_tables,
                                                          entry_ids, ratio, self.block_size // ratio)
        return EntryLayout(blocks, rows, real[:, None, :])  # visible [S, 1, E]: the new token sees every entry

    def _decode_windows(self, ratio: int, span: int) -> WindowPlan:
        inputs, static = self.inputs, self.static
        return WindowPlan(*self.ops.decode_window_plan(
            inputs.context_lens, inputs.compressed_write_start, inputs.slots, inputs.block_tables, self._seq,
            _arange(span, self.device), ratio, span, self.block_size // ratio, static.spare_slot, static.spare_block))


def _segments(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``counts [S]``: the segment of every element of the concatenated segments and its offset inside it
    (``[sum(counts)]`` each): ``[2, 0, 3]`` gives ``[0, 0, 2, 2, 2]`` and ``[0, 1, 0, 1, 2]``."""
    seq = torch.repeat_interleave(torch.arange(counts.shape[0]), counts)
    first = torch.cumsum(counts, 0) - counts  # [S]: where each segment starts
    return seq, torch.arange(seq.shape[0]) - first[seq]


def _arange(n: int, device: torch.device) -> torch.Tensor:
    return _constant("arange", n, device)


def _constant(kind: str, n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)``, ``n`` int64 zeros or an ``[n, 1]`` column of True on ``device``, made once: a graph captured
    after the first (warm-up) build reads it instead of launching a kernel to make it at every replay. Callers
    never write to it. Under ``torch.compile`` it is made in the compiled graph (a constant the compiler folds)."""
    if torch.compiler.is_compiling():
        return _make_constant(kind, n, device)
    return _cached_constant(kind, n, device)


@functools.lru_cache(maxsize=256)
def _cached_constant(kind: str, n: int, device: torch.device) -> torch.Tensor:
    return _make_constant(kind, n, device)


def _make_constant(kind: str, n: int, device: torch.device) -> torch.Tensor:
    if kind == "arange":
        return torch.arange(n, device=device)
    if kind == "zeros":
        return torch.zeros(n, dtype=torch.long, device=device)
    return torch.ones(n, 1, dtype=torch.bool, device=device)

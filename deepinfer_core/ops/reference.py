"""Plain-torch reference ops: the spec every backend's fast op must match.

Each op is registered by name in the op table (``deepinfer_core.ops.table``). Keep these readable:
they define what the model computes. Shapes use T = tokens, H = heads, S = sequences,
Lq / Lk = padded query / key lengths, E = experts, D = hidden size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from deepinfer_core.ops.table import reference_op
from deepinfer_core.quant import fp8_block, mxfp4
from deepinfer_core.sampling.sampler import greedy_rows


# ----------------------------------------------------------------------------- concurrency
class Finished:
    """Work that already ran (what the reference ``fork`` returns): ``join()`` gives its result."""

    def __init__(self, result: Any):
        self.result = result

    def join(self) -> Any:
        """``fn``'s result."""
        return self.result


@reference_op
def fork(fn: Callable[..., Any], *args: Any) -> Finished:
    """Start ``fn(*args)`` beside the ops that follow; ``fork(...).join()`` returns its result once it is done.

    A backend may run ``fn`` concurrently with the caller's next ops (the NVIDIA backend: on a second CUDA stream,
    inside CUDA graphs too), so the caller must not read ``fn``'s result or what ``fn`` writes before ``join``, and
    must not write what ``fn`` reads; ``args`` stay alive until then. Pass the activations as the first tensor
    argument: a backend may decide by their rows (the NVIDIA one overlaps decode-sized work only). The reference
    runs ``fn`` at once."""
    return Finished(fn(*args))


# ----------------------------------------------------------------------------- norms
@reference_op
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, scaled by ``weight`` (kept in its own dtype), cast back to ``x.dtype``."""
    x32 = x.float()  # [..., dim]
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed).to(x.dtype)


@reference_op
def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (per-head q norm, mHC input norm); the scale is computed in fp32."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


# ----------------------------------------------------------------------------- rope
@reference_op
def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    """cos / sin tables for interleaved RoPE: ``[*positions.shape, rope_dim // 2]`` each, in ``dtype``."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)  # [..., rope_dim // 2]
    return (freqs.cos() * scaling).to(dtype), (freqs.sin() * scaling).to(dtype)


@reference_op
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved RoPE on the trailing ``2 * cos.shape[-1]`` channels of ``x``; the rest pass through.

    ``x``: ``[T, ..., dim]``; ``cos`` / ``sin``: ``[T, rope_dim // 2]`` (broadcast over middle dims).
    ``inverse=True`` rotates by ``-angle`` (V4 applies it to the attention output).
    """
    extra_dims = x.dim() - cos.dim()
    cos = cos.repeat_interleave(2, dim=-1).reshape(cos.shape[0], *([1] * extra_dims), -1)  # [T, 1.., rope_dim]
    sin = sin.repeat_interleave(2, dim=-1).reshape(sin.shape[0], *([1] * extra_dims), -1)
    if inverse:
        sin = -sin
    rope_dim = cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    rotated_half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + rotated_half.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


@reference_op
def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``apply_rope`` in place: rotates the trailing ``2 * cos.shape[-1]`` channels of ``x`` and returns ``x``
    (the pass-through channels are not touched). For tensors the caller owns, such as an op's fresh output."""
    rope_dim = 2 * cos.shape[-1]
    x[..., -rope_dim:] = apply_rope(x[..., -rope_dim:], cos, sin, inverse)
    return x


def normed_rope(norm: Callable, unweighted_norm: Callable, rope_: Callable) -> Callable:
    """``rms_norm_rope`` made of the given norms and in-place RoPE."""

    def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                      sin: torch.Tensor) -> torch.Tensor:
        return rope_(norm(x, weight, eps) if weight is not None else unweighted_norm(x, eps), cos, sin)

    return rms_norm_rope


rms_norm_rope = reference_op(normed_rope(rms_norm, unweighted_rms_norm, apply_rope_))
rms_norm_rope.__doc__ = """``apply_rope_(rms_norm(x, weight, eps), cos, sin)``, with ``unweighted_rms_norm`` where
``weight`` is None: a query / key norm, then RoPE on its trailing channels (``x [T, ..., dim]``, ``cos`` / ``sin
[T, rope_dim // 2]``); a new tensor. One op so that a backend may do both in one pass."""


# ----------------------------------------------------------------------------- linear
@reference_op
def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` without bias. ``x``: ``[..., in]``; ``weight``: ``[out, in]``."""
    return F.linear(x, weight)


@reference_op
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """Block-diagonal projection: group g of ``x`` times block g of ``weight``.

    ``x``: ``[T, groups, in_per_group]``; ``weight``: ``[groups * out_per_group, in_per_group]``;
    returns ``[T, groups, out_per_group]``.
    """
    w = weight.view(groups, -1, weight.shape[-1])  # [groups, out_per_group, in_per_group]
    return torch.einsum("tgi,goi->tgo", x, w)


# ----------------------------------------------------------------------------- a static decode step's index math
# A decode step replayed from a CUDA graph computes its layout (``DecodeLayout``) from per-sequence ``[S]`` tensors
# with these ops (one token per sequence, shapes fixed by the captured step): eagerly ~100 small integer kernels per
# step, so a backend may fuse each op into one or two. ``seq`` is ``arange(S)``; ``offsets`` an ``arange`` of the
# padded width. Values equal the host-built ``StepLayout``'s wherever that has them (tests/test_decode_layout.py).
@reference_op
def decode_key_index(context_lens: torch.Tensor, sliding_floor: torch.Tensor, seq: torch.Tensor,
                     offsets: torch.Tensor, window: int) -> tuple[torch.Tensor, ...]:
    """The sliding-window keys of a decode step, ``W = len(offsets)`` per sequence (``W >= window``): sequence ``s``
    reads positions from ``max(ctx - window + 1, sliding_floor, 0)`` (at most ``ctx``) up to its new token at
    ``ctx = context_lens[s]``; places past it are -1 (invisible). Returns ``key_from_new [S, W]`` (the new token),
    ``key_new_rows [S, W]`` (its row: ``s``, else 0), ``key_ring_index [S, W]`` (position % window),
    ``visible [S, 1, W]`` and ``ring_write_index [S]`` (where the new token lands in the ring)."""
    ctx = context_lens[:, None]  # [S, 1]
    first = torch.minimum(ctx, torch.maximum((ctx - (window - 1)).clamp(min=0), sliding_floor[:, None]))  # [S, 1]
    positions = first + offsets[None, :]  # [S, W]
    positions = torch.where(positions <= ctx, positions, -1)
    from_new = positions == ctx
    visible = (positions >= 0) & (positions > ctx - window)
    return (from_new, torch.where(from_new, seq[:, None], 0), positions.clamp(min=0) % window, visible[:, None, :],
            context_lens % window)


def entry_places(tables: torch.Tensor, entry_ids: torch.Tensor, counts: torch.Tensor,
                 per_block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each sequence's compressed entries live in a paged store: ``blocks [S, E]`` (0 past a sequence's
    ``counts [S]``), ``rows [S, E]`` inside the block, and ``real [S, E]`` (the entry exists), from the block tables
    ``[S, max blocks]`` and the entry ids ``[E]`` (``per_block`` entries per block)."""
    table_index = (entry_ids // per_block).clamp(max=tables.shape[1] - 1)[None, :].expand(tables.shape[0], -1)
    real = entry_ids[None, :] < counts[:, None]  # [S, E]
    blocks = torch.where(real, tables.gather(1, table_index), 0)  # [S, E]
    rows = (entry_ids % per_block)[None, :].expand(tables.shape[0], -1)  # [S, E]
    return blocks, rows, real


@reference_op
def decode_entry_places(context_lens: torch.Tensor, block_tables: torch.Tensor, entry_ids: torch.Tensor, ratio: int,
                        per_block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``entry_places`` of the entries each sequence has after a decode step (``(ctx + 1) // ratio``), padded to
    ``entry_ids [E]``: ``blocks [S, E]``, ``rows [S, E]``, ``real [S, E]``."""
    return entry_places(block_tables, entry_ids, (context_lens + 1) // ratio, per_block)


def window_plan(entry: torch.Tensor, ctx: torch.Tensor, first_row: torch.Tensor, slots: torch.Tensor,
                write_blocks: torch.Tensor, carry_writes: tuple, ratio: int, span: int, per_block: int,
                offsets: torch.Tensor, first_valid: torch.Tensor | int = 0) -> tuple[torch.Tensor, ...]:
    """The plan of compressor windows ``entry [N]`` (written to ``write_blocks [N]``) of sequences with ``ctx [N]``
    tokens in state, whose step rows start at ``first_row [N]`` and whose carry is slot ``slots [N]``; ``offsets``
    is ``arange(span)``; ``carry_writes`` = (rows, slots, position % span) of the tokens that stay in the carry.
    Slots before position ``first_valid`` (0, or ``[N, 1]``) are not pooled. Window ``w`` pools the positions
    ``(w + 1) * ratio - span + j``, ``j < span``. Returns the fields of ``layout.WindowPlan`` in order."""
    pos = ((entry + 1) * ratio - span)[:, None] + offsets[None, :]  # [N, span]
    from_new = pos >= ctx[:, None]  # [N, span]
    carry_rows, carry_slots, carry_index = carry_writes
    return (from_new, torch.where(from_new, first_row[:, None] + pos - ctx[:, None], 0),
            slots[:, None].expand(-1, span), pos.clamp(min=0) % span, pos >= first_valid, entry * ratio, write_blocks,
            entry % per_block, carry_rows, carry_slots, carry_index)


@reference_op
def decode_window_plan(context_lens: torch.Tensor, compressed_write_start: torch.Tensor, slots: torch.Tensor,
                       block_tables: torch.Tensor, seq: torch.Tensor, offsets: torch.Tensor, ratio: int, span: int,
                       per_block: int, spare_slot: int, spare_block: int) -> tuple[torch.Tensor, ...]:
    """``window_plan`` of a decode step: one window per sequence, in sequence order. A sequence's new token at
    ``ctx`` ends window ``ctx // ratio`` when ``(ctx + 1) % ratio == 0`` and the window starts at or after its
    ``compressed_write_start``; otherwise the window is a dummy: window 0 of a sequence whose tokens are all in the
    ``spare_slot``'s carry, pooling its last slot only, its entry landing in the ``spare_block`` (state no sequence
    reads). Every sequence's new token stays in its carry at ``ctx % span``."""
    window = context_lens // ratio  # [S]
    real = ((context_lens + 1) % ratio == 0) & (window * ratio >= compressed_write_start)  # [S]
    table_block = block_tables.gather(1, (window // per_block).clamp(max=block_tables.shape[1] - 1)[:, None])[:, 0]
    return window_plan(torch.where(real, window, 0), torch.where(real, context_lens, span), seq,
                       torch.where(real, slots, spare_slot), torch.where(real, table_block, spare_block),
                       (seq, slots, context_lens % span), ratio, span, per_block, offsets,
                       torch.where(real, 0, ratio - 1)[:, None])


# ----------------------------------------------------------------------------- attention
@reference_op
def gather_keys(ring: torch.Tensor, ring_slots: torch.Tensor, ring_index: torch.Tensor, new_kv: torch.Tensor,
                new_rows: torch.Tensor, from_new: torch.Tensor, store: torch.Tensor | None = None,
                entry_blocks: torch.Tensor | None = None, entry_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The keys ``[S, Lw + E, d]`` one attention call reads: every sequence's sliding-window keys, then its
    compressed entries.

    Window key ``j`` of sequence ``s`` is ``new_kv[new_rows[s, j]]`` (a token of this step) where
    ``from_new[s, j]``, else ``ring[ring_slots[s, j], ring_index[s, j]]`` (``ring [slots, W, d]``; the index
    tensors are ``[S, Lw]``). Entry ``e`` is ``store[entry_blocks[s, e], entry_rows[s, e]]`` (``store
    [blocks, rows, d]``, index tensors ``[S, E]``); without a ``store`` the result is the window keys alone.
    """
    from_ring = ring[ring_slots, ring_index]  # [S, Lw, d]
    from_step = new_kv[new_rows]  # [S, Lw, d]
    keys = torch.where(from_new[..., None], from_step, from_ring)
    if store is None:
        return keys
    entries = store[entry_blocks, entry_rows].to(keys.dtype)  # [S, E, d]
    return torch.cat([keys, entries], dim=1)


@reference_op
def write_rows_(dst: torch.Tensor, slots: torch.Tensor, index: torch.Tensor, src: torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:
    """Cache writes: ``dst[slots[m], index[m]] = src[rows[m]]`` (``src[m]`` where ``rows`` is None), cast to
    ``dst``'s dtype; ``dst`` is ``[A, B, width]``, ``src`` ``[N, width]``, the indices ``[M]``. Returns ``dst``. Where
    two writes name one place, which one lands is unspecified (the decode graphs' padded rows all write the spare
    slot)."""
    dst[slots, index] = (src if rows is None else src[rows]).to(dst.dtype)
    return dst


@reference_op
def sink_attention(
    q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Shared-KV multi-query attention with per-head sinks (K == V, one KV head).

    ``q``: ``[S, Lq, H, d]``; ``kv``: ``[S, Lk, d]``; ``visible``: ``[S, Lq, Lk]`` bool;
    ``sinks``: ``[H]``. Each head's softmax runs over its visible keys plus one sink logit whose
    probability mass is dropped. Returns ``[S, Lq, H, d]``; a row with nothing visible returns 0.
    """
    logits = torch.einsum("sqhd,skd->shqk", q, kv) * scale  # [S, H, Lq, Lk]
    logits = logits.masked_fill(~visible[:, None], float("-inf"))
    sink = sinks.to(logits.dtype).view(1, -1, 1, 1).expand(*logits.shape[:3], 1)  # [S, H, Lq, 1]
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1].to(kv.dtype)  # [S, H, Lq, Lk]
    return torch.einsum("shqk,skd->sqhd", probs, kv)


def roped_attention(norm_rope: Callable, attention: Callable, rope_: Callable) -> Callable:
    """``roped_sink_attention`` made of the given ``rms_norm_rope``, ``sink_attention`` and in-place RoPE."""

    def roped_sink_attention(q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor,
                             scale: float, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        flat_cos, flat_sin = cos.flatten(0, 1), sin.flatten(0, 1)  # [S * Lq, rope_dim // 2]
        q = norm_rope(q.flatten(0, 1), None, eps, flat_cos, flat_sin).view_as(q)  # [S, Lq, H, d]
        out = attention(q, kv, visible, sinks, scale)  # [S, Lq, H, d]
        return rope_(out.flatten(0, 1), flat_cos, flat_sin, inverse=True).view_as(out)

    return roped_sink_attention


roped_sink_attention = reference_op(roped_attention(rms_norm_rope, sink_attention, apply_rope_))
roped_sink_attention.__doc__ = """``sink_attention`` of the per-head RMS-normed, RoPE'd queries, its output rotated
back: ``q [S, Lq, H, d]`` (raw projections), ``cos`` / ``sin [S, Lq, rope_dim // 2]`` (each query's angle, padded as
``q``), the rest as ``sink_attention``; the queries' norm has no weight (``rms_norm_rope(q, None, eps, ...)``), the
output takes ``apply_rope_(..., inverse=True)``. One op so that a backend may norm the queries and rotate the output
inside its attention kernel."""


SPARSE_SLICE_KEYS = 1 << 26  # gathered key elements (query rows x keys x width) per slice of ``sparse_sink_attention``


@reference_op
def sparse_sink_attention(q: torch.Tensor, kv: torch.Tensor, index: torch.Tensor, sinks: torch.Tensor, scale: float,
                          store: torch.Tensor | None = None, entry_blocks: torch.Tensor | None = None,
                          entry_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``sink_attention`` where each query row lists the keys it reads: ``index [S, Lq, N]`` (int) names keys of the
    row's sequence, -1 for none; ``q [S, Lq, H, d]``, ``kv [S, Lk, d]``, ``sinks [H]``. Key ``j < Lk`` is ``kv[s,
    j]``; with a paged ``store [blocks, rows, d]`` key ``j >= Lk`` is compressed entry ``e = j - Lk``,
    ``store[entry_blocks[s, e], entry_rows[s, e]]`` (index tensors ``[S, E]``, as ``gather_keys`` reads them), read
    where it lies. Row ``(s, t)`` attends to every key it lists (one listed twice counts twice) plus the sink; a row
    listing nothing returns 0. Returns ``[S, Lq, H, d]``.

    Top-k sparse attention (FlashMLA's sparse kernels): a CSA row reads its window keys and the ``k`` entries its
    indexer selected, whatever the context. Equal to ``sink_attention`` under the mask of the listed keys, up to the
    order of sums. This statement gathers each row's keys, in query slices of at most ``SPARSE_SLICE_KEYS``
    elements; a backend reads them in place."""
    S, Lq, _, d = q.shape
    N = index.shape[-1]
    out = q.new_zeros(q.shape)
    if N == 0:
        return out
    if store is not None:
        kv = torch.cat([kv, store[entry_blocks, entry_rows].to(kv.dtype)], dim=1)  # [S, Lk + E, d]
    rows = max(1, min(Lq, SPARSE_SLICE_KEYS // max(1, S * N * d)))
    seq = torch.arange(S, device=kv.device)[:, None, None]  # [S, 1, 1]
    for start in range(0, Lq, rows):
        part = index[:, start:start + rows].long()  # [S, r, N]
        keys = kv[seq, part.clamp(min=0)]  # [S, r, N, d]
        logits = torch.einsum("sqhd,sqnd->sqhn", q[:, start:start + rows], keys) * scale  # [S, r, H, N]
        logits = logits.masked_fill((part < 0)[:, :, None, :], float("-inf"))
        sink = sinks.to(logits.dtype).view(1, 1, -1, 1).expand(*logits.shape[:3], 1)  # [S, r, H, 1]
        combined = torch.cat([logits, sink], dim=-1)
        probs = torch.softmax(combined - combined.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
        out[:, start:start + rows] = torch.einsum("sqhn,sqnd->sqhd", probs.to(kv.dtype), keys)
    return out


def rows_sparse_attention(attention: Callable) -> Callable:
    """``sparse_sink_attention`` made of a ``sink_attention``: each query row a one-query row of its own over its
    listed keys, gathered (``[S * Lq, N, d]``). A row's result then depends on its own keys alone wherever
    ``attention``'s does (the batch-invariant mode's)."""

    def sparse_sink_attention(q: torch.Tensor, kv: torch.Tensor, index: torch.Tensor, sinks: torch.Tensor,
                              scale: float, store: torch.Tensor | None = None, entry_blocks: torch.Tensor | None = None,
                              entry_rows: torch.Tensor | None = None) -> torch.Tensor:
        S, Lq, H, d = q.shape
        N = index.shape[-1]
        if N == 0:
            return q.new_zeros(q.shape)
        if store is not None:
            kv = torch.cat([kv, store[entry_blocks, entry_rows].to(kv.dtype)], dim=1)  # [S, Lk + E, d]
        seq = torch.arange(S, device=kv.device)[:, None, None]  # [S, 1, 1]
        keys = kv[seq, index.long().clamp(min=0)].view(S * Lq, N, d)  # [S * Lq, N, d]
        out = attention(q.reshape(S * Lq, 1, H, d), keys, (index >= 0).view(S * Lq, 1, N), sinks, scale)
        return out.view(S, Lq, H, d)

    return sparse_sink_attention


def roped_sparse_attention(norm_rope: Callable, attention: Callable, rope_: Callable) -> Callable:
    """``roped_sparse_sink_attention`` made of the given ``rms_norm_rope``, ``sparse_sink_attention`` and in-place
    RoPE."""

    def roped_sparse_sink_attention(q: torch.Tensor, kv: torch.Tensor, index: torch.Tensor, sinks: torch.Tensor,
                                    scale: float, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                                    store: torch.Tensor | None = None, entry_blocks: torch.Tensor | None = None,
                                    entry_rows: torch.Tensor | None = None) -> torch.Tensor:
        flat_cos, flat_sin = cos.flatten(0, 1), sin.flatten(0, 1)  # [S * Lq, rope_dim // 2]
        q = norm_rope(q.flatten(0, 1), None, eps, flat_cos, flat_sin).view_as(q)  # [S, Lq, H, d]
        out = attention(q, kv, index, sinks, scale, store, entry_blocks, entry_rows)  # [S, Lq, H, d]
        return rope_(out.flatten(0, 1), flat_cos, flat_sin, inverse=True).view_as(out)

    return roped_sparse_sink_attention


roped_sparse_sink_attention = reference_op(roped_sparse_attention(rms_norm_rope, sparse_sink_attention, apply_rope_))
roped_sparse_sink_attention.__doc__ = """``sparse_sink_attention`` of the per-head RMS-normed, RoPE'd queries, its
output rotated back, as ``roped_sink_attention`` (whose ``visible`` mask becomes the keys' ``index [S, Lq, N]``, -1
for none; the compressed entries in the paged ``store`` where it is given)."""


@reference_op
def visible_index(visible: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` visible places of each row of ``visible [..., N]`` (bool), ascending, then -1: ``[...,
    count]`` int32. Turns a mask (the sliding window's, the indexer's selection) into the key lists
    ``sparse_sink_attention`` reads."""
    n = visible.shape[-1]
    places = torch.arange(n, device=visible.device).expand_as(visible)
    ordered = torch.where(visible, places, n).sort(dim=-1).values[..., :count]  # visible places first, ascending
    ordered = torch.where(ordered < n, ordered, -1).to(torch.int32)
    if ordered.shape[-1] < count:
        ordered = F.pad(ordered, (0, count - ordered.shape[-1]), value=-1)
    return ordered


# ----------------------------------------------------------------------------- compressors / indexer
@reference_op
def compressor_pool(kv: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Pool each window's slots into one compressed entry, then RMSNorm it.

    ``kv`` / ``gate``: ``[N, slots, d]`` (gate already includes the position bias; masked slots
    carry ``-inf``). Softmax over slots per channel in fp32. Returns ``[N, d]``.
    """
    weights = gate.float().softmax(dim=1).to(kv.dtype)  # [N, slots, d]
    return rms_norm((kv * weights).sum(dim=1), norm_weight, eps)


@reference_op
def compressor_window(
    raw_kv: torch.Tensor,
    raw_gate: torch.Tensor,
    carry_kv: torch.Tensor,
    carry_gate: torch.Tensor,
    from_new: torch.Tensor,
    new_rows: torch.Tensor,
    carry_slots: torch.Tensor,
    carry_index: torch.Tensor,
    valid: torch.Tensor,
    ape: torch.Tensor,
    ratio: int,
    overlap: bool,
):
    """The input slots of every window a compressor completes this step: ``kv``, ``gate [N, slots, d]``.

    Slot ``j`` of window ``n`` is row ``new_rows[n, j]`` of this step's ``raw_kv`` / ``raw_gate [T, width]`` where
    ``from_new [N, span]``, else the carry's ``[carry_slots, carry_index]`` (``carry_kv`` / ``carry_gate
    [slots, span, width]``: the sequence's earlier tokens). The gate gets the position bias ``ape [ratio, width]``;
    slots before position 0 (``~valid``) get kv 0 and gate -inf. With ``overlap`` (CSA: width = 2 d, span = 2
    ratio) slots ``[0, ratio)`` take the first d channels (the previous window's half) and ``[ratio, 2 ratio)``
    the last d; otherwise d = width.
    """
    new_mask = from_new[..., None]  # [N, span, 1]
    kv = torch.where(new_mask, raw_kv[new_rows], carry_kv[carry_slots, carry_index].to(raw_kv.dtype))
    gate = torch.where(new_mask, raw_gate[new_rows], carry_gate[carry_slots, carry_index].to(raw_gate.dtype))
    ape = ape.to(gate.dtype)  # [ratio, width]
    if overlap:
        d, r = kv.shape[-1] // 2, ratio
        kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)  # [N, 2r, d]
        gate = torch.cat([gate[:, :r, :d] + ape[:, :d], gate[:, r:, d:] + ape[:, d:]], dim=1)
    else:
        gate = gate + ape
    valid = valid[..., None]
    return kv.masked_fill(~valid, 0.0), gate.masked_fill(~valid, float("-inf"))


def pooled_windows(window: Callable, pool: Callable) -> Callable:
    """``compressor_entries`` made of a ``compressor_window`` and a ``compressor_pool`` implementation."""

    def compressor_entries(raw_kv: torch.Tensor, raw_gate: torch.Tensor, carry_kv: torch.Tensor,
                           carry_gate: torch.Tensor, from_new: torch.Tensor, new_rows: torch.Tensor,
                           carry_slots: torch.Tensor, carry_index: torch.Tensor, valid: torch.Tensor, ape: torch.Tensor,
                           norm_weight: torch.Tensor, eps: float, ratio: int, overlap: bool) -> torch.Tensor:
        """The compressed entries ``[N, d]`` of the windows a compressor completes this step:
        ``compressor_pool(*compressor_window(...), norm_weight, eps)`` (see those two ops)."""
        kv, gate = window(raw_kv, raw_gate, carry_kv, carry_gate, from_new, new_rows, carry_slots, carry_index, valid,
                          ape, ratio, overlap)  # [N, slots, d] each
        return pool(kv, gate, norm_weight, eps)

    return compressor_entries


compressor_entries = reference_op(pooled_windows(compressor_window, compressor_pool))


def entries_rope(entries: Callable, rope_: Callable) -> Callable:
    """``compressor_entries_rope`` made of the given ``compressor_entries`` and in-place RoPE."""

    def compressor_entries_rope(raw_kv: torch.Tensor, raw_gate: torch.Tensor, carry_kv: torch.Tensor,
                                carry_gate: torch.Tensor, from_new: torch.Tensor, new_rows: torch.Tensor,
                                carry_slots: torch.Tensor, carry_index: torch.Tensor, valid: torch.Tensor,
                                ape: torch.Tensor, norm_weight: torch.Tensor, eps: float, ratio: int, overlap: bool,
                                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        pooled = entries(raw_kv, raw_gate, carry_kv, carry_gate, from_new, new_rows, carry_slots, carry_index, valid,
                         ape, norm_weight, eps, ratio, overlap)  # [N, d]
        return rope_(pooled, cos, sin)

    return compressor_entries_rope


compressor_entries_rope = reference_op(entries_rope(compressor_entries, apply_rope_))
compressor_entries_rope.__doc__ = """``apply_rope_(compressor_entries(...), cos, sin)``: the compressed entries with
RoPE on their trailing channels at the entries' positions (``cos`` / ``sin [N, rope_dim // 2]``), as the store keeps
them. One op so that a backend may rotate the entries where it norms them."""


@reference_op
def indexer_scores(
    q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, scale: float
) -> torch.Tensor:
    """Lightning-indexer scores ``sum_h w[t, h] * relu(q[t, h] . k[e]) * scale`` in fp32.

    ``q``: ``[S, Lq, Hi, di]``; ``keys``: ``[S, E, di]``; ``head_weights``: ``[S, Lq, Hi]``.
    Returns ``[S, Lq, E]``.
    """
    dots = torch.einsum("sqhd,sed->sqhe", q.float(), keys.float())  # [S, Lq, Hi, E]
    return (F.relu(dots) * scale * head_weights.float()[..., None]).sum(dim=2)


@reference_op
def indexer_topk(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """Select up to ``k`` visible entries per query: a bool mask ``[S, Lq, E]``.

    Tie rule (deterministic, documented): higher score first; among equal scores the lower entry
    index wins. Entries that are not visible are never selected.
    """
    masked = scores.masked_fill(~visible, float("-inf"))  # [S, Lq, E]
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :k]  # [S, Lq, k]
    selected = torch.zeros_like(visible)
    selected.scatter_(-1, order, True)
    return selected & visible


def selected_index(topk: Callable, index: Callable) -> Callable:
    """``indexer_topk_index`` made of the given ``indexer_topk`` and ``visible_index``."""

    def indexer_topk_index(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
        return index(topk(scores, visible, k), k)

    return indexer_topk_index


indexer_topk_index = reference_op(selected_index(indexer_topk, visible_index))
indexer_topk_index.__doc__ = """``indexer_topk``'s selection as entry indices: ``[S, Lq, k]`` int32, each query row's
selected entries ascending, then -1 (``visible_index`` of the selection). What sparse attention reads; a backend may
write the indices where it selects, never making the ``[S, Lq, E]`` mask."""


def counted_index(topk_index: Callable) -> Callable:
    """``indexer_topk_index_counts`` made of the given ``indexer_topk_index``."""

    def indexer_topk_index_counts(scores: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
        """``topk_index`` under the visibility ``counts`` stands for: each row's first ``counts`` entries."""
        entries = torch.arange(scores.shape[-1], device=scores.device)  # [E]
        return topk_index(scores, entries < counts[..., None], k)  # mask [S, Lq, E] of this call's rows only

    return indexer_topk_index_counts


indexer_topk_index_counts = reference_op(counted_index(indexer_topk_index))
indexer_topk_index_counts.__doc__ = """``indexer_topk_index`` where each query row sees a prefix of the entries:
``counts [S, Lq]`` int32 visible entries per row (row ``t`` sees entries ``[0, counts[s, t])``; causal compression
makes every row's visible entries a prefix), instead of a ``[S, Lq, E]`` mask. ``scores [S, Lq, E]`` -> ``[S, Lq,
k]`` int32, ascending, then -1. The spec builds the mask of the rows it is given; a backend reads the counts and
makes none (invisible entries rank after every visible one, so a row's selection is the top-``k`` of its prefix)."""


# ----------------------------------------------------------------------------- hyper-connections
@reference_op
def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
):
    """mHC weights and the collapsed block input.

    ``streams``: ``[T, hc, D]``; ``fn``: ``[(2 + hc) * hc, hc * D]``. Returns ``post [T, hc]``,
    ``comb [T, hc, hc]`` (doubly stochastic after Sinkhorn, fp32) and ``collapsed [T, D]``.
    """
    mixed = hc_mix_logits(streams, fn, norm_eps)  # [T, (2 + hc) * hc]
    pre, post, comb = hc_weights(mixed, base, scale, streams.shape[1], sinkhorn_iters, hc_eps)
    return post, comb, hc_collapse(pre, streams)


def pre_normed(pre: Callable, norm: Callable) -> Callable:
    """``hc_pre_normed`` made of the given ``hc_pre`` and ``rms_norm``."""

    def hc_pre_normed(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                      sinkhorn_iters: int, hc_eps: float, norm_eps: float, norm_weight: torch.Tensor):
        post, comb, collapsed = pre(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)
        return post, comb, norm(collapsed, norm_weight, norm_eps)

    return hc_pre_normed


hc_pre_normed = reference_op(pre_normed(hc_pre, rms_norm))
hc_pre_normed.__doc__ = """``hc_pre``, then ``rms_norm(collapsed, norm_weight, norm_eps)``: the block's input as the
attention / MoE reads it (``post [T, hc]``, ``comb [T, hc, hc]``, the normed ``[T, D]``). One op so that a backend may norm the
collapse where it makes it."""


def hc_mix_logits(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """``hc_pre``'s first part: the RMS-normed flattened streams ``[T, hc * D]`` times ``fn``, in fp32."""
    flat = unweighted_rms_norm(streams.flatten(1).float(), norm_eps)  # [T, hc * D]
    return F.linear(flat, fn.float())  # [T, (2 + hc) * hc]


def hc_weights(mixed: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, sinkhorn_iters: int,
               hc_eps: float, sigmoid=torch.sigmoid):
    """``hc_pre``'s second part: ``pre [T, hc]``, ``post [T, hc]`` and the Sinkhorn-normalised ``comb [T, hc, hc]``
    from the mixing logits ``mixed [T, (2 + hc) * hc]`` (fp32). ``sigmoid`` lets a variant keep this form and swap
    the elementwise sigmoid."""
    tokens = mixed.shape[0]
    pre_w, post_w, comb_w = mixed.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    pre_s, post_s, comb_s = scale.float().unbind(0)
    pre = sigmoid(pre_w * pre_s + pre_b) + hc_eps  # [T, hc]
    post = 2 * sigmoid(post_w * post_s + post_b)  # [T, hc]
    comb = hc_sinkhorn(comb_w.view(tokens, hc, hc) * comb_s + comb_b.view(hc, hc), sinkhorn_iters, hc_eps)
    return pre, post, comb


def hc_sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The mixing matrix ``[T, hc, hc]`` from its logits: softmax over the last axis plus ``eps``, then
    normalised over columns, and ``iters - 1`` more times over rows then columns (fp32)."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """``hc_pre``'s last part: the block input ``sum_k pre[t, k] * streams[t, k]``, ``[T, D]`` in the streams' dtype."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


@reference_op
def hc_post(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams ``out[k] = post[k] * block_out + sum_j comb[j, k] * streams[j]``; ``[T, hc, D]``."""
    dtype = streams.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)  # [T, hc, D]
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed


def post_sum(post: Callable) -> Callable:
    """``hc_post_sum`` made of the given ``hc_post``."""

    def hc_post_sum(streams: torch.Tensor, block_a: torch.Tensor, block_b: torch.Tensor, post_weights: torch.Tensor,
                    comb: torch.Tensor) -> torch.Tensor:
        return post(streams, block_a + block_b, post_weights, comb)

    return hc_post_sum


hc_post_sum = reference_op(post_sum(hc_post))
hc_post_sum.__doc__ = """``hc_post(streams, block_a + block_b, post, comb)``: a block whose output is a sum of two
tensors (the MoE's routed and shared experts, ``[T, D]`` each). One op so that a backend may add them where it reads
the block output."""


@reference_op
def hc_head(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float, norm_eps: float
) -> torch.Tensor:
    """Final collapse of the hc streams ``[T, hc, D]`` into ``[T, D]``: ``hc_pre``'s mixing logits and collapse with
    one sigmoid weight per stream."""
    mixes = hc_mix_logits(streams, fn, norm_eps)  # [T, hc]
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps  # [T, hc]
    return hc_collapse(pre, streams)


# ----------------------------------------------------------------------------- MoE
def _score(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


def _normalise(scores: torch.Tensor, ids: torch.Tensor, scaling: float) -> torch.Tensor:
    weights = scores.gather(1, ids)  # [T, k]
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scaling


@reference_op
def moe_route_topk(
    router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, scaling: float, scoring_func: str
):
    """Top-k routing: select by ``score + correction_bias``, weight by the renormalised score.

    ``router_logits``: ``[T, E]``. Returns ``weights [T, k]`` and logical expert ``ids [T, k]``.
    Ties in the biased score go to the lower expert id.
    """
    scores = _score(router_logits, scoring_func)  # [T, E]
    biased = scores + correction_bias.to(scores.dtype)
    ids = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :top_k]  # [T, k]
    return _normalise(scores, ids, scaling), ids


@reference_op
def moe_route_hash(router_logits: torch.Tensor, token_ids: torch.Tensor, tid2eid: torch.Tensor, scaling: float,
                   scoring_func: str):
    """Hash routing: experts come from the frozen ``tid2eid[token_id]`` table; weights from the router."""
    scores = _score(router_logits, scoring_func)  # [T, E]
    ids = tid2eid[token_ids].long()  # [T, k]
    return _normalise(scores, ids, scaling), ids


@reference_op
def swiglu_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, limit: float) -> torch.Tensor:
    """``w2 @ (silu(clamp(w1 x, max=limit)) * clamp(w3 x, -limit, limit))``; ``x``: ``[T, D]``."""
    gate = F.linear(x, w1).clamp(max=limit)  # [T, I]
    up = F.linear(x, w3).clamp(min=-limit, max=limit)
    return F.linear(F.silu(gate) * up, w2)


@reference_op
def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    limit: float,
    expert_mlp=None,
) -> torch.Tensor:
    """Routed experts: each token's output is ``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])``.

    ``x``: ``[T, D]``; ``ids`` / ``weights``: ``[T, k]`` (physical expert slots); ``w1`` / ``w3``:
    ``[E, I, D]``; ``w2``: ``[E, D, I]``. Each touched expert's weights are read once; tokens are
    combined in a fixed order (by expert, then by token). ``expert_mlp`` (default ``swiglu_mlp``) lets a
    variant keep this combine and swap the per-expert MLP.
    """
    expert_mlp = expert_mlp or swiglu_mlp
    return routed_sum(x, ids, weights, w1.shape[0],
                      lambda expert, rows: expert_mlp(rows, w1[expert], w2[expert], w3[expert], limit))


def routed_sum(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int,
               run_expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``sum_k weights[t, k] * run_expert(ids[t, k], x[t])`` for every token: each touched expert runs once on its
    rows (``run_expert(expert, rows [n, D]) -> [n, D]``), combined by expert, then by token."""
    out = torch.zeros_like(x)  # [T, D]
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        picks = order[start : start + count]  # flat (token, slot) indices
        start += count
        tokens = picks // ids.shape[1]
        expert_out = run_expert(expert, x[tokens])  # [count, D]
        scale = weights.reshape(-1)[picks].unsqueeze(-1).to(expert_out.dtype)
        out.index_add_(0, tokens, (expert_out * scale).to(out.dtype))
    return out


# ----------------------------------------------------------------------------- quantized weights
# Weights held as stored (deepinfer_core.quant): each op dequantizes exactly (fp32), casts to the activations' dtype
# and runs its unquantized twin's math; activations are never quantized. A backend overrides these names with
# kernels that read the stored bytes; ``linear`` / ``moe_experts`` never see a quantized tensor.
@reference_op
def linear_fp8_block(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     block: tuple[int, int]) -> torch.Tensor:
    """``linear`` with an fp8 block weight: ``weight`` float8_e4m3fn ``[out, in]``, ``scale`` (ue8m0 or float32)
    ``[ceil(out / B0), ceil(in / B1)]`` for ``block = (B0, B1)``; ``x``: ``[..., in]``."""
    return F.linear(x, fp8_block.dequantize(weight, scale, block).to(x.dtype))


@reference_op
def grouped_linear_fp8_block(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                             groups: int) -> torch.Tensor:
    """``grouped_linear`` with an fp8 block weight (``weight [groups * out_per_group, in_per_group]``)."""
    return grouped_linear(x, fp8_block.dequantize(weight, scale, block).to(x.dtype), groups)


@reference_op
def swiglu_mlp_fp8_block(x: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                         w3: torch.Tensor, s3: torch.Tensor, block: tuple[int, int], limit: float) -> torch.Tensor:
    """``swiglu_mlp`` with fp8 block weights, each followed by its scale (the shared expert)."""
    w1, w2, w3 = (fp8_block.dequantize(w, s, block).to(x.dtype) for w, s in ((w1, s1), (w2, s2), (w3, s3)))
    return swiglu_mlp(x, w1, w2, w3, limit)


@reference_op
def moe_experts_fp8_block(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                          s1: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor,
                          block: tuple[int, int], limit: float) -> torch.Tensor:
    """``moe_experts`` with fp8 block experts: ``w1`` / ``w3`` ``[E, I, D]``, ``w2`` ``[E, D, I]`` float8_e4m3fn,
    each followed by its scale ``[E, ceil(rows / B0), ceil(cols / B1)]``."""

    def run_expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        w = [fp8_block.dequantize(w[e], s[e], block).to(x.dtype) for w, s in ((w1, s1), (w2, s2), (w3, s3))]
        return swiglu_mlp(rows, *w, limit)

    return routed_sum(x, ids, weights, w1.shape[0], run_expert)


@reference_op
def moe_experts_mxfp4(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor,
                      w2: torch.Tensor, s2: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor,
                      limit: float) -> torch.Tensor:
    """``moe_experts`` with MXFP4 experts: ``w1`` / ``w3`` uint8 ``[E, I, D / 2]``, ``w2`` ``[E, D, I / 2]`` (two
    e2m1 codes per byte, low nibble first), each followed by its ue8m0 scale ``[E, rows, cols / 32]``."""

    def run_expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        w = [mxfp4.dequantize(w[e], s[e]).to(x.dtype) for w, s in ((w1, s1), (w2, s2), (w3, s3))]
        return swiglu_mlp(rows, *w, limit)

    return routed_sum(x, ids, weights, w1.shape[0], run_expert)


# ----------------------------------------------------------------------------- head
@reference_op
def logits(hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """Vocabulary logits in fp32: ``[T, D] x [V, D] -> [T, V]``."""
    return F.linear(hidden, head).float()


@reference_op
def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain greedy sampling of fp32 ``logits [R, V]``: each row's argmax (ties to the lowest id), its raw
    log-probability (``log_softmax``) and rank (how many tokens are at least as likely): ``[R]`` int64, float32,
    int64. The sampler calls it for a step whose every row is greedy with nothing to apply first (no penalty, no
    mask, no top-n); it is ``sampling.sampler.greedy_rows``."""
    return greedy_rows(logits)


@reference_op
def embed(token_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Embedding lookup: ``[T] -> [T, D]``."""
    return F.embedding(token_ids, table)

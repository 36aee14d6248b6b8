"""Batch-invariant CPU variants of the op table (same signatures as ``deepinfer_core.ops.reference``).

A token's result depends only on that token's inputs (and, for attention, its own sequence's keys), never
on how many other tokens or sequences share the call, where it sits in the batch, or how the batch is
padded. ``VARIANTS`` maps op names to the variants; ``REFERENCE_KEPT`` names the ops whose reference
implementation is already invariant on CPU, with the reason. In batch-invariant mode the plugin installs
both, so a backend's own (possibly batch-dependent) fast path never stays in the table.

See ``primitives`` for what breaks invariance on CPU and the building blocks used against it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepinfer_batch_invariant import quantized
from deepinfer_batch_invariant.forms import ROW_FORMS, InvariantOps, Kit
from deepinfer_batch_invariant.primitives import KV_CHUNK, chunks_for, fold, matmul_nt, sigmoid, silu, softplus
from deepinfer_core.ops import reference as _ref

QUERY_BLOCK = 256
"""Queries per attention / indexer block (bounds memory; blocks never change a query's result)."""


# ----------------------------------------------------------------------------- the CPU kit
def _pool(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Softmax over slots taken along the last axis, the weighted sum folded in slot order.

    The reference's softmax over a middle axis and its sum over slots are per-window invariant when the
    channel count is a multiple of the SIMD width (V4's 512 / 128), but not in general (measured: 100
    channels, 3 slots); this form is invariant for any width.
    """
    weights = gate.float().transpose(1, 2).softmax(dim=-1).transpose(1, 2).to(kv.dtype)  # [N, slots, d]
    return fold(kv * weights, dim=1)


CPU_KIT = Kit(
    matmul_nt=matmul_nt, sigmoid=sigmoid, silu=silu, softplus=softplus,
    row_sum=lambda x: x.sum(dim=-1, keepdim=True),  # a short contiguous row: one scalar loop per row
    collapse=lambda w, streams: fold(w.unsqueeze(-1) * streams, dim=1),
    hc_weights=functools.partial(_ref.hc_weights, sigmoid=sigmoid),  # torch's CPU sigmoid is not invariant
    pool=_pool, rms_norm=_ref.rms_norm, unweighted_rms_norm=_ref.unweighted_rms_norm,
)
CPU_OPS = InvariantOps(CPU_KIT)
"""The shared forms (``forms.InvariantOps``) over the CPU primitives."""


# ----------------------------------------------------------------------------- attention
def sink_attention(
    q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Reference ``sink_attention`` computed per query over exactly its own visible keys.

    For every query the visible keys are gathered in key order (sliding window, then compressed
    entries) and split into chunks of ``KV_CHUNK``; scores and the weighted sum of each chunk are
    fixed-shape GEMMs, the softmax max is exact, and the chunks' partial sums are folded in chunk order
    (a query's chunks past its own key count are skipped, not added as zeros). So a query's output does
    not depend on how far the batch pads keys (``Lk``) or queries (``Lq``), on the other sequences, or on
    how its own prompt was chunked. Computed in fp32; returns ``q.dtype``.
    """
    S, Lq, H, d = q.shape
    out = q.new_zeros(S, Lq, H, d)
    seq, row = visible.any(-1).nonzero(as_tuple=True)  # queries with at least one visible key
    if seq.numel() == 0:
        return out
    sink = sinks.float().view(1, H)
    Lk = kv.shape[1]
    kv = torch.cat([kv.float(), kv.new_zeros(S, 1, d, dtype=torch.float32)], dim=1)  # key Lk: a zero key
    for start in range(0, seq.numel(), QUERY_BLOCK):
        s_b, r_b = seq[start:start + QUERY_BLOCK], row[start:start + QUERY_BLOCK]
        out[s_b, r_b] = _attend(q[s_b, r_b].float(), kv, Lk, s_b, visible[s_b, r_b], sink, scale).to(out.dtype)
    return out


def _attend(q: torch.Tensor, kv: torch.Tensor, zero_key: int, seq: torch.Tensor, vis: torch.Tensor,
            sink: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of queries ``q [Q, H, d]`` (of sequences ``seq``) over their visible keys ``vis [Q, Lk]``.

    ``kv [S, Lk + 1, d]`` (fp32) ends with a zero key at index ``zero_key``, which fills every chunk
    position past a query's own keys (so padding contributes exact zeros, whatever the batch pads with).
    """
    Q, H, d = q.shape
    C = KV_CHUNK
    counts = vis.sum(-1)  # [Q]
    order = torch.sort((~vis).to(torch.uint8), dim=-1, stable=True).indices  # visible keys first, in key order
    nc = chunks_for(int(counts.max()))
    L = nc * C
    if order.shape[1] < L:
        order = torch.cat([order, order.new_zeros(Q, L - order.shape[1])], dim=1)
    valid = torch.arange(L, device=vis.device)[None, :] < counts[:, None]  # [Q, L]
    order = torch.where(valid, order[:, :L], zero_key)
    keys = kv[seq[:, None], order].view(Q * nc, C, d)  # [Q * nc, C, d]
    queries = q.unsqueeze(1).expand(Q, nc, H, d).reshape(Q * nc, H, d)
    scores = torch.bmm(queries, keys.transpose(1, 2)).view(Q, nc, H, C) * scale  # items [H, d] x [d, C]
    scores = scores.masked_fill(~valid.view(Q, nc, 1, C), float("-inf"))
    m = torch.maximum(scores.amax(dim=(1, 3)), sink)  # [Q, H]; max is exact in any order
    probs = torch.exp(scores - m[:, None, :, None])  # [Q, nc, H, C]
    denom_parts = probs.sum(dim=-1)  # [Q, nc, H]: fixed-length row sums
    out_parts = torch.bmm(probs.view(Q * nc, H, C), keys).view(Q, nc, H, d)  # items [H, C] x [C, d]
    denom, acc = denom_parts[:, 0], out_parts[:, 0]
    for c in range(1, nc):
        real = (counts > c * C)[:, None]  # [Q, 1]: the query has keys in chunk c
        denom = torch.where(real, denom + denom_parts[:, c], denom)
        acc = torch.where(real[..., None], acc + out_parts[:, c], acc)
    denom = denom + torch.exp(sink - m)  # the sink's mass is in the denominator only
    return acc / denom[..., None]  # [Q, H, d]


# ----------------------------------------------------------------------------- indexer
def indexer_scores(q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference ``indexer_scores`` with the entry axis split into fixed ``KV_CHUNK`` chunks.

    Every (query, chunk) dot product is one fixed-shape GEMM item ``[Hi, di] x [di, KV_CHUNK]``, and the
    weighted sum over heads is a left fold in head order, so a query's scores do not depend on ``Lq``,
    ``E`` (padded to the batch's longest sequence) or the other sequences.
    """
    S, Lq, Hi, di = q.shape
    E = keys.shape[1]
    out = torch.zeros(S, Lq, E, dtype=torch.float32, device=q.device)
    if E == 0 or S * Lq == 0:
        return out
    C = KV_CHUNK
    nc = chunks_for(E)
    padded = torch.zeros(S, nc * C, di, dtype=torch.float32, device=q.device)
    padded[:, :E] = keys.float()
    padded = padded.view(S, nc, C, di)
    queries = q.float().reshape(S * Lq, Hi, di)
    weights = head_weights.float().reshape(S * Lq, Hi)
    seq = torch.arange(S, device=q.device).repeat_interleave(Lq)  # [S * Lq]
    flat = out.view(S * Lq, E)
    for start in range(0, S * Lq, QUERY_BLOCK):
        rows = slice(start, start + QUERY_BLOCK)
        R = queries[rows].shape[0]
        a = queries[rows].unsqueeze(1).expand(R, nc, Hi, di).reshape(R * nc, Hi, di)
        b = padded[seq[rows]].reshape(R * nc, C, di)
        dots = torch.bmm(a, b.transpose(1, 2)).view(R, nc, Hi, C)
        terms = F.relu(dots) * scale * weights[rows][:, None, :, None]  # [R, nc, Hi, C]
        flat[rows] = fold(terms, dim=2).reshape(R, nc * C)[:, :E]
    return out


VARIANTS: dict[str, Callable] = {
    **CPU_OPS.table(ROW_FORMS),
    "sink_attention": sink_attention,
    "indexer_scores": indexer_scores,
}
VARIANTS["compressor_entries"] = _ref.pooled_windows(_ref.compressor_window, VARIANTS["compressor_pool"])
"""The windows as the reference gathers them, pooled by this module's ``compressor_pool``."""
VARIANTS["compressor_entries_rope"] = _ref.entries_rope(VARIANTS["compressor_entries"], _ref.apply_rope_)
"""Those entries, then the reference's in-place RoPE (elementwise)."""
VARIANTS["hc_pre_normed"] = _ref.pre_normed(VARIANTS["hc_pre"], _ref.rms_norm)
"""This module's ``hc_pre``, then the reference norm (kept below)."""
VARIANTS["hc_post_sum"] = _ref.post_sum(VARIANTS["hc_post"])
"""The MoE's two outputs added (elementwise), then this module's ``hc_post``."""
VARIANTS["roped_sink_attention"] = _ref.roped_attention(_ref.rms_norm_rope, VARIANTS["sink_attention"],
                                                       _ref.apply_rope_)
"""The reference query norm and RoPE (kept below), this module's ``sink_attention``, the reference's RoPE back."""
VARIANTS["sparse_sink_attention"] = _ref.rows_sparse_attention(VARIANTS["sink_attention"])
VARIANTS["roped_sparse_sink_attention"] = _ref.roped_sparse_attention(_ref.rms_norm_rope, VARIANTS["sparse_sink_attention"],
                                                                     _ref.apply_rope_)
"""Top-k sparse attention: each query row over its own listed keys through this module's ``sink_attention``."""
VARIANTS.update(quantized.variants(VARIANTS))
"""The quantized-weight ops: exact dequantization, then this module's linear / MLP / expert ops."""

REFERENCE_KEPT: dict[str, str] = {
    "rms_norm": "row reduction of fixed length; torch splits a reduction across threads only when the output "
                "is one element and the input >= 32768 (rows here are <= hc * hidden < 32768)",
    "unweighted_rms_norm": "as rms_norm; rsqrt's vector and scalar paths agree bit for bit",
    "rope_cos_sin": "elementwise cos / sin, same bits wherever an element sits",
    "apply_rope": "elementwise IEEE arithmetic only",
    "indexer_topk": "a stable sort per query row; padding entries are -inf and never outrank visible ones",
    "compressor_window": "gathers, selects, concatenation and one IEEE addition per element: no reduction",
    "embed": "a gather",
    "gather_keys": "gathers, a select and a concatenation: no arithmetic",
    "apply_rope_": "apply_rope written back into its input: the same elementwise arithmetic",
    "fork": "runs its function at once: no arithmetic of its own",
    "write_rows_": "a gather and a scatter of whole rows: no arithmetic",
    "rms_norm_rope": "rms_norm / unweighted_rms_norm, then apply_rope_: each kept above",
    "decode_key_index": "integer index math per sequence: no floating point",
    "visible_index": "integer compaction of a mask row: no floating point",
    "indexer_topk_index": "indexer_topk (kept) and visible_index: a permutation and integer compaction",
    "indexer_topk_index_counts": "an integer comparison per entry, then indexer_topk_index (kept)",
    "decode_entry_places": "integer index math per sequence and a gather: no floating point",
    "decode_window_plan": "integer index math per sequence and a gather: no floating point",
    "moe_experts_expert_parallel": "whole rows moved by all-to-all; the local experts run through the table's "
                                   "moe_experts (this mode's invariant one); each token's expert outputs are summed "
                                   "in a fixed order (by expert id, then slot)",
    "greedy_sample": "per row: an exact max and lowest-id min, the sampler's log_softmax (vectorised over the row "
                     "whatever the batch) and an integer count",
}

"""Batch-invariant CPU variants of the op table (same signatures as ``deepinfer_core.ops.reference``).

A token's result depends only on that token's inputs (and, for attention, its own sequence's keys), never
on how many other tokens or sequences share the call, where it sits in the batch, or how the batch is
padded. ``VARIANTS`` maps op names to the variants; ``REFERENCE_KEPT`` names the ops whose reference
implementation is already invariant on CPU, with the reason. In batch-invariant mode the plugin installs
both, so a backend's own (possibly batch-dependent) fast path never stays in the table.

See ``primitives`` for what breaks invariance on CPU and the building blocks used against it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepinfer_batch_invariant.primitives import KV_CHUNK, chunks_for, fold, matmul_nt, sigmoid, silu, softplus
from deepinfer_core.ops import reference as _ref

QUERY_BLOCK = 256
"""Queries per attention / indexer block (bounds memory; blocks never change a query's result)."""


# ----------------------------------------------------------------------------- linear
def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in fixed row tiles (``primitives.matmul_nt``)."""
    return matmul_nt(x, weight)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """Block-diagonal projection, one fixed-tile GEMM per group. ``x [T, g, i]`` -> ``[T, g, o]``."""
    w = weight.view(groups, -1, weight.shape[-1])  # [g, o, i]
    return torch.stack([matmul_nt(x[:, g], w[g]) for g in range(groups)], dim=1)


def logits(hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """Vocabulary logits in fp32, fixed row tiles."""
    return matmul_nt(hidden, head).float()


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


# ----------------------------------------------------------------------------- compressors / indexer
def compressor_pool(kv: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference ``compressor_pool`` with the softmax over slots taken along the last axis and the
    weighted sum folded in slot order.

    The reference's softmax over a middle axis and its sum over slots are per-window invariant when the
    channel count is a multiple of the SIMD width (V4's 512 / 128), but not in general (measured: 100
    channels, 3 slots); this form is invariant for any width.
    """
    weights = gate.float().transpose(1, 2).softmax(dim=-1).transpose(1, 2).to(kv.dtype)  # [N, slots, d]
    return _ref.rms_norm(fold(kv * weights, dim=1), norm_weight, eps)


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


# ----------------------------------------------------------------------------- hyper-connections
def hc_pre(streams, fn, base, scale, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    """Reference ``hc_pre`` with a fixed-tile GEMM, an exp-based sigmoid and a folded stream collapse."""
    tokens, hc, _ = streams.shape
    flat = _ref.unweighted_rms_norm(streams.reshape(tokens, -1).float(), norm_eps)  # [T, hc * D]
    mixed = matmul_nt(flat, fn.float())  # [T, (2 + hc) * hc]
    pre_w, post_w, comb_w = mixed.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    pre_s, post_s, comb_s = scale.float().unbind(0)
    pre = sigmoid(pre_w * pre_s + pre_b) + hc_eps  # [T, hc]
    post = 2 * sigmoid(post_w * post_s + post_b)  # [T, hc]
    comb = torch.softmax(comb_w.view(tokens, hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = fold(pre.unsqueeze(-1) * streams, dim=1).to(streams.dtype)  # [T, D]
    return post, comb, collapsed


def hc_post(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Reference ``hc_post`` with the ``hc x hc`` mixing as a fold over source streams (no batched GEMM)."""
    dtype = streams.dtype
    c = comb.to(dtype)  # [T, j, k]
    mixed = c[:, 0, :, None] * streams[:, 0, None, :]  # [T, k, D]
    for j in range(1, streams.shape[1]):
        mixed = mixed + c[:, j, :, None] * streams[:, j, None, :]
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed


def hc_head(streams, fn, base, scale, hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Reference ``hc_head`` with a fixed-tile GEMM, an exp-based sigmoid and a folded collapse."""
    flat = _ref.unweighted_rms_norm(streams.flatten(1).float(), norm_eps)  # [T, hc * D]
    mixes = matmul_nt(flat, fn.float())  # [T, hc]
    pre = sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return fold(pre.unsqueeze(-1) * streams, dim=1).to(streams.dtype)


# ----------------------------------------------------------------------------- MoE
def _score(router_logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return softplus(router_logits).sqrt()
    if scoring_func == "sigmoid":
        return sigmoid(router_logits)
    return router_logits.softmax(dim=-1)


def _normalise(scores: torch.Tensor, ids: torch.Tensor, scaling: float) -> torch.Tensor:
    weights = scores.gather(1, ids)  # [T, k]
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scaling


def moe_route_topk(router_logits, correction_bias, top_k: int, scaling: float, scoring_func: str):
    """Reference ``moe_route_topk`` with position-independent scoring functions."""
    scores = _score(router_logits, scoring_func)  # [T, E]
    biased = scores + correction_bias.to(scores.dtype)
    ids = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :top_k]  # [T, k]
    return _normalise(scores, ids, scaling), ids


def moe_route_hash(router_logits, token_ids, tid2eid, scaling: float, scoring_func: str):
    """Reference ``moe_route_hash`` with position-independent scoring functions."""
    scores = _score(router_logits, scoring_func)  # [T, E]
    ids = tid2eid[token_ids].long()  # [T, k]
    return _normalise(scores, ids, scaling), ids


def swiglu_mlp(x, w1, w2, w3, limit: float) -> torch.Tensor:
    """Reference ``swiglu_mlp``: three fixed-tile GEMMs and an exp-based SiLU (in fp32)."""
    gate = matmul_nt(x, w1).clamp(max=limit)  # [T, I]
    up = matmul_nt(x, w3).clamp(min=-limit, max=limit)
    return matmul_nt(silu(gate.float()).to(gate.dtype) * up, w2)


def moe_experts(x, ids, weights, w1, w2, w3, limit: float) -> torch.Tensor:
    """Reference ``moe_experts`` (combine by expert id, then token) over batch-invariant experts.

    An expert sees a row count that follows the batch's routing; ``swiglu_mlp`` makes each row's
    result independent of it. A token's contributions are added in ascending expert id, a function of
    the token's own routing only.
    """
    return _ref.moe_experts(x, ids, weights, w1, w2, w3, limit, expert_mlp=swiglu_mlp)


VARIANTS: dict[str, Callable] = {
    "linear": linear,
    "grouped_linear": grouped_linear,
    "logits": logits,
    "sink_attention": sink_attention,
    "indexer_scores": indexer_scores,
    "compressor_pool": compressor_pool,
    "hc_pre": hc_pre,
    "hc_post": hc_post,
    "hc_head": hc_head,
    "moe_route_topk": moe_route_topk,
    "moe_route_hash": moe_route_hash,
    "swiglu_mlp": swiglu_mlp,
    "moe_experts": moe_experts,
}

REFERENCE_KEPT: dict[str, str] = {
    "rms_norm": "row reduction of fixed length; torch splits a reduction across threads only when the output "
                "is one element and the input >= 32768 (rows here are <= hc * hidden < 32768)",
    "unweighted_rms_norm": "as rms_norm; rsqrt's vector and scalar paths agree bit for bit",
    "rope_cos_sin": "elementwise cos / sin, same bits wherever an element sits",
    "apply_rope": "elementwise IEEE arithmetic only",
    "indexer_topk": "a stable sort per query row; padding entries are -inf and never outrank visible ones",
    "embed": "a gather",
}

"""This backend's batch-invariant ops (``Backend.op_variants("batch_invariant")``): its own fast kernels, each run with
one configuration chosen from the model's and the weights' shapes only, never from the number of rows.

A kernel is batch invariant when the arithmetic that produces one output element depends on that element's own row
(token, window, query) and on model shapes only. Most of this backend's kernels already work that way: a program owns
whole rows (or one row's channel block), its tiles are set by the row width, and nothing is split across programs by
a count that follows the batch. Those are offered as they are, and so is ``indexer_topk``, whose radix select and keyed top-k pick exactly the
reference sort's entries (no arithmetic on the scores). Four choose a launch from the number of rows in the
fast path and are offered with a launch fixed by shapes instead:

* ``moe_experts``: the Triton grouped GEMMs with 64-row tiles (``MOE_TILE``; 16-bit steps of one or two tokens the
  fast path's 16-row decode tile, ``MOE_DECODE_TILE``) up to ``MOE_PREFILL_MIN_PER_EXPERT`` assignments per expert;
  above, for bf16, the fast path's CUTLASS grouped GEMM (``moe.moe_experts_grouped``), and for other dtypes the twice
  as wide ``MOE_PREFILL_TILE``. None of them splits K: every output element is one
  tensor-core accumulation along K in ascending order, which gives the same bits whatever the tile, its BLOCK_K or the
  kernel (``test_cuda.py`` and ``benchmarks/bench_moe.py`` check the three against each other on the GPU). No one-token
  kernels: their products are summed in another order. A token's experts are combined in ascending expert id, so a
  token's result depends only on its own input and routing. No atomics.
* ``hc_pre`` / ``hc_pre_normed``: the mixing logits' K split follows the row length alone
  (``hc.INVARIANT_MIX_SPLITS``), one kernel for every token count (``hc_mix_logits(..., invariant=True)``); the
  weights stay on the caller's stream.
* ``compressor_entries`` / ``compressor_entries_rope``: the many-windows launch whatever the number of windows
  (``compressor.launch_pool(..., few=False)``), so a window's slots are summed in blocks of one size.
* ``indexer_scores``: the one-query-row kernel (``indexer.indexer_scores_rows``) for every number of queries, not the
  query-tile kernel the fast path takes for prefill.

Not offered (the batch-invariant plugin keeps its own portable forms): the dense GEMMs (``linear``, ``logits``,
``grouped_linear``, ``swiglu_mlp``: cuBLAS and the one-row GEMV choose by the row count), ``sink_attention`` (the
decode kernel's key blocks are blocks of the step's padded key axis, which chunked prefill moves), ``greedy_sample``
(its log-probability is not the sampler's ``log_softmax``, which a greedy row takes in a step with sampled rows) and the ops TorchInductor compiles with reductions (``hc_head``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer_core.errors import UnsupportedBackendError
from deepinfer_core.ops import reference as ref
from deepinfer_nvidia_sm100.kernels import (
    cache_writes,
    compiled,
    compressor,
    hc,
    indexer,
    indexer_topk,
    keys,
    moe,
    norm,
    rope,
    route,
    streams,
)

MOE_TILE = (64, 64, 64, 4)
"""(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) of ``moe_experts`` in the batch-invariant mode up to
``MOE_PREFILL_MIN_PER_EXPERT`` assignments per expert: 64-row tiles (wgmma / tcgen05). A decode step reads each chosen
expert's weights once with any tile; a prefill step re-reads them once per row block, four times as often with the
16-row decode tile."""
MOE_PREFILL_TILE = (64, 128, 64, 8, 16)
"""The tile beyond ``MOE_PREFILL_MIN_PER_EXPERT`` (``moe.TILES["prefill"]``, the fast path's Triton prefill tile): the
same rows and BLOCK_K, so the same ``tl.dot`` steps along K for every output element (two warpgroups side by side
along N), and twice the columns per program; its programs walk 16 row blocks at a time across the column tiles
(``moe._block_tile``: a prefill step's gathered rows are read from HBM about once, not once per column tile). A
token's bits are the same under either tile (``test_cuda.py``)."""
MOE_PREFILL_MIN_PER_EXPERT = 64
"""Mean assignments per expert (``T * top_k / E``, known from shapes) above which the mode takes ``MOE_PREFILL_TILE``."""
MOE_DECODE_TILE = (16, 64, 128, 4)
"""The fast path's decode tile (``moe.TILES["decode"]``: 16 rows on ``mma.sync``, BLOCK_K 128) for 16-bit steps of at
most one assignment per ``MOE_DECODE_EXPERTS_PER_ASSIGNMENT`` experts (batch 1 and 2 of V4-Flash's 6 of 64): a token's
handful of assignments is not padded to 64-row tiles. The same bits as ``MOE_TILE`` (``bench_moe.py`` on the H200:
the decode tile, the mode's tiles and the CUTLASS path agree at every size; ``test_cuda.py`` checks it)."""
MOE_DECODE_EXPERTS_PER_ASSIGNMENT = 4

INDEX_OPS = ("compressor_window", "decode_key_index", "decode_entry_places", "decode_window_plan")
"""Compiled reference ops without floating-point reductions (gathers, integer index math, one addition per element)."""


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                w3: torch.Tensor, limit: float) -> torch.Tensor:
    """``reference.moe_experts`` through the Triton grouped GEMMs at ``MOE_TILE``; for prefill sizes (``moe_tile``)
    through the CUTLASS grouped GEMM where the fast path takes it (bf16), else at ``MOE_PREFILL_TILE``."""
    tile = moe_tile(ids.numel(), w1.shape[0], x.dtype)
    if tile == MOE_PREFILL_TILE and moe.uses_grouped_gemm(x, ids.numel(), w1.shape[0]):
        return moe.moe_experts_grouped(x, ids, weights, w1, w2, w3, limit)
    return moe.moe_experts(x, ids, weights, w1, w2, w3, limit, config=tile)


def moe_tile(num_assign: int, num_experts: int, dtype: torch.dtype) -> tuple[int, ...]:
    """The mode's MoE tile for ``num_assign`` token -> expert assignments over ``num_experts`` experts of ``dtype``."""
    if num_assign > MOE_PREFILL_MIN_PER_EXPERT * num_experts:
        return MOE_PREFILL_TILE
    if dtype != torch.float32 and num_assign * MOE_DECODE_EXPERTS_PER_ASSIGNMENT <= num_experts:
        return MOE_DECODE_TILE
    return MOE_TILE


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, scale: float) -> torch.Tensor:
    """``reference.indexer_scores`` through the fast path's one-query-row kernel (a query's heads as the rows of one
    tensor-core product per entry tile, the head sum in registers) for every number of queries."""
    if not indexer.takes(q.shape[-1]):
        raise UnsupportedBackendError(f"indexer_scores: index heads of {q.shape[-1]} dims; the batch-invariant indexer "
                                      "kernel takes powers of two from 16; run this model without batch-invariant mode")
    return indexer.indexer_scores_rows(q, keys, head_weights, scale)


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int,
           hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``reference.hc_pre``: the mixing logits split by the row length only, then the per-token finishing kernel."""
    return hc._pre(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, None, invariant=True)


def hc_pre_normed(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                  sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                  norm_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``reference.hc_pre_normed``: ``hc_pre`` above, the collapsed row RMS-normed in the same finishing kernel."""
    return hc._pre(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, norm_weight, invariant=True)


def _pool(raw_kv, raw_gate, carry_kv, carry_gate, from_new, new_rows, carry_slots, carry_index, valid, ape, ratio,
          overlap) -> torch.Tensor:
    return compressor.launch_pool(raw_kv, raw_gate, carry_kv, carry_gate, from_new, new_rows, carry_slots,
                                  carry_index, valid, ape, ratio, overlap, few=False)  # [N, d]


def compressor_entries(raw_kv, raw_gate, carry_kv, carry_gate, from_new, new_rows, carry_slots, carry_index, valid,
                       ape, norm_weight, eps: float, ratio: int, overlap: bool) -> torch.Tensor:
    """``reference.compressor_entries``: the windows pooled with one launch for any number of them, then the row
    norm kernel."""
    pooled = _pool(raw_kv, raw_gate, carry_kv, carry_gate, from_new, new_rows, carry_slots, carry_index, valid, ape,
                   ratio, overlap)
    return _rms_norm(pooled, norm_weight, eps)


def compressor_entries_rope(raw_kv, raw_gate, carry_kv, carry_gate, from_new, new_rows, carry_slots, carry_index,
                            valid, ape, norm_weight, eps: float, ratio: int, overlap: bool, cos: torch.Tensor,
                            sin: torch.Tensor) -> torch.Tensor:
    """``reference.compressor_entries_rope``: ``compressor_entries`` above with the norm and RoPE in one pass."""
    pooled = _pool(raw_kv, raw_gate, carry_kv, carry_gate, from_new, new_rows, carry_slots, carry_index, valid, ape,
                   ratio, overlap)
    return _rms_norm_rope(pooled, norm_weight, eps, cos, sin)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``norm.rms_norm`` without its reference fallback (torch's CUDA reductions pick their launch by the row
    count), one row per program: the kernel takes rows of up to ``norm.MAX_WIDTH`` channels."""
    _check_width(x, "rms_norm")
    return norm.launch(x, weight.contiguous(), eps, invariant=True)


def _unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    _check_width(x, "unweighted_rms_norm")
    return norm.launch(x, None, eps, invariant=True)


def _rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    _check_width(x, "rms_norm_rope")
    if x.shape[-1] % 2 or x.numel() // x.shape[-1] % max(cos.shape[0], 1):
        return ref.normed_rope(_rms_norm, _unweighted_rms_norm, rope.apply_rope_)(x, weight, eps, cos, sin)
    return norm.launch(x, None if weight is None else weight.contiguous(), eps, cos, sin, invariant=True)


def _check_width(x: torch.Tensor, op: str) -> None:
    if not norm.covered(x) and x.numel():
        raise UnsupportedBackendError(f"{op}: rows of {x.shape[-1]} channels; the batch-invariant norm kernel takes 1 to "
                         f"{norm.MAX_WIDTH} channels; run this model without batch-invariant mode")


def batch_invariant_ops() -> dict[str, Callable]:
    """Op name -> this backend's batch-invariant implementation (module docstring)."""
    ops: dict[str, Callable] = {
        "rms_norm": _rms_norm, "unweighted_rms_norm": _unweighted_rms_norm, "rms_norm_rope": _rms_norm_rope,
        "apply_rope": rope.apply_rope, "apply_rope_": rope.apply_rope_,
        "moe_route_topk": route.moe_route_topk, "moe_route_hash": route.moe_route_hash, "moe_experts": moe_experts,
        "hc_pre": hc_pre, "hc_pre_normed": hc_pre_normed, "hc_post": hc.hc_post, "hc_post_sum": hc.hc_post_sum,
        "compressor_entries": compressor_entries, "compressor_entries_rope": compressor_entries_rope,
        "gather_keys": keys.gather_keys, "write_rows_": cache_writes.write_rows_, "fork": streams.fork,
        "indexer_topk": indexer_topk.indexer_topk,  # a selection by the reference's exact key order: no arithmetic
        "indexer_scores": indexer_scores,
    }
    compiled_index_ops = compiled.compiled_ops()
    ops.update({name: compiled_index_ops[name] for name in INDEX_OPS if name in compiled_index_ops})
    return ops

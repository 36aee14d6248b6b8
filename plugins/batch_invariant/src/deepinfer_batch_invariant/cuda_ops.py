"""Batch-invariant CUDA variants of the op table (backend ``nvidia_sm100``; same signatures as the reference).

On CUDA the plain ops are not batch invariant for other reasons than on CPU: cuBLAS picks a GEMM algorithm
(tile shape, split-K) from the problem shape, so a token's row changes with the number of tokens; torch's
reductions choose how many threads and blocks share one row's reduction from the number of rows; the
reference attention reduces over the key axis padded to the batch's longest sequence. Elementwise kernels
are position independent (one functor per element, whatever the vectorisation), so elementwise torch code
stays.

Here every reduction runs in a fixed-configuration Triton kernel (``triton_kernels``): GEMMs with one tile
and a K split fixed by the weight's shape, one program per row for norms and sums, attention over each query's own
keys in fixed ``KV_CHUNK`` chunks, the indexer with one program per (query, entry block). The logic shared with the
CPU variants lives once in ``forms.InvariantOps``; this module supplies the CUDA primitives (``CUDA_KIT``) and the
CUDA-only ops. Nothing here synchronises with the host, so the ops can be captured in CUDA graphs (except the
portable ``moe_experts`` form, whose reference loop reads expert counts on the host).

These are portable forms: the backend's own kernels run with a fixed configuration where it offers them
(``Backend.op_variants("batch_invariant")``, installed over these by ``ops.install``); this module never imports
a backend package.

Triton is imported on first use (``implementations("nvidia_sm100")``), never when the plugin loads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepinfer_batch_invariant import primitives, quantized
from deepinfer_batch_invariant import triton_kernels as tk
from deepinfer_batch_invariant.forms import ROW_FORMS, InvariantOps, Kit
from deepinfer_core.ops import reference as _ref


def _elementwise(cuda_fn: Callable, cpu_fn: Callable) -> Callable:
    """``cuda_fn`` on CUDA tensors (one functor per element: position independent), ``cpu_fn`` elsewhere
    (torch's CPU kernels are not: ``primitives``). CPU tensors reach these ops under Triton's interpreter."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return cuda_fn(x) if x.is_cuda else cpu_fn(x)

    fn.__name__ = cuda_fn.__name__
    return fn


def _collapse(w: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """``sum_l w[:, l, None] * streams[:, l]`` in fp32, folded in stream order: ``[T, hc] x [T, hc, D] -> [T, D]``."""
    return tk.weighted_fold(w.float().unsqueeze(-1), streams, torch.float32, round_product=False)


def _pool(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Per window and channel: softmax over slots, weights in ``kv.dtype``, products summed in slot order."""
    return tk.pool(kv, gate)


_sigmoid = _elementwise(torch.sigmoid, primitives.sigmoid)


def _fold(x: torch.Tensor, dim: int, combine: Callable) -> torch.Tensor:
    """``combine`` folded left over the small axis ``dim`` (kept), element by element: no reduction kernel."""
    parts = x.unbind(dim)
    total = parts[0]
    for part in parts[1:]:
        total = combine(total, part)
    return total.unsqueeze(dim)


def _hc_weights(mixed: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int, eps: float):
    """``reference.hc_weights`` with every sum and max over the ``hc``-wide axes as an elementwise left fold (torch's
    CUDA reductions choose their launch by the number of rows); ``[T, (2 + hc) * hc]`` -> ``pre``, ``post``,
    ``comb``. Elementwise launches only; the backend's ``hc_pre`` (``Backend.op_variants``) keeps them in one kernel."""
    tokens = mixed.shape[0]
    pre_w, post_w, comb_w = mixed.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    pre_s, post_s, comb_s = scale.float().unbind(0)
    pre = _sigmoid(pre_w * pre_s + pre_b) + eps  # [T, hc]
    post = 2 * _sigmoid(post_w * post_s + post_b)  # [T, hc]
    logits = comb_w.reshape(tokens, hc, hc) * comb_s + comb_b.view(hc, hc)  # [T, hc, hc]
    e = torch.exp(logits - _fold(logits, -1, torch.maximum))
    comb = e / _fold(e, -1, torch.add) + eps  # softmax over the last axis, plus eps
    comb = comb / (_fold(comb, -2, torch.add) + eps)
    for _ in range(iters - 1):
        comb = comb / (_fold(comb, -1, torch.add) + eps)
        comb = comb / (_fold(comb, -2, torch.add) + eps)
    return pre, post, comb


CUDA_KIT = Kit(
    matmul_nt=tk.matmul_nt, sigmoid=_sigmoid,
    silu=_elementwise(F.silu, primitives.silu), softplus=_elementwise(F.softplus, primitives.softplus), row_sum=tk.row_sum,
    collapse=_collapse, hc_weights=_hc_weights, pool=_pool, rms_norm=tk.rms_norm,
    unweighted_rms_norm=tk.unweighted_rms_norm,
)
CUDA_OPS = InvariantOps(CUDA_KIT)
"""The shared forms over the CUDA primitives."""


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """Block-diagonal projection ``x [T, g, i]`` -> ``[T, g, o]``: every group's fixed-split GEMM in one launch."""
    return tk.grouped_matmul_nt(x, weight, groups)


def swiglu_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, limit: float) -> torch.Tensor:
    """``forms.InvariantOps.swiglu_mlp`` in fewer launches: where ``w3``'s rows follow ``w1``'s in one storage (the
    model allocates them as one tensor) one GEMM for both, then the clamps, SiLU and product in one elementwise
    kernel, then ``w2``. Each GEMM's split follows its weight's shape, so a row's bits still depend on that row
    only."""
    rows = x.reshape(-1, x.shape[-1])  # [T, D]
    both = _rows_together(w1, w3)
    if both is not None:
        gate_up = tk.matmul_nt(rows, both)  # [T, 2 I]
        gate, up = gate_up[:, : w1.shape[0]], gate_up[:, w1.shape[0]:]
    else:
        gate, up = tk.matmul_nt(rows, w1), tk.matmul_nt(rows, w3)  # [T, I] each
    return tk.matmul_nt(tk.swiglu(gate, up, limit), w2).reshape(*x.shape[:-1], w2.shape[0])


def _rows_together(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor | None:
    """``[w1; w3]`` as one ``[2 I, D]`` view when ``w3``'s rows directly follow ``w1``'s in one storage, else None."""
    if (w1.shape != w3.shape or w1.dtype != w3.dtype or w1.device != w3.device or not w1.is_contiguous()
            or not w3.is_contiguous() or w3.data_ptr() != w1.data_ptr() + w1.numel() * w1.element_size()
            or w1.untyped_storage().data_ptr() != w3.untyped_storage().data_ptr()):
        return None
    return w1.as_strided((2 * w1.shape[0], w1.shape[1]), (w1.shape[1], 1))


VARIANTS: dict[str, Callable] = {
    **CUDA_OPS.table(ROW_FORMS),
    "grouped_linear": grouped_linear,
    "swiglu_mlp": swiglu_mlp,
    "sink_attention": tk.sink_attention,
    "indexer_scores": tk.indexer_scores,
    "rms_norm": tk.rms_norm,
    "unweighted_rms_norm": tk.unweighted_rms_norm,
    "rope_cos_sin": tk.rope_cos_sin,
}
VARIANTS["compressor_entries"] = _ref.pooled_windows(_ref.compressor_window, VARIANTS["compressor_pool"])
"""The windows as the reference gathers them, pooled by this module's ``compressor_pool``."""
VARIANTS["compressor_entries_rope"] = _ref.entries_rope(VARIANTS["compressor_entries"], _ref.apply_rope_)
"""Those entries, then the reference's in-place RoPE (elementwise)."""
VARIANTS["rms_norm_rope"] = _ref.normed_rope(VARIANTS["rms_norm"], VARIANTS["unweighted_rms_norm"], _ref.apply_rope_)
VARIANTS["hc_pre_normed"] = _ref.pre_normed(VARIANTS["hc_pre"], VARIANTS["rms_norm"])
VARIANTS["hc_post_sum"] = _ref.post_sum(VARIANTS["hc_post"])
VARIANTS["roped_sink_attention"] = _ref.roped_attention(VARIANTS["rms_norm_rope"], VARIANTS["sink_attention"],
                                                       _ref.apply_rope_)
"""The fused ops as their parts above, one after the other."""
VARIANTS["sparse_sink_attention"] = _ref.rows_sparse_attention(VARIANTS["sink_attention"])
VARIANTS["roped_sparse_sink_attention"] = _ref.roped_sparse_attention(VARIANTS["rms_norm_rope"], VARIANTS["sparse_sink_attention"],
                                                                     _ref.apply_rope_)
"""Top-k sparse attention: each query row over its own listed keys through this module's ``sink_attention``."""
VARIANTS.update(quantized.variants(VARIANTS))
"""The quantized-weight ops: exact dequantization, then this module's linear / MLP / expert ops."""

REFERENCE_KEPT: dict[str, str] = {
    "apply_rope": "elementwise arithmetic, slicing and concatenation only",
    "indexer_topk": "a stable sort per query row (a permutation: no arithmetic), padding entries are -inf and "
                    "never outrank visible ones; the scatter writes True only",
    "compressor_window": "gathers, selects, concatenation and one addition per element: no reduction",
    "embed": "a gather",
    "gather_keys": "gathers, a select and a concatenation: no arithmetic",
    "apply_rope_": "apply_rope written back into its input: the same elementwise arithmetic",
    "fork": "runs its function at once, on the one stream: no arithmetic of its own",
    "write_rows_": "a gather and a scatter of whole rows: no arithmetic",
    "decode_key_index": "integer index math per sequence: no floating point",
    "visible_index": "integer compaction of a mask row: no floating point",
    "indexer_topk_index": "indexer_topk (kept) and visible_index: a permutation and integer compaction",
    "indexer_topk_index_counts": "an integer comparison per entry, then indexer_topk_index (kept)",
    "decode_entry_places": "integer index math per sequence and a gather: no floating point",
    "decode_window_plan": "integer index math per sequence and a gather: no floating point",
    "moe_experts_expert_parallel": "whole rows moved by all-to-all; the local experts run through the table's "
                                   "moe_experts (this mode's invariant one); each token's expert outputs are summed "
                                   "in a fixed order (by expert id, then slot)",
    "greedy_sample": "per row: an exact max and lowest-id min, an integer count and the sampler's log_softmax (torch "
                     "picks its kernel from the row length only, as the sampler's own: test_cuda.py)",
}

"""Batch-invariant CUDA variants of the op table (backend ``nvidia_sm100``; same signatures as the reference).

On CUDA the plain ops are not batch invariant for other reasons than on CPU: cuBLAS picks a GEMM algorithm
(tile shape, split-K) from the problem shape, so a token's row changes with the number of tokens; torch's
reductions choose how many threads and blocks share one row's reduction from the number of rows; the
reference attention reduces over the key axis padded to the batch's longest sequence. Elementwise kernels
are position independent (one functor per element, whatever the vectorisation), so elementwise torch code
stays.

Here every reduction runs in a fixed-configuration Triton kernel (``triton_kernels``): GEMMs with one tile
and a full K loop, one program per row for norms and sums, attention over each query's own keys in fixed
``KV_CHUNK`` chunks, the indexer with one program per (query, entry block). The logic shared with the CPU
variants lives once in ``forms.InvariantOps``; this module supplies the CUDA primitives (``CUDA_KIT``) and the
CUDA-only ops. Nothing here synchronises with the host, so the ops can be captured in CUDA graphs.

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

MOE_CONFIG = (64, 64, 64, 4)
"""(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) of the backend's Triton MoE kernels, fixed for every batch (the
backend's own choice follows the tokens per expert, which follows the batch)."""


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


def _hc_weights(mixed: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int, eps: float):
    """The backend's one-launch ``hc_weights`` kernel: one program per token, a fixed order inside it."""
    from deepinfer_nvidia_sm100.kernels.hc import hc_weights

    return hc_weights(mixed, base, scale, hc, iters, eps)


CUDA_KIT = Kit(
    matmul_nt=tk.matmul_nt, sigmoid=_elementwise(torch.sigmoid, primitives.sigmoid),
    silu=_elementwise(F.silu, primitives.silu), softplus=_elementwise(F.softplus, primitives.softplus), row_sum=tk.row_sum,
    collapse=_collapse, hc_weights=_hc_weights, pool=_pool, rms_norm=tk.rms_norm,
    unweighted_rms_norm=tk.unweighted_rms_norm,
)
CUDA_OPS = InvariantOps(CUDA_KIT)
"""The shared forms over the CUDA primitives."""


def moe_experts(x, ids, weights, w1, w2, w3, limit: float) -> torch.Tensor:
    """The backend's Triton ``moe_experts`` (sorted grouped GEMMs, combine by ascending expert id) with one
    fixed tile configuration (``MOE_CONFIG``): every row of a tile is computed alike, so a token's result
    depends only on its own routing and input. No host synchronisation (the reference loop has one)."""
    from deepinfer_nvidia_sm100.kernels.moe import moe_experts as triton_moe_experts

    return triton_moe_experts(x, ids, weights, w1, w2, w3, limit, config=MOE_CONFIG)


VARIANTS: dict[str, Callable] = {
    **CUDA_OPS.table(ROW_FORMS),
    "moe_experts": moe_experts,
    "sink_attention": tk.sink_attention,
    "indexer_scores": tk.indexer_scores,
    "rms_norm": tk.rms_norm,
    "unweighted_rms_norm": tk.unweighted_rms_norm,
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
VARIANTS.update(quantized.variants(VARIANTS))
"""The quantized-weight ops: exact dequantization, then this module's linear / MLP / expert ops."""

REFERENCE_KEPT: dict[str, str] = {
    "rope_cos_sin": "elementwise cos / sin: one functor per element, wherever it sits",
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
    "decode_entry_places": "integer index math per sequence and a gather: no floating point",
    "decode_window_plan": "integer index math per sequence and a gather: no floating point",
    "moe_experts_expert_parallel": "whole rows moved by all-to-all; the local experts run through the table's "
                                   "moe_experts (this mode's invariant one); each token's expert outputs are summed "
                                   "in a fixed order (by expert id, then slot)",
    "greedy_sample": "per row: an exact max and lowest-id min, an integer count and the sampler's log_softmax (torch "
                     "picks its kernel from the row length only, as the sampler's own: test_cuda.py)",
}

"""Op ``indexer_topk`` (the lightning indexer's selection) without a sort.

``deepinfer_core.ops.reference.indexer_topk`` sorts every query row's masked scores ``[S, Lq, E]`` (fp32 values and
int64 indices, stable, descending) and scatters the first ``k``: O(E log E) per row and about 24 bytes of
temporaries per score; at 1M context (E = 262,144 entries, a 16K-token prefill chunk) that is more than the GPU.

Here one Triton pass turns every (masked) score into a 64-bit key that orders exactly as the reference's tie rule:
the high 32 bits are the fp32 score's bits made order-preserving as a signed integer (negative floats flip their
magnitude bits), the low 32 bits ``E - 1 - index`` (a lower entry index is a larger key among equal scores).
Every key of a row is distinct, so ``torch.topk`` (a radix select, no sort) on the keys picks exactly the entries the
stable sort puts first; the selection is scattered as a bool mask and, as in the reference, only visible entries
stay selected (invisible entries are ``-inf``, as there). Scores that compare equal as floats but differ in bits are
made one before the keys: ``-0.0`` becomes ``+0.0`` and every NaN the positive quiet NaN (the sort puts NaN first,
as the largest, and ties NaNs by index). Keys take 8 bytes per score and the result 1: the caller
(``Indexer.select``) bounds how many scores one call sees.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100.kernels.compiled import opaque_under_compile

BLOCK = 1024
QUIET_NAN_BITS = 0x7FC00000  # the positive quiet NaN torch's sort and topk treat as larger than +inf
_NAN_BITS = tl.constexpr(QUIET_NAN_BITS)


@triton.jit
def _order_keys_kernel(scores_ptr, visible_ptr, keys_ptr, numel, E, BLOCK: tl.constexpr):
    """Program (block of the flattened ``[R, E]`` scores): ``keys[r, e] = ordered(masked score) << 32 | (E - 1 -
    e)`` with ``masked = visible ? score : -inf`` (``scores`` fp32, ``visible`` as uint8, ``keys`` int64, all
    contiguous)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [B]
    inside = offs < numel
    score = tl.load(scores_ptr + offs, mask=inside, other=0.0)  # [B] fp32
    seen = tl.load(visible_ptr + offs, mask=inside, other=0)  # [B] uint8
    score = tl.where(seen != 0, score, float("-inf"))
    bits = score.to(tl.int32, bitcast=True)
    bits = tl.where(score == 0.0, 0, bits)  # -0.0 -> +0.0
    bits = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, _NAN_BITS, bits)  # every NaN -> one NaN
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed order == float order
    index = offs % E
    keys = (ordered.to(tl.int64) << 32) | (E - 1 - index)
    tl.store(keys_ptr + offs, keys, mask=inside)


def order_keys_torch(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The keys of ``_order_keys_kernel`` with torch ops (CPU tensors): ``[R, E]`` fp32 scores and bool visibility ->
    ``[R, E]`` int64."""
    E = scores.shape[-1]
    masked = scores.float().masked_fill(~visible, float("-inf"))  # [R, E]
    bits = masked.view(torch.int32)
    bits = torch.where(masked == 0.0, 0, bits)
    bits = torch.where(masked.isnan(), QUIET_NAN_BITS, bits)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # [R, E] int32
    index = torch.arange(E, device=scores.device)  # [E]
    return (ordered.long() << 32) | (E - 1 - index)


def order_keys(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Order keys ``[R, E]`` int64 of fp32 ``scores [R, E]`` under ``visible [R, E]``: the Triton kernel on CUDA (and
    under ``TRITON_INTERPRET=1``), else ``order_keys_torch``."""
    if scores.device.type != "cuda" and not _interpreted():
        return order_keys_torch(scores, visible)
    scores = scores.float().contiguous()
    seen = visible.contiguous().view(torch.uint8)
    keys = torch.empty(scores.shape, dtype=torch.int64, device=scores.device)
    numel = scores.numel()
    _order_keys_kernel[(triton.cdiv(numel, BLOCK),)](scores, seen, keys, numel, scores.shape[-1], BLOCK=BLOCK,
                                                     num_warps=4)
    return keys


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _topk_fake(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    return torch.empty_like(visible)


@opaque_under_compile("indexer_topk", _topk_fake)
def indexer_topk(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """Op ``indexer_topk`` (same contract and tie rule as the reference op): ``scores [S, Lq, E]``, ``visible [S, Lq,
    E]`` bool -> bool ``[S, Lq, E]``, up to ``k`` visible entries per query row."""
    E = scores.shape[-1]
    if E <= k or visible.numel() == 0:  # every entry fits the budget: the visible ones
        return visible.clone()
    rows_visible = visible.reshape(-1, E)  # [R, E]
    keys = order_keys(scores.reshape(-1, E), rows_visible)  # [R, E] int64
    index = torch.topk(keys, k, dim=-1, sorted=False).indices  # [R, k]
    del keys
    selected = torch.zeros_like(rows_visible)  # [R, E]
    selected.scatter_(-1, index, rows_visible.gather(-1, index))
    return selected.view(visible.shape)

"""Ops ``moe_route_topk`` / ``moe_route_hash`` as one Triton kernel: a program per token scores its router logits,
picks its experts (top-k by the biased score, ties to the lower id; or the hash table's row) and normalises their
weights.

The reference is ~9 small kernels per MoE layer (score, bias, sort, slice, gather, sum, divide, scale): at batch 1
a chain of launches each far shorter than its launch. The arithmetic is the reference's, rounded to the logits'
dtype wherever the reference rounds (every elementwise result, the sum of the chosen scores), so the chosen experts
agree except at ties that rounding decides and the weights agree to the dtype's last bit or so.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100.kernels import pdl
from deepinfer_nvidia_sm100.kernels.compiled import opaque_under_compile

SCORING = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}


@triton.jit
def _round(x, dtype: tl.constexpr):
    """``x`` (fp32) rounded to ``dtype`` and widened back: where the reference stores an intermediate."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, table_ptr, token_ptr, weights_ptr, ids_ptr, E, K, scaling,
                  SCORING: tl.constexpr, HASH: tl.constexpr, E_P2: tl.constexpr, K_P2: tl.constexpr,
                  PDL: tl.constexpr = False):
    """Token ``program_id(0)``: ``logits [T, E]`` -> ``weights [T, K]`` (logits' dtype) and ``ids [T, K]`` (int64);
    top-k by score + ``bias [E]``, or (``HASH``) the ids ``table [vocab, K]`` holds for ``token [T]``."""
    pdl.begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    dtype: tl.constexpr = weights_ptr.dtype.element_ty
    e = tl.arange(0, E_P2)  # [E_P2]
    real = e < E
    x = tl.load(logits_ptr + t * E + e, mask=real, other=0.0).to(tl.float32)
    if SCORING == 0:  # softplus (torch's threshold 20; log1p of a tiny u as u - u^2 / 2), then its square root
        u = tl.exp(tl.minimum(x, 20.0))
        soft = _round(tl.where(x > 20.0, x, tl.where(u < 1e-4, u - 0.5 * u * u, tl.log(1.0 + u))), dtype)
        scores = _round(tl.sqrt(soft), dtype)
    elif SCORING == 1:
        scores = _round(tl.sigmoid(x), dtype)
    else:
        shifted = tl.exp(x - tl.max(tl.where(real, x, float("-inf")), axis=0))
        shifted = tl.where(real, shifted, 0.0)
        scores = _round(shifted / tl.sum(shifted, axis=0), dtype)
    k = tl.arange(0, K_P2)  # [K_P2]
    if HASH:
        token = tl.load(token_ptr + t).to(tl.int64)
        ids = tl.load(table_ptr + token * K + k, mask=k < K, other=0).to(tl.int64)
        chosen = tl.sum(tl.where(e[None, :] == ids[:, None], scores[None, :], 0.0), axis=1)  # [K_P2]
    else:
        biased = _round(scores + _round(tl.load(bias_ptr + e, mask=real, other=0.0).to(tl.float32), dtype), dtype)
        biased = tl.where(real, biased, float("-inf"))
        ids = tl.zeros([K_P2], dtype=tl.int64)
        chosen = tl.zeros([K_P2], dtype=tl.float32)
        for j in range(K):  # the best remaining expert, the lowest id among equals (a stable descending sort)
            best = tl.max(biased, axis=0)
            pick = tl.min(tl.where(biased == best, e, E_P2), axis=0).to(tl.int64)
            ids = tl.where(k == j, pick, ids)
            chosen = tl.where(k == j, tl.sum(tl.where(e == pick, scores, 0.0), axis=0), chosen)
            biased = tl.where(e == pick, float("-inf"), biased)
    chosen = tl.where(k < K, chosen, 0.0)
    total = _round(_round(tl.sum(chosen, axis=0), dtype) + 1e-20, dtype)
    weights = _round(_round(chosen / total, dtype) * scaling, dtype)
    tl.store(weights_ptr + t * K + k, weights.to(dtype), mask=k < K)
    tl.store(ids_ptr + t * K + k, ids, mask=k < K)


def _launch(logits: torch.Tensor, bias: torch.Tensor | None, table: torch.Tensor | None, tokens: torch.Tensor | None,
            top_k: int, scaling: float, scoring: str) -> tuple[torch.Tensor, torch.Tensor]:
    T, E = logits.shape
    logits = logits.contiguous()
    weights = torch.empty(T, top_k, device=logits.device, dtype=logits.dtype)
    ids = torch.empty(T, top_k, device=logits.device, dtype=torch.long)
    if T:
        hashed = table is not None
        _route_kernel[(T,)](
            logits, logits if hashed else bias.contiguous(), table.contiguous() if hashed else ids,
            tokens.contiguous() if hashed else ids, weights, ids, E, top_k, float(scaling),
            SCORING=SCORING[scoring], HASH=hashed, E_P2=triton.next_power_of_2(E),
            K_P2=triton.next_power_of_2(top_k), num_warps=1 if E <= 256 else 4, **pdl.launch())
    return weights, ids


def _route_shapes(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return logits.new_empty(logits.shape[0], top_k), logits.new_empty(logits.shape[0], top_k, dtype=torch.long)


@opaque_under_compile("moe_route_topk", lambda logits, bias, top_k, scaling, scoring: _route_shapes(logits, top_k))
def moe_route_topk(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, scaling: float,
                   scoring_func: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.moe_route_topk`` in one kernel launch."""
    return _launch(router_logits, correction_bias, None, None, top_k, scaling, scoring_func)


@opaque_under_compile("moe_route_hash",
                      lambda logits, tokens, table, scaling, scoring: _route_shapes(logits, table.shape[1]))
def moe_route_hash(router_logits: torch.Tensor, token_ids: torch.Tensor, tid2eid: torch.Tensor, scaling: float,
                   scoring_func: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.moe_route_hash`` in one kernel launch."""
    return _launch(router_logits, None, tid2eid, token_ids, tid2eid.shape[1], scaling, scoring_func)

"""mHC mixing (op ``hc_pre``) with the sigmoid / softmax / Sinkhorn part as one Triton kernel.

``deepinfer_core.ops.reference.hc_pre`` is three parts: mixing logits (RMS norm + a small GEMM), the weights
(two sigmoids, a softmax, then ``sinkhorn_iters`` row / column normalisations of an ``hc x hc`` matrix per
token) and the collapse of the streams. Compiled by TorchInductor, the weights part still became one kernel
per normalisation (~39 launches per call, 16 calls per decode step of the bench preset: ~600 launches), because
each normalisation reduces along another axis. ``_hc_weights_kernel`` keeps each token's ``hc x hc`` matrix in
registers for the whole loop: one launch per call. The two other parts are the reference functions, compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.ops import reference as ref
from deepinfer_nvidia_sm100.kernels.compiled import maybe_compile


@triton.jit
def _hc_weights_kernel(mixed_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, sinkhorn_iters, hc_eps,
                       HC: tl.constexpr, HC_P2: tl.constexpr):
    """One program per token: ``mixed [(2 + HC) * HC]`` -> ``pre [HC]``, ``post [HC]``, ``comb [HC, HC]`` (fp32)."""
    token = tl.program_id(0).to(tl.int64)
    row = mixed_ptr + token * (2 + HC) * HC
    idx = tl.arange(0, HC_P2)  # [HC_P2]
    in_hc = idx < HC
    pre_s = tl.load(scale_ptr)
    post_s = tl.load(scale_ptr + 1)
    comb_s = tl.load(scale_ptr + 2)
    pre = tl.sigmoid(tl.load(row + idx, mask=in_hc, other=0.0) * pre_s + tl.load(base_ptr + idx, mask=in_hc, other=0.0))
    tl.store(pre_ptr + token * HC + idx, pre + hc_eps, mask=in_hc)
    post_logit = tl.load(row + HC + idx, mask=in_hc, other=0.0) * post_s + tl.load(base_ptr + HC + idx, mask=in_hc,
                                                                                    other=0.0)
    tl.store(post_ptr + token * HC + idx, 2 * tl.sigmoid(post_logit), mask=in_hc)

    rows, cols = idx[:, None], idx[None, :]  # [HC_P2, 1], [1, HC_P2]
    inside = (rows < HC) & (cols < HC)  # [HC_P2, HC_P2]
    offset = 2 * HC + rows * HC + cols
    logits = tl.load(row + offset, mask=inside, other=0.0) * comb_s + tl.load(base_ptr + offset, mask=inside, other=0.0)
    logits = tl.where(inside, logits, float("-inf"))
    row_max = tl.where(in_hc, tl.max(logits, axis=1), 0.0)  # padded rows: no -inf - -inf
    exp = tl.where(inside, tl.exp(logits - row_max[:, None]), 0.0)
    row_sum = tl.where(in_hc, tl.sum(exp, axis=1), 1.0)
    comb = tl.where(inside, exp / row_sum[:, None] + hc_eps, 0.0)  # softmax over each row
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)  # columns
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)  # rows
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)  # columns
    tl.store(comb_ptr + token * HC * HC + rows * HC + cols, comb, mask=inside)


def hc_weights(mixed: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, sinkhorn_iters: int,
               hc_eps: float):
    """``reference.hc_weights`` in one launch: ``mixed [T, (2 + hc) * hc]`` -> ``pre``, ``post [T, hc]``, ``comb``."""
    tokens = mixed.shape[0]
    mixed = mixed.float().contiguous()
    pre = torch.empty(tokens, hc, dtype=torch.float32, device=mixed.device)
    post = torch.empty_like(pre)
    comb = torch.empty(tokens, hc, hc, dtype=torch.float32, device=mixed.device)
    if tokens:
        _hc_weights_kernel[(tokens,)](mixed, base.float().contiguous(), scale.float().contiguous(), pre, post, comb,
                                      sinkhorn_iters, hc_eps, HC=hc, HC_P2=triton.next_power_of_2(hc), num_warps=1)
    return pre, post, comb


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int,
           hc_eps: float, norm_eps: float):
    """Op ``hc_pre`` (same contract as the reference op): compiled mixing logits, the Triton weights kernel,
    compiled collapse."""
    mixed = maybe_compile(ref.hc_mix_logits)(streams, fn, norm_eps)  # [T, (2 + hc) * hc] fp32
    pre, post, comb = hc_weights(mixed, base, scale, streams.shape[1], sinkhorn_iters, hc_eps)
    return post, comb, maybe_compile(ref.hc_collapse)(pre, streams)

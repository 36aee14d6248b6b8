"""CPU fast paths for ops that are many tiny tensor ops in their reference form.

On a CPU a small model is bound by per-op dispatch, not arithmetic: the reference mHC mixing alone
runs ~130 torch ops per call (Sinkhorn). These variants compute the same thing with far fewer
dispatches (fused norms, complex-number RoPE, the Sinkhorn loop on NumPy arrays). Each is checked
against its reference op in tests/test_cpu_ops.py.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference ``rms_norm`` as one fused ``F.rms_norm`` call in fp32."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference ``unweighted_rms_norm`` (scale computed in fp32)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), None, eps)
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Reference ``apply_rope``: interleaved pairs rotated as complex numbers ``(x0 + i x1) * e^{i angle}``."""
    return torch.cat([x[..., : -2 * cos.shape[-1]], _rotated(x, cos, sin, inverse)], dim=-1)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Reference ``apply_rope_``: ``apply_rope``'s rotation written into the rotary channels of ``x``."""
    x[..., -2 * cos.shape[-1]:] = _rotated(x, cos, sin, inverse)
    return x


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """The trailing ``2 * cos.shape[-1]`` channels of ``x`` rotated, in ``x``'s dtype."""
    half = cos.shape[-1]
    rotation = torch.complex(cos.float(), -sin.float() if inverse else sin.float())  # [T, half]
    rotation = rotation.reshape(cos.shape[0], *([1] * (x.dim() - 2)), half)
    pairs = x[..., -2 * half:].float().reshape(*x.shape[:-1], half, 2)
    return torch.view_as_real(torch.view_as_complex(pairs) * rotation).flatten(-2).to(x.dtype)


def hc_pre(streams, fn, base, scale, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    """Reference ``hc_pre``; the per-token sigmoid / softmax / Sinkhorn run on NumPy arrays."""
    tokens, hc, width = streams.shape
    flat = F.rms_norm(streams.reshape(tokens, -1).float(), (hc * width,), None, norm_eps)  # [T, hc * D]
    mixed = F.linear(flat, fn.float()).numpy()  # [T, (2 + hc) * hc]
    b = base.float().numpy()
    s = scale.float().numpy()
    eps = np.float32(hc_eps)
    pre = _sigmoid(mixed[:, :hc] * s[0] + b[:hc]) + eps  # [T, hc]
    post = 2 * _sigmoid(mixed[:, hc:2 * hc] * s[1] + b[hc:2 * hc])
    logits = mixed[:, 2 * hc:].reshape(tokens, hc, hc) * s[2] + b[2 * hc:].reshape(hc, hc)
    comb = np.exp(logits - logits.max(axis=-1, keepdims=True))
    comb = comb / comb.sum(axis=-1, keepdims=True) + eps  # [T, hc, hc]
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    pre_t = torch.from_numpy(pre)
    collapsed = torch.bmm(pre_t.unsqueeze(1), streams.float()).squeeze(1).to(streams.dtype)  # [T, D]
    return torch.from_numpy(post), torch.from_numpy(comb), collapsed


DENSE_MOE_MAX_EXPERTS = 8


def moe_experts(x, ids, weights, w1, w2, w3, limit: float):
    """Reference ``moe_experts``; with few experts, every expert runs on every token in three batched
    matmuls (each expert's weights read once) and the chosen outputs are gathered, instead of a loop
    of ~20 small ops per expert. Many experts: the reference loop."""
    num_experts, tokens = w1.shape[0], x.shape[0]
    if num_experts > DENSE_MOE_MAX_EXPERTS:
        return _reference_moe_experts(x, ids, weights, w1, w2, w3, limit)
    stacked = x.unsqueeze(0).expand(num_experts, -1, -1)  # [E, T, D]
    gate = torch.bmm(stacked, w1.transpose(1, 2)).clamp_(max=limit)  # [E, T, I]
    up = torch.bmm(stacked, w3.transpose(1, 2)).clamp_(min=-limit, max=limit)
    expert_out = torch.bmm(F.silu(gate).mul_(up), w2.transpose(1, 2))  # [E, T, D]
    chosen = expert_out[ids, torch.arange(tokens).unsqueeze(1)]  # [T, k, D]
    return (chosen * weights.unsqueeze(-1).to(chosen.dtype)).sum(dim=1).to(x.dtype)


def _reference_moe_experts(*args):
    from deepinfer_core.ops.reference import moe_experts as reference

    return reference(*args)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.float32(1) / (np.float32(1) + np.exp(-x))


OVERRIDES = {
    "rms_norm": rms_norm,
    "unweighted_rms_norm": unweighted_rms_norm,
    "apply_rope": apply_rope,
    "apply_rope_": apply_rope_,
    "hc_pre": hc_pre,
    "moe_experts": moe_experts,
}

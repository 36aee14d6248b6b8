"""The batch-invariant forms of the ops, written once over a ``Kit`` of device primitives.

Most ops are the reference op with its batch-dependent pieces (GEMMs, row reductions, small-axis sums,
activations whose bits depend on where an element sits) swapped for primitives whose result for one row
never depends on the other rows. The logic is the same on every device; only the primitives differ:
``cpu_ops.CPU_KIT`` (fixed-tile torch GEMMs, exp-based activations, explicit folds) and
``cuda_ops.CUDA_KIT`` (fixed-configuration Triton kernels). ``InvariantOps(kit)`` binds one kit; its
methods have the reference ops' signatures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from deepinfer_core.ops import reference as _ref


@dataclasses.dataclass(frozen=True)
class Kit:
    """The primitives a device provides; each must give a row the same bits whatever the other rows are."""

    matmul_nt: Callable  # (x [..., K], w [N, K]) -> [..., N] in x.dtype
    sigmoid: Callable  # elementwise
    silu: Callable
    softplus: Callable
    row_sum: Callable  # x [..., n] -> [..., 1]
    collapse: Callable  # (w [T, hc] fp32, streams [T, hc, D]) -> sum_l w[:, l, None] * streams[:, l] in fp32
    hc_weights: Callable  # (mixed [T, (2 + hc) * hc] fp32, base, scale, hc, iters, eps) -> pre, post, comb
    #                       (``reference.hc_weights``'s contract: sigmoids, softmax, Sinkhorn; per token)
    pool: Callable  # (kv [N, slots, d], gate [N, slots, d]) -> (kv * softmax_slots(gate)).sum(slots) [N, d]
    rms_norm: Callable  # reference signature
    unweighted_rms_norm: Callable  # reference signature


class InvariantOps:
    """The batch-invariant forms of the row-wise ops of the table, over the primitives of ``kit``."""

    def __init__(self, kit: Kit) -> None:
        self.kit = kit

    # ------------------------------------------------------------------------- linear
    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` with the kit's row-invariant GEMM."""
        return self.kit.matmul_nt(x, weight)

    def grouped_linear(self, x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
        """Block-diagonal projection, one row-invariant GEMM per group. ``x [T, g, i]`` -> ``[T, g, o]``."""
        w = weight.view(groups, -1, weight.shape[-1])  # [g, o, i]
        return torch.stack([self.kit.matmul_nt(x[:, g], w[g]) for g in range(groups)], dim=1)

    def logits(self, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits in fp32 with the kit's GEMM."""
        return self.kit.matmul_nt(hidden, head).float()

    # ------------------------------------------------------------------------- compressors
    def compressor_pool(self, kv: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float) -> torch.Tensor:
        """Reference ``compressor_pool``: the kit's per-window softmax-weighted slot sum, then RMSNorm."""
        return self.kit.rms_norm(self.kit.pool(kv, gate), norm_weight, eps)  # [N, d]

    # ------------------------------------------------------------------------- hyper-connections
    def hc_pre(self, streams, fn, base, scale, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        """Reference ``hc_pre`` over the kit: row-invariant norm and GEMM, per-token weights, stream collapse."""
        kit = self.kit
        flat = kit.unweighted_rms_norm(streams.flatten(1).float(), norm_eps)  # [T, hc * D]
        mixed = kit.matmul_nt(flat, fn.float())  # [T, (2 + hc) * hc]
        pre, post, comb = kit.hc_weights(mixed, base, scale, streams.shape[1], sinkhorn_iters, hc_eps)
        collapsed = kit.collapse(pre, streams).to(streams.dtype)  # [T, D]
        return post, comb, collapsed

    def hc_head(self, streams, fn, base, scale, hc_eps: float, norm_eps: float) -> torch.Tensor:
        """Reference ``hc_head`` over the kit (norm, GEMM, sigmoid, collapse)."""
        kit = self.kit
        flat = kit.unweighted_rms_norm(streams.flatten(1).float(), norm_eps)  # [T, hc * D]
        mixes = kit.matmul_nt(flat, fn.float())  # [T, hc]
        pre = kit.sigmoid(mixes * scale.float() + base.float()) + hc_eps
        return kit.collapse(pre, streams).to(streams.dtype)

    @staticmethod
    def hc_post(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
                comb: torch.Tensor) -> torch.Tensor:
        """Reference ``hc_post`` with the ``hc x hc`` mixing as an elementwise fold over source streams
        (no batched GEMM, whose kernel choice follows the token count)."""
        dtype = streams.dtype
        c = comb.to(dtype)  # [T, j, k]
        mixed = c[:, 0, :, None] * streams[:, 0, None, :]  # [T, k, D]
        for j in range(1, streams.shape[1]):
            mixed = mixed + c[:, j, :, None] * streams[:, j, None, :]
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mixed

    # ------------------------------------------------------------------------- MoE
    def _score(self, router_logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
        if scoring_func == "sqrtsoftplus":
            return self.kit.softplus(router_logits).sqrt()
        if scoring_func == "sigmoid":
            return self.kit.sigmoid(router_logits)
        return router_logits.softmax(dim=-1)

    def _normalise(self, scores: torch.Tensor, ids: torch.Tensor, scaling: float) -> torch.Tensor:
        weights = scores.gather(1, ids)  # [T, k]
        return weights / (self.kit.row_sum(weights) + 1e-20) * scaling

    def moe_route_topk(self, router_logits, correction_bias, top_k: int, scaling: float, scoring_func: str):
        """Reference ``moe_route_topk`` with the kit's activations and row sum."""
        scores = self._score(router_logits, scoring_func)  # [T, E]
        biased = scores + correction_bias.to(scores.dtype)
        ids = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :top_k]  # [T, k]
        return self._normalise(scores, ids, scaling), ids

    def moe_route_hash(self, router_logits, token_ids, tid2eid, scaling: float, scoring_func: str):
        """Reference ``moe_route_hash`` with the kit's activations and row sum."""
        scores = self._score(router_logits, scoring_func)  # [T, E]
        ids = tid2eid[token_ids].long()  # [T, k]
        return self._normalise(scores, ids, scaling), ids

    def swiglu_mlp(self, x, w1, w2, w3, limit: float) -> torch.Tensor:
        """Reference ``swiglu_mlp``: three row-invariant GEMMs, SiLU in fp32 with the kit's activation."""
        mm = self.kit.matmul_nt
        gate = mm(x, w1).clamp(max=limit)  # [T, I]
        up = mm(x, w3).clamp(min=-limit, max=limit)
        return mm(self.kit.silu(gate.float()).to(gate.dtype) * up, w2)

    def moe_experts(self, x, ids, weights, w1, w2, w3, limit: float) -> torch.Tensor:
        """Reference ``moe_experts`` (combine by expert id, then token) over row-invariant experts.

        An expert sees a row count that follows the batch's routing; ``swiglu_mlp`` makes each row's
        result independent of it. A token's contributions are added in ascending expert id, a function of
        the token's own routing only. (The reference loop reads the expert counts on the host.)
        """
        return _ref.moe_experts(x, ids, weights, w1, w2, w3, limit, expert_mlp=self.swiglu_mlp)

    def table(self, names: tuple[str, ...]) -> dict[str, Callable]:
        """Op name -> bound form, for ``names``."""
        return {name: getattr(self, name) for name in names}


ROW_FORMS = ("linear", "grouped_linear", "logits", "compressor_pool", "hc_pre", "hc_post", "hc_head",
             "moe_route_topk", "moe_route_hash", "swiglu_mlp", "moe_experts")
"""The ops ``InvariantOps`` provides."""

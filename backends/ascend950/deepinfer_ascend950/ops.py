"""The Ascend 950 op table: our op names -> torch_npu fused ops, each matching ``deepinfer_core.ops.reference``.

UNVERIFIED ON HARDWARE. Every adapter here is written against torch_npu's documented API and has been run
only on the CPU, with plain-torch stand-ins of the documented semantics in place of torch_npu
(``tests/contract_reference.py``, ``tests/test_contract_*.py``). Signatures were read from the torch-npu
2.13.0 wheel's own docstrings (``torch_npu/_op_plugin_docs.py``) and the Ascend/op-plugin API pages
``docs/zh/custom_APIs/torch_npu/torch_npu-<op>.md``; neither says the op was validated on Ascend 950 for
these shapes, and most of those pages list Atlas A2/A3 products only.

``NpuOps(npu)`` takes the torch_npu module (or a stand-in with the same functions) and never imports it
itself. Ops not overridden here run the reference op, which is plain torch and runs on the NPU as is:
``linear``, ``grouped_linear``, ``logits``, ``embed`` (matmuls dispatch to CANN through torch_npu),
``rope_cos_sin``, ``compressor_pool``, ``indexer_scores`` / ``indexer_topk``, ``hc_pre`` / ``hc_post`` /
``hc_head``, ``swiglu_mlp`` (shared expert) and ``moe_route_hash``.

| op | torch_npu API | falls back to the reference op when |
|---|---|---|
| rms_norm, unweighted_rms_norm | npu_rms_norm | x is 1-D or over 8-D |
| apply_rope, apply_rope_ | npu_rotary_mul(rotary_mode="interleave") | more than 999 heads, rope dim >= 896 |
| sink_attention | npu_fused_infer_attention_score_v2 (+ softmax_lse for the sinks) | q is not fp16 / bf16 |
| moe_route_topk | npu_moe_gating_top_k | scoring is not sigmoid / softmax (V4's sqrtsoftplus), > 2048 experts |
| moe_experts | npu_moe_init_routing, npu_moe_compute_expert_tokens, npu_grouped_matmul, npu_moe_finalize_routing | > 2048 experts |
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from deepinfer_core.ops import reference

SOURCE = "ascend950"
FIA_MAX_GROUP = 64
"""npu_fused_infer_attention_score_v2: num_query_heads / num_key_value_heads must not exceed 64; V4 has
one shared KV head, so heads go to the op in groups of at most 64."""
ATTENTION_DTYPES = (torch.float16, torch.bfloat16)
ROTARY_MAX_DIM = 896  # npu_rotary_mul: D < 896 and even
ROTARY_MAX_BN = 1000  # npu_rotary_mul interleave mode: B * N < 1000
MOE_MAX_EXPERTS = 2048  # npu_moe_gating_top_k / npu_moe_compute_expert_tokens: at most 2048 experts
GATING_NORM_TYPE = {"softmax": 0, "sigmoid": 1}  # npu_moe_gating_top_k norm_type: 0 softmax, 1 sigmoid


class NpuOps:
    """Adapters from our op names to torch_npu. ``overrides()`` is what ``Backend.op_overrides`` returns."""

    def __init__(self, npu: Any):
        self.npu = npu  # the torch_npu module, or a stand-in exposing the same npu_* functions
        self._ones: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def overrides(self) -> dict[str, Callable]:
        return {
            "rms_norm": self.rms_norm,
            "unweighted_rms_norm": self.unweighted_rms_norm,
            "apply_rope": self.apply_rope,
            "apply_rope_": self.apply_rope_,
            "sink_attention": self.sink_attention,
            "moe_route_topk": self.moe_route_topk,
            "moe_experts": self.moe_experts,
        }

    # ------------------------------------------------------------------------------------------ norms
    # torch_npu.npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)
    # doc: torch_npu 2.13.0 _op_plugin_docs.py "npu_rms_norm"; op-plugin torch_npu-npu_rms_norm.md.
    # y = x / sqrt(mean(x^2) + eps) * gamma; gamma has x's dtype; 2-8 dims; returns (y, rstd). Unverified.
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not 2 <= x.dim() <= 8:
            return reference.rms_norm(x, weight, eps)
        return self.npu.npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)[0]

    def unweighted_rms_norm(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        if not 2 <= x.dim() <= 8:
            return reference.unweighted_rms_norm(x, eps)
        return self.npu.npu_rms_norm(x, self._unit_gamma(x), epsilon=eps)[0]

    def _unit_gamma(self, x: torch.Tensor) -> torch.Tensor:
        key = (x.shape[-1], x.dtype, x.device)
        if key not in self._ones:  # allocated once per shape, before any graph capture replays it
            self._ones[key] = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        return self._ones[key]

    # ------------------------------------------------------------------------------------------- rope
    # torch_npu.npu_rotary_mul(Tensor input, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None)
    # doc: torch_npu 2.13.0 _op_plugin_docs.py "npu_rotary_mul". Interleave mode:
    #   x_new = stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2);  out = r1 * x + r2 * x_new
    # which is exactly our interleaved RoPE with r1 = repeat_interleave(cos, 2), r2 = repeat_interleave(sin, 2).
    # (The default 'half' mode rotates the two halves instead: wrong for DeepSeek-V4's interleaved layout.)
    # Constraints used: 4-D input; layout BSND with r1/r2 shaped 1S1D in interleave mode; B*N < 1000; D even,
    # D < 896; r1/r2 values in [-1, 1] (V4's attention factor is 1). Unverified on hardware.
    def apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        rotated = self._rotary(x, cos, sin, inverse)
        if rotated is None:
            return reference.apply_rope(x, cos, sin, inverse)
        return torch.cat([x[..., :-rotated.shape[-1]], rotated], dim=-1)

    def apply_rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """In place: only the rotary channels of ``x`` are written (the model's call; no concatenation)."""
        rotated = self._rotary(x, cos, sin, inverse)
        if rotated is None:
            return reference.apply_rope_(x, cos, sin, inverse)
        x[..., -rotated.shape[-1]:] = rotated
        return x

    def _rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor | None:
        """The trailing ``2 * cos.shape[-1]`` channels of ``x`` rotated by ``npu_rotary_mul`` (``[*x.shape[:-1],
        rope_dim]``), or None outside its documented limits."""
        rope_dim = 2 * cos.shape[-1]
        tokens = x.shape[0]
        heads = math.prod(x.shape[1:-1])  # 1 for [T, dim]
        if tokens == 0 or rope_dim == 0 or rope_dim >= ROTARY_MAX_DIM or heads >= ROTARY_MAX_BN:
            return None
        rope = x[..., -rope_dim:].reshape(1, tokens, heads, rope_dim).contiguous()  # [B=1, S=T, N, D] BSND
        r1 = cos.repeat_interleave(2, dim=-1).to(x.dtype).reshape(1, tokens, 1, rope_dim)  # 1S1D
        r2 = sin.repeat_interleave(2, dim=-1).to(x.dtype).reshape(1, tokens, 1, rope_dim)
        if inverse:
            r2 = -r2
        rotated = self.npu.npu_rotary_mul(rope, r1, r2, rotary_mode="interleave")
        return rotated.reshape(*x.shape[:-1], rope_dim)

    # -------------------------------------------------------------------------------------- attention
    # torch_npu.npu_fused_infer_attention_score_v2(query, key, value, *, atten_mask=None, learnable_sink=None,
    #     num_query_heads=1, num_key_value_heads=0, softmax_scale=1.0, input_layout="BSH", sparse_mode=0,
    #     inner_precise=0, return_softmax_lse=False, ...) -> (attention_out, softmax_lse)
    # doc: torch_npu 2.13.0 _op_plugin_docs.py "npu_fused_infer_attention_score_v2";
    #      op-plugin torch_npu-npu_fused_infer_attention_score_v2.md (products listed: Atlas A2 / A3 only).
    #
    # Layout: our q [S, Lq, H, d] is BSND as is; kv [S, Lk, d] is K == V with KV_N = 1, passed as key and value
    # [S, Lk, 1, d]. The sliding-window keys and the compressed entries (CSA / HCA) reach this op already
    # concatenated along Lk, with ``visible`` saying which of them each query sees (window band, causal entry
    # bound, indexer top-k); that pattern is neither causal nor a band, so it goes in as an explicit bool
    # atten_mask [S, 1, Lq, Lk] with sparse_mode=0, True meaning "masked out" (the op's mask convention: 1 =
    # not computed; unverified). inner_precise=2 (high precision + the documented row-invalid correction for
    # rows whose mask is all ones) when Lq > 1; the Lq == 1 (incremental) branch only accepts 0 / 1.
    #
    # Sinks: the documented ``learnable_sink`` argument (shape [Q_N], bf16) is restricted to the TND /
    # NTD_TND layouts and value D <= 128, and TND allows only sparse_mode 0 without mask or 3 with a causal
    # mask; DeepSeek-V4 has D = 512 and an arbitrary visibility mask, so it cannot be used. Instead the op
    # returns softmax_lse (documented: log of sum(exp(scores - max)) + max, shape [B, Q_N, Q_S, 1], fp32), and
    # the sink is applied exactly afterwards: with Z = exp(lse), the reference's softmax over the visible keys
    # plus one dropped sink logit s equals the plain softmax scaled by Z / (Z + e^s) = sigmoid(lse - s).
    # Rows with nothing visible are set to 0 explicitly (the reference's result), whatever the op returns.
    def sink_attention(
        self, q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, scale: float
    ) -> torch.Tensor:
        if q.dtype not in ATTENTION_DTYPES or kv.dtype != q.dtype:
            return reference.sink_attention(q, kv, visible, sinks, scale)
        seqs, q_len, heads, _ = q.shape
        if seqs == 0 or q_len == 0 or kv.shape[1] == 0:
            return torch.zeros_like(q)
        key = kv.unsqueeze(2).contiguous()  # [S, Lk, 1, d]
        mask = (~visible).unsqueeze(1).contiguous()  # [S, 1, Lq, Lk], True = masked out
        outs = []
        for start in range(0, heads, FIA_MAX_GROUP):
            group = q[:, :, start : start + FIA_MAX_GROUP].contiguous()  # [S, Lq, h, d]
            h = group.shape[2]
            out, lse = self.npu.npu_fused_infer_attention_score_v2(
                group, key, key,
                atten_mask=mask,
                num_query_heads=h,
                num_key_value_heads=1,
                softmax_scale=scale,
                input_layout="BSND",
                sparse_mode=0,
                inner_precise=2 if q_len > 1 else 0,
                return_softmax_lse=True,
            )  # out [S, Lq, h, d]; lse [S, h, Lq, 1] fp32
            sink = sinks[start : start + h].float().view(1, h, 1, 1)
            keep = torch.sigmoid(lse.float() - sink).permute(0, 2, 1, 3)  # [S, Lq, h, 1]
            outs.append(out.float() * keep)
        out = torch.cat(outs, dim=2)  # [S, Lq, H, d]
        any_visible = visible.any(dim=-1)[:, :, None, None]  # [S, Lq, 1, 1]
        return torch.where(any_visible, out, torch.zeros((), dtype=out.dtype, device=out.device)).to(q.dtype)

    # -------------------------------------------------------------------------------------------- MoE
    # torch_npu.npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1,
    #     group_select_mode=0, renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0, eps=1e-20)
    #     -> (y_out, expert_idx_out int32, norm_out fp32)
    # doc: torch_npu 2.13.0 _op_plugin_docs.py "npu_moe_gating_top_k"; op-plugin torch_npu-npu_moe_gating_top_k.md
    # (its "equivalent computation": norm = softmax / sigmoid(x); idx = stable top-k of norm + bias; y = norm[idx];
    # sigmoid only: y /= sum(y) + eps; y *= routed_scaling_factor). Stable sort = ties to the lower expert id, as
    # in the reference. Softmax is not renormalised by the op, so that path renormalises norm_out here.
    # DeepSeek-V4 scores with sqrtsoftplus, which the op does not offer: V4 checkpoints take the reference op.
    def moe_route_topk(
        self, router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, scaling: float, scoring_func: str
    ):
        norm_type = GATING_NORM_TYPE.get(scoring_func)
        if norm_type is None or router_logits.dim() != 2 or router_logits.shape[-1] > MOE_MAX_EXPERTS:
            return reference.moe_route_topk(router_logits, correction_bias, top_k, scaling, scoring_func)
        bias = correction_bias.to(router_logits.dtype)
        if norm_type == 1:
            weights, ids, _ = self.npu.npu_moe_gating_top_k(
                router_logits, top_k, bias=bias, norm_type=1, routed_scaling_factor=scaling, eps=1e-20
            )
            return weights, ids.long()
        _, ids, norm = self.npu.npu_moe_gating_top_k(router_logits, top_k, bias=bias, norm_type=0, out_flag=True)
        ids = ids.long()
        weights = norm.float().gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scaling
        return weights.to(router_logits.dtype), ids

    # Routed experts, the dropless MoE pipeline of torch_npu (docs: torch_npu 2.13.0 _op_plugin_docs.py and
    # op-plugin torch_npu-<op>.md for each op below; unverified on hardware):
    #   npu_moe_init_routing(x, row_idx, expert_idx, active_num) -> (expanded_x, expanded_row_idx, expanded_expert_idx)
    #       sorts the T*k (token, slot) rows by expert (stable); row_idx[t, j] = j*T + t names each row;
    #       expanded_x[i] = x[sorted_row_idx[i] % T]; expanded_row_idx[sorted_row_idx[i]] = i.
    #   npu_moe_compute_expert_tokens(sorted_expert_for_source_row, num_expert) -> per-expert end offsets
    #       ("binary search for the last row of each expert"; read as the exclusive cumulative count, the way
    #       group_list_type=0 consumes it - unverified). The doc page lists Ascend 950PR / 950DT.
    #   npu_grouped_matmul([x], [w], group_list=..., split_item=2, group_type=0, group_list_type=0) -> [y]
    #       rows [end[e-1], end[e]) of x times w[e] ([E, K, N]); our weights are [E, N, K], passed as a
    #       transposed view (the doc describes transposed weights by stride; unverified for this case).
    #   npu_moe_finalize_routing(rows, skip1, skip2, bias, scales, expanded_src_to_dst_row, export_for_source_row)
    #       out[t] = sum_j scales[t, j] * rows[expanded_src_to_dst_row[t + j*T]] (skip/bias None).
    # The clamped SwiGLU between the matmuls is plain torch (npu_clipped_swiglu with alpha=1, bias=0 would fuse it;
    # its doc lists Atlas A2/A3 inference products only, so it is left out until tried on a 950).
    def moe_experts(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: torch.Tensor,
        limit: float,
    ) -> torch.Tensor:
        tokens, top_k = ids.shape
        experts = w1.shape[0]
        if tokens == 0:
            return torch.zeros_like(x)
        if experts > MOE_MAX_EXPERTS:
            return reference.moe_experts(x, ids, weights, w1, w2, w3, limit)
        npu = self.npu
        row_idx = torch.arange(tokens * top_k, dtype=torch.int32, device=x.device).view(top_k, tokens).t().contiguous()
        expert_idx = ids.to(torch.int32).contiguous()  # [T, k]
        expanded_x, expanded_row_idx, expanded_expert_idx = npu.npu_moe_init_routing(x, row_idx, expert_idx, tokens)
        group_list = npu.npu_moe_compute_expert_tokens(expanded_expert_idx, experts).to(torch.int64)  # [E] ends

        def grouped(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # weight [E, out, in]
            return npu.npu_grouped_matmul(
                [rows], [weight.transpose(1, 2)], group_list=group_list, split_item=2, group_type=0, group_list_type=0
            )[0]

        gate = grouped(expanded_x, w1).clamp(max=limit)  # [T*k, I]
        up = grouped(expanded_x, w3).clamp(min=-limit, max=limit)
        down = grouped(F.silu(gate) * up, w2)  # [T*k, D]
        out = npu.npu_moe_finalize_routing(
            down, None, None, None, weights.to(down.dtype), expanded_row_idx, expert_idx
        )  # [T, D]
        return out.to(x.dtype)

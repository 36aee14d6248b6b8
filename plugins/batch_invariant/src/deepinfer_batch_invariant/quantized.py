"""Batch-invariant forms of the core's quantized-weight ops (``linear_fp8_block``, ``moe_experts_mxfp4``, ...).

Each dequantizes its weights exactly (elementwise: the same bits whatever the batch), then runs this backend's
batch-invariant unquantized op. Correct and invariant, not fast: stacked experts are dequantized whole per call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from deepinfer_core.quant import fp8_block, mxfp4


def variants(invariant: Mapping[str, Callable]) -> dict[str, Callable]:
    """The quantized ops built on ``invariant``'s ``linear``, ``grouped_linear``, ``swiglu_mlp`` and ``moe_experts``."""
    linear, grouped, swiglu, experts = (invariant[n] for n in ("linear", "grouped_linear", "swiglu_mlp", "moe_experts"))

    def fp8(weight: torch.Tensor, scale: torch.Tensor, block, like: torch.Tensor) -> torch.Tensor:
        return fp8_block.dequantize(weight, scale, block).to(like.dtype)

    def linear_fp8_block(x, weight, scale, block):
        return linear(x, fp8(weight, scale, block, x))

    def grouped_linear_fp8_block(x, weight, scale, block, groups):
        return grouped(x, fp8(weight, scale, block, x), groups)

    def swiglu_mlp_fp8_block(x, w1, s1, w2, s2, w3, s3, block, limit):
        return swiglu(x, fp8(w1, s1, block, x), fp8(w2, s2, block, x), fp8(w3, s3, block, x), limit)

    def moe_experts_fp8_block(x, ids, weights, w1, s1, w2, s2, w3, s3, block, limit):
        return experts(x, ids, weights, fp8(w1, s1, block, x), fp8(w2, s2, block, x), fp8(w3, s3, block, x), limit)

    def moe_experts_mxfp4(x, ids, weights, w1, s1, w2, s2, w3, s3, limit):
        w1, w2, w3 = (mxfp4.dequantize(w, s).to(x.dtype) for w, s in ((w1, s1), (w2, s2), (w3, s3)))
        return experts(x, ids, weights, w1, w2, w3, limit)

    return {"linear_fp8_block": linear_fp8_block, "grouped_linear_fp8_block": grouped_linear_fp8_block,
            "swiglu_mlp_fp8_block": swiglu_mlp_fp8_block, "moe_experts_fp8_block": moe_experts_fp8_block,
            "moe_experts_mxfp4": moe_experts_mxfp4}

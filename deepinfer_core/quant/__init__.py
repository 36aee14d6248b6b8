"""Quantized DeepSeek-V4 checkpoints as DeepSeek ships them (docs/quantization.md).

* :mod:`~deepinfer_core.quant.config`: config.json's ``quantization_config`` and ``expert_dtype``;
* :mod:`~deepinfer_core.quant.scales`: ue8m0 (``float8_e8m0fnu``) power-of-two scales;
* :mod:`~deepinfer_core.quant.fp8_block`: fp8 e4m3 weights with one scale per block of ``B x B``;
* :mod:`~deepinfer_core.quant.mxfp4`: MXFP4 weights, two e2m1 codes per byte and one ue8m0 scale per 32 inputs;
* :mod:`~deepinfer_core.quant.tensors`: what one quantized tensor of a checkpoint is, and the model's view of it;
* :mod:`~deepinfer_core.quant.writer`: turns a bf16 / fp32 checkpoint into the format (``deepinfer quantize``).

Weights stay quantized in memory; the reference ops (``ops/reference.py``: ``linear_fp8_block``,
``moe_experts_mxfp4``, ...) dequantize them exactly in fp32 and then run the unquantized math.
"""

"""DeepSeek-V4 parameter names and shapes, and the renames that bring checkpoints onto them.

Canonical names are DeepSeek's own on-disk names (``embed.weight``, ``layers.0.attn.wq_a.weight``,
``layers.0.ffn.experts.3.w1.weight`` ...); the engine's model consumes exactly these. Three naming
schemes map onto them through :func:`canonical_name`:

* DeepSeek's own names (identity);
* what HF transformers ``save_pretrained`` writes (DeepSeek's names under a ``model.`` prefix, with
  ``model.embed_tokens.weight`` and ``model.hc_head.hc_*`` at the top);
* HF transformers' in-memory module names (``model.layers.N.self_attn.q_a_proj.weight`` ...), where
  the routed experts of a layer are fused into ``mlp.experts.gate_up_proj [E, 2I, D]`` and
  ``mlp.experts.down_proj [E, D, I]``. Those map to the *fused* names ``layers.N.ffn.experts.gate_up_proj``
  / ``layers.N.ffn.experts.down_proj``; :func:`fused_pieces` says how to cut them into the
  per-expert canonical tensors.

``mtp.*`` tensors (multi-token-prediction draft layers) map to ``None``: the target's loader skips them;
``deepinfer_core.models.deepseek_v4.mtp`` reads them.
"""

from __future__ import annotations

import re

from deepinfer_core.models.deepseek_v4.config import CSA, HCA, DeepseekV4Config

# Tensor kinds: how the loader converts a tensor's dtype.
WEIGHT = "weight"  # floating point, converted to the dtype the caller asks for
FP32 = "fp32"  # floating point kept in float32 (norms, hyper-connection mixers, sinks, biases, APE)
INT = "int"  # integer table (hash routing), loaded as int64
STORED = "stored"  # a quantized weight or its scale (deepinfer_core.quant.tensors), kept as stored

Shape = tuple[int, ...]
Spec = tuple[Shape, str]

FUSED_GATE_UP = "ffn.experts.gate_up_proj"
FUSED_DOWN = "ffn.experts.down_proj"

_TOP_LEVEL = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}

# HF in-memory per-layer suffix -> DeepSeek suffix.
_LAYER_SUFFIX = {
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.experts.gate_up_proj": FUSED_GATE_UP,
    "mlp.experts.down_proj": FUSED_DOWN,
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
}
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_HF_EXPERT_TO_W = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def canonical_name(name: str) -> str | None:
    """Map a checkpoint tensor name from any supported scheme onto its canonical name.

    Returns ``None`` for ``mtp.*`` draft-layer tensors (skipped, not an error). Fused HF expert
    tensors map to ``layers.N.ffn.experts.gate_up_proj`` / ``layers.N.ffn.experts.down_proj`` (see
    :func:`fused_pieces`). Names no scheme knows are returned prefix-stripped and unchanged otherwise,
    so they show up as unexpected tensors when compared with :func:`expected_tensors`.
    """
    stripped = name.removeprefix("model.")
    if stripped.startswith("mtp.") or stripped == "mtp":
        return None
    if stripped in _TOP_LEVEL:
        return _TOP_LEVEL[stripped]
    match = _LAYER.match(stripped)
    if match is None:
        return stripped
    layer, suffix = match.groups()
    return f"layers.{layer}.{_layer_suffix(suffix)}"


def _layer_suffix(suffix: str) -> str:
    if suffix in _LAYER_SUFFIX:
        return _LAYER_SUFFIX[suffix]
    expert = _HF_EXPERT.match(suffix)
    if expert:
        return f"ffn.experts.{expert.group(1)}.{_HF_EXPERT_TO_W[expert.group(2)]}.weight"
    return suffix


def is_fused(name: str) -> bool:
    """True for the fused per-layer expert names that :func:`canonical_name` can return."""
    return name.endswith(("." + FUSED_GATE_UP, "." + FUSED_DOWN))


def fused_shape(name: str, config: DeepseekV4Config) -> Shape:
    """Expected shape of a fused expert tensor: ``[E, 2I, D]`` (gate_up) or ``[E, D, I]`` (down)."""
    E, D, I = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
    return (E, 2 * I, D) if name.endswith(FUSED_GATE_UP) else (E, D, I)


def fused_pieces(name: str, config: DeepseekV4Config) -> list[tuple[str, tuple[slice, ...]]]:
    """Per-expert canonical tensors cut from a fused expert tensor, as ``(canonical, index)``.

    ``index`` is a tuple of slices into the fused tensor; the piece is ``fused[index]`` with the
    leading expert dimension (of size 1) squeezed away. For ``gate_up_proj [E, 2I, D]`` the first
    ``I`` rows of expert ``e`` are ``w1`` (gate) and the next ``I`` rows are ``w3`` (up); for
    ``down_proj [E, D, I]`` expert ``e`` is ``w2``.
    """
    prefix = name.rsplit(".ffn.experts.", 1)[0]
    I = config.moe_intermediate_size
    pieces = []
    for e in range(config.n_routed_experts):
        expert = slice(e, e + 1)
        base = f"{prefix}.ffn.experts.{e}"
        if name.endswith(FUSED_GATE_UP):
            pieces.append((f"{base}.w1.weight", (expert, slice(0, I))))
            pieces.append((f"{base}.w3.weight", (expert, slice(I, 2 * I))))
        else:
            pieces.append((f"{base}.w2.weight", (expert,)))
    return pieces


def expected_tensors(config: DeepseekV4Config) -> dict[str, Spec]:
    """Every canonical tensor a checkpoint of ``config`` must hold, as ``name -> (shape, kind)``.

    ``kind`` is :data:`WEIGHT`, :data:`FP32` or :data:`INT` (see the module constants).
    """
    D, V, hc = config.hidden_size, config.vocab_size, config.hc_mult
    specs: dict[str, Spec] = {
        "embed.weight": ((V, D), WEIGHT),
        "head.weight": ((V, D), WEIGHT),
        "norm.weight": ((D,), FP32),
        "hc_head_fn": ((hc, hc * D), FP32),
        "hc_head_base": ((hc,), FP32),
        "hc_head_scale": ((1,), FP32),
    }
    for layer in range(config.num_hidden_layers):
        for suffix, spec in _layer_specs(config, layer).items():
            specs[f"layers.{layer}.{suffix}"] = spec
    return specs


def _layer_specs(config: DeepseekV4Config, layer: int) -> dict[str, Spec]:
    D, hc = config.hidden_size, config.hc_mult
    mix = (2 + hc) * hc
    specs: dict[str, Spec] = {"attn_norm.weight": ((D,), FP32), "ffn_norm.weight": ((D,), FP32)}
    for part in ("attn", "ffn"):
        specs[f"hc_{part}_fn"] = ((mix, hc * D), FP32)
        specs[f"hc_{part}_base"] = ((mix,), FP32)
        specs[f"hc_{part}_scale"] = ((3,), FP32)
    specs.update(_attention_specs(config, layer))
    specs.update(_moe_specs(config, layer))
    return specs


def _attention_specs(config: DeepseekV4Config, layer: int) -> dict[str, Spec]:
    D, H, hd, q = config.hidden_size, config.num_attention_heads, config.head_dim, config.q_lora_rank
    g, o = config.o_groups, config.o_lora_rank
    specs: dict[str, Spec] = {
        "attn.wq_a.weight": ((q, D), WEIGHT),
        "attn.q_norm.weight": ((q,), FP32),
        "attn.wq_b.weight": ((H * hd, q), WEIGHT),
        "attn.wkv.weight": ((hd, D), WEIGHT),
        "attn.norm.weight": ((hd,), FP32),
        "attn.wo_a.weight": ((g * o, H * hd // g), WEIGHT),
        "attn.wo_b.weight": ((D, g * o), WEIGHT),
        "attn.attn_sink": ((H,), FP32),
    }
    layer_type = config.layer_types[layer]
    if layer_type == CSA:
        ih, ihd, r = config.index_n_heads, config.index_head_dim, config.compress_ratio(layer)
        specs.update(_compressor_specs("attn.compressor", D, 2 * hd, hd, r))
        specs.update(_compressor_specs("attn.indexer.compressor", D, 2 * ihd, ihd, r))
        specs["attn.indexer.wq_b.weight"] = ((ih * ihd, q), WEIGHT)
        specs["attn.indexer.weights_proj.weight"] = ((ih, D), WEIGHT)
    elif layer_type == HCA:
        specs.update(_compressor_specs("attn.compressor", D, hd, hd, config.compress_ratio(layer)))
    return specs


def _compressor_specs(prefix: str, D: int, width: int, norm: int, ratio: int) -> dict[str, Spec]:
    return {
        f"{prefix}.wkv.weight": ((width, D), WEIGHT),
        f"{prefix}.wgate.weight": ((width, D), WEIGHT),
        f"{prefix}.ape": ((ratio, width), FP32),
        f"{prefix}.norm.weight": ((norm,), FP32),
    }


def _moe_specs(config: DeepseekV4Config, layer: int) -> dict[str, Spec]:
    D, E, I = config.hidden_size, config.n_routed_experts, config.moe_intermediate_size
    shared = I * config.n_shared_experts
    specs: dict[str, Spec] = {"ffn.gate.weight": ((E, D), WEIGHT)}
    if config.mlp_layer_types[layer] == "hash_moe":
        specs["ffn.gate.tid2eid"] = ((config.vocab_size, config.num_experts_per_tok), INT)
    else:
        specs["ffn.gate.bias"] = ((E,), FP32)
    for e in range(E):
        specs[f"ffn.experts.{e}.w1.weight"] = ((I, D), WEIGHT)
        specs[f"ffn.experts.{e}.w3.weight"] = ((I, D), WEIGHT)
        specs[f"ffn.experts.{e}.w2.weight"] = ((D, I), WEIGHT)
    specs["ffn.shared_experts.w1.weight"] = ((shared, D), WEIGHT)
    specs["ffn.shared_experts.w3.weight"] = ((shared, D), WEIGHT)
    specs["ffn.shared_experts.w2.weight"] = ((D, shared), WEIGHT)
    return specs


def hf_layer_tensors(state_dict, prefix: str, config: DeepseekV4Config):
    """Yield ``(prefix + "." + DeepSeek suffix, tensor)`` for an HF ``DeepseekV4DecoderLayer``'s ``state_dict``
    (in-memory names such as ``self_attn.q_a_proj.weight``; fused experts cut per expert). ``prefix``: ``layers.N``
    or a draft layer's ``mtp.K``."""
    for name, tensor in state_dict.items():
        suffix = _layer_suffix(name)
        if suffix in (FUSED_GATE_UP, FUSED_DOWN):
            for piece, index in fused_pieces(f"{prefix}.{suffix}", config):
                yield piece, tensor[index].squeeze(0)
        else:
            yield f"{prefix}.{suffix}", tensor

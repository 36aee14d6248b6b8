"""DeepSeek-V4 configuration, parsed from a checkpoint's config.json.

Field names and defaults follow HF transformers 5.23 ``DeepseekV4Config`` (the reference); the
legacy keys DeepSeek's own configs ship (``compress_ratios``, ``num_hash_layers``,
``qk_rope_head_dim``, ``compress_rate_csa`` / ``compress_rate_hca``, ``rope_scaling``) are folded in
the same way.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.errors import DeepInferError
from deepinfer_core.quant.config import QuantizationConfig

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
SUPPORTED_MODEL_TYPES = ("deepseek_v4",)
_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


class ConfigError(DeepInferError, ValueError):
    """A config.json that this engine cannot run, with the reason and what to do."""


@dataclasses.dataclass
class DeepseekV4Config:
    """Hyper-parameters of a DeepSeek-V4 model (see HF ``DeepseekV4Config`` for their meaning)."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1024
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    layer_types: list[str] = dataclasses.field(default_factory=list)
    mlp_layer_types: list[str] = dataclasses.field(default_factory=list)
    compress_rates: dict[str, int] = dataclasses.field(default_factory=dict)
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1.0e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1.0e-6
    partial_rotary_factor: float = 64 / 512
    rope_parameters: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    model_type: str = "deepseek_v4"
    torch_dtype: str | None = None
    quantization_config: dict[str, Any] | None = None  # fp8 / fp4 checkpoints (deepinfer_core.quant.config)
    expert_dtype: str | None = None

    # ----------------------------------------------------------------- derived
    @property
    def quantization(self) -> QuantizationConfig | None:
        """The checkpoint's declared quantization (``quantization_config`` and ``expert_dtype``), or None."""
        return QuantizationConfig.from_config({"quantization_config": self.quantization_config,
                                               "expert_dtype": self.expert_dtype})

    @property
    def rope_head_dim(self) -> int:
        """Channels per head that carry RoPE (the trailing slice of each head)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def compress_ratio(self, layer_idx: int) -> int:
        """Tokens per compressed entry for a layer; 0 for sliding-window-only layers."""
        layer_type = self.layer_types[layer_idx]
        return 0 if layer_type == SLIDING else self.compress_rates[layer_type]

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    @property
    def block_multiple(self) -> int:
        """Smallest token count that is a multiple of every compression ratio in use."""
        multiple = 1
        for layer_idx in range(self.num_hidden_layers):
            ratio = self.compress_ratio(layer_idx)
            if ratio:
                multiple = math.lcm(multiple, ratio)
        return multiple

    def rope_inv_freq(self, rope_type: str) -> torch.Tensor:
        """Inverse frequencies, one per rotated channel pair, for ``main`` or ``compress`` RoPE.

        Returns a float32 tensor of shape ``[rope_head_dim // 2]``. Sliding layers use ``main``;
        CSA / HCA layers, their compressors and the indexer use ``compress`` (YaRN when configured,
        with the attention factor forced to 1 as in the reference).
        """
        params = self.rope_parameters[rope_type]
        dim = int(self.head_dim * params.get("partial_rotary_factor", self.partial_rotary_factor))
        base = float(params["rope_theta"])
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        if params.get("rope_type", "default") == "default":
            return 1.0 / pos_freqs
        if params["rope_type"] != "yarn":
            raise ConfigError(f"rope_type {params['rope_type']!r} is not supported; use 'default' or 'yarn'")
        return _yarn_inv_freq(params, dim, base, pos_freqs, self.max_position_embeddings)

    # ----------------------------------------------------------------- parsing
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DeepseekV4Config:
        """Build a config from a config.json dict, folding in legacy keys; raises ConfigError."""
        raw = dict(raw)
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unknown model_type {model_type!r} in config.json; this engine runs {list(SUPPORTED_MODEL_TYPES)}. "
                "Point it at a DeepSeek-V4 checkpoint folder."
            )
        if "torch_dtype" not in raw and "dtype" in raw:
            raw["torch_dtype"] = raw["dtype"]
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in known}
        config = cls(**kwargs)
        config._fold_legacy(raw)
        config.validate()
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> DeepseekV4Config:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except ValueError as exc:  # invalid JSON, or bytes that are not UTF-8
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} holds a {type(raw).__name__}, not a JSON object; fix or re-download it")
        return cls.from_dict(raw)

    def _fold_legacy(self, raw: dict[str, Any]) -> None:
        n = self.num_hidden_layers
        rates = {CSA: 4, HCA: 128}
        rates.update(self.compress_rates or {})
        if raw.get("compress_rate_csa") is not None:
            rates[CSA] = raw["compress_rate_csa"]
        if raw.get("compress_rate_hca") is not None:
            rates[HCA] = raw["compress_rate_hca"]
        self.compress_rates = rates
        if not self.layer_types and raw.get("compress_ratios") is not None:
            self.layer_types = [_RATIO_TO_LAYER_TYPE.get(r, f"compress_ratio={r}") for r in raw["compress_ratios"]]
        if not self.layer_types:
            interleave = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
            self.layer_types = [HCA] * min(n, 2) + interleave
        self.layer_types = list(self.layer_types[:n])
        if not self.mlp_layer_types:
            n_hash = raw.get("num_hash_layers", 3)
            self.mlp_layer_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        self.mlp_layer_types = list(self.mlp_layer_types[:n])
        if "partial_rotary_factor" not in raw or raw["partial_rotary_factor"] is None:
            legacy = raw.get("qk_rope_head_dim")
            self.partial_rotary_factor = legacy / self.head_dim if legacy is not None else 64 / 512
        rp = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            self.rope_parameters = {"main": dict(rp["main"]), "compress": dict(rp["compress"])}
            return
        yarn = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        if "type" in yarn and "rope_type" not in yarn:
            yarn["rope_type"] = yarn.pop("type")
        main = {"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": self.partial_rotary_factor}
        compress = {**yarn, "rope_theta": self.compress_rope_theta, "partial_rotary_factor": self.partial_rotary_factor}
        compress.setdefault("rope_type", "default")
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
        self.rope_parameters = {"main": main, "compress": compress}

    def validate(self) -> None:
        """Raise ConfigError naming the first field that makes this config unrunnable."""
        n = self.num_hidden_layers
        for name, types, allowed in (
            ("layer_types", self.layer_types, LAYER_TYPES),
            ("mlp_layer_types", self.mlp_layer_types, MLP_LAYER_TYPES),
        ):
            if len(types) != n:
                raise ConfigError(f"num_hidden_layers is {n} but {name} has {len(types)} entries")
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                raise ConfigError(f"{name} entries must be one of {list(allowed)}; got {bad}")
        if self.num_key_value_heads != 1:
            raise ConfigError(f"DeepSeek-V4 uses one shared KV head; config has num_key_value_heads={self.num_key_value_heads}")
        if self.num_attention_heads % self.o_groups:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) must be divisible by o_groups ({self.o_groups})")
        if self.rope_head_dim % 2 or self.rope_head_dim > self.head_dim:
            raise ConfigError(f"rope head dim {self.rope_head_dim} must be even and <= head_dim {self.head_dim}")
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise ConfigError(f"scoring_func {self.scoring_func!r} is not supported (sqrtsoftplus, sigmoid, softmax)")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported; DeepSeek-V4 uses 'silu'")
        _ = self.quantization  # parsing it raises ConfigError for a quantization this engine does not read

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _yarn_inv_freq(params: dict, dim: int, base: float, pos_freqs: torch.Tensor, max_pos: int) -> torch.Tensor:
    factor = params.get("factor")
    original = params["original_max_position_embeddings"]
    if factor is None:
        factor = max_pos / original
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight

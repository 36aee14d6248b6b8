"""config.json's quantization fields as DeepSeek ships them, parsed and checked.

``quantization_config``: ``{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
"scale_fmt": "ue8m0", "activation_scheme": "dynamic"}``; top-level ``expert_dtype``: ``"fp4"`` (MXFP4 routed experts,
V4-Flash) or ``"fp8"`` (fp8 block experts, V4-Flash-Base); absent means ``"fp4"``. Which tensors are quantized is
read per tensor from the checkpoint (``deepinfer_core.quant.tensors``), not from this config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

QUANT_METHODS = ("fp8",)
FORMATS = ("e4m3",)
SCALE_FORMATS = (None, "ue8m0")
EXPERT_DTYPES = ("fp4", "fp8")
ACTIVATION_SCHEMES = (None, "dynamic")


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """A quantized checkpoint's declared format: fp8 e4m3 block weights plus the routed experts' dtype."""

    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str | None = "ue8m0"
    expert_dtype: str = "fp4"
    quant_method: str = "fp8"
    fmt: str = "e4m3"
    activation_scheme: str | None = "dynamic"

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> QuantizationConfig | None:
        """The quantization of a config.json dict, or None when it declares none; raises ``ConfigError`` naming
        the field for a method, format, block size, scale format, activation scheme or expert dtype this engine
        does not read."""
        quant = raw.get("quantization_config")
        if not quant:
            return None
        if not isinstance(quant, Mapping):
            _fail("quantization_config", quant, "an object such as {\"quant_method\": \"fp8\", ...}")
        config = cls(
            weight_block_size=_block_size(quant.get("weight_block_size", [128, 128])),
            scale_fmt=_one_of("quantization_config.scale_fmt", quant.get("scale_fmt"), SCALE_FORMATS),
            expert_dtype=_one_of("expert_dtype", raw.get("expert_dtype") or quant.get("expert_dtype") or "fp4",
                                 EXPERT_DTYPES),
            quant_method=_one_of("quantization_config.quant_method", quant.get("quant_method"), QUANT_METHODS),
            fmt=_one_of("quantization_config.fmt", quant.get("fmt", "e4m3"), FORMATS),
            activation_scheme=_one_of("quantization_config.activation_scheme", quant.get("activation_scheme"),
                                      ACTIVATION_SCHEMES),
        )
        return config

    def to_config(self) -> dict[str, Any]:
        """The config.json fields that declare this quantization: ``{"quantization_config": ..., "expert_dtype": ..}``."""
        quant = {"quant_method": self.quant_method, "fmt": self.fmt, "weight_block_size": list(self.weight_block_size),
                 "scale_fmt": self.scale_fmt, "activation_scheme": self.activation_scheme}
        return {"quantization_config": quant, "expert_dtype": self.expert_dtype}


def _block_size(value: Any) -> tuple[int, int]:
    ok = (isinstance(value, list | tuple) and len(value) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value))
    if not ok:
        _fail("quantization_config.weight_block_size", value, "two positive integers such as [128, 128]")
    return int(value[0]), int(value[1])


def _one_of(field: str, value: Any, allowed: tuple) -> Any:
    if value not in allowed:
        _fail(field, value, " or ".join("absent" if a is None else repr(a) for a in allowed))
    return value


def _fail(field: str, value: Any, wanted: str) -> None:
    from deepinfer_core.models.deepseek_v4.config import ConfigError

    raise ConfigError(f"config.json {field} is {value!r}; this engine reads {wanted}. "
                      "Quantized DeepSeek-V4 checkpoints use fp8 e4m3 block weights with ue8m0 or float32 scales "
                      "and fp4 or fp8 experts (docs/quantization.md)")

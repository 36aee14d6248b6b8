"""Write DeepSeek-V4 checkpoints in the quantized format DeepSeek ships (``deepinfer quantize``).

Routed experts become MXFP4 (``--experts fp4``: ue8m0 scales per 32 inputs) or fp8 blocks (``--experts fp8``);
every other linear weight becomes fp8 e4m3 with one scale per ``B x B`` block (``--linear fp8``). Values round to
the nearest representable one; scales are powers of two (ue8m0) by default, as V4-Flash ships them. The embedding,
the head, the router gate, norms, sinks, biases and the hyper-connection weights stay as stored. Tensors are
written under DeepSeek's own names, shard by shard, so memory stays around one shard.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from deepinfer_core.errors import DeepInferError
from deepinfer_core.models.deepseek_v4 import weights as v4_weights
from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config
from deepinfer_core.quant import fp8_block, mxfp4
from deepinfer_core.quant.config import QuantizationConfig
from deepinfer_core.quant.tensors import (
    FP8_BLOCK,
    MXFP4,
    SCALE_SUFFIX,
    QuantizedTensor,
    scale_name,
    view,
    weight_name,
)

EXPERT_FORMATS = ("fp4", "fp8")
LINEAR_FORMATS = ("fp8", "none")
BLOCK_SIZES = (128, 32)  # what DeepSeek ships (V4-Flash, V4.1-Flash); the CLI offers these
SCALE_FORMATS = ("ue8m0", "float32")
_KEPT = ("embed.weight", "head.weight")  # read by a lookup and the logits op
_ROUTER = ".ffn.gate.weight"


class QuantizeError(DeepInferError, ValueError):
    """A checkpoint or recipe ``deepinfer quantize`` cannot turn into the quantized format."""


@dataclasses.dataclass(frozen=True)
class QuantRecipe:
    """What to quantize and how: the experts' format, the other linears', the fp8 block and the fp8 scale format."""

    experts: str = "fp4"
    linear: str = "fp8"
    block: int = 128
    scale_fmt: str | None = None  # None: ue8m0 with fp4 experts, float32 with fp8 experts (as DeepSeek ships them)

    def __post_init__(self) -> None:
        for field, value, allowed in (("experts", self.experts, EXPERT_FORMATS), ("linear", self.linear, LINEAR_FORMATS),
                                      ("scale_fmt", self.scale_fmt, (None, *SCALE_FORMATS))):
            if value not in allowed:
                raise QuantizeError(f"{field} {value!r} is not a choice; use one of {[a for a in allowed if a]}")
        if not isinstance(self.block, int) or self.block < 1:
            raise QuantizeError(f"block {self.block!r} must be a positive integer (DeepSeek ships 128 and 32)")

    @classmethod
    def from_config(cls, quant: QuantizationConfig) -> QuantRecipe:
        """The recipe that writes what a config's ``quantization_config`` declares (``load_format="dummy"`` draws
        weights this way): its experts' dtype, fp8 linears, its block (square) and its scale format."""
        rows, cols = quant.weight_block_size
        if rows != cols:
            raise QuantizeError(f"weight_block_size {[rows, cols]}: the writer makes square blocks; use [{rows}, "
                                f"{rows}] or load a checkpoint written with these blocks")
        return cls(experts=quant.expert_dtype, linear="fp8", block=rows,
                   scale_fmt="ue8m0" if quant.scale_fmt == "ue8m0" else "float32")

    @property
    def ue8m0(self) -> bool:
        """Whether fp8 block scales are powers of two (``float8_e8m0fnu``) rather than float32."""
        return (self.scale_fmt or ("ue8m0" if self.experts == "fp4" else "float32")) == "ue8m0"

    def config(self) -> QuantizationConfig:
        """The ``quantization_config`` / ``expert_dtype`` this recipe writes."""
        return QuantizationConfig(weight_block_size=(self.block, self.block),
                                  scale_fmt="ue8m0" if self.ue8m0 else None, expert_dtype=self.experts)

    def format_of(self, name: str, kind: str) -> str | None:
        """``"fp4"``, ``"fp8"`` or None (kept as stored) for the canonical tensor ``name`` of ``kind``."""
        if kind != v4_weights.WEIGHT or name in _KEPT or name.endswith(_ROUTER):
            return None
        if ".ffn.experts." in name:
            return self.experts
        return None if self.linear == "none" else self.linear


def planned_quantization(recipe: QuantRecipe, config: DeepseekV4Config,
                         specs: Mapping[str, v4_weights.Spec] | None = None) -> dict[str, QuantizedTensor]:
    """What ``recipe`` writes for a checkpoint of ``config``, as the loader will read it (canonical name -> format);
    ``specs``: the tensors to plan, by default the target model's (``expected_tensors``)."""
    planned = {}
    for name, (shape, kind) in (v4_weights.expected_tensors(config) if specs is None else specs).items():
        fmt = recipe.format_of(name, kind)
        if fmt == "fp4":
            planned[name] = QuantizedTensor(name, MXFP4, shape, (1, mxfp4.GROUP), torch.float8_e8m0fnu)
        elif fmt == "fp8":
            scale = torch.float8_e8m0fnu if recipe.ue8m0 else torch.float32
            planned[name] = QuantizedTensor(name, FP8_BLOCK, shape, (recipe.block, recipe.block), scale)
    return planned


def quantize_tensors(recipe: QuantRecipe, tensors: Iterable[tuple[str, torch.Tensor, str]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of the quantized checkpoint for canonical ``(name, tensor, kind)`` inputs: a quantized
    weight is followed by its ``.scale``; the rest pass through unchanged."""
    block = (recipe.block, recipe.block)
    for name, tensor, kind in tensors:
        fmt = recipe.format_of(name, kind)
        if fmt is None:
            yield name, tensor
            continue
        if fmt == "fp4":
            if tensor.shape[-1] % mxfp4.GROUP:
                raise QuantizeError(f"{name} has input width {tensor.shape[-1]}; MXFP4 needs a multiple of "
                                    f"{mxfp4.GROUP}: use --experts fp8 for this model")
            weight, scale = mxfp4.quantize(tensor)
        else:
            weight, scale = fp8_block.quantize(tensor, block, recipe.ue8m0)
        yield name, weight
        yield scale_name(name), scale


def quantized_config(config_dict: dict, recipe: QuantRecipe) -> dict:
    """``config_dict`` with the recipe's ``quantization_config`` and ``expert_dtype``."""
    return {**config_dict, **recipe.config().to_config()}


def quantize_checkpoint(src: str | Path, dst: str | Path, recipe: QuantRecipe,
                        max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Write ``src`` (a bf16 / fp16 / fp32 V4 checkpoint) quantized by ``recipe`` into ``dst``, with its tokenizer
    and other files; returns the shard names. Raises QuantizeError for a quantized source or an existing ``dst``."""
    from deepinfer_core.checkpoint import iter_checkpoint, plan_checkpoint, read_headers, write_checkpoint

    src, dst = Path(src), Path(dst)
    raw = json.loads((src / "config.json").read_text())
    if raw.get("quantization_config"):
        raise QuantizeError(f"{src} is already quantized (config.json has a quantization_config); "
                            "quantize a bf16 or fp32 checkpoint")
    if dst.exists() and any(dst.iterdir()):
        raise QuantizeError(f"{dst} exists and is not empty; pick a new folder")
    config = DeepseekV4Config.from_dict(raw)
    plan = plan_checkpoint(src, config)
    plan.raise_for_problems()
    stored = _stored_dtypes(plan, read_headers(src))
    kinds = {name: source.kind for name, source in plan.sources.items()}
    read = ((name, tensor.to(stored[name]) if recipe.format_of(name, kinds[name]) is None else tensor, kinds[name])
            for name, tensor in iter_checkpoint(plan, torch.float32))
    shards = write_checkpoint(dst, quantize_tensors(recipe, read), quantized_config(raw, recipe), max_shard_bytes)
    _copy_side_files(src, dst)
    return shards


def _stored_dtypes(plan, headers) -> dict[str, torch.dtype]:
    """The dtype each canonical tensor has on disk (what an unquantized tensor is written back as)."""
    by_name = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
               "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8}
    return {name: by_name[headers[s.shard][s.source][1]] for name, s in plan.sources.items()}


def _copy_side_files(src: Path, dst: Path) -> None:
    """Everything beside the weights and config.json (tokenizer, generation config, model card)."""
    for path in src.iterdir():
        skip = path.suffix == ".safetensors" or path.name in ("config.json", "model.safetensors.index.json")
        if path.is_file() and not skip:
            shutil.copy2(path, dst / path.name)


def dequantized_tensors(folder: str | Path, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """Every canonical tensor of the checkpoint in ``folder`` with quantized weights dequantized exactly (to float32,
    then ``dtype``); other tensors as the loader reads them. What HF transformers runs to check the engine."""
    from deepinfer_core.checkpoint import iter_checkpoint, plan_checkpoint

    folder = Path(folder)
    plan = plan_checkpoint(folder, DeepseekV4Config.from_file(folder / "config.json"))
    plan.raise_for_problems()
    held: dict[str, torch.Tensor] = {}
    for name, tensor in iter_checkpoint(plan, dtype):
        weight = weight_name(name) if name.endswith(SCALE_SUFFIX) else name
        spec = plan.quantized.get(weight)
        if spec is None:
            yield name, tensor
            continue
        held[name] = tensor
        if weight in held and scale_name(weight) in held:
            stored, scale = held.pop(weight), held.pop(scale_name(weight))
            yield weight, view(spec, stored, scale).dequantize().to(dtype)

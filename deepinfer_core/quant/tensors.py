"""One quantized tensor of a checkpoint (``QuantizedTensor``) and the model's in-memory view of it.

A checkpoint's tensor ``X.weight`` is quantized when its dtype says so and a sibling ``X.scale`` sits beside it:

* ``float8_e4m3fn`` ``[out, in]`` + scale ``[ceil(out / B), ceil(in / B)]`` (``float8_e8m0fnu`` or ``float32``):
  an fp8 block weight (:data:`FP8_BLOCK`);
* ``int8`` / ``uint8`` ``[out, in / 2]`` + scale ``[out, in / 32]`` (``float8_e8m0fnu``): MXFP4 (:data:`MXFP4`),
  routed experts only.

The model keeps the stored bytes: an fp8 weight as ``float8_e4m3fn``, MXFP4 as ``uint8``, scales as stored.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from deepinfer_core.quant import fp8_block, mxfp4

FP8_BLOCK = "fp8_block"
MXFP4 = "mxfp4"
SCALE_SUFFIX = ".scale"
WEIGHT_SUFFIX = ".weight"
SAFETENSORS_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "F32": torch.float32,
                      "I8": torch.int8, "U8": torch.uint8}


def scale_name(weight_name: str) -> str:
    """``X.weight`` -> ``X.scale``."""
    return weight_name.removesuffix(WEIGHT_SUFFIX) + SCALE_SUFFIX


def weight_name(scale: str) -> str:
    """``X.scale`` -> ``X.weight``."""
    return scale.removesuffix(SCALE_SUFFIX) + WEIGHT_SUFFIX


@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """How one weight is stored: its format, its logical ``[out, in]`` shape, its scale block and scale dtype."""

    name: str  # canonical weight name (``layers.0.attn.wq_a.weight``)
    format: str  # FP8_BLOCK or MXFP4
    shape: tuple[int, int]  # the dequantized weight's shape
    block: tuple[int, int]  # (rows, inputs) per scale: (B, B) for fp8 blocks, (1, 32) for MXFP4
    scale_dtype: torch.dtype

    @property
    def stored_shape(self) -> tuple[int, int]:
        """The weight tensor's shape on disk and in memory (MXFP4 packs two inputs per byte)."""
        out, inp = self.shape
        return (out, inp // 2) if self.format == MXFP4 else (out, inp)

    @property
    def stored_dtype(self) -> torch.dtype:
        return torch.uint8 if self.format == MXFP4 else fp8_block.FP8_DTYPE

    @property
    def scale_shape(self) -> tuple[int, int]:
        return fp8_block.scale_shape(self.shape, self.block)

    @property
    def nbytes(self) -> int:
        """Bytes held: the weight plus its scales."""
        scale_bytes = math.prod(self.scale_shape) * self.scale_dtype.itemsize
        return math.prod(self.stored_shape) + scale_bytes

    def key(self) -> tuple:
        """What must agree for two weights to share one fused or stacked tensor."""
        return self.format, self.block, self.scale_dtype


class Fp8BlockWeight(NamedTuple):
    """The model's fp8 block weight: ``weight`` ``float8_e4m3fn [..., out, in]``, ``scale`` ``[..., ceil(out / B0),
    ceil(in / B1)]``, ``block`` ``(B0, B1)``."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        """The exact float32 weight."""
        return fp8_block.dequantize(self.weight, self.scale, self.block)


class Mxfp4Weight(NamedTuple):
    """The model's MXFP4 weight: ``packed`` ``uint8 [..., out, in / 2]``, ``scale`` ``float8_e8m0fnu [..., out, in / 32]``."""

    packed: torch.Tensor
    scale: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The exact float32 weight."""
        return mxfp4.dequantize(self.packed, self.scale)


def view(spec: QuantizedTensor, weight: torch.Tensor, scale: torch.Tensor) -> Fp8BlockWeight | Mxfp4Weight:
    """The in-memory weight object of ``spec`` over its allocated ``weight`` and ``scale`` tensors."""
    if spec.format == MXFP4:
        return Mxfp4Weight(weight, scale)
    return Fp8BlockWeight(weight, scale, spec.block)

"""fp8 block quantization: an ``float8_e4m3fn`` weight ``[..., out, in]`` with one scale per ``B_out x B_in`` block.

``W[o, i] = weight[o, i] * scale[o // B_out, i // B_in]``; the scale tensor is ``[..., ceil(out / B_out),
ceil(in / B_in)]``, ``float8_e8m0fnu`` (ue8m0: powers of two) or ``float32``. Edge blocks may be partial.
"""

from __future__ import annotations

import torch

from deepinfer_core.quant.scales import exponent_at_least, exponent_to_float, scale_to_float, ue8m0_from_exponent

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn magnitude


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The block-scale shape of a weight of ``shape`` (``[..., out, in]``)."""
    *lead, out, inp = shape
    return (*lead, -(-out // block[0]), -(-inp // block[1]))


def expand_scale(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """The float32 block scale repeated onto every element of a weight of ``shape``: ``[..., out, in]``."""
    out, inp = shape[-2:]
    per_row = scale_to_float(scale).repeat_interleave(block[0], dim=-2)[..., :out, :]  # [..., out, ceil(in / B)]
    return per_row.repeat_interleave(block[1], dim=-1)[..., :inp]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The exact float32 weight ``[..., out, in]`` (each e4m3 value times its block's scale)."""
    return weight.float() * expand_scale(scale, tuple(weight.shape), block)


def quantize(weight: torch.Tensor, block: tuple[int, int], ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 weight, scale)`` of a float weight ``[..., out, in]``, rounding to nearest (ties to even).

    Each block's scale maps its largest magnitude to at most 448: with ``ue8m0`` the smallest power of two that
    does (``float8_e8m0fnu``), else ``amax / 448`` (``float32``). An all-zero block gets scale 1."""
    w = weight.float()
    amax = _block_amax(w, block)  # [..., ceil(out / B), ceil(in / B)]
    if ue8m0:
        exponent = exponent_at_least(amax / FP8_MAX)
        scale, scale_value = ue8m0_from_exponent(exponent), exponent_to_float(exponent)
    else:
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        scale_value = scale
    scaled = w / expand_scale(scale_value, tuple(w.shape), block)
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def _block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Largest magnitude of every block, ``[..., ceil(out / B_out), ceil(in / B_in)]`` (edge blocks zero-padded)."""
    *lead, out, inp = w.shape
    rows, cols = -(-out // block[0]), -(-inp // block[1])
    padded = torch.nn.functional.pad(w.abs(), (0, cols * block[1] - inp, 0, rows * block[0] - out))
    tiles = padded.reshape(*lead, rows, block[0], cols, block[1])
    return tiles.amax(dim=(-3, -1))

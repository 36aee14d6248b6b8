"""MXFP4 weights: two e2m1 codes per byte and one ue8m0 scale per 32 consecutive inputs.

A weight ``[..., out, in]`` is stored as ``packed`` ``[..., out, in / 2]`` (int8 or uint8: the low nibble is element
``2i``, the high nibble element ``2i + 1``) and ``scale`` ``[..., out, in / 32]`` (``float8_e8m0fnu``):
``W[o, i] = E2M1[code(o, i)] * 2 ** (scale[o, i // 32] - 127)``. Codes 0-7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and bit 3
is the sign.
"""

from __future__ import annotations

import itertools

import torch

from deepinfer_core.quant.scales import exponent_at_least, exponent_to_float, ue8m0_from_exponent, ue8m0_to_float

GROUP = 32  # inputs per scale
FP4_MAX = 6.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
SIGN_BIT = 8
_E2M1 = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), dtype=torch.float32)  # code -> value
_MIDPOINTS = torch.tensor([(a + b) / 2 for a, b in itertools.pairwise(E2M1_MAGNITUDES)], dtype=torch.float32)


def decode_codes(packed: torch.Tensor) -> torch.Tensor:
    """The e2m1 codes (0-15, uint8) of ``packed [..., n / 2]`` in element order: ``[..., n]``."""
    byte = packed.view(torch.uint8)
    return torch.stack([byte & 0x0F, byte >> 4], dim=-1).flatten(-2)  # [..., n / 2, 2] -> [..., n]


def dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The exact float32 weight ``[..., out, in]`` of ``packed [..., out, in / 2]`` and ``scale [..., out, in / 32]``."""
    values = _E2M1.to(packed.device)[decode_codes(packed).long()]  # [..., out, in]
    return values * ue8m0_to_float(scale).repeat_interleave(GROUP, dim=-1)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed int8 [..., out, in / 2], scale float8_e8m0fnu [..., out, in / 32])`` of a float weight.

    Each group's scale is the smallest power of two that maps its largest magnitude to at most 6 (nothing is
    clipped); each value rounds to the nearest e2m1 value, ties to the even code. ``in`` must be a multiple of 32.
    """
    w = weight.float()
    *lead, out, inp = w.shape
    if inp % GROUP:
        raise ValueError(f"MXFP4 needs an input width that is a multiple of {GROUP}; got {inp}")
    groups = w.reshape(*lead, out, inp // GROUP, GROUP)
    exponent = exponent_at_least(groups.abs().amax(-1) / FP4_MAX)  # [..., out, in / 32]
    scaled = groups / exponent_to_float(exponent).unsqueeze(-1)
    codes = encode_values(scaled.reshape(*lead, out, inp))
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8)  # [..., out, in / 2]
    return packed, ue8m0_from_exponent(exponent)


def encode_values(values: torch.Tensor) -> torch.Tensor:
    """The e2m1 code (uint8) nearest each value of magnitude <= 6; ties go to the even code, zero has no sign."""
    magnitude = values.abs()
    midpoints = _MIDPOINTS.to(values.device)
    code = torch.bucketize(magnitude, midpoints)  # ties (a value at a midpoint) go to the lower code
    tie = magnitude == midpoints[code.clamp(max=len(midpoints) - 1)]
    code = code + (tie & (code % 2 == 1)).long()  # ... unless that code is odd
    sign = ((values < 0) & (code > 0)).long() * SIGN_BIT
    return (code + sign).to(torch.uint8)

"""ue8m0 scales: one byte ``b`` stands for ``2 ** (b - 127)`` (``float8_e8m0fnu``; byte 255 is NaN)."""

from __future__ import annotations

import torch

UE8M0_BIAS = 127
UE8M0_NAN = 255
_MIN_EXPONENT, _MAX_EXPONENT = -UE8M0_BIAS, UE8M0_NAN - 1 - UE8M0_BIAS  # bytes 0 .. 254


def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """The float32 value of every ue8m0 byte, exactly: ``2 ** (byte - 127)``, byte 0 = 2^-127 (an fp32 subnormal),
    byte 255 = NaN. ``scale``: ``float8_e8m0fnu`` or ``uint8``, any shape."""
    byte = scale.view(torch.uint8).to(torch.int32)
    normal = (byte << 23).view(torch.float32)  # the byte as an fp32 exponent field, mantissa 0: 2^(byte - 127)
    value = torch.where(byte == 0, torch.full_like(normal, 2.0**-127), normal)
    return torch.where(byte == UE8M0_NAN, torch.full_like(normal, float("nan")), value)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A block scale as float32: ue8m0 bytes decoded exactly, a float32 scale as it is."""
    if scale.dtype == torch.float8_e8m0fnu:
        return ue8m0_to_float(scale)
    return scale.float()


def exponent_at_least(ratio: torch.Tensor) -> torch.Tensor:
    """The smallest integer ``e`` with ``2 ** e >= ratio`` (int32, clamped to ue8m0's range); 0 where ``ratio`` is 0.

    A scale ``2 ** e`` chosen this way maps the block's largest magnitude inside the element format's range, so
    nothing is clipped."""
    mantissa, exponent = torch.frexp(ratio.float())  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    exact_power = mantissa == 0.5
    e = torch.where(exact_power, exponent - 1, exponent)
    e = torch.where(ratio > 0, e, torch.zeros_like(e))
    return e.clamp(_MIN_EXPONENT, _MAX_EXPONENT).to(torch.int32)


def ue8m0_from_exponent(exponent: torch.Tensor) -> torch.Tensor:
    """``float8_e8m0fnu`` bytes for integer exponents in [-127, 127]."""
    return (exponent + UE8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def exponent_to_float(exponent: torch.Tensor) -> torch.Tensor:
    """``2 ** exponent`` in float32, exactly (through the ue8m0 bytes)."""
    return ue8m0_to_float(ue8m0_from_exponent(exponent))

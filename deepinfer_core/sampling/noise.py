"""Counter-based random noise: a pure function of (seed, position, vocab id).

The uniform number for a vocab entry is a splitmix64 hash of a per-row key and the vocab id, so
a request's sample depends only on its own seed and the position of the token being generated;
not on batch size, row order, other requests or how many draws happened before.

Construction (all arithmetic modulo 2**64, done on torch int64 which wraps on overflow):

    row_key(seed, position) = mix64(mix64(seed) ^ position)
    bits(seed, position, v) = mix64(row_key + (v + 1) * GOLDEN)      # splitmix64 stream, element v
    uniform                 = (top 52 bits of bits + 0.5) / 2**52      # in (0, 1), exact in float64

``mix64`` is the splitmix64 finaliser. torch's ``>>`` on int64 is an arithmetic (sign-extending)
shift, so every right shift is followed by a mask that clears the sign-extended high bits, which
makes it a logical shift. ``python_uniform`` is the same function in plain Python big ints; the tests
check the two agree bit for bit.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    """The int64 (two's complement) value of the 64-bit pattern ``x``."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _lsr(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (arithmetic shift, then clear the sign-fill bits)."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (bijective on 64-bit patterns)."""
    x = (x ^ _lsr(x, 30)) * _signed(_MIX1)
    x = (x ^ _lsr(x, 27)) * _signed(_MIX2)
    return x ^ _lsr(x, 31)


def to_int64_seed(seed: int) -> int:
    """Map any Python int seed onto an int64 value (its low 64 bits, two's complement)."""
    return _signed(seed)


def derive_seed(seed: int, index: int) -> int:
    """A distinct int64 seed for sub-stream ``index`` of ``seed`` (e.g. completion i of n).

    Index 0 returns the seed itself, so ``n=1`` requests sample exactly as the seed says.
    """
    if index == 0:
        return to_int64_seed(seed)
    mixed = mix64(torch.tensor([to_int64_seed(seed) ^ _signed(index * GOLDEN)], dtype=torch.int64))
    return int(mixed.item())


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Per-row stream keys from int64 ``seeds`` [num_rows] and ``positions`` [num_rows]."""
    return mix64(mix64(seeds) ^ positions)  # [num_rows]


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform(0, 1) float64 noise [num_rows, vocab_size] for (seed, position, vocab id).

    ``seeds`` and ``positions`` are int64 [num_rows] on the device the noise should be made on.
    """
    keys = row_keys(seeds, positions)  # [num_rows]
    counters = (torch.arange(vocab_size, dtype=torch.int64, device=seeds.device) + 1) * _signed(GOLDEN)  # [vocab]
    bits = mix64(keys[:, None] + counters[None, :])  # [num_rows, vocab]
    top52 = _lsr(bits, 12)  # [num_rows, vocab], in [0, 2**52)
    # k + 0.5 with k < 2**52 is exact in float64, so u is never rounded to 0 or 1.
    return (top52.to(torch.float64) + 0.5) * (2.0**-52)  # [num_rows, vocab], in (0, 1)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel float64 noise [num_rows, vocab_size]: ``-log(-log(u))`` of ``uniform_noise``."""
    u = uniform_noise(seeds, positions, vocab_size)  # [num_rows, vocab]
    return -torch.log(-torch.log(u))  # [num_rows, vocab]


def python_uniform(seed: int, position: int, vocab_id: int) -> float:
    """Plain-Python reference of ``uniform_noise`` for one element (used to test the torch ops)."""

    def mix(x: int) -> int:
        x &= _MASK64
        x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
        x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
        return x ^ (x >> 31)

    key = mix(mix(seed) ^ (position & _MASK64))
    bits = mix(key + (vocab_id + 1) * GOLDEN)
    return ((bits >> 12) + 0.5) * 2.0**-52

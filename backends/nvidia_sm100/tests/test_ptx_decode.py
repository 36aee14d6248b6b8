"""The MXFP4 inline-PTX strings of ``dequant.py`` executed by ``ptx_emulator`` (the PTX ISA's instruction
semantics, on any machine): every byte value decodes to the e2m1 codes of ``deepinfer_core.quant.mxfp4``, and
``mxfp4_row_sums`` returns the running float32 sums of exact products in input order. A contract test of the
strings against the documented instructions; on a GPU ``test_kernels_gpu.py`` runs the kernels that use them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ptx_emulator import instructions, operand_count, run

pytest.importorskip("triton", reason="the test extra installs triton")
from deepinfer_nvidia_sm100.kernels import dequant

from deepinfer_core.quant import mxfp4


def _codes(byte: int) -> tuple[float, float]:
    """(low nibble, high nibble) e2m1 values of a packed byte, by ``mxfp4.dequantize`` (scale 1)."""
    even, odd = mxfp4.dequantize(torch.tensor([[byte] * 16], dtype=torch.uint8),
                                 torch.tensor([[127]], dtype=torch.uint8).view(torch.float8_e8m0fnu))[0, :2].tolist()
    return even, odd


def _bf16_halves(bits: int) -> tuple[float, float]:
    return tuple(float(np.array([(bits >> s & 0xFFFF) << 16], dtype=np.uint32).view(np.float32)[0]) for s in (0, 16))


def _bits(values) -> list[int]:
    return np.asarray(values, dtype=np.float32).view(np.uint32).tolist()


def _word(packed: list[int]) -> int:
    return sum(b << (8 * i) for i, b in enumerate(packed))


def _bf16_inputs(gen: np.random.Generator, n: int) -> np.ndarray:
    """float32 values that bf16 holds exactly (activations widened from bf16), with a wide spread of exponents."""
    values = (gen.standard_normal(n) * np.exp2(gen.integers(-30, 30, n))).astype(np.float32)
    return (values.view(np.uint32) & 0xFFFF0000).view(np.float32)


def test_row_sums_ptx_is_exact_running_sums_on_every_byte():
    asm = dequant._MXFP4_ROW_SUMS_PTX.value
    assert operand_count("=r,=r,=r,=r,r,r,r,r,r,r,r,r,r") == (4, 9)
    assert instructions(asm) <= 1 + 34  # the constant, then 4.25 a weight for eight weights
    gen = np.random.default_rng(0)
    for first in range(256):  # every byte value in every position of the four
        packed = [(first + i * 67) % 256 for i in range(4)]
        x_even, x_odd = _bf16_inputs(gen, 4), _bf16_inputs(gen, 4)
        out = run(asm, [_word(packed), *_bits(x_even), *_bits(x_odd)], 4)
        total, want = np.float32(0.0), []
        for j, byte in enumerate(packed):
            even, odd = _codes(byte)
            total = np.float32(total + np.float32(even * np.float64(x_even[j])))  # products exact in float32
            total = np.float32(total + np.float32(odd * np.float64(x_odd[j])))
            want.append(total)
        got = np.array(out, dtype=np.uint32).view(np.float32)
        assert (got == np.array(want, dtype=np.float32)).all(), (packed, got, want)  # exactly (-0.0 == 0.0)


@pytest.mark.parametrize("scale", [1.0, 2.0**-127, 2.0**-20, 2.0**100])
def test_words_ptx_decodes_every_byte_times_the_scale(scale):
    """``_MXFP4_WORDS_PTX`` (``mxfp4_word_codes``): two words and a bf16 scale -> eight bf16x2 registers, register
    ``i`` code ``i`` of the first word (low half) and of the second (high half), times the scale."""
    asm = dequant._MXFP4_WORDS_PTX.value
    scale_bits = int(torch.tensor([scale], dtype=torch.float32).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF
    for first in range(0, 256, 8):
        a, b = [first + i for i in range(4)], [first + 4 + i for i in range(4)]
        out = run(asm, [_word(a), _word(b), scale_bits | scale_bits << 16], 8)
        codes_a = [c for byte in a for c in _codes(byte)]
        codes_b = [c for byte in b for c in _codes(byte)]
        for i, bits in enumerate(out):
            low, high = _bf16_halves(bits)
            assert (low, high) == (codes_a[i] * scale, codes_b[i] * scale), (first, i)


def _e4m3_value(byte: int) -> float:
    return float(torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item())


def test_e4m3_codes_ptx_places_every_code_as_its_e4m3_times_a_64th():
    """``_E4M3_CODES_PTX`` (``e4m3_codes``): four packed bytes -> the e4m3 bytes of their low nibbles and of their
    high nibbles, each the code times 2^-6 exactly; the Triton-operation form gives the same bytes."""
    asm = dequant._E4M3_CODES_PTX.value
    assert operand_count("=r,=r,r") == (2, 1) and instructions(asm) <= 10
    for first in range(256):
        packed = [(first + i * 67) % 256 for i in range(4)]
        low, high = run(asm, [_word(packed)], 2)
        for j, byte in enumerate(packed):
            even, odd = _codes(byte)
            assert _e4m3_value((low >> 8 * j) & 0xFF) * 64 == even, (byte, hex(low))
            assert _e4m3_value((high >> 8 * j) & 0xFF) * 64 == odd, (byte, hex(high))
            assert (low >> 8 * j) & 0xFF == ((byte & 7) << 2) | ((byte & 8) << 4)  # the Triton form's bits
            assert (high >> 8 * j) & 0xFF == ((byte >> 2) & 0x1C) | (byte & 0x80)

"""A small emulator of the PTX instructions the backend's inline assembly uses, after the PTX ISA's definitions, so
that the MXFP4 decode strings of ``dequant.py`` are checked on a machine without a GPU (a contract test of the
documented instruction semantics; on a GPU the same strings are also checked by running them).

Supported: ``mov.b32``, ``and.b32``, ``or.b32``, ``shl.b32``, ``shr.b32``, ``mul.lo.u32``, ``prmt.b32`` (default mode),
``mul.rn.bf16x2``, ``mul.rn.f32``, ``fma.rn.f32``; registers hold 32-bit patterns, ``$n`` operands are the asm's
numbered operands (outputs first, then inputs, one 32-bit register each)."""

from __future__ import annotations

import re

import numpy as np
import torch

MASK = 0xFFFFFFFF


def _f32(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


def _bits_f32(value: np.float32) -> int:
    return int(np.array([value], dtype=np.float32).view(np.uint32)[0])


def _bf16(half: int) -> float:
    return _f32(half << 16)


def _bits_bf16(value: float) -> int:
    """bf16 bits of ``value`` rounded to nearest even (``.rn``)."""
    return int(torch.tensor([value], dtype=torch.float64).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF


def _prmt(a: int, b: int, selector: int) -> int:
    """``prmt.b32`` default mode: byte ``i`` of the result is byte ``selector[4i:4i+3] & 7`` of ``{b, a}`` (a bytes
    0-3, b bytes 4-7); selector bit ``4i + 3`` replicates that byte's sign bit instead."""
    source = (b << 32) | a
    out = 0
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = (source >> (8 * (nibble & 7))) & 0xFF
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _fma_f32(a: int, b: int, c: int) -> int:
    """``fma.rn.f32``: ``a * b + c`` rounded once (exact in float64 for the operands the decode produces)."""
    return _bits_f32(np.float32(np.float64(_f32(a)) * np.float64(_f32(b)) + np.float64(_f32(c))))


def run(asm: str, inputs: list[int], outputs: int) -> list[int]:
    """Execute ``asm`` (a ``{ ... }`` block) with ``inputs`` as ``$outputs..``; return the ``outputs`` registers."""
    regs: dict[str, int] = {f"${i}": 0 for i in range(outputs)}
    regs.update({f"${outputs + i}": value & MASK for i, value in enumerate(inputs)})
    body = asm.strip().removeprefix("{").removesuffix("}")

    def value(operand: str) -> int:
        operand = operand.strip()
        if operand in regs:
            return regs[operand]
        if operand.startswith("0f"):  # a float32 literal's bits
            return int("0x" + operand[2:], 0)
        return int(operand, 0) & MASK

    for statement in filter(None, (s.strip() for s in body.split(";"))):
        if statement.startswith(".reg"):
            for name in statement.split(None, 2)[2].split(","):
                regs[name.strip()] = 0
            continue
        op, args = statement.split(None, 1)
        dest, *srcs = [a.strip() for a in args.split(",")]
        v = [value(s) for s in srcs]
        if op == "mov.b32":
            result = v[0]
        elif op == "and.b32":
            result = v[0] & v[1]
        elif op == "or.b32":
            result = v[0] | v[1]
        elif op == "shl.b32":
            result = (v[0] << v[1]) & MASK if v[1] < 32 else 0
        elif op == "shr.b32":  # .b32: a logical shift
            result = (v[0] >> v[1]) if v[1] < 32 else 0
        elif op == "mul.lo.u32":
            result = (v[0] * v[1]) & MASK
        elif op == "prmt.b32":
            result = _prmt(v[0], v[1], v[2])
        elif op == "mul.rn.bf16x2":
            result = sum(_bits_bf16(_bf16((v[0] >> s) & 0xFFFF) * _bf16((v[1] >> s) & 0xFFFF)) << s for s in (0, 16))
        elif op == "mul.rn.f32":
            result = _bits_f32(np.float32(np.float64(_f32(v[0])) * np.float64(_f32(v[1]))))
        elif op == "fma.rn.f32":
            result = _fma_f32(v[0], v[1], v[2])
        else:
            raise NotImplementedError(f"ptx_emulator: {op}")
        regs[dest] = result
    return [regs[f"${i}"] for i in range(outputs)]


def operand_count(constraints: str) -> tuple[int, int]:
    """(outputs, inputs) of an inline-asm constraint string such as ``"=r,=r,r"``."""
    parts = [p.strip() for p in constraints.split(",")]
    outputs = sum(p.startswith("=") for p in parts)
    return outputs, len(parts) - outputs


def instructions(asm: str) -> int:
    """Instructions of an asm block (``.reg`` declarations left out)."""
    body = asm.strip().removeprefix("{").removesuffix("}")
    return len([s for s in (s.strip() for s in body.split(";")) if s and not s.startswith(".reg")
                and re.match(r"[a-z]", s)])

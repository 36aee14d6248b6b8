"""Triton kernels compiled ahead of time for a named GPU (``GPUTarget``), on any machine: the compile checks of the
tests and ``benchmarks/sass_census.py`` see the code the JIT would build for a preset's shapes, and can count the
machine instructions (SASS) of a kernel's main loop."""

from __future__ import annotations

import collections
import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")

DIVISIBLE_WIDTHS = ("D", "I", "K", "N", "k_per_split")  # integer arguments the presets' shapes make multiples of 16
SPARSE_WIDTHS = ("queries", "E", "per_block", "kv_rows", "H", "N", "total")  # the same, of sparse_attention.py's


def with_defaults(fn, constants: dict) -> dict:
    """``constants`` plus the defaults of ``fn``'s constexpr arguments that it leaves out (as a launch takes them)."""
    defaults = {name: p.default for name, p in inspect.signature(fn.fn).parameters.items()
                if p.default is not inspect.Parameter.empty}
    return {**{fn.arg_names[i]: defaults[fn.arg_names[i]] for i in fn.constexprs if fn.arg_names[i] in defaults},
            **constants}


def divisible_source(fn, types: dict[str, str], constants: dict, widths=DIVISIBLE_WIDTHS) -> ASTSource:
    """``fn`` with pointers, strides and the integer arguments named in ``widths`` marked divisible by 16, as
    Triton's JIT sees the preset's shapes; arguments typed by ``types``, else ``*bf16`` pointers and ``i32``
    scalars; ``constants`` (constexpr arguments, or others fixed at compile time) by value; constexpr arguments left
    out take their defaults."""
    constants = with_defaults(fn, constants)
    signature, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if i in fn.constexprs or arg in constants:
            signature[arg] = "constexpr"
            continue
        signature[arg] = types.get(arg, "*bf16" if arg.endswith("_ptr") else "i32")
        if arg.endswith("_ptr") or arg.startswith("stride") or arg in widths:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()},
                     attrs=attrs)


def compile_divisible(fn, types: dict[str, str], constants: dict, capability: int, warps: int, stages: int,
                      widths=DIVISIBLE_WIDTHS):
    """``fn`` compiled for sm_{capability}a as the JIT sees the preset's shapes (``divisible_source``)."""
    return triton.compile(divisible_source(fn, types, constants, widths), target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": warps, "num_stages": stages})


def _cuda_tool(name: str, cubin: bytes, *args: str) -> str:
    """The text output of a CUDA binary tool bundled with Triton run on a cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *args, f.name], capture_output=True, text=True, check=True).stdout


def disassemble(cubin: bytes) -> str:
    """SASS text of a cubin by the ``nvdisasm`` bundled with Triton."""
    return _cuda_tool("nvdisasm", cubin, "-c")


def registers(cubin: bytes) -> int:
    """Registers a thread of the cubin's kernel holds (``cuobjdump -res-usage``)."""
    usage = re.search(r"REG:(\d+)", _cuda_tool("cuobjdump", cubin, "-res-usage"))
    if usage is None:
        raise ValueError("cuobjdump -res-usage printed no register count")
    return int(usage.group(1))


REGISTERS_PER_SM, MAX_WARPS_PER_SM = 65536, 64  # SM90 / SM100


def resident_warps(regs: int, warps: int, shared_bytes: int = 0, shared_per_sm: int = 228 * 1024) -> int:
    """Warps of a kernel an SM holds at once (whole programs of ``warps`` warps), bound by registers (allocated per
    warp in units of 256), shared memory and the 64-warp limit."""
    per_warp = -(-regs * 32 // 256) * 256
    programs = min(REGISTERS_PER_SM // (per_warp * warps), MAX_WARPS_PER_SM // warps,
                   shared_per_sm // shared_bytes if shared_bytes else MAX_WARPS_PER_SM)
    return programs * warps


def loop_census(sass: str) -> tuple[collections.Counter, int]:
    """(opcode counts of the longest backward-branch loop, spill loads / stores in the whole kernel)."""
    labels, pending, rows = {}, [], []
    for line in sass.splitlines():
        label = LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        match = INSTRUCTION.search(line)
        if match:
            address = int(match.group(1), 16)
            labels.update(dict.fromkeys(pending, address))
            pending = []
            rows.append((address, match.group(2), match.group(3)))
    loops = [(labels[target.group(1)], address) for address, op, args in rows
             if op.startswith("BRA") and (target := re.search(r"(\.L_x_\d+)", args)) and target.group(1) in labels
             and labels[target.group(1)] < address]
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    counts = collections.Counter(op.split(".")[0] for address, op, _ in rows if start <= address <= end)
    return counts, sum(op.startswith(("LDL", "STL")) for _, op, _ in rows)

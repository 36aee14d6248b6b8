"""Triton kernels compiled ahead of time for a named GPU (``GPUTarget``), on any machine: the compile checks of the
tests and ``benchmarks/sass_census.py`` see the code the JIT would build for a preset's shapes."""

from __future__ import annotations

from triton.compiler import ASTSource

DIVISIBLE_WIDTHS = ("D", "I", "K", "N", "k_per_split")  # integer arguments the presets' shapes make multiples of 16


def divisible_source(fn, types: dict[str, str], constants: dict, widths=DIVISIBLE_WIDTHS) -> ASTSource:
    """``fn`` with pointers, strides and the integer arguments named in ``widths`` marked divisible by 16, as
    Triton's JIT sees the preset's shapes; arguments typed by ``types``, else ``*bf16`` pointers and ``i32``
    scalars; ``constants`` (constexpr arguments, or others fixed at compile time) by value."""
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

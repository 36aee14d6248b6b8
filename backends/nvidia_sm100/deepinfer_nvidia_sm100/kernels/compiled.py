"""Small reference ops fused by TorchInductor (``torch.compile`` generates Triton kernels for them).

The model's norms, RoPE tables and mHC ops are chains of small element-wise and reduction ops; eagerly each is
several kernel launches, and a decode step is bound by launching them. Compiled, each op is one or two fused
kernels. The compiled function *is* the reference op (same source), so semantics cannot drift; tests still
check each against the eager reference on the GPU. (``hc_pre``, ``hc_post`` and ``apply_rope`` are not here: compiled,
they kept a kernel per Sinkhorn normalisation, a cuBLAS bmm of 4 x 4 tiles and a slow copy; ``kernels/hc.py`` and
``kernels/rope.py`` are hand-written Triton.)

Set ``DEEPINFER_NVIDIA_COMPILE=0`` to run these ops eagerly (the reference ops).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from deepinfer_core.ops import reference as ref

COMPILED_OPS = ("rms_norm", "unweighted_rms_norm", "rope_cos_sin", "hc_head", "compressor_window", "compressor_pool")
ENV = "DEEPINFER_NVIDIA_COMPILE"


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip() not in ("0", "false", "no", "off")


def compiled_ops() -> dict[str, Callable]:
    """Op name -> ``torch.compile`` of its reference op (dynamic shapes: one compile serves every batch)."""
    if not enabled():
        return {}
    return {name: maybe_compile(getattr(ref, name)) for name in COMPILED_OPS}


_COMPILED: dict[Callable, Callable] = {}


def maybe_compile(fn: Callable) -> Callable:
    """``torch.compile(fn, dynamic=True)``, made once per function; ``fn`` itself when compiling is switched off."""
    if not enabled():
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]

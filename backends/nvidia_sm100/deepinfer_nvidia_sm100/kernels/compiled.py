"""Small reference ops fused by TorchInductor (``torch.compile`` generates Triton kernels for them).

The model's norms, RoPE tables and mHC ops are chains of small element-wise and reduction ops; eagerly each is
several kernel launches, and a decode step is bound by launching them. So is a static decode step's index math
(``decode_key_index``, ``decode_entry_places``, ``decode_window_plan``: ~100 integer kernels per step eagerly).
Compiled, each op is one or two fused kernels. The compiled function *is* the reference op (same source), so
semantics cannot drift; tests still check each against the eager reference on the GPU. (``hc_pre``, ``hc_post`` and
``apply_rope`` are not here: compiled, they kept a kernel per Sinkhorn normalisation, a cuBLAS bmm of 4 x 4 tiles and a slow copy; ``kernels/hc.py`` and
``kernels/rope.py`` are hand-written Triton.)

Set ``DEEPINFER_NVIDIA_COMPILE=0`` to run these ops eagerly (the reference ops).

``DEEPINFER_NVIDIA_COMPILE_STEP=1`` compiles whole decode steps before their CUDA graph is captured
(``compile_step``): TorchInductor then fuses the layout's index ops, casts and norms across op boundaries; the
backend's Triton and TileLang kernel wrappers stay opaque custom ops (``opaque_under_compile``), except the RMS
norms, which trace their reference op (``reference_under_compile``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.exc import TorchDynamoException

from deepinfer_core.ops import reference as ref
from deepinfer_nvidia_sm100 import envs

logger = logging.getLogger("deepinfer")

COMPILED_OPS = ("rms_norm", "unweighted_rms_norm", "rope_cos_sin", "hc_head", "compressor_window", "compressor_pool",
                "decode_key_index", "decode_entry_places", "decode_window_plan")


def enabled() -> bool:
    """Whether these ops are compiled (``DEEPINFER_NVIDIA_COMPILE``, on by default)."""
    return envs.DEEPINFER_NVIDIA_COMPILE


def step_enabled() -> bool:
    """Whether decode steps are compiled whole before capture (``DEEPINFER_NVIDIA_COMPILE_STEP``, off by default)."""
    return enabled() and envs.DEEPINFER_NVIDIA_COMPILE_STEP


def compile_step(fn: Callable, backend: str | Callable = "inductor") -> Callable:
    """``fn`` (a static-shape decode step) compiled by TorchInductor, run under ``no_grad`` (not inference mode:
    TorchInductor in torch 2.11 fails on inference mode around ordinary tensors, pytorch/pytorch#169477).

    One compile per static shape: every captured (batch size, context bucket) is its own compiled graph, so the
    recompile limit is raised to cover the captured shapes. The compile happens in the first call."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 256)
    compiled = torch.compile(fn, dynamic=False, backend=backend)

    def step(*args):
        with torch.inference_mode(False), torch.no_grad(), _concatenations_copied():
            return compiled(*args)

    return step


class StepCompiler:
    """Compiles decode steps before their capture while that works: the first step TorchDynamo or TorchInductor
    cannot compile is captured as it is, with a warning and its traceback, and so is every later one (a compiler
    failure costs that compile's time, never the CUDA graphs)."""

    def __init__(self, backend: str | Callable = "inductor") -> None:
        self.backend = backend
        self.failure: str | None = None  # why compiling was given up, once it was

    def capture(self, fn: Callable, capture: Callable[[Callable], Any]) -> Any:
        """``capture(step)`` of the compiled ``fn`` when compiling is on and has not failed, else of ``fn``.
        ``capture`` must call the step before capturing it (the compile happens in that first call)."""
        if self.failure is None and step_enabled():
            try:
                return capture(compile_step(fn, self.backend))
            except TorchDynamoException as exc:
                self.failure = f"{type(exc).__name__}: {exc}".strip()
                logger.warning("compiling the decode step failed; decode steps are captured uncompiled from now on "
                               "(DEEPINFER_NVIDIA_COMPILE_STEP=0 skips compiling)", exc_info=True)
        return capture(fn)


@contextlib.contextmanager
def _concatenations_copied():
    """While a step compiles, every ``torch.cat`` is lowered as copies into one buffer (Inductor's
    ``ConcatKernel``), never as a masked pointwise kernel. On CUDA, Inductor's pointwise cat indexes each input with
    ``Identity(i - start)``; fused with the layout's integer divisions, its loop-reordering check substitutes 0 and
    builds ``Max(FloorDiv(Identity(-128), 32), ...)``, which sympy rejects ("ValueError: The argument
    '(((-128))//32)' is not comparable", torch 2.11). Inductor's ``max_pointwise_cat_inputs=0`` setting does not
    avoid it; replacing the lowering does. Compiles happen inside the first call per shape, so the
    replacement is scoped to the call."""
    from torch._inductor import ir, lowering

    original = lowering.pointwise_cat
    lowering.pointwise_cat = lambda inputs, dim=0: lowering.TensorBox(ir.ConcatKernel.create(inputs, dim))
    try:
        yield
    finally:
        lowering.pointwise_cat = original


GRAPH_ONLY_OPS = ("rope_cos_sin", "hc_head")
"""Compiled where a CUDA graph captures them, eager elsewhere: a few small kernels whose compiled call costs the host
more (TorchDynamo's guard checks on every call) than their eager launches, while in a graph only the one fused
kernel replays."""


def compiled_ops() -> dict[str, Callable]:
    """Op name -> ``torch.compile`` of its reference op (dynamic shapes: one compile serves every batch); the
    ``GRAPH_ONLY_OPS`` compiled only while a CUDA graph is being captured."""
    if not enabled():
        return {}
    ops = {name: maybe_compile(getattr(ref, name)) for name in COMPILED_OPS}
    ops.update({name: compiled_in_graphs(getattr(ref, name)) for name in GRAPH_ONLY_OPS})
    return ops


_capturing = 0  # graph captures (their warm-up calls included) in progress: ``capturing``


@contextlib.contextmanager
def capturing():
    """Marks a CUDA graph's warm-up and capture (``backend.CudaGraphRunner``): ``compiled_in_graphs`` ops compile
    there (in the warm-up, so nothing compiles inside the capture itself)."""
    global _capturing
    _capturing += 1
    try:
        yield
    finally:
        _capturing -= 1


def compiled_in_graphs(fn: Callable) -> Callable:
    """``maybe_compile(fn)`` inside ``capturing()``, else ``fn``."""
    compiled = maybe_compile(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return (compiled if _capturing else fn)(*args, **kwargs)

    return call


def opaque_under_compile(name: str, fake: Callable, mutates_args: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Decorator for a kernel wrapper: an eager call runs it as it is; under ``torch.compile`` (a decode step
    compiled whole, ``compile_step``) it is the custom op ``deepinfer_nvidia::<name>``, one opaque node whose output
    shapes come from ``fake``, so TorchDynamo never traces into the kernel launches (TileLang's FFI, Triton grids).
    The wrapper's arguments must be annotated with types ``torch.library`` knows; outputs must be new tensors, or
    none for a wrapper that writes into the arguments named in ``mutates_args``."""

    def wrap(fn: Callable) -> Callable:
        op = torch.library.custom_op(f"deepinfer_nvidia::{name}", fn, mutates_args=mutates_args)
        op.register_fake(fake)
        return _under_compile(fn, op)

    return wrap


def reference_under_compile(reference: Callable) -> Callable[[Callable], Callable]:
    """Decorator for a kernel wrapper that TorchInductor does better inside a compiled step: an eager call runs the
    kernel; under ``torch.compile`` the plain ``reference`` op is traced instead, so Inductor fuses it with its
    neighbours (a norm with the casts, residual adds and RoPE around it) rather than launching it alone."""
    return lambda fn: _under_compile(fn, reference)


def _under_compile(fn: Callable, traced: Callable) -> Callable:
    """``fn``, except that a call while TorchDynamo traces calls ``traced``."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return traced(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


_COMPILED: dict[Callable, Callable] = {}


def maybe_compile(fn: Callable) -> Callable:
    """``torch.compile(fn, dynamic=True)``, made once per function; ``fn`` itself when compiling is switched off."""
    if not enabled():
        return fn
    if fn not in _COMPILED:  # inside a compiled decode step, ``fn`` is traced as part of it
        _COMPILED[fn] = _under_compile(torch.compile(fn, dynamic=True), fn)
    return _COMPILED[fn]

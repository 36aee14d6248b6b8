"""Op ``prefetch``: read the first megabytes of the weights the next ops multiply into the GPU's L2 cache, on a
stream of its own.

A batch-1 decode step alternates weight-reading GEMVs (at HBM bandwidth) with chains of short kernels (mixing, norms,
attention, routing) during which HBM is idle. Read while such a chain runs, the first megabytes of the next
projection are L2 hits when its GEMV comes (the GEMV's own loads are ``evict_first``, so its stream of lines does not
push the warmed ones out). On the H200 a GEMV over a ``[4096, 8192]`` weight took 20.3 us cold and 16.8 / 15.4 us
with its first 32 / 48 MB read just before (``benchmarks/bench_l2_warm.py``, docs/performance.md 4.19).

The reads are plain loads (``evict_last``) over one program per SM, their values folded into one word per program so
the compiler keeps them. Hopper's bulk L2 prefetch (``cp.async.bulk.prefetch.L2``, a hint the memory system may
drop) moved the same GEMV by ~1 us whatever the size and was removed (4.19). The kernel runs on a third stream
(``warm_stream``, the default priority: below the side stream's forked chains), forked from the caller's stream where
the op is called; ``join()`` makes the caller's stream wait for it (the model joins at the end of the block that uses
the weights, long after the reads are done).

At most ``budget_bytes()`` a call (a fraction of L2), in the order the weights are given. Steps of more than
``MAX_ROWS`` rows (prefill: compute-bound GEMMs) and of fewer than ``MIN_ROWS`` skip it: at batch 1 the reads made
the step slower (TPOT 2.10 against 1.99 ms, docs/performance.md 4.19), their 132 programs competing with the
step's chains of short kernels. ``DEEPINFER_NVIDIA_PREFETCH=0`` leaves the op to the
reference (nothing read); ``DEEPINFER_NVIDIA_PREFETCH_MB`` sets the budget (A/B runs).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from deepinfer_core.ops import reference as ref
from deepinfer_nvidia_sm100.kernels.compiled import env_flag
from deepinfer_nvidia_sm100.kernels.streams import Forked

ENV = "DEEPINFER_NVIDIA_PREFETCH"
BUDGET_ENV = "DEEPINFER_NVIDIA_PREFETCH_MB"
MAX_ROWS = 512
MIN_ROWS = 2
L2_FRACTION = 0.5
"""The default budget: half the L2 (60 MB on the H200), the rest for activations, keys and the GEMVs' streams."""
MAX_SEGMENTS = 4
BLOCK = 8192
"""32-bit words one program reads per round: 32 KB, eight 16-byte loads per thread of 8 warps in flight."""


def enabled() -> bool:
    """Whether ``DEEPINFER_NVIDIA_PREFETCH`` puts the op in the table (on by default)."""
    return env_flag(ENV, "1")


@functools.cache
def _properties(device_index: int):
    return torch.cuda.get_device_properties(device_index)


def budget_bytes(device: torch.device) -> int:
    """Bytes one call reads at most: ``DEEPINFER_NVIDIA_PREFETCH_MB`` or ``L2_FRACTION`` of the L2."""
    if os.environ.get(BUDGET_ENV):
        return int(float(os.environ[BUDGET_ENV]) * 2**20)
    return int(_properties(_index(device)).L2_cache_size * L2_FRACTION)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def warm_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream the reads run on (one per device, shared by every call and captured graph)."""
    return torch.cuda.Stream(device)


@triton.jit
def _fold_segment(acc, base, words, BLOCK: tl.constexpr):
    """``acc`` (``[BLOCK]`` int32) max-folded with this program's rounds of ``base[:words]`` (32-bit words)."""
    base = base.to(tl.pointer_type(tl.int32))
    offsets = tl.arange(0, BLOCK)
    for start in range(tl.program_id(0) * BLOCK, words, tl.num_programs(0) * BLOCK):
        index = start + offsets  # [BLOCK]
        acc = tl.maximum(acc, tl.load(base + index, mask=index < words, other=0, eviction_policy="evict_last"))
    return acc


@triton.jit
def _warm_kernel(p0, n0, p1, n1, p2, n2, p3, n3, sink_ptr, BLOCK: tl.constexpr):
    """Read up to four word ranges (``n``: 32-bit words, 0 for none) into L2; one folded word per program to
    ``sink_ptr`` (so the loads stay)."""
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    acc = _fold_segment(acc, p0, n0, BLOCK)
    acc = _fold_segment(acc, p1, n1, BLOCK)
    acc = _fold_segment(acc, p2, n2, BLOCK)
    acc = _fold_segment(acc, p3, n3, BLOCK)
    tl.store(sink_ptr + tl.program_id(0), tl.max(acc, axis=0))


def plan(weights: tuple[torch.Tensor, ...], budget: int) -> list[tuple[torch.Tensor, int]]:
    """``(tensor, bytes)`` to read: each weight from its start, in order, until ``budget`` bytes (whole 32-bit
    words; at most ``MAX_SEGMENTS`` weights)."""
    segments = []
    for weight in weights[:MAX_SEGMENTS]:
        take = min(weight.numel() * weight.element_size(), budget) // 4 * 4
        if take <= 0:
            break
        segments.append((weight, take))
        budget -= take
    return segments


@functools.cache
def _sink(device: torch.device) -> torch.Tensor:
    return torch.empty(_properties(_index(device)).multi_processor_count, dtype=torch.int32, device=device)


def launch(segments: list[tuple[torch.Tensor, int]]) -> None:
    """One kernel reading ``segments`` (``plan``'s output) on the current stream, one program per SM."""
    if not segments:
        return
    padded = segments + [(segments[0][0], 0)] * (MAX_SEGMENTS - len(segments))
    args = [value for weight, size in padded for value in (weight, size // 4)]
    sink = _sink(segments[0][0].device)
    _warm_kernel[(sink.numel(),)](*args, sink, BLOCK=BLOCK, num_warps=8)


def prefetch(x: torch.Tensor, *weights: torch.Tensor) -> Forked | ref.Finished:
    """``reference.prefetch``: the first ``budget_bytes()`` of ``weights`` read into L2 on ``warm_stream`` for a
    decode step of ``MIN_ROWS`` to ``MAX_ROWS`` rows on the GPU; nothing for other steps, CPU tensors or a step being
    compiled by TorchInductor."""
    if not MIN_ROWS <= x.shape[0] <= MAX_ROWS or not x.is_cuda or torch.compiler.is_compiling():
        return ref.Finished(None)
    main = torch.cuda.current_stream()
    warm = warm_stream(main.device)
    warm.wait_stream(main)
    with torch.cuda.stream(warm):
        launch(plan(weights, budget_bytes(x.device)))
    done = torch.cuda.Event()
    done.record(warm)
    return Forked(None, main, done)

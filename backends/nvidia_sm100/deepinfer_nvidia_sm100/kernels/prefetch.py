"""Op ``prefetch``: start reading weights that the next ops will multiply into the GPU's L2 cache.

A batch-1 decode step alternates weight-reading GEMVs (at HBM bandwidth) with chains of short kernels (norms,
attention, mixing, routing) during which HBM is idle. Prefetched while such a chain runs, the first megabytes of the
next projection are L2 hits when its GEMV reads them (the GEMV's own loads are ``evict_first``, so its stream does
not push the prefetched lines out). The kernel issues Hopper's bulk prefetch (``cp.async.bulk.prefetch.L2.global``,
PTX ISA 8.0, sm_90 and later: one instruction moves up to ``CHUNK`` bytes into L2 with no registers and no
completion to wait for), one chunk per lane, and ends; the data keeps arriving after it has exited. At most
``budget_bytes()`` a call (a fraction of L2), in the order the weights are given.

Launched on the caller's stream with PDL (``pdl.launch()``) it issues its prefetches before waiting for its
predecessor, so it neither waits for nor delays the kernels around it; without PDL it costs one short launch.
``DEEPINFER_NVIDIA_PREFETCH=0`` turns it off; ``DEEPINFER_NVIDIA_PREFETCH_MB`` sets the budget (A/B runs). Steps of
more than ``MAX_ROWS`` rows (prefill: compute-bound GEMMs, a host-bound eager step) skip it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer_nvidia_sm100.kernels import pdl
from deepinfer_nvidia_sm100.kernels.compiled import env_flag

ENV = "DEEPINFER_NVIDIA_PREFETCH"
BUDGET_ENV = "DEEPINFER_NVIDIA_PREFETCH_MB"
MAX_ROWS = 512
CHUNK = 8 * 1024
"""Bytes per bulk prefetch instruction (one lane's share of a weight). Each SM's copy engine works through its
lanes' prefetches at ~33 GB/s (H200: 64 KB chunks on a few programs took ~60 us for 8 MB, docs/performance.md 4.19),
so small chunks spread over one program per SM."""
L2_FRACTION = 0.5
"""The default budget: half the L2 (the rest keeps activations, KV and what the GEMVs stream through)."""
LANES = 32
MAX_SEGMENTS = 4

_BULK_PREFETCH = tl.constexpr("{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
                              "mov.u32 $0, 0; }")


def enabled() -> bool:
    """Whether ``DEEPINFER_NVIDIA_PREFETCH`` puts the op in the table (on by default; it needs sm_90 or later)."""
    return env_flag(ENV, "1")


@functools.cache
def _l2_bytes(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).L2_cache_size)


@functools.cache
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def budget_bytes(device: torch.device) -> int:
    """Bytes one call prefetches at most: ``DEEPINFER_NVIDIA_PREFETCH_MB`` or ``L2_FRACTION`` of the L2."""
    if os.environ.get(BUDGET_ENV):
        return int(float(os.environ[BUDGET_ENV]) * 2**20)
    return int(_l2_bytes(device.index if device.index is not None else torch.cuda.current_device()) * L2_FRACTION)


@triton.jit
def _prefetch_segment(base, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """This program's lanes each prefetch one ``CHUNK`` of ``base[:nbytes]`` per round (lane-strided over the
    grid); lanes past the end issue nothing."""
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)  # [LANES]
    stride = tl.num_programs(0) * LANES
    chunks = tl.cdiv(nbytes, CHUNK)
    base = base.to(tl.pointer_type(tl.uint8))
    for first in range(0, chunks, stride):
        index = first + lane  # [LANES]
        start = index.to(tl.int64) * CHUNK
        size = tl.where(index < chunks, tl.minimum(nbytes - start, CHUNK), 0).to(tl.int32)
        tl.inline_asm_elementwise(_BULK_PREFETCH, "=r,l,r", [base + start, size], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def _prefetch_kernel(p0, n0, p1, n1, p2, n2, p3, n3, CHUNK: tl.constexpr, LANES: tl.constexpr,
                     PDL: tl.constexpr = False):
    """Bulk L2 prefetches of up to four byte ranges (``n == 0``: none); under PDL issued before the wait for the
    previous kernel (weights are not written by it) and the next kernel let in at once."""
    _prefetch_segment(p0, n0, CHUNK, LANES)
    _prefetch_segment(p1, n1, CHUNK, LANES)
    _prefetch_segment(p2, n2, CHUNK, LANES)
    _prefetch_segment(p3, n3, CHUNK, LANES)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # a PDL chain stays ordered: this kernel ends after its predecessor


def plan(weights: tuple[torch.Tensor, ...], budget: int) -> list[tuple[torch.Tensor, int]]:
    """``(tensor, bytes)`` to prefetch: each weight from its start, in order, until ``budget`` bytes (16-byte
    multiples; at most ``MAX_SEGMENTS``)."""
    segments = []
    for weight in weights[:MAX_SEGMENTS]:
        take = min(weight.numel() * weight.element_size(), budget) // 16 * 16
        if take <= 0:
            break
        segments.append((weight, take))
        budget -= take
    return segments


def launch(segments: list[tuple[torch.Tensor, int]], chunk: int = CHUNK) -> None:
    """One kernel prefetching ``segments`` (``plan``'s output) on the current stream: ``chunk`` bytes per lane and
    instruction, at most one program per SM."""
    if not segments:
        return
    padded = segments + [(segments[0][0], 0)] * (MAX_SEGMENTS - len(segments))
    args = [value for segment in padded for value in segment]
    chunks = max(triton.cdiv(n, chunk) for _, n in segments)  # the grid strides over each segment in turn
    device = segments[0][0].device
    programs = max(1, min(triton.cdiv(chunks, LANES), _sm_count(device.index if device.index is not None else 0)))
    _prefetch_kernel[(programs,)](*args, CHUNK=chunk, LANES=LANES, num_warps=1, **pdl.launch())


def prefetch(x: torch.Tensor, *weights: torch.Tensor) -> None:
    """``reference.prefetch``: the first ``budget_bytes()`` of ``weights`` into L2 for a decode-sized ``x`` on the
    GPU; nothing for larger steps, CPU tensors or a graph being compiled by TorchInductor."""
    if x.shape[0] > MAX_ROWS or not x.is_cuda or torch.compiler.is_compiling():
        return
    launch(plan(weights, budget_bytes(x.device)))

"""``fork`` on a second CUDA stream: the forked work runs beside the caller's next kernels, in eager steps and in
CUDA graphs alike (a graph captured across two streams replays their kernels as concurrent branches).

The model forks an attention layer's key path (the key norm, the compressor fold, the key gather, the ring write)
beside its query path, the indexer's fold beside the attention, and the shared expert beside the routing. At batch
1 those are chains of small kernels that leave most of the GPU idle; beside the weight-reading GEMVs of the other
path they fill it. ``join()`` waits for its own fork's work only (an event
recorded after it), not for work forked later; the side stream runs at high priority (``SIDE_PRIORITY``). Work on
more than ``MAX_ROWS`` rows (prefill) runs in place: its kernels fill the GPU alone, and forking them makes prefill
steps slower.
``DEEPINFER_NVIDIA_STREAMS=0`` runs all forked work in place (the reference op); a step being compiled by
TorchInductor also runs it in place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from deepinfer_core.ops import reference as ref
from deepinfer_nvidia_sm100 import envs

MAX_ROWS = 512
"""Forked work whose first tensor argument (the activations, by the op's convention) has more rows runs in place."""


def enabled() -> bool:
    """Forked work on a second stream, unless ``DEEPINFER_NVIDIA_STREAMS=0``."""
    return envs.DEEPINFER_NVIDIA_STREAMS


SIDE_PRIORITY = -1
"""The side stream's priority (lower is higher; the default streams' is 0): its blocks are scheduled ahead of a
running main-stream kernel's next blocks, so the forked chains of small kernels do not wait behind a GEMV's
thousands of blocks."""


@functools.cache
def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of ``device``, made on first use and kept (every fork and every captured graph shares it);
    priority ``SIDE_PRIORITY``."""
    return torch.cuda.Stream(device, priority=SIDE_PRIORITY)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class Forked:
    """Work queued on the side stream up to ``done``; ``join()`` makes the caller's stream wait for it (not for work
    forked after it) and returns its result."""

    def __init__(self, result: Any, main: torch.cuda.Stream, done: torch.cuda.Event):
        self.result, self.main, self.done = result, main, done

    def join(self) -> Any:
        """``fn``'s result, safe to use on the caller's stream from here on."""
        self.main.wait_event(self.done)
        for t in _tensors(self.result):
            if t.is_cuda:
                t.record_stream(self.main)  # made on the side stream, freed from the caller's: reuse waits for it
        return self.result


def fork(fn: Callable[..., Any], *args: Any) -> Forked | ref.Finished:
    """``reference.fork`` on the side stream (work of at most ``MAX_ROWS`` rows): it waits for the caller's stream up
    to here, then runs ``fn``."""
    tensors = list(_tensors(args))
    small = bool(tensors) and (tensors[0].dim() == 0 or tensors[0].shape[0] <= MAX_ROWS)
    if not enabled() or torch.compiler.is_compiling() or not small or not tensors[0].is_cuda:
        return ref.fork(fn, *args)
    main = torch.cuda.current_stream()
    side = side_stream(main.device)
    if side == main:  # already on the side stream (a fork inside forked work): nothing to overlap with
        return ref.fork(fn, *args)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        result = fn(*args)
    done = torch.cuda.Event()
    done.record(side)
    for t in tensors:
        if t.is_cuda:
            t.record_stream(side)  # a caller that drops an argument early must not see its memory reused under fn
    return Forked(result, main, done)

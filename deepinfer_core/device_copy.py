"""Host-to-device copies that do not wait for the device's queued work."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A small host tensor on ``device`` without waiting for the device's queued work: copied from pinned
    memory, non-blocking (a plain ``tensor.to(device)`` from pageable memory waits until the stream is idle,
    which would stall the host behind a step still running)."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def to_device_together(hosts: list[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Small host tensors on ``device`` in one non-blocking copy: packed into one pinned buffer (``to_device`` on each
    would pin and copy each); returns views of one device buffer, in order, with the hosts' shapes and dtypes."""
    device = torch.device(device)
    if device.type == "cpu":
        return list(hosts)
    specs = [(t.shape, t.dtype) for t in hosts]
    offsets, total = arena_offsets(specs)
    arena = torch.empty(total, dtype=torch.uint8, pin_memory=device.type != "meta")  # meta: tests and tools
    for view, host in zip(arena_views(arena, offsets, specs), hosts, strict=True):
        view.copy_(host)
    return arena_views(arena.to(device, non_blocking=True), offsets, specs)


ARENA_ALIGN = 64  # bytes between tensors in an arena (any dtype's alignment)


def arena_offsets(specs: list[tuple[torch.Size, torch.dtype]]) -> tuple[list[int], int]:
    """Byte offsets of tensors of these (shape, dtype) laid out one after another, each aligned to ``ARENA_ALIGN``,
    and the arena's size in bytes (at least 1)."""
    offsets, total = [], 0
    for shape, dtype in specs:
        offsets.append(total)
        nbytes = shape.numel() * dtype.itemsize
        total += -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN
    return offsets, max(total, 1)


def arena_views(arena: torch.Tensor, offsets: list[int], specs: list[tuple[torch.Size, torch.dtype]]
                ) -> list[torch.Tensor]:
    """The tensors of an ``arena_offsets`` layout as views of the uint8 ``arena``."""
    return [arena[o:o + shape.numel() * dtype.itemsize].view(dtype).view(shape)
            for o, (shape, dtype) in zip(offsets, specs, strict=True)]


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a device tensor in pinned host memory, queued on the current stream without waiting: read it
    only once an event recorded after it (``record_event``) has completed. A host tensor is returned as it is."""
    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def record_event(device: torch.device | str) -> torch.Event | None:
    """An event recorded now on ``device``'s current stream (None on the CPU, whose copies are done on return)."""
    device = torch.device(device)
    if device.type == "cpu":
        return None
    event = torch.Event(device=device)
    event.record()
    return event


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


@contextlib.contextmanager
def beside(device: torch.device | str) -> Iterator[None]:
    """Run the enclosed device work on a side stream of ``device`` (one per device) that first waits for the current
    stream's work so far: nothing queued later on the current stream waits for it (a step's copies of its sampled
    tokens to the host, beside the next step). CUDA only; elsewhere the work stays on the current stream. Tensors the
    enclosed work reads must stay alive until an event recorded inside (``record_event``) completes."""
    device = torch.device(device)
    if device.type != "cuda":
        yield
        return
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield

"""Host-to-device copies that do not wait for the device's queued work."""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A small host tensor on ``device`` without waiting for the device's queued work: copied from pinned
    memory, non-blocking (a plain ``tensor.to(device)`` from pageable memory waits until the stream is idle,
    which would stall the host behind a step still running)."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


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

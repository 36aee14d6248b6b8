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

"""Zeroed int32 counters for GPU kernels whose programs meet inside the kernel: a split-K product whose K splits of a
tile add up in the last one to finish counts arrivals per tile, and that last program sets its counter back to zero.
Backends and plugins keep one ``TileCounters`` per kind of launch."""

from __future__ import annotations

import torch


class TileCounters:
    """Up to ``slots`` zeroed int32 counters a launch, one buffer per (device, stream priority), kept for the
    process.

    Launches on one stream never overlap (with programmatic dependent launch a kernel counts only after it waited
    for the one before), and the engine runs work side by side only on its main stream and its high-priority side
    stream (``fork``), so one buffer per stream priority keeps concurrent launches apart: a graph captured on another
    stream of the main stream's priority (the capture stream, after eager warm-up launches) takes the main stream's.
    """

    def __init__(self, slots: int):
        self.slots = slots
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}

    def get(self, device: torch.device, tiles: int) -> torch.Tensor | None:
        """The counters for a launch of ``tiles`` tiles on ``device``'s current stream, all zero; None (the caller
        then adds its partials by a second kernel) beyond ``slots`` tiles, and while a CUDA graph is captured before
        an eager launch made the buffer (allocated there, it would be zeroed only by that graph's replays)."""
        if tiles > self.slots:
            return None
        priority = torch.cuda.current_stream(device).priority if device.type == "cuda" else 0
        key = (str(device), priority)
        counters = self._buffers.get(key)
        if counters is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            counters = self._buffers[key] = torch.zeros(self.slots, dtype=torch.int32, device=device)
        return counters

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer made so far (tests check that each launch left them at zero)."""
        return list(self._buffers.values())

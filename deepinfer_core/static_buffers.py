"""Device tensors that keep their storage from step to step, so a captured device graph can read them at replay."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from deepinfer_core.device_copy import arena_offsets, arena_views, record_event

T = TypeVar("T")


class StaticBuffers:
    """Device tensors that keep their storage from step to step: a CUDA graph reads them at replay.

    The first build with these buffers only learns the index tensors' shapes and dtypes, in build order
    (``place`` returns a plain copy). ``seal`` then lays them out in one device arena with a host twin (pinned
    on CUDA); every later build (after ``rewind``) writes its host tensors into the twin, which must have the
    same shapes (a ``StaticShape`` guarantees that), and ``upload`` moves the whole layout in one copy instead of
    one small pageable copy per tensor.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.specs: list[tuple[torch.Size, torch.dtype]] = []
        self.tensors: list[torch.Tensor] = []  # views into the device arena, after seal
        self._staging: list[torch.Tensor] = []  # views into the host twin
        self._host_arena: torch.Tensor | None = None
        self._device_arena: torch.Tensor | None = None
        self._uploaded = None  # event of the last upload (the host twin is reused only after it)
        self._next = 0

    @property
    def sealed(self) -> bool:
        return self._device_arena is not None

    @classmethod
    def sized(cls, device: torch.device, place: Callable[[StaticBuffers], T]) -> tuple[StaticBuffers, T]:
        """New buffers sized by a first pass of ``place`` (which only learns the shapes), sealed, and ``place``'s
        result from a second pass into their fixed storage."""
        buffers = cls(device)
        place(buffers)
        buffers.seal()
        return buffers, place(buffers)

    def rewind(self) -> None:
        """Start a new build: the next ``place`` fills the first tensor again."""
        self._next = 0
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def place(self, host: torch.Tensor) -> torch.Tensor:
        """The fixed device tensor for the next index tensor; it holds ``host``'s values after ``upload``
        (before ``seal``: a plain copy of ``host`` on the device)."""
        index, self._next = self._next, self._next + 1
        if not self.sealed:
            self.specs.append((host.shape, host.dtype))
            return host.to(self.device)
        if index >= len(self.tensors):
            raise RuntimeError(f"static layout has more tensors than the {len(self.tensors)} it was sealed with")
        target = self.tensors[index]
        if target.shape != host.shape or target.dtype != host.dtype:
            raise RuntimeError(f"static layout tensor {index} changed from {tuple(target.shape)} {target.dtype} "
                               f"to {tuple(host.shape)} {host.dtype}; the static shape does not fix it")
        self._staging[index].copy_(host)
        return target

    def seal(self) -> None:
        """Lay the tensors seen so far out in one arena (device) plus its host twin."""
        offsets, total = arena_offsets(self.specs)
        on_host = self.device.type == "cpu"
        self._host_arena = torch.zeros(total, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self._device_arena = self._host_arena if on_host else torch.zeros_like(self._host_arena, device=self.device)
        self._staging = arena_views(self._host_arena, offsets, self.specs)
        self.tensors = arena_views(self._device_arena, offsets, self.specs)

    def upload(self) -> None:
        """One copy of everything placed since ``rewind`` to the device (non-blocking from pinned memory)."""
        if not self.sealed or self._device_arena is self._host_arena:  # sizing build, or on the host already
            return
        self._device_arena.copy_(self._host_arena, non_blocking=True)
        self._uploaded = record_event(self.device)

"""``SwaHostCache``: per-sequence state (sliding windows, compressor carries) at block boundaries, in host memory.

An entry is a copy of one slot's state (``DeepseekV4State.slot_views``) taken when a step left the sequence's
computed tokens exactly on a block boundary, keyed by the prefix-cache hash of the block ending there: the state a
later request with the same first tokens needs to continue from that boundary exactly, without replay. Entries live
in pinned host memory when the model runs on CUDA (the copies are asynchronous, ordered on the device's stream) and
in plain host memory otherwise. The cache holds at most ``capacity_bytes`` (least recently used entries go first)
and drops an entry ``ttl_s`` seconds after it was stored or last used (``clock``: ``time.monotonic``, injectable).
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from deepinfer_swa_replay.stats import HostCacheStats

DEFAULT_CAPACITY_BYTES = 2 << 30
DEFAULT_TTL_S = 180.0


@dataclasses.dataclass
class HostEntry:
    """One slot's state at a block boundary: host copies in ``slot_views`` order."""

    tensors: list[torch.Tensor]
    nbytes: int
    used_at: float  # when stored or last found (the TTL counts from here)


class SwaHostCache:
    """A size-capped, TTL-bounded LRU of slot states by block hash (see module docstring)."""

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES, ttl_s: float = DEFAULT_TTL_S,
                 pin_memory: bool = False, clock: Callable[[], float] = time.monotonic,
                 stats: HostCacheStats | None = None):
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self.pin_memory = pin_memory
        self.clock = clock
        self.stats = stats or HostCacheStats()
        self.entries: OrderedDict[bytes, HostEntry] = OrderedDict()  # least recently used first
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    def store(self, key: bytes, views: Sequence[torch.Tensor]) -> HostEntry | None:
        """Copy ``views`` (one slot's state) to host memory under ``key``, replacing an entry there and evicting the
        least recently used ones to stay within the capacity; None (nothing kept) when one entry exceeds it."""
        nbytes = sum(v.numel() * v.element_size() for v in views)
        if nbytes > self.capacity_bytes:
            return None
        self._drop(key)
        self.expire()
        while self.nbytes + nbytes > self.capacity_bytes:
            self._drop(next(iter(self.entries)))
            self.stats.evictions.inc()
        entry = HostEntry([self._host_copy(v) for v in views], nbytes, self.clock())
        self.entries[key] = entry
        self.nbytes += nbytes
        self.stats.stores.inc()
        self.stats.host_bytes.set(self.nbytes)
        return entry

    def find(self, keys: Sequence[bytes]) -> tuple[int, HostEntry] | None:
        """The first of ``keys`` that has a live entry, as (its index, the entry), marked used; None if none has."""
        self.expire()
        for index, key in enumerate(keys):
            entry = self.entries.get(key)
            if entry is not None:
                entry.used_at = self.clock()
                self.entries.move_to_end(key)
                return index, entry
        return None

    def expire(self) -> None:
        """Drop the entries not stored or used for ``ttl_s`` seconds (they sit first: least recently used)."""
        now = self.clock()
        while self.entries:
            key, entry = next(iter(self.entries.items()))
            if now - entry.used_at < self.ttl_s:
                break
            self._drop(key)
            self.stats.expirations.inc()

    @staticmethod
    def restore(entry: HostEntry, views: Sequence[torch.Tensor]) -> None:
        """Write an entry back into a slot's ``views`` (asynchronous from pinned memory, ordered on the stream)."""
        for view, host in zip(views, entry.tensors, strict=True):
            view.copy_(host, non_blocking=host.is_pinned())

    def _host_copy(self, view: torch.Tensor) -> torch.Tensor:
        host = torch.empty(view.shape, dtype=view.dtype, device="cpu", pin_memory=self.pin_memory)
        host.copy_(view, non_blocking=self.pin_memory)
        return host

    def _drop(self, key: bytes) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
            self.stats.host_bytes.set(self.nbytes)

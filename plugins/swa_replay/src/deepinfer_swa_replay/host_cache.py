"""``SwaHostCache``: the host-memory tier of the core's prefix state cache (``deepinfer_core.engine.prefix_state_cache``).

An entry is a copy of one slot's state (``SlotStateModel.slot_state_views``: sliding windows, compressor carries)
taken when a step left the sequence's computed tokens exactly on a block boundary, keyed by the prefix-cache hash of
the block ending there. Here entries live in pinned host memory when the model runs on CUDA (the copies are
asynchronous, ordered on the device's stream) and in plain host memory otherwise, at most ``capacity_bytes`` of them
(least recently used first), each dropped ``ttl_s`` seconds after it was stored or last used (``clock``:
``time.monotonic``, injectable). The store itself is the core's ``PrefixStateCache``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from deepinfer_core.engine.prefix_state_cache import PrefixStateCache, StateEntry
from deepinfer_swa_replay.stats import HostCacheStats

DEFAULT_CAPACITY_BYTES = 2 << 30
DEFAULT_TTL_S = 180.0

HostEntry = StateEntry  # one slot's state at a block boundary, in host memory


class SwaHostCache(PrefixStateCache):
    """A size-capped, TTL-bounded LRU of slot states by block hash in host memory (see module docstring)."""

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES, ttl_s: float = DEFAULT_TTL_S,
                 pin_memory: bool = False, clock: Callable[[], float] = time.monotonic,
                 stats: HostCacheStats | None = None):
        super().__init__(capacity_bytes, ttl_s, host=True, pin_memory=pin_memory, clock=clock,
                         stats=stats or HostCacheStats())

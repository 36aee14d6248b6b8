"""``ReplayStats``: what bounded replay did in one engine (kept in the engine context's ``plugin_state``);
``HostCacheStats``: the SWA host cache's counters."""

from __future__ import annotations

import dataclasses

from deepinfer_core.engine.prefix_state_cache import PrefixStateStats
from deepinfer_core.metrics import Gauge


@dataclasses.dataclass
class ReplayStats:
    """Counts of one engine's prefix hits under bounded replay."""

    hits_adopted: int = 0  # hits of which some blocks were adopted
    hits_dropped: int = 0  # hits not adopted at all (too short once L - (window + 6) is applied)
    tokens_offered: int = 0  # cached tokens the hits offered
    tokens_adopted: int = 0  # cached tokens the requests took
    tokens_replayed: int = 0  # tokens recomputed before adopted hits (window per adopted hit)

    def record(self, offered: int, adopted: int, replayed: int) -> None:
        """Count one hit of ``offered`` tokens, ``adopted`` of them taken, ``replayed`` recomputed before them."""
        self.tokens_offered += offered
        self.tokens_adopted += adopted
        self.tokens_replayed += replayed
        if adopted:
            self.hits_adopted += 1
        else:
            self.hits_dropped += 1


#: Metric names of the SWA host cache's counters (``LLM.get_metrics()`` where the engine has a metrics registry).
HOST_CACHE_METRICS = {
    "hits": ("deepinfer:swa_host_cache_hits", "prefix hits whose window state was restored from the SWA host cache"),
    "misses": ("deepinfer:swa_host_cache_misses", "prefix hits the SWA host cache held no state for (rebuilt)"),
    "evictions": ("deepinfer:swa_host_cache_evictions", "SWA host cache entries dropped for the size cap"),
    "expirations": ("deepinfer:swa_host_cache_expirations", "SWA host cache entries dropped for the TTL"),
    "stores": ("deepinfer:swa_host_cache_stores", "slot states copied into the SWA host cache"),
}
HOST_BYTES_METRIC = ("deepinfer:swa_host_cache_bytes", "host memory the SWA host cache holds")


class HostCacheStats(PrefixStateStats):
    """The SWA host cache's counters of one engine (the core's ``PrefixStateStats`` under ``HOST_CACHE_METRICS``'
    names): hits, misses, evictions, expirations, stores and ``host_bytes``. Standalone until the engine starts; then
    the engine's metrics registry's own objects of the same names, so ``LLM.get_metrics()`` lists them."""

    def __init__(self) -> None:
        super().__init__(HOST_CACHE_METRICS, HOST_BYTES_METRIC)

    @property
    def host_bytes(self) -> Gauge:
        """Host memory the cache holds (the ``bytes`` gauge)."""
        return self.bytes

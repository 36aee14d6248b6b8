"""``ReplayStats``: what bounded replay did in one engine (kept in the engine context's ``plugin_state``);
``HostCacheStats``: the SWA host cache's counters."""

from __future__ import annotations

import dataclasses

from deepinfer_core.metrics import Counter, Gauge, MetricsRegistry


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


@dataclasses.dataclass
class HostCacheStats:
    """The SWA host cache's counters of one engine (``deepinfer_core.metrics`` objects: each has a ``value``).

    Standalone until the engine starts; then the engine's metrics registry's own objects of the same names, so
    ``LLM.get_metrics()`` lists them (``HOST_CACHE_METRICS``)."""

    hits: Counter = dataclasses.field(default_factory=lambda: Counter(*HOST_CACHE_METRICS["hits"]))
    misses: Counter = dataclasses.field(default_factory=lambda: Counter(*HOST_CACHE_METRICS["misses"]))
    evictions: Counter = dataclasses.field(default_factory=lambda: Counter(*HOST_CACHE_METRICS["evictions"]))
    expirations: Counter = dataclasses.field(default_factory=lambda: Counter(*HOST_CACHE_METRICS["expirations"]))
    stores: Counter = dataclasses.field(default_factory=lambda: Counter(*HOST_CACHE_METRICS["stores"]))
    host_bytes: Gauge = dataclasses.field(default_factory=lambda: Gauge(*HOST_BYTES_METRIC))

    def register(self, registry: MetricsRegistry) -> None:
        """Move every counter (and the bytes gauge) into ``registry``, keeping the counts so far."""
        for field, (name, help_text) in HOST_CACHE_METRICS.items():
            counter = registry.counter(name, help_text)
            counter.inc(getattr(self, field).value)
            setattr(self, field, counter)
        gauge = registry.gauge(*HOST_BYTES_METRIC)
        gauge.set(self.host_bytes.value)
        self.host_bytes = gauge

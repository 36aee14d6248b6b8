"""Engine metrics as vLLM's metrics reader returns them: ``LLM.get_metrics()`` -> ``Counter`` / ``Gauge`` /
``Vector`` objects with a ``name`` (``deepinfer:...``, Prometheus style) and a value.

One ``MetricsRegistry`` per engine (``Engine.metrics``; plugins reach it as ``engine.metrics`` in the lifecycle
hooks). Adding a metric is one call that returns the object to update::

    hits = engine.metrics.counter("deepinfer:swa_host_cache_hits", "SWA KV found in the host cache")
    hits.inc()

Asking again for a name returns the same object (so a plugin may ask in every hook); asking for it as another kind
is refused. ``snapshot()`` copies every metric in registration order.
"""

from __future__ import annotations

import dataclasses

from deepinfer_core.errors import DeepInferError


class MetricError(DeepInferError, ValueError):
    """A metric asked for under a name already registered as another kind or size, or a bad name."""


@dataclasses.dataclass
class Metric:
    """A named metric (vLLM's ``vllm.v1.metrics.reader.Metric``); ``help`` is its one-line description."""

    name: str
    help: str = ""
    labels: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Counter(Metric):
    """A monotonically increasing count (``value``)."""

    value: int = 0

    def inc(self, amount: int = 1) -> None:
        """Add ``amount`` (>= 0)."""
        if amount < 0:
            raise MetricError(f"counter {self.name} cannot decrease (inc({amount}))")
        self.value += amount


@dataclasses.dataclass
class Gauge(Metric):
    """A value that goes up and down (``value``)."""

    value: float = 0.0

    def set(self, value: float) -> None:
        self.value = value


@dataclasses.dataclass
class Vector(Metric):
    """A fixed-length list of counts (``values``), e.g. accepted draft tokens per draft position."""

    values: list[int] = dataclasses.field(default_factory=list)

    @property
    def value(self) -> list[int]:
        """``values`` (so every metric has a ``value``)."""
        return self.values

    def inc(self, index: int, amount: int = 1) -> None:
        """Add ``amount`` to entry ``index``."""
        self.values[index] += amount


class MetricsRegistry:
    """The metrics of one engine, by name (see module docstring)."""

    def __init__(self) -> None:
        self._metrics: dict[str, Metric] = {}

    def counter(self, name: str, help: str = "") -> Counter:
        """The counter called ``name`` (registered now at 0 if new)."""
        return self._get(name, Counter, help)

    def gauge(self, name: str, help: str = "") -> Gauge:
        """The gauge called ``name`` (registered now at 0.0 if new)."""
        return self._get(name, Gauge, help)

    def vector(self, name: str, size: int, help: str = "") -> Vector:
        """The vector of ``size`` counts called ``name`` (registered now at zeros if new)."""
        vector = self._get(name, Vector, help, values=[0] * size)
        if len(vector.values) != size:
            raise MetricError(f"metric {name} has {len(vector.values)} entries, asked for {size}")
        return vector

    def get(self, name: str) -> Metric | None:
        """The metric called ``name``, or None."""
        return self._metrics.get(name)

    def snapshot(self) -> list[Metric]:
        """Copies of every metric, in registration order."""
        return [dataclasses.replace(m, labels=dict(m.labels), **_copied_values(m)) for m in self._metrics.values()]

    def _get(self, name: str, kind: type, help: str, **fields) -> Metric:
        if not name or any(c.isspace() for c in name):
            raise MetricError(f"metric name {name!r} must be non-empty without spaces (e.g. 'deepinfer:my_count')")
        metric = self._metrics.get(name)
        if metric is None:
            metric = self._metrics[name] = kind(name=name, help=help, **fields)
        elif type(metric) is not kind:
            raise MetricError(f"metric {name} is a {type(metric).__name__}, asked for as a {kind.__name__}")
        return metric


def _copied_values(metric: Metric) -> dict:
    return {"values": list(metric.values)} if isinstance(metric, Vector) else {}


__all__ = ["Counter", "Gauge", "Metric", "MetricError", "MetricsRegistry", "Vector"]

"""The ``deepinfer.plugins`` entry point ``swa_host_cache``: prefix hits restore the sliding window from host memory.

This is the host-memory tier of the core's prefix state cache (``deepinfer_core.engine.prefix_state_cache``: the
device tier is the core's own, on by default): the same ``PrefixStateKeeper`` and store, here in (pinned) host memory
with a TTL, reached through the core's hooks, and tried when the device tier holds no state for a hit.

Enabled per engine by the feature option ``enable_swa_host_cache`` (``LLM(..., enable_swa_host_cache=True)``,
``--option enable_swa_host_cache=true``); ``swa_host_cache_bytes`` (default 2 GiB) caps its host memory and
``swa_host_cache_ttl_s`` (default 180) drops entries not stored or used for that long. ``swa_host_cache_split_prefill``
(default off) ends an admitted prompt's first chunk on the last block boundary at least ``prefill_min_tokens()`` before
its end (``deepinfer_first_chunk_end``) when the first part is that long too, so that the same prompt sent again is
restored there: a miss then takes two prefill steps.

Capture: when a step leaves a request's computed tokens on a block boundary (a prompt of whole blocks, a decode step
that fills a block, a chunk that ends on one), the request's slot (``SlotStateModel.slot_state_views``: every layer's
sliding ring and compressor carry) is copied into a ``SwaHostCache`` entry keyed by the prefix-cache hash of that block. The copy is enqueued on the device right after that step and before the next one writes the slot: in
``deepinfer_before_step`` of the next step, or in ``deepinfer_after_step`` when no later step was launched
(``Engine.step_in_flight``). So the state of finished and preempted sequences outlives their slots.

Restore: when a request is admitted with a prefix hit (``deepinfer_restore_prefix_state``), the cache is looked up
at the hit's block boundaries from the longest down to the exact rebuild's start (below it restoring saves nothing);
the longest found is adopted, written into the request's slot before its first step, and the request computes from
there reading the restored window: outputs equal exact reuse. Without an entry, the hit falls back to the rebuild
(exact, or bounded replay with ``enable_swa_replay``). Counters (``HostCacheStats``): hits, misses, evictions (size
cap), expirations (TTL), stores, host bytes; in ``LLM.get_metrics()`` where the engine has a metrics registry, and
through ``host_cache_stats(llm.context)`` always.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from deepinfer_core.engine.prefix_replay import PrefixHit
from deepinfer_core.engine.prefix_state_cache import PrefixStateKeeper
from deepinfer_core.engine.request import Request
from deepinfer_core.engine_context import EngineContext
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.models.interface import SlotStateModel, StaticStepModel
from deepinfer_core.options import parse_flag
from deepinfer_swa_replay.errors import SwaHostCacheError, SwaHostCacheOptionError
from deepinfer_swa_replay.host_cache import DEFAULT_CAPACITY_BYTES, DEFAULT_TTL_S, SwaHostCache
from deepinfer_swa_replay.stats import HostCacheStats

DEEPINFER_HOOK_API_VERSION = 1

ENABLE = "enable_swa_host_cache"
BYTES = "swa_host_cache_bytes"
TTL = "swa_host_cache_ttl_s"
SPLIT = "swa_host_cache_split_prefill"
KEY = "swa_host_cache"  # our entry-point name: the key of our state in context.plugin_state


@dataclasses.dataclass
class HostCacheState:
    """One engine's SWA host cache: its store and the core's keeper working on it between hooks."""

    cache: SwaHostCache
    split_prefill: bool = False
    keeper: PrefixStateKeeper = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.keeper = PrefixStateKeeper(self.cache, split_min_tokens=1 if self.split_prefill else 0)


def host_cache_state(context: EngineContext | None) -> HostCacheState | None:
    """The ``HostCacheState`` of ``context``'s engine, or None when the SWA host cache is off for it."""
    found = context.plugin_state.get(KEY) if context is not None else None
    return found if isinstance(found, HostCacheState) else None


def host_cache_stats(context: EngineContext | None) -> HostCacheStats | None:
    """The SWA host cache's counters of ``context``'s engine (hits, misses, evictions, expirations, stores,
    host_bytes; each with a ``value``), or None when it is off for it."""
    state = host_cache_state(context)
    return state.cache.stats if state is not None else None


@hookimpl
def deepinfer_feature_options() -> dict[str, str]:
    return {
        ENABLE: "SWA host cache: keep sequences' sliding-window state at block boundaries in host memory and restore "
                "it exactly on a prefix hit (see deepinfer_swa_replay.host_cache_plugin)",
        BYTES: f"host memory the SWA host cache may hold, in bytes (default {DEFAULT_CAPACITY_BYTES})",
        TTL: f"seconds an SWA host cache entry lives after it was stored or last used (default {DEFAULT_TTL_S:g})",
        SPLIT: "end a prompt's first chunk on its last block boundary so the same prompt again is restored there "
               "(default false; a miss then takes two prefill steps)",
    }


@hookimpl
def deepinfer_configure(options: Mapping[str, Any], context: EngineContext) -> None:
    """Give an engine built with ``enable_swa_host_cache`` its cache; refuse sizes given without it."""
    if not _flag(options.get(ENABLE, False)):
        given = [name for name in (BYTES, TTL, SPLIT) if name in options]
        if given:
            raise SwaHostCacheOptionError(f"option {given[0]} needs {ENABLE}=true (the SWA host cache is off)")
        return
    capacity = _positive(options, BYTES, DEFAULT_CAPACITY_BYTES, int)
    ttl = _positive(options, TTL, DEFAULT_TTL_S, float)
    cache = SwaHostCache(capacity, ttl, pin_memory=torch.device(context.device).type == "cuda")
    context.plugin_state[KEY] = HostCacheState(cache, split_prefill=_flag(options.get(SPLIT, False), SPLIT))


@hookimpl
def deepinfer_engine_start(engine) -> None:
    """Bind the keeper to the engine's slot state views, block size and exact replay span; put the counters in its
    metrics."""
    state = host_cache_state(engine.context)
    if state is None:
        return
    model = engine.model
    if not isinstance(model, SlotStateModel):
        raise SwaHostCacheError(f"the SWA host cache needs a model that can copy its slot state (SlotStateModel."
                                f"slot_state_views, e.g. DeepSeek-V4); {type(model).__name__} cannot: drop {ENABLE}")
    slot_state = engine.runner.state
    min_chunk = model.prefill_min_tokens() if isinstance(model, StaticStepModel) else 1
    state.keeper.bind(lambda slot: model.slot_state_views(slot_state, slot), engine.config.block_size,
                      model.prefix_replay_span(), min_chunk, getattr(engine, "metrics", None))


@hookimpl
def deepinfer_restore_prefix_state(hit: PrefixHit, context: EngineContext | None) -> int | None:
    """The longest boundary of the hit whose state the cache holds (above the exact rebuild's start), else None."""
    state = host_cache_state(context)
    if state is None:
        return None
    return state.keeper.lookup(hit.request, hit.num_cached_tokens, hit.block_hashes) or None


@hookimpl
def deepinfer_first_chunk_end(request: Request, start: int, end: int, block_size: int,
                              context: EngineContext | None) -> int | None:
    """With ``swa_host_cache_split_prefill``: a chunk that finishes the request's tokens ends on the last block
    boundary ``prefill_min_tokens()`` before their end (the step then leaves the state there to keep)."""
    state = host_cache_state(context)
    return state.keeper.first_chunk_end(request, start, end) if state is not None else None


@hookimpl
def deepinfer_before_step(engine, scheduler_output) -> None:
    """Copy the slots the last step left on a block boundary, write restored states into the slots of requests
    starting from one, and note this step's chunks that end on a boundary."""
    state = host_cache_state(engine.context)
    if state is not None:
        state.keeper.before_step(scheduler_output.chunks)


@hookimpl
def deepinfer_after_step(engine) -> None:
    """Copy the last step's boundary slots now when no later step was launched (else the next step's
    ``deepinfer_before_step`` does, before that step runs)."""
    state = host_cache_state(engine.context)
    if state is not None:
        state.keeper.after_step(engine.step_in_flight)


def _flag(value: Any, name: str = ENABLE) -> bool:
    flag = parse_flag(value)
    if flag is None:
        raise SwaHostCacheOptionError(f"option {name} must be a boolean (true/false, 1/0), got {value!r}")
    return flag


def _positive(options: Mapping[str, Any], name: str, default: float, kind: type) -> Any:
    """Option ``name`` as a positive ``kind`` (int or float), ``default`` when it is not set."""
    value = options.get(name, default)
    try:
        number = kind(value)
    except (TypeError, ValueError):
        number = None
    if isinstance(value, bool) or number is None or not number > 0 or (kind is int and float(value) != number):
        raise SwaHostCacheOptionError(f"option {name} must be a positive {kind.__name__}, got {value!r}")
    return number

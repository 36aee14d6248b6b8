"""The ``deepinfer.plugins`` entry point ``swa_host_cache``: prefix hits restore the sliding window from host memory.

Enabled per engine by the feature option ``enable_swa_host_cache`` (``LLM(..., enable_swa_host_cache=True)``,
``--option enable_swa_host_cache=true``); ``swa_host_cache_bytes`` (default 2 GiB) caps its host memory and
``swa_host_cache_ttl_s`` (default 180) drops entries not stored or used for that long. ``swa_host_cache_split_prefill``
(default off) ends an admitted prompt's first chunk on its last block boundary (``deepinfer_first_chunk_end``) when
both parts are at least ``prefill_min_tokens()`` long, so that the same prompt sent again is restored there: a miss
then takes two prefill steps.

Capture: when a step leaves a request's computed tokens on a block boundary (a prompt of whole blocks, a decode step
that fills a block, a chunk that ends on one), the request's slot (``DeepseekV4State.slot_views``: every layer's
sliding ring and compressor carry) is copied into a ``SwaHostCache`` entry keyed by the prefix-cache hash of that
block. The copy is enqueued on the device right after that step and before the next one writes the slot: in
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
from collections.abc import Callable, Mapping
from typing import Any

import torch

from deepinfer_core.engine.prefix_replay import PrefixHit
from deepinfer_core.engine.request import Request
from deepinfer_core.engine.state_manager import chain_hashes
from deepinfer_core.engine_context import EngineContext
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.options import parse_flag
from deepinfer_swa_replay.errors import SwaHostCacheError, SwaHostCacheOptionError
from deepinfer_swa_replay.host_cache import DEFAULT_CAPACITY_BYTES, DEFAULT_TTL_S, HostEntry, SwaHostCache
from deepinfer_swa_replay.stats import HostCacheStats

DEEPINFER_HOOK_API_VERSION = 1

ENABLE = "enable_swa_host_cache"
BYTES = "swa_host_cache_bytes"
TTL = "swa_host_cache_ttl_s"
SPLIT = "swa_host_cache_split_prefill"
KEY = "swa_host_cache"  # our entry-point name: the key of our state in context.plugin_state


@dataclasses.dataclass
class Capture:
    """A slot to copy once its step has run: ``request``'s state after its first ``end`` tokens (a block boundary);
    the block hash there chains from ``parent`` (the hash at ``hashed``) over the tokens ``[hashed, end)``."""

    request: Request
    slot: int
    end: int
    hashed: int
    parent: bytes


@dataclasses.dataclass
class HostCacheState:
    """One engine's SWA host cache and what it does between hooks."""

    cache: SwaHostCache
    block_size: int = 0
    replay_span: int = 0
    slot_views: Callable[[int], list[torch.Tensor]] | None = None  # set at engine start
    split_prefill: bool = False
    min_chunk: int = 1  # the shortest chunk a split leaves (the model's prefill_min_tokens)
    pending_restores: dict[str, tuple[int, HostEntry]] = dataclasses.field(default_factory=dict)  # by request id
    looked_up: set[str] = dataclasses.field(default_factory=set)  # counted since their admission was planned
    captures: list[Capture] = dataclasses.field(default_factory=list)  # of the step launched last


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
    """Learn the engine's block size, exact replay span and slot views; put the counters in its metrics."""
    state = host_cache_state(engine.context)
    if state is None:
        return
    slot_views = getattr(engine.runner.state, "slot_views", None)
    if not callable(slot_views):
        raise SwaHostCacheError(f"the SWA host cache needs a model state with slot_views (a DeepSeek-V4 state); "
                                f"{type(engine.runner.state).__name__} has none: drop {ENABLE}")
    state.slot_views = slot_views
    state.block_size = engine.config.block_size
    state.replay_span = engine.model.prefix_replay_span()
    min_tokens = getattr(engine.model, "prefill_min_tokens", None)
    state.min_chunk = max(1, min_tokens()) if callable(min_tokens) else 1
    registry = getattr(engine, "metrics", None)
    if registry is not None:
        state.cache.stats.register(registry)


@hookimpl
def deepinfer_restore_prefix_state(hit: PrefixHit, context: EngineContext | None) -> int | None:
    """The longest boundary of the hit whose state the cache holds (above the exact rebuild's start), else None."""
    state = host_cache_state(context)
    if state is None or state.slot_views is None:
        return None
    lowest = hit.num_cached_tokens - state.replay_span  # a restore at or below it computes more than the rebuild
    blocks = [k for k in range(len(hit.block_hashes), 0, -1) if k * hit.block_size > lowest]
    found = state.cache.find([hit.block_hashes[k - 1] for k in blocks])
    request_id = hit.request.request_id
    first_look = request_id not in state.looked_up  # an admission retried (no room yet) counts once
    state.looked_up.add(request_id)
    stats = state.cache.stats
    if found is None:
        stats.misses.inc(first_look)
        state.pending_restores.pop(request_id, None)
        return None
    stats.hits.inc(first_look)
    restored = blocks[found[0]] * hit.block_size
    state.pending_restores[request_id] = (restored, found[1])
    return restored


@hookimpl
def deepinfer_first_chunk_end(request: Request, start: int, end: int, block_size: int,
                              context: EngineContext | None) -> int | None:
    """With ``swa_host_cache_split_prefill``: a chunk that finishes the request's tokens ends on their last block
    boundary when both parts are at least ``min_chunk`` long (the step then leaves the state there to keep)."""
    state = host_cache_state(context)
    if state is None or not state.split_prefill or end != request.num_tokens:
        return None
    boundary = (end - 1) // block_size * block_size
    if boundary - start < state.min_chunk or end - boundary < state.min_chunk:
        return None
    return boundary


@hookimpl
def deepinfer_before_step(engine, scheduler_output) -> None:
    """Copy the slots the last step left on a block boundary, write restored states into the slots of requests
    starting from one, and note this step's chunks that end on a boundary."""
    state = host_cache_state(engine.context)
    if state is None or state.slot_views is None:
        return
    _flush(state)
    if state.looked_up or state.pending_restores:  # requests admitted since the last step
        for chunk in scheduler_output.chunks:
            request = chunk.request
            state.looked_up.discard(request.request_id)
            pending = state.pending_restores.pop(request.request_id, None)
            if pending is not None and pending[0] == chunk.start:
                state.cache.restore(pending[1], state.slot_views(request.slot))
    state.captures = [_capture(chunk.request, chunk.end, state.block_size) for chunk in scheduler_output.chunks
                      if chunk.end % state.block_size == 0 and not getattr(chunk, "draft_token_ids", None)]


@hookimpl
def deepinfer_after_step(engine) -> None:
    """Copy the last step's boundary slots now when no later step was launched (else the next step's
    ``deepinfer_before_step`` does, before that step runs)."""
    state = host_cache_state(engine.context)
    if state is not None and state.slot_views is not None and not engine.step_in_flight:
        _flush(state)


def _capture(request: Request, end: int, block_size: int) -> Capture:
    hashed = len(request.block_hashes) * block_size
    parent = request.block_hashes[-1] if request.block_hashes else b""
    return Capture(request, request.slot, end, hashed, parent)


def _flush(state: HostCacheState) -> None:
    """Store every noted capture under the hash of its boundary block (tokens the host does not have: skipped)."""
    captures, state.captures = state.captures, []
    for capture in captures:
        tokens = capture.request.token_slice(capture.hashed, capture.end)
        if len(tokens) != capture.end - capture.hashed:
            continue
        digest = chain_hashes(tokens, state.block_size, capture.parent)[-1] if tokens else capture.parent
        state.cache.store(digest, state.slot_views(capture.slot))


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

"""The ``deepinfer.plugins`` entry point ``swa_replay``: SWA bounded replay of prefix-cache hits.

Enabled per engine by the feature option ``enable_swa_replay`` (``LLM(..., enable_swa_replay=True)``,
``--option enable_swa_replay=true``). Without it the engine keeps the exact rebuild: outputs after a hit equal a
cold run.

With it, a request admitted with a prefix hit (``deepinfer_adopt_prefix_hit``) adopts at most
``L - (window + 6)`` tokens of its L-token input, rounded down to a block boundary, and nothing when that is not
above the window; ``deepinfer_rebuild_sliding_window`` then recomputes the ``window`` tokens before the adopted
hit with the attention window truncated to them (the engine reads no key below the replay start:
``ForwardBatch.sliding_floor``; compressed entries below the hit come from the cache:
``ForwardBatch.compressed_write_start``). A preempted request that comes back takes the same path.

Per-engine state: ``deepinfer_configure`` puts a ``ReplayStats`` in ``context.plugin_state["swa_replay"]`` for an
engine built with the option; the prefix-hit hooks act only for a context that holds one (``stats(llm.context)``).
Every backend: the plugin only changes which tokens the scheduler computes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deepinfer_core.engine.prefix_replay import PrefixHit
from deepinfer_core.engine_context import EngineContext
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.options import parse_flag as read_flag
from deepinfer_swa_replay.errors import SwaReplayOptionError
from deepinfer_swa_replay.policy import BoundedReplay
from deepinfer_swa_replay.stats import ReplayStats

DEEPINFER_HOOK_API_VERSION = 1

OPTION = "enable_swa_replay"
KEY = "swa_replay"  # our entry-point name: the key of our state in context.plugin_state

def parse_flag(value: Any) -> bool:
    """The option's value as a bool: a bool, 0 / 1, or "true" / "false" / "1" / "0" / "on" / "off" / "yes" / "no"."""
    flag = read_flag(value)
    if flag is not None:
        return flag
    raise SwaReplayOptionError(f"option {OPTION} must be a boolean (true/false, 1/0), got {value!r}")


def stats(context: EngineContext | None) -> ReplayStats | None:
    """The ``ReplayStats`` of ``context``'s engine, or None when bounded replay is off for it."""
    found = context.plugin_state.get(KEY) if context is not None else None
    return found if isinstance(found, ReplayStats) else None


@hookimpl
def deepinfer_feature_options() -> dict[str, str]:
    return {OPTION: "SWA bounded replay: prefix hits adopt at most L - (window + 6) tokens and recompute only the "
                    "window before them (approximate; see deepinfer_swa_replay)"}


@hookimpl
def deepinfer_configure(options: Mapping[str, Any], context: EngineContext) -> None:
    """Give an engine built with ``enable_swa_replay`` its ``ReplayStats`` (which also marks the mode on)."""
    if OPTION in options and parse_flag(options[OPTION]):
        context.plugin_state[KEY] = ReplayStats()


@hookimpl
def deepinfer_adopt_prefix_hit(hit: PrefixHit, context: EngineContext | None) -> int | None:
    """At most ``L - (window + 6)`` tokens of the hit, whole blocks, more than the window; else none."""
    counts = stats(context)
    if counts is None:
        return None
    adopted = BoundedReplay(hit.sliding_window).adopted(hit.request.num_tokens, hit.num_cached_tokens, hit.block_size)
    counts.record(hit.num_cached_tokens, adopted, min(adopted, hit.sliding_window))
    return adopted


@hookimpl
def deepinfer_rebuild_sliding_window(num_cached_tokens: int, sliding_window: int,
                                     context: EngineContext | None) -> int | None:
    """Recompute only the ``window`` tokens before the adopted hit."""
    if stats(context) is None:
        return None
    return BoundedReplay(sliding_window).start(num_cached_tokens)

"""Where a request starts computing after a prefix-cache hit, and how much of the hit it adopts.

The cache keeps what a block of tokens leaves behind that is shareable (a V4 model: compressed entries and indexer
keys); per-sequence state (sliding windows, compressor carries) is rebuilt by recomputing the tokens before the hit.
The model says how many tokens an exact rebuild needs (``CausalLM.prefix_replay_span``). Plugins may change two
decisions, in this order: how many tokens of the hit the request adopts (``deepinfer_adopt_prefix_hit``; default:
all) and where the rebuild starts (``deepinfer_rebuild_sliding_window``; default: the exact rebuild), e.g. bounded
replay.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from deepinfer_core.engine.request import Request
from deepinfer_core.errors import PluginReturnError
from deepinfer_core.plugins import call_hook

if TYPE_CHECKING:
    from deepinfer_core.engine_context import EngineContext


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """A prefix-cache hit of a request being admitted, as the prefix-hit hooks see it."""

    #: the request being admitted (``num_tokens``: its prompt plus any tokens it generated before a preemption)
    request: Request
    #: tokens of the request whose blocks the cache holds (a multiple of ``block_size``; at most ``num_tokens - 1``)
    num_cached_tokens: int
    #: tokens per cache block: an adopted hit is a whole number of blocks
    block_size: int
    #: the model's attention window in tokens (128 for DeepSeek-V4)
    sliding_window: int
    #: tokens the exact rebuild recomputes before a hit (``CausalLM.prefix_replay_span``)
    replay_span: int


@dataclasses.dataclass(frozen=True)
class ReplayPlan:
    """What the scheduler does with a hit: adopt its first ``adopted`` tokens, compute from ``start``."""

    adopted: int
    start: int


class PrefixReplay:
    """The adopted length and replay start of a prefix hit: the plugins' choice, else all of it and the exact
    rebuild."""

    def __init__(self, replay_span: int, sliding_window: int, plugin_manager=None, context: EngineContext | None = None):
        self.replay_span = replay_span
        self.sliding_window = sliding_window
        self.plugin_manager = plugin_manager
        self.context = context

    def plan(self, request: Request, num_cached_tokens: int, block_size: int) -> ReplayPlan:
        """How ``request``, whose first ``num_cached_tokens`` tokens hit the cache, uses the hit."""
        hit = PrefixHit(request, num_cached_tokens, block_size, self.sliding_window, self.replay_span)
        adopted = self._adopted(hit)
        if adopted == 0:
            return ReplayPlan(0, 0)
        return ReplayPlan(adopted, self.start(hit, adopted))

    def start(self, hit: PrefixHit, num_cached_tokens: int) -> int:
        """The first token to compute when the first ``num_cached_tokens`` tokens of ``hit`` are adopted."""
        if self.plugin_manager is not None:
            start = call_hook(self.plugin_manager, "deepinfer_rebuild_sliding_window", request=hit.request,
                              num_cached_tokens=num_cached_tokens, sliding_window=self.sliding_window,
                              hit=hit, context=self.context)
            if start is not None:
                if not 0 <= start <= num_cached_tokens:
                    raise PluginReturnError(f"deepinfer_rebuild_sliding_window returned {start}, outside "
                                            f"[0, {num_cached_tokens}]")
                return start
        return max(0, num_cached_tokens - self.replay_span)

    def _adopted(self, hit: PrefixHit) -> int:
        """The plugins' ``deepinfer_adopt_prefix_hit`` answer, checked, else the whole hit."""
        if self.plugin_manager is None:
            return hit.num_cached_tokens
        adopted = call_hook(self.plugin_manager, "deepinfer_adopt_prefix_hit", hit=hit, context=self.context)
        if adopted is None:
            return hit.num_cached_tokens
        if not 0 <= adopted <= hit.num_cached_tokens or adopted % hit.block_size:
            raise PluginReturnError(
                f"deepinfer_adopt_prefix_hit returned {adopted}: expected a multiple of the block size "
                f"{hit.block_size} in [0, {hit.num_cached_tokens}]")
        return adopted

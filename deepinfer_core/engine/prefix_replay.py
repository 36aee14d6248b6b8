"""Where a request starts computing after a prefix-cache hit, and how much of the hit it adopts.

The cache keeps what a block of tokens leaves behind that is shareable (a V4 model: compressed entries and indexer
keys); per-sequence state (sliding windows, compressor carries) is rebuilt by recomputing the tokens before the hit.
The model says how many tokens an exact rebuild needs (``CausalLM.prefix_replay_span``). The engine's prefix state
cache (``engine/prefix_state_cache.py``, device memory) may instead restore that state from a copy taken at one of the
hit's block boundaries (or inside the block after them: a prompt's all but last token), then plugins may
(``deepinfer_restore_prefix_state``, e.g. the SWA host cache in host memory): the request adopts the restored tokens and computes from there, reading the restored window. Else plugins may change
two decisions, in this order: how many tokens of the hit the request adopts (``deepinfer_adopt_prefix_hit``; default: all) and where the
rebuild starts (``deepinfer_rebuild_sliding_window``; default: the exact rebuild), e.g. bounded replay. A plugin may
also end an admitted request's first chunk early (``deepinfer_first_chunk_end``), e.g. on a block boundary whose
state it keeps; without a plugin's answer the prefix state cache's split policy decides.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from deepinfer_core.engine.prefix_state_cache import PrefixStateKeeper
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
    #: prefix-cache hash of each cached block: ``block_hashes[k - 1]`` identifies the first ``k * block_size`` tokens
    block_hashes: tuple[bytes, ...] = ()


@dataclasses.dataclass(frozen=True)
class ReplayPlan:
    """What the scheduler does with a hit: adopt its first ``adopted`` tokens, compute from ``start``, reading no
    sliding-window key below ``sliding_floor`` (``start`` for a rebuild; 0 when the window was restored)."""

    adopted: int
    start: int
    sliding_floor: int


class PrefixReplay:
    """The adopted length and replay start of a prefix hit: the plugins' choice, else all of it and the exact
    rebuild."""

    def __init__(self, replay_span: int, sliding_window: int, plugin_manager=None, context: EngineContext | None = None,
                 state_cache: PrefixStateKeeper | None = None):
        self.replay_span = replay_span
        self.sliding_window = sliding_window
        self.plugin_manager = plugin_manager
        self.context = context
        self.state_cache = state_cache

    def plan(self, request: Request, num_cached_tokens: int, block_size: int,
             block_hashes: tuple[bytes, ...] = ()) -> ReplayPlan:
        """How ``request``, whose first ``num_cached_tokens`` tokens hit the cache (blocks ``block_hashes``), uses
        the hit. The prefix state cache may restore a state kept inside the block after the hit's last one (the same
        prompt again: all tokens but the last), also for a request without a block hit (``num_cached_tokens`` 0:
        only the prefix state cache is asked)."""
        hit = PrefixHit(request, num_cached_tokens, block_size, self.sliding_window, self.replay_span,
                        tuple(block_hashes))
        restored = (self.state_cache.lookup(request, num_cached_tokens, hit.block_hashes)
                    if self.state_cache is not None else 0)
        if not restored and num_cached_tokens:
            restored = self._restored(hit)
        if restored or not num_cached_tokens:
            return ReplayPlan(restored, restored, 0)
        adopted = self._adopted(hit)
        if adopted == 0:
            return ReplayPlan(0, 0, 0)
        start = self.start(hit, adopted)
        return ReplayPlan(adopted, start, start)

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

    def first_chunk_end(self, request: Request, start: int, end: int, block_size: int) -> int:
        """Where the first chunk ``[start, end)`` of an admitted request ends: the plugins'
        ``deepinfer_first_chunk_end`` answer, else the prefix state cache's split (``PrefixStateKeeper.first_chunk_end``),
        checked; else ``end``."""
        if end - start <= 1:
            return end
        chosen = None
        if self.plugin_manager is not None:
            chosen = call_hook(self.plugin_manager, "deepinfer_first_chunk_end", request=request, start=start, end=end,
                               block_size=block_size, context=self.context)
        if chosen is None and self.state_cache is not None:
            chosen = self.state_cache.first_chunk_end(request, start, end)
        if chosen is None:
            return end
        if not start < chosen <= end:
            raise PluginReturnError(f"deepinfer_first_chunk_end returned {chosen}, outside ({start}, {end}]")
        return chosen

    def _restored(self, hit: PrefixHit) -> int:
        """The plugins' ``deepinfer_restore_prefix_state`` answer, checked, else 0 (nothing restored)."""
        if self.plugin_manager is None:
            return 0
        restored = call_hook(self.plugin_manager, "deepinfer_restore_prefix_state", hit=hit, context=self.context)
        if restored is None:
            return 0
        if not 0 < restored <= hit.num_cached_tokens or restored % hit.block_size:
            raise PluginReturnError(
                f"deepinfer_restore_prefix_state returned {restored}: expected a positive multiple of the block size "
                f"{hit.block_size} up to {hit.num_cached_tokens}")
        return restored

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

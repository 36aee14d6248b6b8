"""Where a request starts computing after a prefix-cache hit.

The cache keeps what a block of tokens leaves behind that is shareable (a V4 model: compressed entries and indexer
keys); per-sequence state (sliding windows, compressor carries) is rebuilt by recomputing the tokens before the hit.
The model says how many tokens an exact rebuild needs (``CausalLM.prefix_replay_span``); a plugin may choose another
start through the ``deepinfer_rebuild_sliding_window`` hook (e.g. bounded replay).
"""

from __future__ import annotations

from deepinfer_core.engine.request import Request
from deepinfer_core.plugins import call_hook


class PrefixReplay:
    """The replay start of a prefix hit: a plugin's choice, else the model's exact rebuild."""

    def __init__(self, replay_span: int, sliding_window: int, plugin_manager=None):
        self.replay_span = replay_span
        self.sliding_window = sliding_window
        self.plugin_manager = plugin_manager

    def start(self, request: Request, num_cached_tokens: int) -> int:
        """The first token to compute for ``request`` whose first ``num_cached_tokens`` tokens hit the cache."""
        if self.plugin_manager is not None:
            start = call_hook(self.plugin_manager, "deepinfer_rebuild_sliding_window",
                              request=request, num_cached_tokens=num_cached_tokens, sliding_window=self.sliding_window)
            if start is not None:
                if not 0 <= start <= num_cached_tokens:
                    raise ValueError(f"rebuild_sliding_window returned {start}, outside [0, {num_cached_tokens}]")
                return start
        return max(0, num_cached_tokens - self.replay_span)

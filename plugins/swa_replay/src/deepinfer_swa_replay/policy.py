"""``BoundedReplay``: how much of a prefix hit a request adopts, and where its sliding-window rebuild starts.

DeepSeek's reference engine does not rebuild the sliding-window KV of a prefix hit exactly (that needs
``num_layers x window`` tokens of replay); it recomputes only the ``window`` tokens before the hit, with every
layer's window truncated to them, and uses the result as approximate window KV: the cost is constant in the context
length and the depth. It keeps ``window + rollback`` tokens after the hit (128 + 6 = 134 for V4: 6 tokens of
speculative rollback), so the longest usable hit of an L-token input is ``L - 134``. A hit of ``window`` tokens or
fewer is not adopted (there is nothing below the replay to reuse; vLLM PR 56227 does the same).
"""

from __future__ import annotations

import dataclasses

ROLLBACK_TOKENS = 6
"""Tokens kept after the hit, beyond the window, so a speculative rollback of up to 6 tokens stays possible."""


@dataclasses.dataclass(frozen=True)
class BoundedReplay:
    """Bounded replay for a model whose attention window is ``window`` tokens."""

    window: int
    rollback: int = ROLLBACK_TOKENS

    @property
    def reserve(self) -> int:
        """Tokens of an input that are never adopted from the cache: its last ``window + rollback``."""
        return self.window + self.rollback

    def adopted(self, num_tokens: int, num_cached_tokens: int, block_size: int) -> int:
        """Tokens adopted from a hit of ``num_cached_tokens`` on an input of ``num_tokens``: at most
        ``num_tokens - reserve``, rounded down to a block boundary; 0 when that is not above the window."""
        usable = (num_tokens - self.reserve) // block_size * block_size
        adopted = min(num_cached_tokens, usable)
        return adopted if adopted > self.window else 0

    def start(self, num_adopted_tokens: int) -> int:
        """The first token recomputed before an adopted hit: the last ``window`` tokens before it."""
        return max(0, num_adopted_tokens - self.window)

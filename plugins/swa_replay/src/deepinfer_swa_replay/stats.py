"""``ReplayStats``: what bounded replay did in one engine (kept in the engine context's ``plugin_state``)."""

from __future__ import annotations

import dataclasses


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

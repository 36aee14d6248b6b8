"""Confidence-scheduled verification: which draft prefixes one step verifies within a token budget.

Sequence ``s`` drafted tokens with confidences ``c[s][0..k)``: ``c[s][j]`` estimates the chance that token ``j`` is
accepted given that the tokens before it were. Verifying the prefix of length ``L`` accepts, in expectation,
``sum_{j < L} prod_{i <= j} c[s][i]`` tokens, so extending a prefix from ``L`` to ``L + 1`` gains
``prod_{i <= L} c[s][i]``. Gains never increase along a prefix (each factor is at most 1), so taking the largest
gain across the batch one token at a time is optimal for the budget (an exchange argument: any allocation can swap
a token for a larger available gain without breaking a prefix).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def allocate_verification(confidences: Sequence[Sequence[float]], budget: int) -> list[int]:
    """Prefix lengths to verify per sequence (``sum <= budget``) maximising the expected accepted tokens.

    ``confidences``: per sequence, its draft tokens' confidences in ``[0, 1]`` (any length; a tensor ``[S, k]``
    works too). Ties go to the lower sequence index; a gain of 0 is never taken.
    """
    if budget < 0:
        raise ValueError(f"the verification budget must be >= 0 tokens, got {budget}")
    rows = [[float(c) for c in row] for row in confidences]
    for s, row in enumerate(rows):
        bad = [c for c in row if not 0.0 <= c <= 1.0]
        if bad:
            raise ValueError(f"confidences must lie in [0, 1]; sequence {s} has {bad[0]}")
    lengths = [0] * len(rows)
    heap = [(-row[0], s) for s, row in enumerate(rows) if row and row[0] > 0]  # (-gain of the next token, sequence)
    heapq.heapify(heap)
    gains = [row[0] if row else 0.0 for row in rows]
    while budget > 0 and heap:
        _, s = heapq.heappop(heap)
        lengths[s] += 1
        budget -= 1
        row = rows[s]
        if lengths[s] < len(row):
            gains[s] *= row[lengths[s]]
            if gains[s] > 0:
                heapq.heappush(heap, (-gains[s], s))
    return lengths


def expected_accepted(confidences: Sequence[Sequence[float]], lengths: Sequence[int]) -> float:
    """``sum_s sum_{j < lengths[s]} prod_{i <= j} c[s][i]``: the expected accepted tokens of an allocation."""
    total = 0.0
    for row, length in zip(confidences, lengths, strict=True):
        gain = 1.0
        for c in list(row)[:length]:
            gain *= float(c)
            total += gain
    return total

"""Which rank runs which request: spread by outstanding tokens (prompt + tokens still to generate)."""

from __future__ import annotations

from collections.abc import Sequence


def outstanding_tokens(num_prompt_tokens: int, max_tokens: int | None, n: int, max_model_len: int) -> int:
    """Tokens a request may still put through a rank: ``n`` completions of prompt + ``max_tokens`` (else up to
    ``max_model_len``)."""
    longest = max_model_len if max_tokens is None else min(num_prompt_tokens + max_tokens, max_model_len)
    return n * max(longest, num_prompt_tokens)


def spread_requests(costs: Sequence[int], world_size: int) -> list[int]:
    """The rank of each request: largest first, each to the rank with the fewest outstanding tokens so far (ties: the
    lower rank; equal costs keep input order). Every rank computes the same answer from the same costs."""
    load = [0] * world_size
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[index] = rank
        load[rank] += costs[index]
    return owners

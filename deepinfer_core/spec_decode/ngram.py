"""vLLM's ``"ngram"`` proposer (prompt lookup decoding): find the sequence's last n tokens earlier in it and propose
the tokens that followed there. Deterministic, no model, no state.

Keys (vLLM's): ``prompt_lookup_max`` (longest n tried first, default 5) and ``prompt_lookup_min`` (shortest, default
1; the engine refuses ``min > max`` or ``min < 1``). For each n from the longest down, the latest earlier occurrence
of the last n tokens wins; the draft is the tokens after it, at most ``max_draft_len``.
"""

from __future__ import annotations

import array

from deepinfer_core.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from deepinfer_core.spec_decode.proposer import NO_DRAFT, Draft, DraftBatch, Proposer

NGRAM_KEYS = ("prompt_lookup_max", "prompt_lookup_min")
WORD = array.array("i").itemsize  # bytes per token id in the search


class NgramProposer(Proposer):
    """Prompt-lookup drafts (see module docstring)."""

    def __init__(self, config: SpeculativeConfig, target=None, context=None):
        self.max_n = config.options.get("prompt_lookup_max", 5)
        self.min_n = config.options.get("prompt_lookup_min", 1)
        for name, value in (("prompt_lookup_max", self.max_n), ("prompt_lookup_min", self.min_n)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpeculativeConfigError(f"speculative_config {name} must be an integer >= 1, got {value!r}")
        if self.min_n > self.max_n:
            raise SpeculativeConfigError(f"speculative_config prompt_lookup_min={self.min_n} is larger than "
                                         f"prompt_lookup_max={self.max_n}")

    def propose(self, batch: DraftBatch) -> list[Draft]:
        return [Draft(lookup(s.token_ids, self.min_n, self.max_n, s.max_draft_len)) if s.max_draft_len else NO_DRAFT
                for s in batch.sequences]


def lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The up to ``k`` tokens that followed the latest earlier occurrence of ``tokens``' last n tokens, for the
    largest n in ``[min_n, max_n]`` that occurs; ``[]`` when none does.

    The search runs in C: the ids as 4-byte words, ``bytes.rfind`` of the suffix's bytes among those before the last
    token, a hit not on a word boundary searched past (long contexts cost microseconds, not a Python loop per
    position)."""
    length = len(tokens)
    data = array.array("i", tokens).tobytes()  # 4 bytes per id
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        needle = data[WORD * (length - n):]
        end = WORD * (length - 1)  # an occurrence must end before the last token (not the suffix itself)
        while (found := data.rfind(needle, 0, end)) >= 0:
            if found % WORD == 0:
                start = found // WORD + n
                return tokens[start:start + k]
            end = found + len(needle) - 1
    return []

"""Request outputs, compatible with vLLM's ``vllm.outputs`` / ``vllm.logprobs`` classes.

``logprobs`` of a completion is a list with one dict per generated token, mapping token id to
``Logprob``; each dict holds the sampled token plus the requested top-n (so it has n or n + 1
entries). ``prompt_logprobs`` is the same per prompt token, with ``None`` for the first token (it
has no prediction). Log-probabilities are those of the raw model output (see ``sampling.sampler``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclasses.dataclass
class Logprob:
    """Log-probability of one token: ``rank`` 1 is the most likely; ``decoded_token`` its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request.

    Attributes:
        index: which of the request's ``n`` completions this is.
        text: generated text (stop string removed unless ``include_stop_str_in_output``).
        token_ids: generated token ids (a stop token id or EOS that ended it included).
        cumulative_logprob: sum of the sampled tokens' log-probabilities, or None if not tracked.
        logprobs: per generated token, token id -> ``Logprob``, or None if not requested.
        finish_reason: ``"stop"`` (EOS, stop token id or stop string), ``"length"``, or None while running.
        stop_reason: the stop string or stop token id that ended it; None for EOS / length / running.
    """

    index: int
    text: str
    token_ids: Sequence[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """Whether this completion has finished (vLLM's method name)."""
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """Everything generated for one request so far.

    Attributes:
        request_id: the request's id.
        prompt: the prompt text, or None if the request was given token ids.
        prompt_token_ids: the prompt ids.
        prompt_logprobs: per prompt token (first is None), or None if not requested.
        outputs: one ``CompletionOutput`` per completion (``n`` of them).
        finished: whether every completion has finished.
        error: why the engine refused the request (then ``outputs`` is empty), else None.
        num_cached_tokens: prompt tokens that came from the prefix cache (whole blocks; with a plugin that adopts
            only part of a hit, the adopted part), taken from the request's latest admission (after a preemption,
            the re-admission's) and, for ``n > 1``, from the first completion's; None for a refused request.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    num_cached_tokens: int | None = None


def make_logprobs_dict(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    ranks: Sequence[int],
    decode: Callable[[int], str] | None = None,
) -> dict[int, Logprob]:
    """One position's token id -> ``Logprob`` dict, the first id (the sampled one) first.

    Pass the sampled token first, then the top-n (``top_token_ids`` / ``top_logprobs`` of the
    sampler with ranks 1..n); a repeated id keeps its first entry. ``decode`` fills ``decoded_token``.
    """
    out: dict[int, Logprob] = {}
    for token_id, logprob, rank in zip(token_ids, logprobs, ranks, strict=True):
        token_id = int(token_id)
        if token_id not in out:
            text = decode(token_id) if decode is not None else None
            out[token_id] = Logprob(float(logprob), int(rank), text)
    return out


def sample_logprobs_dict(
    sampled_id: int,
    sampled_logprob: float,
    sampled_rank: int,
    top_ids: Sequence[int],
    top_logprobs: Sequence[float],
    decode: Callable[[int], str] | None = None,
) -> dict[int, Logprob]:
    """The dict for one generated token: the sampled token plus the top-n (ranks 1..n)."""
    ids = [sampled_id, *top_ids]
    lps = [sampled_logprob, *top_logprobs]
    ranks = [sampled_rank, *range(1, len(top_ids) + 1)]
    return make_logprobs_dict(ids, lps, ranks, decode)

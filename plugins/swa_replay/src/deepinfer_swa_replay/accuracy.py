"""``ReplayAccuracy``: how far outputs after a bounded-replay hit are from outputs after an exact hit.

Bounded replay is approximate by design. ``measure`` runs the same prompts through two engines of one checkpoint,
one with exact reuse (the default: equal to a cold run) and one with ``enable_swa_replay``; each prompt is sent
twice, so the second request hits the cache the first filled, and the second requests' greedy outputs are compared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from deepinfer_core.outputs import RequestOutput
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_swa_replay.errors import SwaReplayError


@dataclasses.dataclass(frozen=True)
class ReplayAccuracy:
    """Differences of the bounded-replay outputs from the exact ones, over ``samples`` prompts."""

    samples: int
    #: largest |logprob difference| over the exact run's top-k tokens at the first sampled position
    max_first_token_diff: float
    #: mean over prompts of that position's largest difference
    mean_first_token_diff: float
    #: largest |logprob difference| of a chosen token, over positions where both runs had the same context
    max_chosen_diff: float
    #: mean fraction of generated tokens equal to the exact run's before the first divergence
    greedy_agreement: float
    #: fraction of prompts whose whole greedy completion is identical
    identical: float


def greedy_params(max_tokens: int, top_k: int) -> SamplingParams:
    """Greedy decoding of ``max_tokens`` tokens with the ``top_k`` largest logprobs of every position."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=top_k)


def after_hit(llm: Any, prompt: Sequence[int], params: SamplingParams) -> RequestOutput:
    """The output of ``prompt`` sent a second time to ``llm`` (the first fills the prefix cache)."""
    llm.generate({"prompt_token_ids": list(prompt)}, params, use_tqdm=False)
    return llm.generate({"prompt_token_ids": list(prompt)}, params, use_tqdm=False)[0]


def compare(exact: RequestOutput, replay: RequestOutput) -> tuple[float, float, float, bool]:
    """(first-position top-k difference, largest chosen-token difference before divergence, agreed fraction,
    identical) of one prompt's two outputs."""
    a, b = exact.outputs[0], replay.outputs[0]
    first = max(abs(lp.logprob - b.logprobs[0][t].logprob) for t, lp in a.logprobs[0].items() if t in b.logprobs[0])
    chosen, agreed = 0.0, 0
    for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):  # position i: both contexts are equal
        if ta in b.logprobs[i]:
            chosen = max(chosen, abs(a.logprobs[i][ta].logprob - b.logprobs[i][ta].logprob))
        if ta != tb:
            break
        agreed += 1
    return first, chosen, agreed / len(a.token_ids), a.token_ids == b.token_ids


def measure(exact_llm: Any, replay_llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int = 16,
            top_k: int = 20) -> ReplayAccuracy:
    """Compare greedy outputs after a prefix hit of ``replay_llm`` (bounded replay) with ``exact_llm``'s."""
    params = greedy_params(max_tokens, top_k)
    rows = [compare(after_hit(exact_llm, p, params), after_hit(replay_llm, p, params)) for p in prompts]
    if not rows:
        raise SwaReplayError("measure needs at least one prompt")
    firsts, chosen, agreed, same = zip(*rows)
    return ReplayAccuracy(len(rows), max(firsts), sum(firsts) / len(rows), max(chosen), sum(agreed) / len(rows),
                          sum(same) / len(rows))

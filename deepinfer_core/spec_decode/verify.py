"""Verification of draft tokens against the target model: one pure function of the target's logits, the sampling
metadata of every verified position and the drafts.

Rows: a sequence with a draft of ``d`` tokens has ``d + 1`` consecutive rows; row ``j < d`` holds the target's logits
at the position before draft token ``j`` (it verifies it), row ``d`` the position after the last draft token (the
bonus). Each row's ``SamplingMetadata`` is what sampling that position without speculation would use (its position,
its output tokens including the draft tokens before it), so every sampling control applies at every verified
position as it would without speculation.

The rule, per row in order, stopping at the first rejection:

* the target's own sample ``t`` of the row is drawn by the ordinary sampler (``sampling/sampler.py``: argmax for
  greedy rows, Gumbel-max with counter-based noise of (seed, position) for random rows);
* a deterministic draft token ``x`` (``draft_probs`` None, ``q`` one-hot) is accepted iff ``t == x``; on rejection
  ``t`` is emitted. For a random row this *is* the standard rule: ``P(t == x) = p(x) = min(1, p(x) / q(x))``, and
  ``t`` given ``t != x`` follows ``normalize(max(p - q, 0))``. For a greedy row it is "keep while equal to the
  argmax". So with deterministic drafts every emitted token is the token sampling without speculation would give at
  that position with the same seed, bit for bit;
* a draft with ``draft_probs`` ``q`` on a random row: accept ``x`` iff ``u <= p(x) / q(x)`` with ``u`` uniform from
  the counter-based noise of (seed ^ ``ACCEPT_STREAM``, position); on rejection emit ``argmax(log(max(p - q, 0)) +
  gumbel(seed, position))`` (a sample of the normalized residual). Greedy rows treat it as deterministic;
* after the last draft token is accepted, the bonus row's ``t`` is emitted.

``p`` is the distribution the sampler draws random rows from (``sampler.sampling_probs``: processed logits over the
temperature, top-k / top-p / min-p filtered).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from deepinfer_core.device_copy import to_device
from deepinfer_core.sampling.noise import gumbel_noise, to_int64_seed, uniform_noise
from deepinfer_core.sampling.sampler import (
    SamplerOutput,
    SamplingMetadata,
    argmax_lowest,
    logprob_output,
    processed_logits,
    sample,
    sampling_probs,
)

ACCEPT_STREAM = to_int64_seed(0xA5C3_9E37_79B9_7F4A)
"""XOR-ed into a row's seed for the acceptance draw ``u`` (a stream apart from the sampling noise)."""


@dataclasses.dataclass
class VerifyOutput:
    """``sampler_output``: one row per input row, the token emitted at that position (valid for the first
    ``num_emitted[g]`` rows of group ``g``); ``num_emitted`` int64 ``[num_groups]``: accepted draft tokens + 1."""

    sampler_output: SamplerOutput
    num_emitted: torch.Tensor


def group_rows(draft_token_ids: Sequence[Sequence[int]]) -> list[int]:
    """The group of every row: ``[0] * (len(d0) + 1) + [1] * (len(d1) + 1) + ...``."""
    return [g for g, draft in enumerate(draft_token_ids) for _ in range(len(draft) + 1)]


def verify(logits: torch.Tensor, metadata: SamplingMetadata, draft_token_ids: Sequence[Sequence[int]],
           draft_probs: Sequence[torch.Tensor | None] | None = None,
           greedy: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None = None) -> VerifyOutput:
    """Verify drafts (see module docstring). ``logits`` float32 ``[R, vocab]`` with ``R = sum(len(d) + 1)``;
    ``metadata``: ``R`` rows; ``draft_probs[g]``: ``[len(d_g), vocab]`` or None; ``greedy``: the backend's
    ``greedy_sample`` op for plain greedy steps."""
    device = logits.device
    groups = group_rows(draft_token_ids)
    if len(groups) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows for drafts needing {len(groups)} (a draft of d tokens "
                         "has d + 1 rows)")
    out = sample(logits, metadata, greedy=greedy)
    targets = out.sampled_token_ids  # [R]
    drafted = [t for draft in draft_token_ids for t in (*draft, -1)]  # [R]; -1 on bonus rows
    host = torch.tensor([drafted, groups, _offsets(draft_token_ids)], dtype=torch.long)  # [3, R]
    drafted_t, group_t, offset_t = to_device(host, device).unbind(0)  # [R] each
    accept = targets == drafted_t  # [R]; never on bonus rows
    probabilistic = [g for g, q in enumerate(draft_probs or ()) if q is not None and draft_token_ids[g]]
    if probabilistic and not metadata.row_kinds().all_greedy:
        emitted, accept = _rejection_sample(logits, metadata, draft_token_ids, draft_probs, probabilistic, groups,
                                            targets, accept)
        out = logprob_output(logits, emitted, metadata.num_logprobs)
    rejected = ~accept  # [R]; bonus rows count as the stop
    num_groups = len(draft_token_ids)
    first = torch.full((num_groups,), len(groups), dtype=torch.long, device=device)
    first = first.scatter_reduce(0, group_t[rejected], offset_t[rejected], reduce="amin")  # [G]
    return VerifyOutput(out, first + 1)


def _offsets(draft_token_ids: Sequence[Sequence[int]]) -> list[int]:
    return [j for draft in draft_token_ids for j in range(len(draft) + 1)]


def _rejection_sample(logits, metadata, draft_token_ids, draft_probs, probabilistic, groups, targets, accept):
    """Emitted tokens and acceptances ``[R]`` with the ``u <= p(x) / q(x)`` rule on the random rows of the drafts
    that carry ``q``."""
    device = logits.device
    starts = [0]
    for draft in draft_token_ids:
        starts.append(starts[-1] + len(draft) + 1)
    rows = [starts[g] + j for g in probabilistic for j in range(len(draft_token_ids[g]))]
    rows_t = to_device(torch.tensor(rows, dtype=torch.long), device)  # [M]
    q = torch.cat([draft_probs[g].to(device=device, dtype=torch.float32) for g in probabilistic])  # [M, V]
    x = to_device(torch.tensor([t for g in probabilistic for t in draft_token_ids[g]], dtype=torch.long), device)
    p = sampling_probs(processed_logits(logits.float(), metadata), metadata)[rows_t]  # [M, V]
    seeds, positions = metadata.seeds.to(device)[rows_t], metadata.positions.to(device)[rows_t]  # [M]
    u = uniform_noise(seeds ^ ACCEPT_STREAM, positions, 1)[:, 0]  # [M] float64
    px, qx = p.gather(1, x[:, None])[:, 0].double(), q.gather(1, x[:, None])[:, 0].double()  # [M]
    accepted = u * qx <= px  # u <= p(x) / q(x), q(x) > 0 (checked when the draft arrives)
    residual = (p - q).clamp(min=0)  # [M, V]
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)  # p == q: never rejected
    recovered = argmax_lowest(residual.double().log() + gumbel_noise(seeds, positions, p.shape[1]))  # [M]
    random_row = metadata.temperature.to(device)[rows_t] > 0  # [M]; greedy rows keep the argmax rule
    emitted = targets.clone()
    emitted[rows_t] = torch.where(random_row, torch.where(accepted, x, recovered), targets[rows_t])
    accept = accept.clone()
    accept[rows_t] = torch.where(random_row, accepted, accept[rows_t])
    return emitted, accept

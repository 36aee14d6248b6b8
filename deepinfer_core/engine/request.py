"""A request inside the engine: its tokens, how far its state has been computed, where it lives."""

from __future__ import annotations

import dataclasses
import enum

from deepinfer_core.sampling.params import SamplingParams

INFLIGHT_PLACEHOLDER = 0  # host-side id of an in-flight token; never reaches the model (the runner fills it)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """One completion being generated (a prompt with ``n`` samples becomes ``n`` requests).

    The scheduler only looks at token counts: ``num_computed_tokens`` of ``all_token_ids`` are folded
    into the request's state; the step computes the next chunk. Tokens below ``replay_until`` are
    recomputed only to rebuild the sliding-window state after a prefix-cache hit (their compressed
    entries come from the cache; a hit restored inside a block sets it to that block's start: the entries its
    restored tokens completed were copied in, and the later ones are written as they complete); ``sliding_floor`` is the first token such a replay started from (0 also when a
    plugin restored the window instead: ``deepinfer_restore_prefix_state``). ``admitted_from`` is the token its
    latest admission started computing from.
    ``num_cached_tokens`` is the prefix-cache hit its latest admission adopted (a plugin may adopt only part of a
    hit); ``RequestOutput.num_cached_tokens`` reports it.

    ``num_inflight_tokens`` counts tokens a launched step samples that the host has not read yet (with
    asynchronous scheduling, the next step is planned before the last one's tokens are back): they count in
    ``num_tokens``, and a step that takes one as input reads it on the device (``input_tokens``).

    ``draft_token_ids`` are a proposer's guesses of the tokens after the newest one (speculative decoding,
    ``deepinfer_core/spec_decode``): they count in ``num_tokens``, right after the known tokens (a draft is only made
    when no token is in flight; the token a step verifying it samples comes after it), so the next step computes them
    like any other token and verifies them; the scheduler replaces them with the accepted ones.

    Text and logprobs are not kept here: the output processor (``engine/output_processor.py``) keeps them.
    """

    request_id: str
    group_id: str
    sample_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" / "length" once finished
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_computed_tokens: int = 0
    replay_until: int = 0
    sliding_floor: int = 0
    admitted_from: int = 0
    num_cached_tokens: int = 0
    slot: int | None = None
    block_ids: list[int] = dataclasses.field(default_factory=list)
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)
    num_preemptions: int = 0
    num_inflight_tokens: int = 0
    bad_words_token_ids: list[list[int]] = dataclasses.field(default_factory=list)  # params.bad_words, tokenized
    needs_host_tokens: bool = False  # a step sampling it needs its latest token on the host (penalties, ...)
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)  # unverified, after every other token
    draft_probs: object | None = None  # torch.Tensor [len(draft_token_ids), vocab], or None: deterministic drafts
    draft_num_proposed: int = 0  # tokens the proposer drafted (it may verify fewer: Draft.num_proposed)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without concatenating the whole prompt and output."""
        prompt_len = len(self.prompt_token_ids)
        head = self.prompt_token_ids[start:min(end, prompt_len)] if start < prompt_len else []
        tail = self.output_token_ids[max(start - prompt_len, 0):max(end - prompt_len, 0)]
        return head + tail

    def input_tokens(self, start: int, end: int) -> list[int]:
        """Token ids at positions ``[start, end)``; a position whose token is still on the device (in flight)
        reads ``INFLIGHT_PLACEHOLDER``, which the model runner overwrites on the device before the step runs."""
        known = self.token_slice(start, end)
        known_end = self.num_known_tokens
        drafts = self.draft_token_ids[max(start - known_end, 0):max(end - known_end, 0)]
        return known + drafts + [INFLIGHT_PLACEHOLDER] * (end - start - len(known) - len(drafts))

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host has (prompt and read outputs)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """All tokens, in-flight and draft ones included: what the scheduler plans with."""
        return self.num_known_tokens + self.num_inflight_tokens + len(self.draft_token_ids)

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    def drop_draft(self, keep: int = 0) -> None:
        """Keep only the first ``keep`` draft tokens (a step too small for the rest, a preemption: 0)."""
        del self.draft_token_ids[keep:]
        if self.draft_probs is not None:
            self.draft_probs = self.draft_probs[:keep] if keep else None

    @property
    def num_pending_tokens(self) -> int:
        """Tokens not yet folded into the state (the next step's work)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

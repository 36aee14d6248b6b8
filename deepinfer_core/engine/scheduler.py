"""Scheduling: which requests compute how many tokens this step.

The scheduler speaks token counts, not phases: every request catches ``num_computed_tokens`` up to
its token count within the step's token budget. A fresh prompt, a chunk of a long prompt, a replay
after a prefix hit, a decode token and a speculative draft (verified when computed, rejected tokens rewound in
``update``) are all "N more tokens for request R".
"""

from __future__ import annotations

import abc
import dataclasses
from collections import deque
from collections.abc import Mapping, Sequence

from deepinfer_core.engine.prefix_replay import PrefixReplay
from deepinfer_core.engine.request import Request, RequestStatus
from deepinfer_core.engine.state_manager import StateManager
from deepinfer_core.engine.stop import StopDecision, check_stop, reaches_length_limit


@dataclasses.dataclass
class ScheduledChunk:
    """``num_tokens`` tokens of ``request`` starting at ``start`` (its ``num_computed_tokens``)."""

    request: Request
    start: int
    num_tokens: int
    #: whether this chunk reaches the end of the request's tokens when planned, so a new token is sampled
    samples: bool = dataclasses.field(init=False)
    #: the request's draft tokens this chunk verifies (its last ones), with their draft probabilities (or None)
    draft_token_ids: list[int] = dataclasses.field(init=False)
    draft_probs: object | None = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.end == self.request.num_tokens
        self.draft_token_ids = list(self.request.draft_token_ids) if self.samples else []
        self.draft_probs = self.request.draft_probs if self.draft_token_ids else None

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def reads_inflight_token(self) -> bool:
        """Whether the chunk's last input token before its draft is still on the device (sampled by the step
        before)."""
        return self.end - len(self.draft_token_ids) > self.request.num_known_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether the step computes the log-probabilities of the prompt tokens this chunk covers."""
        return self.request.params.prompt_logprobs is not None and self.start < len(self.request.prompt_token_ids)


@dataclasses.dataclass
class SchedulerOutput:
    """One step's plan: the chunks to run (in batch order) and the requests preempted for it."""

    chunks: list[ScheduledChunk]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler(abc.ABC):
    """The scheduling interface: add requests, plan a step, take back the step's results."""

    @abc.abstractmethod
    def add(self, request: Request) -> None:
        """Queue a new request."""

    @abc.abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Plan the next step. Allocates the state the planned chunks need and advances each planned request's
        ``num_computed_tokens`` past its chunk; a chunk that samples adds an in-flight token to its request."""

    @abc.abstractmethod
    def update(self, output: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]]) -> list[Request]:
        """Take a step's results (``sampled``: request id -> new token, or new tokens in order: a verified draft's
        accepted tokens and the target's next one): append the tokens, rewind past rejected draft tokens, commit the
        computed blocks, finish the requests a token stops (``engine/stop.py``; later tokens of the step are dropped);
        return the requests that took a token, once per token taken.
        With asynchronous scheduling the next step has already been planned: a request that finished since keeps
        no later result of this step."""

    @abc.abstractmethod
    def finish_request(self, request: Request, reason: StopDecision) -> None:
        """End a request for a reason the scheduler cannot see (a stop string), releasing its state."""

    @abc.abstractmethod
    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""


PADDED_PER_BUDGET = 2  # prompt chunks of a step, padded to its longest, stay within this many token budgets


class FcfsScheduler(Scheduler):
    """Continuous batching, first come first served, chunked prefill, preemption by recompute.

    Running requests are served first in arrival order; waiting requests are admitted while the
    token budget (``max_num_batched_tokens``), the sequence limit (``max_num_seqs``) and free state
    allow. When a running request cannot get a block, the latest-arrived running request is
    preempted: its state is released and it recomputes later (prefix caching usually restores most).

    Without ``mixed_chunks`` (SGLang's default) a step that has prompt tokens to fold (a prompt chunk of a
    running request, or a waiting request that can be admitted) folds only those and the running requests'
    decodes wait for a step without prompt work; with it (vLLM's way) decodes ride along in every step. A decode
    beside a prompt chunk costs a separate pass over the weights here (a captured decode graph beside the eager
    prefill), while its sequences decode as many steps after the prompts either way.

    A step's prompt chunks (those of more than one token) are planned so that their count times the longest stays
    within ``PADDED_PER_BUDGET`` token budgets: the model's eager layout pads every chunk to the longest, and many
    short prompts beside one long chunk would otherwise take memory quadratic in the budget.
    """

    def __init__(self, state: StateManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 eos_token_id: int | None, prefix_replay: PrefixReplay, mixed_chunks: bool = False):
        self.mixed_chunks = mixed_chunks
        self.state = state
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.prefix_replay = prefix_replay
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        preempted: list[Request] = []
        if not self.mixed_chunks and self._has_prompt_work():
            output = self._plan(preempted, decodes=False)
            if output.chunks:
                return output
        return self._plan(preempted, decodes=True)

    def _has_prompt_work(self) -> bool:
        """Whether a running request has prompt tokens left to fold or the next waiting one may be admitted."""
        return any(_prompt_pending(r) for r in self.running if r.status == RequestStatus.RUNNING) or bool(
            self.waiting and len(self.running) < self.max_num_seqs and not self.waiting[0].num_inflight_tokens)

    def _plan(self, preempted: list[Request], decodes: bool) -> SchedulerOutput:
        """The step's chunks; with ``decodes`` False, running requests with only a decode pending are left out."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for request in list(self.running):
            if request.status != RequestStatus.RUNNING or budget == 0 or self._ends_in_flight(request):
                continue
            if not decodes and not _prompt_pending(request):
                continue
            num = self._padded_fit(chunks, min(request.num_pending_tokens, budget))
            if num == 0:
                continue
            if num < request.num_pending_tokens:  # draft tokens past the chunk's end are not verified
                request.drop_draft(max(0, num - _undrafted_pending(request)))
            if not self._allocate_or_preempt(request, num, preempted):
                continue
            chunks.append(ScheduledChunk(request, request.num_computed_tokens, num))
            budget -= num
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            if self.waiting[0].num_inflight_tokens:  # preempted while its token was in flight: wait for it
                break
            chunk = self._admit(self.waiting[0], budget, chunks)
            if chunk is None:
                break
            self.waiting.popleft()
            chunks.append(chunk)
            budget -= chunk.num_tokens
        for chunk in chunks:
            chunk.request.num_computed_tokens = chunk.end
            chunk.request.num_inflight_tokens += chunk.samples
        return SchedulerOutput(chunks, preempted)

    def _padded_fit(self, chunks: list[ScheduledChunk], num: int) -> int:
        """How many of ``num`` tokens a chunk may take beside ``chunks`` so that the step's prompt chunks, padded to
        the longest, stay within ``PADDED_PER_BUDGET`` budgets (0: none; a one-token chunk always fits)."""
        if num <= 1:  # before the scan below: a decode step plans hundreds of one-token chunks
            return num
        lengths = [c.num_tokens for c in chunks if c.num_tokens > 1]
        if not lengths:
            return num
        cap = PADDED_PER_BUDGET * self.max_num_batched_tokens // (len(lengths) + 1)
        return 0 if max(lengths) > cap else min(num, cap)

    def _ends_in_flight(self, request: Request) -> bool:
        """Whether the request's in-flight token is certain to end it (its length limit): no step is planned
        for a request that will have finished when the step's results are read."""
        return request.num_inflight_tokens > 0 and reaches_length_limit(
            request.params, len(request.prompt_token_ids), len(request.output_token_ids) + request.num_inflight_tokens,
            self.max_model_len)

    def _allocate_or_preempt(self, request: Request, num: int, preempted: list[Request]) -> bool:
        while not self.state.allocate(request, request.num_computed_tokens + num):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _admit(self, request: Request, budget: int, chunks: list[ScheduledChunk]) -> ScheduledChunk | None:
        cached = self.state.match_prefix(request)
        hit = start = floor = 0
        if cached or (self.prefix_replay.state_cache is not None and self.state.reuses_prefix(request)):
            plan = self.prefix_replay.plan(request, len(cached) * self.state.block_size, self.state.block_size,
                                           tuple(self.state.block_hash[b] for b in cached))
            hit, start, floor = plan.adopted, plan.start, plan.sliding_floor
            cached = cached[: hit // self.state.block_size]
        num = self._padded_fit(chunks, min(request.num_tokens - start, budget))
        num = self.prefix_replay.first_chunk_end(request, start, start + num, self.state.block_size) - start
        if num == 0 or not self.state.can_admit(cached, start + num):
            return None
        self.state.admit(request, cached)
        if not self.state.allocate(request, start + num):
            raise RuntimeError(f"state manager admitted {request.request_id} but could not allocate its blocks")
        request.num_computed_tokens = start
        request.replay_until = hit // self.state.block_size * self.state.block_size  # compressed writes from here
        request.sliding_floor = floor
        request.admitted_from = start
        request.num_cached_tokens = hit
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return ScheduledChunk(request, start, num)

    def _preempt(self, request: Request) -> None:
        request.drop_draft()
        self.state.release(request)
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.replay_until = request.sliding_floor = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        position = 0  # back into the queue in arrival order
        while position < len(self.waiting) and self.waiting[position].arrival < request.arrival:
            position += 1
        self.waiting.insert(position, request)

    # ------------------------------------------------------------------ update
    def update(self, output: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]]) -> list[Request]:
        accepted = []
        for chunk in output.chunks:
            request = chunk.request
            if request.status == RequestStatus.FINISHED:  # ended by an earlier step's token: drop this result
                continue
            tokens = sampled.get(request.request_id)
            if tokens is None:
                if request.status == RequestStatus.RUNNING:  # not preempted since the step was planned
                    self.state.commit(request, chunk.end)
                continue
            tokens = [tokens] if isinstance(tokens, int) else list(tokens)
            computed_end = chunk.end - self._reject_drafts(request, chunk, len(tokens) - 1)
            request.num_inflight_tokens -= 1
            stop = None
            for token in tokens:
                request.output_token_ids.append(token)
                accepted.append(request)
                stop = check_stop(request.params, len(request.prompt_token_ids), request.output_token_ids,
                                  self.eos_token_id, self.max_model_len)
                if stop is not None:
                    break
            if request.status == RequestStatus.RUNNING:
                self.state.commit(request, min(computed_end, request.num_known_tokens))
            if stop is not None:
                self.finish_request(request, stop)
        return accepted

    @staticmethod
    def _reject_drafts(request: Request, chunk: ScheduledChunk, num_accepted: int) -> int:
        """Clear the draft the chunk verified; rewind ``num_computed_tokens`` past its rejected tokens (their state
        was rolled back by the runner). Returns how many were rejected."""
        rejected = len(chunk.draft_token_ids) - num_accepted
        request.drop_draft()
        if request.status == RequestStatus.RUNNING and rejected:
            request.num_computed_tokens -= rejected
        return rejected

    def finish_request(self, request: Request, reason: StopDecision) -> None:
        if request.status == RequestStatus.FINISHED:
            return
        if request.status == RequestStatus.RUNNING:
            self.state.release(request)
            self.running.remove(request)
        else:  # preempted while its last token was in flight: its state is released already
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason, request.stop_reason = reason


def _prompt_pending(request: Request) -> bool:
    """Whether the request has prompt work pending: tokens besides a decode's one, or its prompt's last token (a
    prompt split before it: ``PrefixStateKeeper.first_chunk_end``), which samples its first token with the prompt
    steps rather than waiting for a step of decodes."""
    pending = _undrafted_pending(request)
    return pending > 1 or (pending == 1 and not request.output_token_ids and not request.num_inflight_tokens)


def _undrafted_pending(request: Request) -> int:
    """Pending tokens besides draft tokens (1 for a decode: draft tokens are not prompt work)."""
    return request.num_pending_tokens - request.num_draft_tokens

"""What the engine runs for speculative decoding: after each step, count the verified drafts, tell the proposer
which sequences ended or lost draft tokens, and ask it for the next drafts (``Proposer.propose``), which become the
requests' ``draft_token_ids``. The scheduler computes them as ordinary tokens; the runner verifies them
(``spec_decode/verify.py``) and rolls back the rejected ones (``spec_decode/rows.py``)."""

from __future__ import annotations

import logging

from deepinfer_core.engine.request import Request, RequestStatus
from deepinfer_core.metrics import MetricsRegistry
from deepinfer_core.models.interface import SpeculativeModel, missing_members
from deepinfer_core.spec_decode.config import SpeculativeConfig, SpeculativeConfigError, resolve_speculative_config
from deepinfer_core.spec_decode.proposer import Draft, DraftBatch, DraftSequence, Proposer, ProposerError
from deepinfer_core.spec_decode.proposer import default_registry as default_proposers

logger = logging.getLogger("deepinfer")

METRIC_PREFIX = "deepinfer:spec_decode_"


class Speculator:
    """One engine's proposer and its speculative-decoding metrics (see module docstring).

    A request a two-phase logits processor (a grammar) applies to drafts like any other: the processor prepares one
    row per verified position (``engine/logits_preparer.rows_of``) and follows the rejected drafts back."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, model, max_model_len: int):
        check_model(model, config)
        self.config = config
        self.proposer = proposer
        self.vocab_size = model.vocab_size
        self.max_model_len = max_model_len
        self.k = config.num_speculative_tokens
        self.register_metrics(MetricsRegistry())

    @property
    def needs_hidden_states(self) -> bool:
        return bool(self.proposer.needs_hidden_states)

    def register_metrics(self, metrics: MetricsRegistry) -> None:
        """Create (or find) the ``deepinfer:spec_decode_*`` metrics in ``metrics`` (the engine's registry)."""
        counter = metrics.counter
        self.num_drafts = counter(f"{METRIC_PREFIX}num_drafts", "draft rounds: sequences x steps that drafted")
        self.num_draft_tokens = counter(f"{METRIC_PREFIX}num_draft_tokens", "tokens the proposer drafted")
        self.num_verified_tokens = counter(f"{METRIC_PREFIX}num_verified_tokens", "draft tokens the target verified")
        self.num_accepted_tokens = counter(f"{METRIC_PREFIX}num_accepted_tokens", "draft tokens accepted")
        self.accepted_per_pos = metrics.vector(f"{METRIC_PREFIX}num_accepted_tokens_per_pos", self.k,
                                               "accepted draft tokens by draft position")

    # ------------------------------------------------------------------ after each step
    def after_step(self, launched, result, accepted: list[Request]) -> None:
        """Count the step's verified drafts, notify the proposer, and draft for the step's running sequences
        (``launched``: the step's ``LaunchedStep``; ``result``: its ``ModelRunnerOutput``; ``accepted``: the
        scheduler's requests that took tokens, once per token)."""
        scheduled = launched.scheduled
        taken = {}
        for request in accepted:
            taken[request.request_id] = taken.get(request.request_id, 0) + 1
        emitted = {request_id: len(tokens) for request_id, tokens in result.sampled_lists.items()}
        for chunk in scheduled.chunks:
            if chunk.draft_token_ids and chunk.request.request_id in taken:
                self._record(chunk, emitted[chunk.request.request_id] - 1)
        self._notify(scheduled, accepted)
        self._propose(scheduled, emitted, launched.hidden)

    def _record(self, chunk, num_accepted: int) -> None:
        self.num_drafts.inc()
        self.num_draft_tokens.inc(max(chunk.request.draft_num_proposed, len(chunk.draft_token_ids)))
        self.num_verified_tokens.inc(len(chunk.draft_token_ids))
        self.num_accepted_tokens.inc(num_accepted)
        for position in range(num_accepted):
            self.accepted_per_pos.inc(position)
        chunk.request.draft_num_proposed = 0
        if num_accepted < len(chunk.draft_token_ids) and not chunk.request.is_finished:
            self.proposer.on_rollback(chunk.request.request_id, chunk.request.num_tokens)

    def _notify(self, scheduled, accepted: list[Request]) -> None:
        for request in scheduled.preempted:
            self.proposer.on_finish(request.request_id)
        for request in dict.fromkeys(accepted):
            if request.is_finished:
                self.proposer.on_finish(request.request_id)

    def _propose(self, scheduled, emitted: dict[str, int], hidden) -> None:
        chunks = [c for c in scheduled.chunks if c.request.status == RequestStatus.RUNNING]
        if not chunks:
            return
        sequences = [self._sequence(c, emitted, hidden) for c in chunks]
        drafts = self.proposer.propose(DraftBatch(sequences))
        if not isinstance(drafts, list) or len(drafts) != len(sequences):
            raise ProposerError(f"proposer {self.config.method!r} returned {_count(drafts)} drafts for "
                                f"{len(sequences)} sequences; return one Draft per DraftBatch.sequences entry")
        for chunk, sequence, draft in zip(chunks, sequences, drafts):
            self._take(chunk.request, sequence, draft)

    def _sequence(self, chunk, emitted: dict[str, int], hidden) -> DraftSequence:
        request = chunk.request
        end = request.num_computed_tokens
        rows = hidden.rows(request.request_id, chunk.start, end) if hidden is not None else None
        accepted = emitted.get(request.request_id, 1) - 1 if chunk.draft_token_ids else 0
        return DraftSequence(request.request_id, request.slot, request.all_token_ids, end, chunk.start, rows,
                             accepted, request.params, self._max_draft_len(chunk, request))

    def _max_draft_len(self, chunk, request: Request) -> int:
        """``num_speculative_tokens``, less near ``max_tokens`` / ``max_model_len``; 0 for a chunk that sampled
        nothing or a token still in flight."""
        if not chunk.samples or request.num_inflight_tokens or request.num_known_tokens != request.num_tokens:
            return 0
        room = self.max_model_len - request.num_tokens - 1
        if request.params.max_tokens is not None:
            room = min(room, request.params.max_tokens - len(request.output_token_ids) - 1)
        return max(0, min(self.k, room))

    def _take(self, request: Request, sequence: DraftSequence, draft: Draft) -> None:
        if not isinstance(draft, Draft):
            raise ProposerError(f"proposer {self.config.method!r} returned a {type(draft).__name__} for "
                                f"{request.request_id}, not a deepinfer_core.spec_decode.Draft")
        tokens = [int(t) for t in draft.token_ids]
        if len(tokens) > sequence.max_draft_len:
            raise ProposerError(f"proposer {self.config.method!r} drafted {len(tokens)} tokens for "
                                f"{request.request_id}, more than its max_draft_len {sequence.max_draft_len}")
        if any(not 0 <= t < self.vocab_size for t in tokens):
            raise ProposerError(f"proposer {self.config.method!r} drafted token ids {tokens} for "
                                f"{request.request_id}, outside the vocabulary [0, {self.vocab_size})")
        probs = draft.draft_probs
        if probs is not None and tokens and tuple(probs.shape) != (len(tokens), self.vocab_size):
            raise ProposerError(f"proposer {self.config.method!r}: draft_probs of {request.request_id} is "
                                f"{tuple(probs.shape)}, expected {(len(tokens), self.vocab_size)}")
        request.draft_token_ids = tokens
        request.draft_probs = probs if tokens else None
        request.draft_num_proposed = draft.num_drafted if tokens else 0
        if not tokens and draft.num_drafted > 0:  # drafted, none of it chosen for verification: a round of 0 accepted
            self.num_drafts.inc()
            self.num_draft_tokens.inc(draft.num_drafted)


def check_model(model, config: SpeculativeConfig) -> None:
    """Refuse a model that cannot verify drafts, or more draft tokens than it can roll back."""
    missing = missing_members(model, SpeculativeModel)
    if missing:
        raise SpeculativeConfigError(f"speculative decoding ({config.method!r}) needs a model that can roll back "
                                     f"rejected draft tokens; {type(model).__name__} lacks {missing} of "
                                     "deepinfer_core.models.interface.SpeculativeModel. Run without "
                                     "speculative_config (and DEEPINFER_USE_NEXTN_DECODE)")
    if config.num_speculative_tokens > model.max_draft_tokens:
        raise SpeculativeConfigError(f"speculative_config num_speculative_tokens={config.num_speculative_tokens} is "
                                     f"more than {type(model).__name__} can roll back in one step "
                                     f"({model.max_draft_tokens}); lower it")


def build_speculator(speculative_config, model, plugin_manager, context, max_model_len: int,
                     num_slots: int) -> Speculator | None:
    """The engine's ``Speculator`` from ``speculative_config`` (or ``DEEPINFER_USE_NEXTN_DECODE``), None without
    speculation: the proposers registered (the core's and the plugins'), the config checked against them and the
    model, the proposer built and given ``num_slots``."""
    from deepinfer_core import envs

    nextn = envs.DEEPINFER_USE_NEXTN_DECODE if speculative_config is None else None
    if speculative_config is None and not nextn:
        return None
    registry = default_proposers(plugin_manager, context)
    config = resolve_speculative_config(speculative_config, nextn, registry.methods())
    check_model(model, config)
    proposer = registry.build(config, model, context)
    proposer.allocate(num_slots)
    logger.info("speculative decoding: %s, %d draft tokens per step", config.method, config.num_speculative_tokens)
    return Speculator(config, proposer, model, max_model_len)


def _count(drafts) -> str:
    return str(len(drafts)) if isinstance(drafts, list) else f"a {type(drafts).__name__}"


__all__ = ["Speculator", "build_speculator", "check_model"]

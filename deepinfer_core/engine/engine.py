"""The offline engine: requests in, one step at a time (schedule, run, update), outputs out."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence

from deepinfer_core.engine.decode_graphs import DecodeGraphs
from deepinfer_core.engine.input_processor import InputProcessor, RequestRejectedError
from deepinfer_core.engine.logits_preparer import LogitsPreparer
from deepinfer_core.engine.model_runner import LaunchedStep, ModelRunner
from deepinfer_core.engine.output_processor import OutputProcessor
from deepinfer_core.engine.prefill_graphs import PrefillGraphs
from deepinfer_core.engine.prefix_replay import PrefixReplay
from deepinfer_core.engine.prefix_state_cache import PrefixStateCache, PrefixStateKeeper
from deepinfer_core.engine.request import Request, RequestStatus
from deepinfer_core.engine.scheduler import FcfsScheduler, Scheduler, SchedulerOutput
from deepinfer_core.engine.state_manager import StateManager
from deepinfer_core.engine_context import EngineContext
from deepinfer_core.metrics import MetricsRegistry
from deepinfer_core.models.interface import CausalLM, SlotStateModel, StaticStepModel
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.plugins import call_hook
from deepinfer_core.sampling.noise import derive_seed
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.spec_decode.speculator import Speculator

logger = logging.getLogger("deepinfer")


@dataclasses.dataclass
class EngineConfig:
    """Sizes the engine runs with (resolved by ``LLM`` from the user's arguments)."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True
    seed: int = 0
    async_scheduling: bool = False
    enable_mixed_chunk: bool = False  # decodes in steps that fold prompt tokens (see FcfsScheduler)
    prefix_state_cache_bytes: int = 0  # device memory for sequence state at block boundaries (0: none)
    prefix_state_split_min_tokens: int = 0  # prompt chunks this long end one token before the prompt's end (0: never)


class Engine:
    """Owns the scheduler, state manager, model runner and output processor; ``step()`` is schedule, run, update.

    Two loops, chosen once: the synchronous one reads each step's results before planning the next. With
    ``config.async_scheduling`` a step is planned and launched before the previous step's tokens are read: the host
    reads and applies step N's results (stop checks, text, freeing finished requests) while the device computes step
    N + 1, whose decode inputs come from step N's samples on the device. A request that step N ends computes one
    token too many in step N + 1, which is dropped. Outputs are the same as without it; a step whose requests need
    the previous token's id on the host (repetition, presence or frequency penalties, multi-token ``bad_words``, a
    logits processor with ``needs_latest_tokens``) waits for the step before, as without it.

    Two-phase logits processors (a grammar's token masks: ``sampling/logits_processor.py``) prepare on a host worker
    thread (``logits_preparer.py``) while the device runs the step's forward pass: a step with such rows queues its
    forward, reads the previous step's tokens, starts ``prepare``, applies the previous step's results, then queues
    its sampling, which waits for ``prepare`` only if it has not finished. Where the previous tokens are on the host
    before the forward is queued (the synchronous loop; the CPU), ``prepare`` starts before the forward.

    ``context`` is the ``EngineContext`` the plugins were configured with (``engine.context`` in the lifecycle
    hooks); ``logits_processors`` run in the sampler on every step (``sampling/logits_processor.py``).
    ``speculator``: speculative decoding (``spec_decode/speculator.py``): after each step's results are applied, its
    proposer drafts the next tokens, which the next step verifies. ``metrics``: the engine's ``MetricsRegistry``
    (``LLM.get_metrics()``).
    """

    def __init__(self, model: CausalLM, state, tokenizer, config: EngineConfig, plugin_manager=None,
                 decode_graphs: DecodeGraphs | None = None, prefill_graphs: PrefillGraphs | None = None,
                 logits_processors: Sequence[Callable] = (), context: EngineContext | None = None,
                 speculator: Speculator | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.plugin_manager = plugin_manager
        self.context = context
        self.logits_processors = list(logits_processors)
        self.eos_token_id = _first(tokenizer.eos_token_ids) if tokenizer is not None else None
        self.vocab_size = model.vocab_size
        self.state_manager = StateManager(config.num_blocks, config.max_num_seqs, config.block_size,
                                          config.enable_prefix_caching)
        self.state_cache = self._state_cache(model, state, config)
        replay = PrefixReplay(model.prefix_replay_span(), model.sliding_window, plugin_manager, context,
                              self.state_cache)
        self.scheduler: Scheduler = FcfsScheduler(
            self.state_manager, config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len,
            self.eos_token_id, replay, config.enable_mixed_chunk)
        self.runner = ModelRunner(model, state, self.eos_token_id, decode_graphs, prefill_graphs,
                                  self.logits_processors)
        self.input_processor = InputProcessor(config.max_model_len, config.block_size, config.num_blocks,
                                              self.vocab_size, tokenizer, self.logits_processors)
        self.output_processor = OutputProcessor(tokenizer)
        self.preparer = LogitsPreparer(self.logits_processors)
        self.metrics = MetricsRegistry()
        if self.state_cache is not None:
            self.state_cache.stats.register(self.metrics)
        self.speculator = speculator
        if speculator is not None:
            speculator.register_metrics(self.metrics)
            self.runner.return_hidden = speculator.needs_hidden_states
        self._arrivals = itertools.count()
        self._unseeded = itertools.count()
        self._in_flight: LaunchedStep | None = None  # launched, results not read yet (asynchronous scheduling)
        self._step = self._async_step if config.async_scheduling else self._sync_step
        self.num_steps = 0
        self.num_overlapped_steps = 0  # steps launched before the previous step's tokens were read
        if plugin_manager is not None:
            call_hook(plugin_manager, "deepinfer_engine_start", engine=self)

    # ------------------------------------------------------------------ requests
    def add_request(self, group_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        """Queue ``params.n`` completions of a prompt; raises RequestRejectedError for bad requests."""
        prepared = self.input_processor.prepare(prompt_token_ids, params)
        base_seed = params.seed if params.seed is not None else derive_seed(self.config.seed, next(self._unseeded))
        requests = [
            Request(request_id=f"{group_id}-{index}", group_id=group_id, sample_index=index,
                    prompt_token_ids=list(prompt_token_ids), params=params, seed=derive_seed(base_seed, index),
                    arrival=next(self._arrivals), bad_words_token_ids=prepared.bad_words_token_ids,
                    needs_host_tokens=prepared.needs_host_tokens)
            for index in range(params.n)
        ]
        self.output_processor.add_group(group_id, prompt, list(prompt_token_ids), requests)
        for request in requests:
            self.scheduler.add(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    @property
    def step_in_flight(self) -> bool:
        """Whether a launched step's results are unread (asynchronous scheduling): device work enqueued now runs
        after that step (in ``deepinfer_after_step`` of step N: whether step N + 1 was launched already)."""
        return self._in_flight is not None

    @property
    def groups(self) -> dict[str, list[Request]]:
        """The live prompts' completions, by group id."""
        return {group_id: group.requests for group_id, group in self.output_processor.groups.items()}

    def partial_output(self, group_id: str) -> RequestOutput:
        """The output so far of a prompt that has not finished (text safe to show, tokens; ``finished`` False)."""
        return self.output_processor.partial_output(group_id)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of the prompts whose completions all finished in it (with asynchronous
        scheduling: whose last tokens were read in it)."""
        return self._step()

    def _sync_step(self) -> list[RequestOutput]:
        scheduled = self._schedule()
        if scheduled is None:
            return []
        launched, _ = self._launch(scheduled, previous=None)
        return self._update(launched)

    def _async_step(self) -> list[RequestOutput]:
        outputs = []
        if self._in_flight is not None and self._needs_host_tokens():
            outputs += self._update(self._take_in_flight())
        scheduled = self._schedule()
        if scheduled is None:  # every running request ends with the tokens in flight
            return outputs + (self._update(self._take_in_flight()) if self._in_flight is not None else [])
        previous = self._in_flight
        self._in_flight, applied = self._launch(scheduled, previous)
        self.num_overlapped_steps += previous is not None
        return outputs + applied

    def _schedule(self) -> SchedulerOutput | None:
        """The next step's plan, or None when there is nothing to run."""
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            if self._in_flight is None and self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler planned nothing while requests are pending (state too small?)")
            return None
        if self.state_cache is not None:
            self.state_cache.before_step(scheduled.chunks)
        if self.plugin_manager is not None:
            call_hook(self.plugin_manager, "deepinfer_before_step", engine=self, scheduler_output=scheduled)
        return scheduled

    def _launch(self, scheduled: SchedulerOutput,
                previous: LaunchedStep | None) -> tuple[LaunchedStep, list[RequestOutput]]:
        """Queue the step (forward and sampling) and apply ``previous``'s results (their outputs returned) while the
        device computes; with two-phase processors' rows, their ``prepare`` starts as soon as the rows' tokens are on
        the host, and ``previous`` is applied before the sampling is queued (the class docstring)."""
        self.num_steps += 1
        if not self.preparer.applies(scheduled):
            launched = self.runner.launch(scheduled, previous)
            self.output_processor.catch_up_text()  # while the device computes
            return launched, self._update(previous) if previous is not None else []
        prepared = None
        if previous is None or previous.is_ready():  # the tokens are on the host: prepare beside the forward
            prepared = self.preparer.start(scheduled, previous.read().sampled if previous is not None else None)
        forward = self.runner.forward(scheduled, previous)
        if prepared is None:  # read the tokens while the device runs the forward
            prepared = self.preparer.start(scheduled, previous.read().sampled)
        applied = self._update(previous) if previous is not None else []
        launched = self.runner.sample(forward, prepared)
        self.output_processor.catch_up_text()  # while the device computes
        return launched, applied

    def _needs_host_tokens(self) -> bool:
        """Whether a running request needs the previous token's id on the host to plan the next step
        (penalties, multi-token bad words, a logits processor that asks for it), so the tokens in flight are read
        first. With speculative decoding always: the proposer drafts from them."""
        return self.speculator is not None or any(r.needs_host_tokens for r in self.scheduler.running)

    def _take_in_flight(self) -> LaunchedStep:
        launched, self._in_flight = self._in_flight, None
        return launched

    def _update(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's results and apply them: tokens and token stops (scheduler), text, stop strings
        and logprobs (output processor). Returns the prompts whose completions all finished."""
        result = self.runner.collect(launched)
        if self.state_cache is not None:
            self.state_cache.after_step(self.step_in_flight)
        if self.plugin_manager is not None:
            call_hook(self.plugin_manager, "deepinfer_after_step", engine=self, scheduler_output=launched.scheduled,
                      model_output=result)
        accepted = self.scheduler.update(launched.scheduled, result.sampled_lists)
        for request, reason in self.output_processor.process(accepted, result):
            self.scheduler.finish_request(request, reason)
        if self.speculator is not None:
            self.speculator.after_step(launched, result, accepted)
        return self.output_processor.finished_outputs(accepted)

    @staticmethod
    def _state_cache(model: CausalLM, state, config: EngineConfig) -> PrefixStateKeeper | None:
        """The device tier of the prefix state cache (``engine/prefix_state_cache.py``) when the config gives it bytes
        and the model can copy its slot state; else None (prefix hits keep the exact rebuild)."""
        if not config.prefix_state_cache_bytes or not config.enable_prefix_caching:
            return None
        if not isinstance(model, SlotStateModel):
            return None
        keeper = PrefixStateKeeper(PrefixStateCache(config.prefix_state_cache_bytes),
                                   config.prefix_state_split_min_tokens)
        min_chunk = model.prefill_min_tokens() if isinstance(model, StaticStepModel) else 1
        keeper.bind(lambda slot: model.slot_state_views(state, slot), config.block_size, model.prefix_replay_span(),
                    min_chunk, block_views=lambda block: model.block_state_views(state, block))
        return keeper

    def step_boundary(self) -> None:
        """Call ``deepinfer_step_boundary``: a data-parallel rank's lockstep loop does, after each iteration on every
        rank (``distributed/worker.py``)."""
        if self.plugin_manager is not None:
            call_hook(self.plugin_manager, "deepinfer_step_boundary", engine=self)

    def shutdown(self) -> None:
        self.preparer.shutdown()
        if self.plugin_manager is not None:
            call_hook(self.plugin_manager, "deepinfer_engine_shutdown", engine=self)


def _first(ids) -> int | None:
    ids = list(ids or [])
    return ids[0] if ids else None


__all__ = ["Engine", "EngineConfig", "RequestRejectedError", "RequestStatus"]

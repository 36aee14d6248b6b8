"""The offline engine: requests in, one step at a time (schedule, run, update), outputs out."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence

from deepinfer_core.engine.decode_graphs import DecodeGraphs
from deepinfer_core.engine.model_runner import LaunchedStep, ModelRunner
from deepinfer_core.engine.output_processor import OutputProcessor
from deepinfer_core.engine.prefill_graphs import PrefillGraphs
from deepinfer_core.engine.prefix_replay import PrefixReplay
from deepinfer_core.engine.request import Request, RequestStatus
from deepinfer_core.engine.scheduler import FcfsScheduler, Scheduler, SchedulerOutput
from deepinfer_core.engine.state_manager import StateManager
from deepinfer_core.engine_context import EngineContext
from deepinfer_core.errors import DeepInferError
from deepinfer_core.models.interface import CausalLM
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.plugins import call_hook
from deepinfer_core.sampling.bad_words import tokenize_bad_words
from deepinfer_core.sampling.logits_processor import applies_to, needs_latest_tokens, processor_name, validate_params
from deepinfer_core.sampling.noise import derive_seed
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.structured_outputs import PLUGIN_HINT

logger = logging.getLogger("deepinfer")


class RequestRejectedError(DeepInferError, ValueError):
    """A request the engine refuses before running it (too long, empty, bad token ids)."""


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


class Engine:
    """Owns the scheduler, state manager, model runner and output processor; ``step()`` is schedule, run, update.

    Two loops, chosen once: the synchronous one reads each step's results before planning the next. With
    ``config.async_scheduling`` a step is planned and launched before the previous step's tokens are read: the host
    reads and applies step N's results (stop checks, text, freeing finished requests) while the device computes step
    N + 1, whose decode inputs come from step N's samples on the device. A request that step N ends computes one
    token too many in step N + 1, which is dropped. Outputs are the same as without it; a step whose requests need
    the previous token's id on the host (repetition, presence or frequency penalties, multi-token ``bad_words``, a
    logits processor with ``needs_latest_tokens``) waits for the step before, as without it.

    ``context`` is the ``EngineContext`` the plugins were configured with (``engine.context`` in the lifecycle
    hooks); ``logits_processors`` run in the sampler on every step (``sampling/logits_processor.py``).
    """

    def __init__(self, model: CausalLM, state, tokenizer, config: EngineConfig, plugin_manager=None,
                 decode_graphs: DecodeGraphs | None = None, prefill_graphs: PrefillGraphs | None = None,
                 logits_processors: Sequence[Callable] = (), context: EngineContext | None = None):
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
        replay = PrefixReplay(model.prefix_replay_span(), model.sliding_window, plugin_manager, context)
        self.scheduler: Scheduler = FcfsScheduler(
            self.state_manager, config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len,
            self.eos_token_id, replay, config.enable_mixed_chunk)
        self.runner = ModelRunner(model, state, self.eos_token_id, decode_graphs, prefill_graphs,
                                  self.logits_processors)
        self.output_processor = OutputProcessor(tokenizer)
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
        self._validate(prompt_token_ids, params)
        bad_words = self._bad_words_token_ids(params)
        needs_host_tokens = (params.uses_penalties or any(len(word) > 1 for word in bad_words)
                             or any(needs_latest_tokens(p) and applies_to(p, params) for p in self.logits_processors))
        base_seed = params.seed if params.seed is not None else derive_seed(self.config.seed, next(self._unseeded))
        requests = [
            Request(request_id=f"{group_id}-{index}", group_id=group_id, sample_index=index,
                    prompt_token_ids=list(prompt_token_ids), params=params, seed=derive_seed(base_seed, index),
                    arrival=next(self._arrivals), bad_words_token_ids=bad_words, needs_host_tokens=needs_host_tokens)
            for index in range(params.n)
        ]
        self.output_processor.add_group(group_id, prompt, list(prompt_token_ids), requests)
        for request in requests:
            self.scheduler.add(request)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise RequestRejectedError("the prompt is empty; give at least one token")
        if len(token_ids) > self.config.max_model_len:
            raise RequestRejectedError(
                f"the prompt has {len(token_ids)} tokens, longer than max_model_len={self.config.max_model_len}; "
                "shorten the prompt or raise max_model_len")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestRejectedError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            outside = sorted(t for t in ids if t >= self.vocab_size)
            if outside:
                raise RequestRejectedError(f"{name} has token ids {outside[:5]} outside the vocabulary "
                                           f"[0, {self.vocab_size})")
        self._validate_processors(params)
        longest = min(len(token_ids) + (params.max_tokens or self.config.max_model_len), self.config.max_model_len)
        blocks = -(-longest // self.config.block_size)
        if blocks > self.config.num_blocks:
            raise RequestRejectedError(
                f"a sequence of {longest} tokens needs {blocks} state blocks but the memory budget holds "
                f"{self.config.num_blocks}; raise kv_cache_memory_bytes or lower max_tokens / max_model_len")

    def _validate_processors(self, params: SamplingParams) -> None:
        """Let each logits processor that applies to ``params`` refuse it (``validate_params``); refuse
        ``structured_outputs`` that no processor applies (one that says so with ``applies_structured_outputs``)."""
        applying = [p for p in self.logits_processors if applies_to(p, params)]
        if params.structured_outputs is not None and not any(
                getattr(p, "applies_structured_outputs", False) for p in applying):
            raise RequestRejectedError(PLUGIN_HINT)
        for processor in applying:
            try:
                validate_params(processor, params)
            except (ValueError, TypeError) as exc:
                raise RequestRejectedError(str(exc)) from exc
            except Exception as exc:  # a processor's bug refuses this request, named
                raise RequestRejectedError(f"logits processor {processor_name(processor)} raised "
                                           f"{type(exc).__name__} validating the request: {exc}") from exc

    def _bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """``params.bad_words`` tokenized with the engine's tokenizer (``sampling/bad_words.py``)."""
        if not params.bad_words:
            return []
        if self.tokenizer is None:
            raise RequestRejectedError("bad_words need a tokenizer, and this engine has none; ban token ids with "
                                       "allowed_token_ids or logit_bias instead")
        words = tokenize_bad_words(params.bad_words, lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        outside = sorted({t for word in words for t in word if t >= self.vocab_size})
        if outside:
            raise RequestRejectedError(f"bad_words {params.bad_words!r} tokenize to ids {outside[:5]} outside the "
                                       f"model's vocabulary [0, {self.vocab_size})")
        return words

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

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
        launched = self._launch(scheduled, previous=None)
        self.output_processor.catch_up_text()  # while the device computes
        return self._update(launched)

    def _async_step(self) -> list[RequestOutput]:
        outputs = []
        if self._in_flight is not None and self._needs_host_tokens():
            outputs += self._update(self._take_in_flight())
        scheduled = self._schedule()
        if scheduled is None:  # every running request ends with the tokens in flight
            return outputs + (self._update(self._take_in_flight()) if self._in_flight is not None else [])
        previous, self._in_flight = self._in_flight, None
        self._in_flight = self._launch(scheduled, previous)
        self.num_overlapped_steps += previous is not None
        self.output_processor.catch_up_text()  # while the device computes
        return outputs + (self._update(previous) if previous is not None else [])

    def _schedule(self) -> SchedulerOutput | None:
        """The next step's plan, or None when there is nothing to run."""
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            if self._in_flight is None and self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler planned nothing while requests are pending (state too small?)")
            return None
        if self.plugin_manager is not None:
            call_hook(self.plugin_manager, "deepinfer_before_step", engine=self, scheduler_output=scheduled)
        return scheduled

    def _launch(self, scheduled: SchedulerOutput, previous: LaunchedStep | None) -> LaunchedStep:
        self.num_steps += 1
        return self.runner.launch(scheduled, previous)

    def _needs_host_tokens(self) -> bool:
        """Whether a running request needs the previous token's id on the host to plan the next step
        (penalties, multi-token bad words, a logits processor that asks for it), so the tokens in flight are read
        first."""
        return any(r.needs_host_tokens for r in self.scheduler.running)

    def _take_in_flight(self) -> LaunchedStep:
        launched, self._in_flight = self._in_flight, None
        return launched

    def _update(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's results and apply them: tokens and token stops (scheduler), text, stop strings
        and logprobs (output processor). Returns the prompts whose completions all finished."""
        result = self.runner.collect(launched)
        if self.plugin_manager is not None:
            call_hook(self.plugin_manager, "deepinfer_after_step", engine=self, scheduler_output=launched.scheduled,
                      model_output=result)
        accepted = self.scheduler.update(launched.scheduled, result.sampled)
        for request, reason in self.output_processor.process(accepted, result):
            self.scheduler.finish_request(request, reason)
        return self.output_processor.finished_outputs(accepted)

    def shutdown(self) -> None:
        if self.plugin_manager is not None:
            call_hook(self.plugin_manager, "deepinfer_engine_shutdown", engine=self)


def _first(ids) -> int | None:
    ids = list(ids or [])
    return ids[0] if ids else None


__all__ = ["Engine", "EngineConfig", "RequestRejectedError", "RequestStatus"]

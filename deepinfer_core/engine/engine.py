"""The offline engine: requests in, one step at a time (schedule, run, update), outputs out."""

from __future__ import annotations

import dataclasses
import itertools
import logging

from deepinfer_core.engine.decode_graphs import DecodeGraphs
from deepinfer_core.engine.detokenizer import SequenceDetokenizer
from deepinfer_core.engine.model_runner import LaunchedStep, ModelRunner, ModelRunnerOutput
from deepinfer_core.engine.prefill_graphs import PrefillGraphs
from deepinfer_core.engine.request import Request, RequestStatus
from deepinfer_core.engine.scheduler import FcfsScheduler, Scheduler, SchedulerOutput
from deepinfer_core.engine.state_manager import StateManager
from deepinfer_core.errors import DeepInferError
from deepinfer_core.outputs import CompletionOutput, Logprob, RequestOutput, sample_logprobs_dict
from deepinfer_core.sampling.noise import derive_seed
from deepinfer_core.sampling.params import SamplingParams

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
    """Owns the scheduler, state manager and model runner; ``step()`` is schedule, run, update.

    With ``config.async_scheduling`` a step is planned and launched before the previous step's tokens are read:
    the host reads and applies step N's results (stop checks, text, freeing finished requests) while the device
    computes step N + 1, whose decode inputs come from step N's samples on the device. A request that step N
    ends computes one token too many in step N + 1, which is dropped. Outputs are the same as without it; a step
    whose requests use repetition, presence or frequency penalties (they need the previous token's id on the
    host) waits for the step before, as without it.
    """

    def __init__(self, model, state, tokenizer, config: EngineConfig, plugin_manager=None,
                 decode_graphs: DecodeGraphs | None = None, prefill_graphs: PrefillGraphs | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.plugin_manager = plugin_manager
        self.eos_token_id = _first(tokenizer.eos_token_ids) if tokenizer is not None else None
        self.vocab_size = model.config.vocab_size
        self.state_manager = StateManager(config.num_blocks, config.max_num_seqs, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler: Scheduler = FcfsScheduler(self.state_manager, config.max_num_seqs,
                                                  config.max_num_batched_tokens, self._replay_start,
                                                  self._append_token, config.enable_mixed_chunk)
        self.runner = ModelRunner(model, state, self.eos_token_id, decode_graphs, prefill_graphs)
        self.groups: dict[str, list[Request]] = {}
        self._deferred_text: list[Request] = []  # requests whose last token's text waits for the next step
        self._arrivals = itertools.count()
        self._unseeded = itertools.count()
        self._in_flight: LaunchedStep | None = None  # launched, results not read yet (asynchronous scheduling)
        self.num_steps = 0
        self.num_overlapped_steps = 0  # steps launched before the previous step's tokens were read
        if plugin_manager is not None:
            plugin_manager.hook.deepinfer_engine_start(engine=self)

    # ------------------------------------------------------------------ requests
    def add_request(self, group_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        """Queue ``params.n`` completions of a prompt; raises RequestRejectedError for bad requests."""
        self._validate(prompt_token_ids, params)
        base_seed = params.seed if params.seed is not None else derive_seed(self.config.seed, next(self._unseeded))
        requests = []
        for index in range(params.n):
            request = Request(
                request_id=f"{group_id}-{index}", group_id=group_id, sample_index=index, prompt=prompt,
                prompt_token_ids=list(prompt_token_ids), params=params, seed=derive_seed(base_seed, index),
                arrival=next(self._arrivals),
                detokenizer=SequenceDetokenizer(self.tokenizer if params.detokenize else None, params,
                                                prompt_token_ids, self.eos_token_id, self.config.max_model_len),
                logprobs=[] if params.logprobs is not None else None,
            )
            requests.append(request)
            self.scheduler.add(request)
        self.groups[group_id] = requests

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
        longest = min(len(token_ids) + (params.max_tokens or self.config.max_model_len), self.config.max_model_len)
        blocks = -(-longest // self.config.block_size)
        if blocks > self.config.num_blocks:
            raise RequestRejectedError(
                f"a sequence of {longest} tokens needs {blocks} state blocks but the memory budget holds "
                f"{self.config.num_blocks}; raise kv_cache_memory_bytes or lower max_tokens / max_model_len")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of request groups that finished in it (with asynchronous scheduling:
        whose last tokens were read in it)."""
        outputs = []
        if self._in_flight is not None and not self._may_overlap():
            outputs = self._finish(self._in_flight)
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            if self._in_flight is not None:  # every running request ends with the tokens in flight
                return outputs + self._finish(self._in_flight)
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler planned nothing while requests are pending (state too small?)")
            return outputs
        if self.plugin_manager is not None:
            self.plugin_manager.hook.deepinfer_before_step(engine=self, scheduler_output=scheduled)
        previous = self._in_flight
        launched = self.runner.launch(scheduled, previous)
        self.num_steps += 1
        self.num_overlapped_steps += previous is not None
        self._in_flight = launched
        self._catch_up_text()  # while the device computes
        if previous is not None:
            return outputs + self._finish(previous)
        return outputs if self.config.async_scheduling else outputs + self._finish(launched)

    def _may_overlap(self) -> bool:
        """Whether the next step may be launched before the tokens in flight are read: asynchronous scheduling
        is on and no running request needs the previous token's id on the host (penalties)."""
        return self.config.async_scheduling and not any(r.params.uses_penalties for r in self.scheduler.running)

    def _finish(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's results and apply them; returns the request groups that finished."""
        if launched is self._in_flight:
            self._in_flight = None
        result = self.runner.collect(launched)
        if self.plugin_manager is not None:
            self.plugin_manager.hook.deepinfer_after_step(engine=self, scheduler_output=launched.scheduled,
                                                          model_output=result)
        return self._update(launched.scheduled, result)

    def _update(self, scheduled: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        self._record_logprobs(scheduled, result)
        finished = self.scheduler.update(scheduled, result.sampled)
        outputs = []
        for group_id in dict.fromkeys(r.group_id for r in finished):
            group = self.groups[group_id]
            if all(r.is_finished for r in group):
                outputs.append(self._group_output(group))
                del self.groups[group_id]
        return outputs

    def _append_token(self, request: Request, token: int) -> bool:
        """Apply the stop rules to a new token; True when the request is finished. Its text is decoded now when a
        stop string could end the request or the token ends it, else during the next step (``_catch_up_text``)."""
        finished = request.detokenizer.append(token, defer_text=True).finished
        if request.detokenizer.has_deferred_text:
            self._deferred_text.append(request)
        return finished

    def _catch_up_text(self) -> None:
        """Decode the text the last step deferred, while the device computes this step (off the critical path:
        ~0.3 ms per batch-64 step on the 2-core sandbox, tools/bench_detokenize_step.py)."""
        deferred, self._deferred_text = self._deferred_text, []
        for request in deferred:
            request.detokenizer.catch_up()

    def _replay_start(self, request: Request, num_cached_tokens: int) -> int:
        """Where to start recomputing after a prefix hit: a plugin's choice, else the exact rebuild."""
        window = self.model.config.sliding_window
        if self.plugin_manager is not None:
            start = self.plugin_manager.hook.deepinfer_rebuild_sliding_window(
                request=request, num_cached_tokens=num_cached_tokens, sliding_window=window)
            if start is not None:
                if not 0 <= start <= num_cached_tokens:
                    raise ValueError(f"rebuild_sliding_window returned {start}, outside [0, {num_cached_tokens}]")
                return start
        return max(0, num_cached_tokens - exact_replay_span(self.model.config))

    # ------------------------------------------------------------------ outputs
    def _record_logprobs(self, scheduled: SchedulerOutput, result: ModelRunnerOutput) -> None:
        rows = result.rows
        by_id = {c.request.request_id: c.request for c in scheduled.chunks}  # this step's requests only
        for row, request_id in enumerate(result.sampled_order):
            request = by_id[request_id]
            if request.is_finished:  # ended by the step before (asynchronous scheduling): this token is dropped
                continue
            lp = rows.logprobs[row]
            request.cumulative_logprob += lp
            if request.logprobs is not None:
                n = request.params.logprobs
                request.logprobs.append(sample_logprobs_dict(
                    rows.token_ids[row], lp, rows.ranks[row], rows.top_token_ids[row][:n],
                    rows.top_logprobs[row][:n], self._decode))
        for request_id, (first, plp) in result.prompt_logprobs.items():
            request = by_id[request_id]
            if request.status != RequestStatus.RUNNING:  # preempted since: its prompt logprobs start over
                continue
            entries = _prompt_entries(request, first, plp, self._decode)
            request.prompt_logprobs_partial.extend(entries)
            if first + len(entries) >= len(request.prompt_token_ids):
                request.prompt_logprobs = request.prompt_logprobs_partial

    def _decode(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer is not None else None

    def _group_output(self, group: list[Request]) -> RequestOutput:
        first = group[0]
        completions = [
            CompletionOutput(
                index=r.sample_index, text=r.detokenizer.text, token_ids=list(r.output_token_ids),
                cumulative_logprob=r.cumulative_logprob, logprobs=r.logprobs,
                finish_reason=r.detokenizer.finish_reason, stop_reason=r.detokenizer.stop_reason,
            )
            for r in group
        ]
        return RequestOutput(request_id=first.group_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
                             prompt_logprobs=first.prompt_logprobs, outputs=completions, finished=True)

    def shutdown(self) -> None:
        if self.plugin_manager is not None:
            self.plugin_manager.hook.deepinfer_engine_shutdown(engine=self)


def exact_replay_span(config) -> int:
    """Tokens to recompute before a prefix hit so every layer's window and carry are rebuilt exactly.

    Each layer's sliding window reaches ``W - 1`` tokens back, so wrong (missing) state at the
    replay's start stops mattering after ``num_layers * (W - 1)`` tokens; the compressor carry needs
    the last ``2 * csa_ratio`` tokens' inputs on top.
    """
    ratios = [config.compress_ratio(i) for i in range(config.num_hidden_layers)]
    return config.num_hidden_layers * config.sliding_window + 2 * max(ratios, default=0)


def _prompt_entries(request: Request, first: int, plp, decode) -> list[dict[int, Logprob]]:
    entries = []
    for i, token in enumerate(request.prompt_token_ids[first:first + plp.token_logprobs.shape[0]]):
        top_ids = plp.top_token_ids[i].tolist()
        top_lps = plp.top_logprobs[i].tolist()
        entries.append(sample_logprobs_dict(token, float(plp.token_logprobs[i]), int(plp.ranks[i]),
                                            top_ids, top_lps, decode))
    return entries


def _first(ids) -> int | None:
    ids = list(ids or [])
    return ids[0] if ids else None


__all__ = ["Engine", "EngineConfig", "RequestRejectedError", "RequestStatus", "exact_replay_span"]

"""What the user sees of a request: its text, stop strings, logprobs and prompt logprobs, and its final output.

The scheduler appends each new token to its request and ends the request when the token stops it
(``engine/stop.py``). The output processor then turns the step's tokens into text (``SequenceDetokenizer``), looks
for stop strings (a match ends the request: the engine tells the scheduler), records logprobs, and builds a
``RequestOutput`` once every completion of a prompt has finished.

A token's text is decoded at once when a stop string could end the request or the token ends it; otherwise it
waits for ``catch_up_text``, which the engine calls while the device computes the next step.
"""

from __future__ import annotations

import collections
import dataclasses

from deepinfer_core.engine.detokenizer import SequenceDetokenizer, decode_token
from deepinfer_core.engine.model_runner import ModelRunnerOutput
from deepinfer_core.engine.request import Request
from deepinfer_core.engine.stop import StopDecision
from deepinfer_core.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
    sample_logprobs_dict,
)


@dataclasses.dataclass
class CompletionState:
    """The output side of one request: its text and the logprobs it asked for."""

    group_id: str
    detokenizer: SequenceDetokenizer
    logprobs: SampleLogprobs | None
    cumulative_logprob: float = 0.0
    prompt_logprobs: PromptLogprobs | None = None  # complete ones
    prompt_logprobs_partial: PromptLogprobs = dataclasses.field(default_factory=lambda: [None])


@dataclasses.dataclass
class GroupState:
    """A prompt's ``n`` completions."""

    prompt: str | None
    prompt_token_ids: list[int]
    requests: list[Request]


class OutputProcessor:
    """Text, stop strings and logprobs of every live request; request outputs once a prompt's group finishes."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.groups: dict[str, GroupState] = {}
        self.completions: dict[str, CompletionState] = {}
        self._deferred_text: list[SequenceDetokenizer] = []  # tokens whose text waits for catch_up_text

    def add_group(self, group_id: str, prompt: str | None, prompt_token_ids: list[int],
                  requests: list[Request]) -> None:
        """Start tracking a prompt's completions."""
        self.groups[group_id] = GroupState(prompt, prompt_token_ids, requests)
        for request in requests:
            params = request.params
            self.completions[request.request_id] = CompletionState(
                group_id, SequenceDetokenizer(self.tokenizer if params.detokenize else None, params, prompt_token_ids),
                [] if params.logprobs is not None else None)

    def process(self, accepted: list[Request], result: ModelRunnerOutput) -> list[tuple[Request, StopDecision]]:
        """Take a step's results: prompt logprobs, then each request that took a token (``accepted``, once per token
        taken, in order: the tokens already appended and the request ended where a token stops it). Returns the
        requests a stop string ends, with the reason, for the engine to end in the scheduler; a stop string matched
        before a request's last token of the step drops the step's later tokens."""
        self._add_prompt_logprobs(result)
        rows_of: dict[str, list[int]] = {}
        for row, request_id in enumerate(result.req_ids):
            rows_of.setdefault(request_id, []).append(row)
        left = collections.Counter(request.request_id for request in accepted)  # tokens still to take, per request
        stopped: dict[str, tuple[Request, StopDecision]] = {}
        for request in accepted:
            request_id = request.request_id
            left[request_id] -= 1
            row = rows_of[request_id].pop(0)
            if request_id in stopped:
                continue
            last = left[request_id] == 0
            completion = self.completions[request_id]
            self._add_logprobs(completion, result, row)
            token_stop = (request.finish_reason, request.stop_reason) if request.is_finished and last else None
            update = completion.detokenizer.append(result.sampled_token_ids[row], token_stop, defer_text=True)
            if completion.detokenizer.has_deferred_text:
                self._deferred_text.append(completion.detokenizer)
            if update.finished and token_stop is None:
                stopped[request_id] = (request, (update.finish_reason, update.stop_reason))
                _drop_later_tokens(request, left[request_id])
        return [(request, reason) for request, reason in stopped.values() if not _restop(request, reason)]

    def catch_up_text(self) -> None:
        """Decode the text the last step deferred (while the device computes the next one)."""
        deferred, self._deferred_text = self._deferred_text, []
        for detokenizer in deferred:
            detokenizer.catch_up()

    def finished_outputs(self, requests: list[Request]) -> list[RequestOutput]:
        """The outputs of the groups among ``requests``' whose completions have all finished; those groups are
        forgotten."""
        outputs = []
        for group_id in dict.fromkeys(r.group_id for r in requests):
            group = self.groups.get(group_id)
            if group is not None and all(r.is_finished for r in group.requests):
                outputs.append(self._group_output(group_id, group))
        return outputs

    def partial_output(self, group_id: str) -> RequestOutput:
        """A live prompt's output so far (vLLM's ``RequestOutputKind.CUMULATIVE``): each completion's tokens and the
        text safe to show (``SequenceDetokenizer.output_text``); ``finished`` False; logprobs left out."""
        group = self.groups[group_id]
        completions = [
            CompletionOutput(index=r.sample_index, text=self.completions[r.request_id].detokenizer.output_text,
                             token_ids=list(r.output_token_ids), cumulative_logprob=None, logprobs=None,
                             finish_reason=r.finish_reason, stop_reason=r.stop_reason)
            for r in group.requests
        ]
        return RequestOutput(request_id=group_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
                             prompt_logprobs=None, outputs=completions, finished=False,
                             num_cached_tokens=_num_cached_prompt_tokens(group))

    def _group_output(self, group_id: str, group: GroupState) -> RequestOutput:
        states = [self.completions.pop(r.request_id) for r in group.requests]
        completions = [
            CompletionOutput(index=r.sample_index, text=state.detokenizer.text, token_ids=list(r.output_token_ids),
                             cumulative_logprob=state.cumulative_logprob, logprobs=state.logprobs,
                             finish_reason=r.finish_reason, stop_reason=r.stop_reason)
            for r, state in zip(group.requests, states)
        ]
        del self.groups[group_id]
        return RequestOutput(request_id=group_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
                             prompt_logprobs=states[0].prompt_logprobs, outputs=completions, finished=True,
                             num_cached_tokens=_num_cached_prompt_tokens(group))

    def _add_logprobs(self, completion: CompletionState, result: ModelRunnerOutput, row: int) -> None:
        logprob = result.logprobs[row]
        completion.cumulative_logprob += logprob
        if completion.logprobs is not None:
            n = completion.detokenizer.params.logprobs
            completion.logprobs.append(sample_logprobs_dict(
                result.sampled_token_ids[row], logprob, result.ranks[row], result.top_token_ids[row][:n],
                result.top_logprobs[row][:n], self._decode))

    def _add_prompt_logprobs(self, result: ModelRunnerOutput) -> None:
        """Prompt logprobs arrive chunk by chunk; a chunk from the prompt's start (after a preemption too) starts
        them over, and a complete set takes no more."""
        for request_id, (first, plp) in result.prompt_logprobs.items():
            completion = self.completions.get(request_id)
            if completion is None or completion.prompt_logprobs is not None:
                continue
            if first == 1:
                completion.prompt_logprobs_partial = [None]
            group = self.groups[completion.group_id]
            entries = _prompt_entries(group.prompt_token_ids, first, plp, self._decode)
            completion.prompt_logprobs_partial.extend(entries)
            if first + len(entries) >= len(group.prompt_token_ids):
                completion.prompt_logprobs = completion.prompt_logprobs_partial

    def _decode(self, token_id: int) -> str | None:
        return decode_token(self.tokenizer, token_id) if self.tokenizer is not None else None


def _drop_later_tokens(request: Request, count: int) -> None:
    """Remove the ``count`` tokens a request took after the one a stop string ended it at."""
    if count:
        del request.output_token_ids[-count:]


def _restop(request: Request, reason: StopDecision) -> bool:
    """For a request a later token of the same step had already ended (a stop token past a stop string): take the
    stop string's reason instead. Returns whether the request was already ended."""
    if not request.is_finished:
        return False
    request.finish_reason, request.stop_reason = reason
    return True


def _num_cached_prompt_tokens(group: GroupState) -> int:
    """Prompt tokens the first completion's latest admission took from the prefix cache (vLLM reports one value per
    request); a re-admission after a preemption may hit generated tokens too, which are not prompt tokens."""
    return min(group.requests[0].num_cached_tokens, len(group.prompt_token_ids))


def _prompt_entries(prompt_token_ids: list[int], first: int, plp, decode) -> list[dict[int, Logprob]]:
    entries = []
    for i, token in enumerate(prompt_token_ids[first:first + plp.token_logprobs.shape[0]]):
        entries.append(sample_logprobs_dict(token, float(plp.token_logprobs[i]), int(plp.ranks[i]),
                                            plp.top_token_ids[i].tolist(), plp.top_logprobs[i].tolist(), decode))
    return entries

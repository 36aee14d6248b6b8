"""Runs one scheduled step: builds the flat batch, calls the model, samples, returns plain results."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from deepinfer_core.device_copy import beside, record_event, to_device, to_host
from deepinfer_core.engine.decode_graphs import DecodeGraphs
from deepinfer_core.engine.prefill_graphs import PrefillGraphs
from deepinfer_core.engine.scheduler import ScheduledChunk, SchedulerOutput
from deepinfer_core.engine.verify_graphs import VerifyGraphs, VerifyStep
from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.sampling.sampler import (
    PromptLogprobsOutput,
    SamplerOutput,
    SamplingMetadata,
    compute_prompt_logprobs,
    sample,
)
from deepinfer_core.spec_decode.rows import DraftRollback, HiddenStates, emitted_rows, first_rows
from deepinfer_core.spec_decode.verify import verify


@dataclasses.dataclass
class ModelRunnerOutput:
    """A step's results on the host: one row per token taken (``req_ids``' order: a request that verified a draft has
    one row per token it took, in order; any other that sampled has one), and prompt logprobs."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[float]  # the raw model's log-probability of each sampled token
    ranks: list[int]  # 1 = most likely under the raw model
    top_token_ids: list[list[int]]  # [num_rows][n]; empty rows when no logprobs were asked for
    top_logprobs: list[list[float]]
    prompt_logprobs: dict[str, tuple[int, PromptLogprobsOutput]]  # request id -> (first position, output)

    @property
    def sampled(self) -> dict[str, int]:
        """Request id -> its newest token."""
        return dict(zip(self.req_ids, self.sampled_token_ids))

    @property
    def sampled_lists(self) -> dict[str, list[int]]:
        """Request id -> its new tokens, in order (more than one where a draft was accepted)."""
        tokens: dict[str, list[int]] = {}
        for request_id, token in zip(self.req_ids, self.sampled_token_ids):
            tokens.setdefault(request_id, []).append(token)
        return tokens


@dataclasses.dataclass
class LaunchedStep:
    """A step queued on the device, its results not read yet (``ModelRunner.collect`` reads them).

    The sampled rows travel to the host in one non-blocking copy queued right behind the sampler on a side stream
    (``device_copy.beside``), so neither the packing nor the copy holds up the next step queued behind the sampler
    (which reads only the sampled ids on the device), and reading them waits for that copy only."""

    scheduled: SchedulerOutput
    sampler_output: SamplerOutput | None  # on the device; the next step reads its sampled ids (``feed``)
    req_ids: list[str]  # row order of sampler_output
    prompt_logprobs: dict[str, tuple[int, PromptLogprobsOutput]]  # on their way to the host
    rows_on_host: torch.Tensor | None  # [3 * rows + 2 * rows * n] float64: ids, logprobs, ranks, top ids, top logprobs
    num_top: int  # n of the top logprobs
    rows_copied: torch.Event | None  # recorded after the rows' copy (None: done already)
    ready: torch.Event | None  # recorded after the step's work and its prompt logprobs' copies (None: done already)
    group_rows: list[int] | None = None  # rows per request in ``req_ids`` when drafts were verified (then the flat
    # copy ends with the tokens each request took: ``spec_decode.rows.emitted_rows`` keeps those rows)
    hidden: HiddenStates | None = None  # the target's hidden states, for a proposer that needs them
    _result: ModelRunnerOutput | None = dataclasses.field(default=None, init=False, repr=False)

    def is_ready(self) -> bool:
        """Whether ``read`` would return without waiting for the device."""
        return all(event is None or event.query() for event in (self.ready, self.rows_copied))

    def read(self) -> ModelRunnerOutput:
        """Wait for the step and its rows' copy, and return its results on the host (read once, then kept)."""
        if self._result is None:
            self._result = self._read()
        return self._result

    def _read(self) -> ModelRunnerOutput:
        if self.ready is not None:
            self.ready.synchronize()
        if self.rows_copied is not None:
            self.rows_copied.synchronize()
        rows, n = len(self.req_ids), self.num_top
        flat = self.rows_on_host.tolist() if self.rows_on_host is not None else []
        ids, lps, ranks = flat[:rows], flat[rows:2 * rows], flat[2 * rows:3 * rows]
        top_ids, top_lps = flat[3 * rows:3 * rows + rows * n], flat[3 * rows + rows * n:3 * rows + 2 * rows * n]
        output = ModelRunnerOutput(
            req_ids=self.req_ids, sampled_token_ids=[int(t) for t in ids], logprobs=lps,
            ranks=[int(r) for r in ranks],
            top_token_ids=[[int(t) for t in top_ids[i * n:(i + 1) * n]] for i in range(rows)],
            top_logprobs=[top_lps[i * n:(i + 1) * n] for i in range(rows)],
            prompt_logprobs=self.prompt_logprobs)
        if self.group_rows is None:
            return output
        return emitted_rows(output, self.group_rows, [int(e) for e in flat[3 * rows + 2 * rows * n:]])

    def feed(self, input_ids: torch.Tensor, rows: list[int], chunks: list[ScheduledChunk]) -> None:
        """Write the tokens this step sampled into ``input_ids`` (device) of the next step: ``rows[i]`` is the
        row of chunk ``i``'s last input token; only chunks whose last token is in flight are written."""
        if self.group_rows is not None:
            raise RuntimeError("a step that verified draft tokens cannot hand its tokens to the next step on the "
                               "device; read its results first (the engine does with a proposer)")
        order = {request_id: i for i, request_id in enumerate(self.req_ids)}
        pairs = [(row, order[c.request.request_id]) for row, c in zip(rows, chunks) if c.reads_inflight_token]
        if not pairs:
            return
        sampled = self.sampler_output.sampled_token_ids  # [num_sampled]
        (row, source), n = pairs[0], len(pairs)
        if pairs == [(row + i, source + i) for i in range(n)]:  # the usual decode step: one slice copy
            input_ids[row:row + n].copy_(sampled[source:source + n])
            return
        index = to_device(torch.tensor(pairs, dtype=torch.long).T.contiguous(), input_ids.device)  # [2, n]
        input_ids[index[0]] = sampled[index[1]]


@dataclasses.dataclass
class ForwardStep:
    """A step whose forward pass is queued and whose sampling is not (``ModelRunner.sample`` queues it)."""

    scheduled: SchedulerOutput
    parts: list[torch.Tensor]  # logits of the sampling chunks, stacked in ``order``
    order: list[int]  # row of the stacked logits of each sampling chunk
    sampling_chunks: list[ScheduledChunk]
    prompt_logprobs: dict[str, tuple[int, PromptLogprobsOutput]]
    draft_save: Any = None  # the model's save of the state the step's draft tokens overwrite (``DraftRollback``)
    hidden: HiddenStates | None = None
    verify_step: VerifyStep | None = None  # the step's verification through a static graph (its own save)


class ModelRunner:
    """Owns the model and its state pools; turns a ``SchedulerOutput`` into sampled tokens."""

    def __init__(self, model, state, eos_token_id: int | None, decode_graphs: DecodeGraphs | None = None,
                 prefill_graphs: PrefillGraphs | None = None, logits_processors: Sequence[Callable] = ()):
        self.model = model
        self.logits_processors = list(logits_processors)  # run by the sampler, after the graphs, on sampled rows
        self.state = state
        self.eos_token_id = eos_token_id
        self.device = model.device
        self.decode_graphs = decode_graphs
        self.prefill_graphs = prefill_graphs
        self.num_mixed_steps = 0  # steps that replayed a graph for their decodes beside a prefill
        self.return_hidden = False  # a proposer reads the target's hidden states: no decode graph (they return none)
        self.verify_graphs: VerifyGraphs | None = None  # with a speculator: verification steps through static graphs

    def build_batch(self, output: SchedulerOutput) -> tuple[ForwardBatch, list[int], dict[str, tuple[int, int]]]:
        """The flat batch, the logits row of each sampling chunk, and prompt-logprob row ranges. A token still in
        flight reads a placeholder here (``LaunchedStep.feed`` writes it on the device)."""
        tokens: list[int] = []
        positions: list[int] = []
        query_start = [0]
        sample_rows: list[int] = []
        prompt_rows: dict[str, tuple[int, int]] = {}
        logits_rows: list[int] = []
        for chunk in output.chunks:
            request = chunk.request
            tokens.extend(request.input_tokens(chunk.start, chunk.end))
            positions.extend(range(chunk.start, chunk.end))
            first_row = query_start[-1]
            query_start.append(first_row + chunk.num_tokens)
            if chunk.wants_prompt_logprobs:
                prompt_rows[request.request_id] = (len(logits_rows), chunk.num_tokens)
                logits_rows.extend(range(first_row, first_row + chunk.num_tokens))
            elif chunk.samples:  # the last token's row, after one row per draft token (verified against them)
                last = first_row + chunk.num_tokens - 1
                logits_rows.extend(range(last - len(chunk.draft_token_ids), last + 1))
            if chunk.samples:
                sample_rows.extend(range(len(logits_rows) - 1 - len(chunk.draft_token_ids), len(logits_rows)))
        uploaded = to_device(torch.tensor(tokens + positions + logits_rows, dtype=torch.long), self.device)  # one copy
        input_ids, positions_t, logits_rows_t = uploaded.split([len(tokens), len(positions), len(logits_rows)])
        batch = ForwardBatch(
            input_ids=input_ids,
            positions=positions_t,
            query_start=query_start,
            context_lens=[c.start for c in output.chunks],
            slots=[c.request.slot for c in output.chunks],
            block_tables=[c.request.block_ids for c in output.chunks],
            logits_rows=logits_rows_t,
            compressed_write_start=[c.request.replay_until for c in output.chunks],
            sliding_floor=[c.request.sliding_floor for c in output.chunks],
        )
        return batch, sample_rows, prompt_rows

    def launch(self, output: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step on the device without waiting for it: ``forward``, then ``sample``."""
        return self.sample(self.forward(output, previous))

    def forward(self, output: SchedulerOutput, previous: LaunchedStep | None = None) -> ForwardStep:
        """Queue the step's forward pass without waiting for it: its decode chunks through the captured graphs
        (when there are), a lone prompt through its bucket's prefill graph, the rest eagerly in one forward. A chunk
        whose last input token is in flight reads it from ``previous`` (the step before) on the device."""
        if previous is None and any(c.reads_inflight_token for c in output.chunks):
            raise RuntimeError("a chunk reads a token still in flight, but no launched step was given to read it from")
        verified, verify_step = self._verify(output.chunks, previous)
        graphed = []
        if not verified:
            graphed = self.decode_graphs.select(output.chunks) if self._graphs(self.decode_graphs, output.chunks) else []
        fill = (lambda input_ids: previous.feed(input_ids, list(range(len(graphed))), graphed)) if previous else None
        graph_logits = self.decode_graphs.run(graphed, fill) if graphed else None  # [G, V]
        if graph_logits is None:
            graphed = []
        in_graph = {id(c) for c in graphed + verified}
        eager = SchedulerOutput([c for c in output.chunks if id(c) not in in_graph], output.preempted)
        parts = [graph_logits] if graphed else [verify_step.logits] if verified else []
        row_of = {id(c): i for i, c in enumerate(graphed)}  # chunk -> row of the stacked sampling logits
        row_of.update(first_rows(verified))
        base = len(graphed) + sum(c.num_tokens for c in verified)  # the eager chunks' first row
        prompt_logprobs = {}
        self.num_mixed_steps += bool((graphed or verified) and eager.chunks)
        # not after a verification graph: its draft-row save lives in the graphs' shared pool until the rollback
        lone = self._graphs(self.prefill_graphs, eager.chunks) and not verified
        prefill = self.prefill_graphs.run(eager.chunks) if lone else None
        draft_save = hidden = None
        if prefill is not None:  # a lone prompt through its bucket's graph: [1, V] (unread where it does not sample)
            if eager.chunks[0].samples:
                parts.append(prefill)
                row_of[id(eager.chunks[0])] = base
        elif eager.chunks:
            batch, sample_rows, prompt_rows = self.build_batch(eager)
            if previous is not None:
                previous.feed(batch.input_ids, [end - 1 for end in batch.query_start[1:]], eager.chunks)
            draft_save = DraftRollback.save(self.model, self.state, eager.chunks)
            result = self.model.forward(batch, self.state, **({"return_hidden": True} if self.return_hidden else {}))
            logits = result.logits  # [N, V] fp32
            hidden = HiddenStates.of(result.final_hidden, eager.chunks, batch.query_start)
            sampled = logits  # [samples, V]; prompt-logprob rows besides the sampled ones are left out
            if sample_rows != list(range(logits.shape[0])):
                sampled = logits[to_device(torch.tensor(sample_rows, dtype=torch.long), logits.device)]
            parts.append(sampled)
            row_of.update(first_rows([c for c in eager.chunks if c.samples], base))
            prompt_logprobs = self._prompt_logprobs(eager, logits, prompt_rows)
        if verify_step is not None:
            hidden = HiddenStates.joined(verify_step.hidden, hidden)
        sampling_chunks = [c for c in output.chunks if c.samples]
        return ForwardStep(output, parts, [row_of[id(c)] for c in sampling_chunks], sampling_chunks, prompt_logprobs,
                           draft_save, hidden, verify_step)

    def _verify(self, chunks: list[ScheduledChunk], previous: LaunchedStep | None
                ) -> tuple[list[ScheduledChunk], VerifyStep | None]:
        """The step's decode chunks verifying drafts, run through a static verification graph (with a speculator:
        ``engine/verify_graphs.py``), and that step; ([], None) where none runs."""
        chosen = self.verify_graphs.select(chunks) if self.verify_graphs is not None else []
        if not chosen:
            return [], None
        fill = None
        if previous is not None and any(c.reads_inflight_token for c in chosen):
            fill = lambda input_ids, rows: previous.feed(input_ids, rows, chosen)
        step = self.verify_graphs.run(chosen, fill)
        return (chosen, step) if step is not None else ([], None)

    def _graphs(self, graphs, chunks: list[ScheduledChunk]) -> bool:
        """Whether captured graphs may run some of ``chunks``: not while a proposer reads hidden states (graphs
        return none), nor for a step verifying drafts (a lone prompt's graph samples one row)."""
        if graphs is None or self.return_hidden:
            return False
        return graphs is self.decode_graphs or not any(c.draft_token_ids for c in chunks)

    def sample(self, step: ForwardStep, prepared: Mapping[int, object] | None = None) -> LaunchedStep:
        """Queue the sampling of every chunk of ``step`` that samples, in the step's order, and the copy of its
        results to the host. ``prepared``: the two-phase logits processors' ``prepare`` started for this step
        (``logits_preparer.LogitsPreparer.start``; the others run in the sampler)."""
        chunks = step.sampling_chunks
        sampler_output, num_emitted = self._sample(chunks, step.parts, step.order, prepared)
        group_rows = None
        if num_emitted is not None:
            group_rows = [len(c.draft_token_ids) + 1 for c in chunks]
            if step.draft_save is not None:
                step.draft_save.rollback(self.model, self.state, chunks, num_emitted)
        if step.verify_step is not None:  # its padding rows are put back even where no chunk verified a draft
            step.verify_step.rollback(self.model, self.state, chunks, num_emitted)
        rows_on_host, num_top, rows_copied = copy_rows_to_host(sampler_output, num_emitted)
        req_ids = [c.request.request_id for c in chunks for _ in range(len(c.draft_token_ids) + 1)]
        return LaunchedStep(step.scheduled, sampler_output, req_ids, step.prompt_logprobs, rows_on_host, num_top,
                            rows_copied, record_event(self.device), group_rows, step.hidden)

    def _sample(self, chunks: list[ScheduledChunk], parts: list[torch.Tensor], order: list[int],
                prepared: Mapping[int, object] | None = None) -> tuple[SamplerOutput | None, torch.Tensor | None]:
        """Sample the chunks' tokens from their logits (``parts`` stacked, row ``order[i]`` for chunk ``i``, followed
        by a row per draft token it verifies); verify drafts (``spec_decode/verify.py``). Returns the sampler's rows
        and, when drafts were verified, the tokens each chunk takes (``[num_chunks]`` on the device)."""
        if not chunks:
            return None, None
        stacked = parts[0] if len(parts) == 1 else torch.cat(parts)
        rows = [(c, j) for c in chunks for j in range(len(c.draft_token_ids) + 1)]  # (chunk, draft position)
        order = [first + j for first, c in zip(order, chunks) for j in range(len(c.draft_token_ids) + 1)]
        if order != list(range(len(order))):
            stacked = stacked[to_device(torch.tensor(order), stacked.device)]
        metadata = self._metadata(rows, stacked.device, prepared)
        if len(rows) == len(chunks):
            return sample(stacked, metadata, greedy=self.model.ops.greedy_sample), None
        verified = verify(stacked, metadata, [c.draft_token_ids for c in chunks], [c.draft_probs for c in chunks],
                          greedy=self.model.ops.greedy_sample)
        return verified.sampler_output, verified.num_emitted

    def _metadata(self, rows: list[tuple[ScheduledChunk, int]], device: torch.device,
                  prepared: Mapping[int, object] | None) -> SamplingMetadata:
        """Sampling metadata of every row: row ``(chunk, j)`` samples the token after the chunk's ``j``-th draft token
        (``j`` 0: after its last non-draft token), as sampling there without speculation would."""
        requests = [c.request for c, _ in rows]
        positions = [c.end - len(c.draft_token_ids) + j for c, j in rows]
        return SamplingMetadata.from_params(
            [r.params for r in requests],
            seeds=[r.seed for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids + c.draft_token_ids[:j] if j else r.output_token_ids
                              for (c, j), r in zip(rows, requests)],
            eos_token_id=self.eos_token_id,
            positions=positions,
            num_output_tokens=[p - len(r.prompt_token_ids) for p, r in zip(positions, requests)],
            bad_words_token_ids=[r.bad_words_token_ids for r in requests],
            logits_processors=self.logits_processors,
            request_ids=[r.request_id for r in requests],
            device=device,
            prepared=prepared,
        )

    def collect(self, launched: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step and read its results to the host."""
        return launched.read()

    def _prompt_logprobs(self, output, logits, prompt_rows) -> dict[str, tuple[int, PromptLogprobsOutput]]:
        result = {}
        for chunk in output.chunks:
            request = chunk.request
            if request.request_id not in prompt_rows:
                continue
            first, _ = prompt_rows[request.request_id]
            # logits row i predicts token start + i + 1; keep those inside the prompt
            targets = request.token_slice(chunk.start + 1, min(chunk.end + 1, len(request.prompt_token_ids)))
            rows = logits[first:first + len(targets)]
            target_ids = to_device(torch.tensor(targets, dtype=torch.long), logits.device)
            plp = compute_prompt_logprobs(rows, target_ids, request.params.prompt_logprobs)
            result[request.request_id] = (chunk.start + 1, PromptLogprobsOutput(
                *(to_host(getattr(plp, f.name)) for f in dataclasses.fields(plp))))
        return result


def copy_rows_to_host(out: SamplerOutput | None, num_emitted: torch.Tensor | None = None,
                      ) -> tuple[torch.Tensor | None, int, torch.Event | None]:
    """Start the sampled rows' copy to the host on the side stream: (the host tensor, n of the top logprobs, the
    event recorded after the copy). ``num_emitted``: the tokens each chunk took after verifying its draft, copied
    last."""
    if out is None:
        return None, 0, None
    n = out.top_token_ids.shape[1] if out.top_token_ids is not None else 0
    parts = [out.sampled_token_ids, out.sampled_logprobs, out.sampled_ranks]
    if n:
        parts += [out.top_token_ids.flatten(), out.top_logprobs.flatten()]
    if num_emitted is not None:
        parts.append(num_emitted)
    device = out.sampled_token_ids.device
    with beside(device):
        flat = torch.cat([p.to(torch.float64) for p in parts])  # exact for int64 ids and float32
        return to_host(flat), n, record_event(device)

"""Runs one scheduled step: builds the flat batch, calls the model, samples, returns plain results."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch

from deepinfer_core.device_copy import beside, record_event, to_device, to_host
from deepinfer_core.engine.decode_graphs import DecodeGraphs
from deepinfer_core.engine.prefill_graphs import PrefillGraphs
from deepinfer_core.engine.scheduler import ScheduledChunk, SchedulerOutput
from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.sampling.sampler import (
    PromptLogprobsOutput,
    SamplerOutput,
    SamplingMetadata,
    compute_prompt_logprobs,
    sample,
)


@dataclasses.dataclass
class ModelRunnerOutput:
    """A step's results on the host: one row per request that sampled (``req_ids``' order), and prompt logprobs."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[float]  # the raw model's log-probability of each sampled token
    ranks: list[int]  # 1 = most likely under the raw model
    top_token_ids: list[list[int]]  # [num_rows][n]; empty rows when no logprobs were asked for
    top_logprobs: list[list[float]]
    prompt_logprobs: dict[str, tuple[int, PromptLogprobsOutput]]  # request id -> (first position, output)

    @property
    def sampled(self) -> dict[str, int]:
        """Request id -> its new token."""
        return dict(zip(self.req_ids, self.sampled_token_ids))


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
        top_ids, top_lps = flat[3 * rows:3 * rows + rows * n], flat[3 * rows + rows * n:]
        return ModelRunnerOutput(
            req_ids=self.req_ids, sampled_token_ids=[int(t) for t in ids], logprobs=lps,
            ranks=[int(r) for r in ranks],
            top_token_ids=[[int(t) for t in top_ids[i * n:(i + 1) * n]] for i in range(rows)],
            top_logprobs=[top_lps[i * n:(i + 1) * n] for i in range(rows)],
            prompt_logprobs=self.prompt_logprobs)

    def feed(self, input_ids: torch.Tensor, rows: list[int], chunks: list[ScheduledChunk]) -> None:
        """Write the tokens this step sampled into ``input_ids`` (device) of the next step: ``rows[i]`` is the
        row of chunk ``i``'s last input token; only chunks whose last token is in flight are written."""
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
            elif chunk.samples:
                logits_rows.append(first_row + chunk.num_tokens - 1)
            if chunk.samples:
                sample_rows.append(len(logits_rows) - 1)
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
        graphed = self.decode_graphs.select(output.chunks) if self.decode_graphs is not None else []
        fill = (lambda input_ids: previous.feed(input_ids, list(range(len(graphed))), graphed)) if previous else None
        graph_logits = self.decode_graphs.run(graphed, fill) if graphed else None  # [G, V]
        if graph_logits is None:
            graphed = []
        in_graph = {id(c) for c in graphed}
        eager = SchedulerOutput([c for c in output.chunks if id(c) not in in_graph], output.preempted)
        parts = [graph_logits] if graphed else []
        row_of = {id(c): i for i, c in enumerate(graphed)}  # chunk -> row of the stacked sampling logits
        prompt_logprobs = {}
        self.num_mixed_steps += bool(graphed and eager.chunks)
        prefill = self.prefill_graphs.run(eager.chunks) if self.prefill_graphs is not None else None  # [1, V]
        if prefill is not None:  # a lone prompt through its bucket's graph
            parts.append(prefill)
            row_of[id(eager.chunks[0])] = len(graphed)
        elif eager.chunks:
            batch, sample_rows, prompt_rows = self.build_batch(eager)
            if previous is not None:
                previous.feed(batch.input_ids, [end - 1 for end in batch.query_start[1:]], eager.chunks)
            logits = self.model.forward(batch, self.state).logits  # [N, V] fp32
            sampled = logits  # [samples, V]; prompt-logprob rows besides the sampled ones are left out
            if sample_rows != list(range(logits.shape[0])):
                sampled = logits[to_device(torch.tensor(sample_rows, dtype=torch.long), logits.device)]
            parts.append(sampled)
            row_of.update({id(c): len(graphed) + i for i, c in enumerate(c for c in eager.chunks if c.samples)})
            prompt_logprobs = self._prompt_logprobs(eager, logits, prompt_rows)
        sampling_chunks = [c for c in output.chunks if c.samples]
        return ForwardStep(output, parts, [row_of[id(c)] for c in sampling_chunks], sampling_chunks, prompt_logprobs)

    def sample(self, step: ForwardStep, prepared: Mapping[int, object] | None = None) -> LaunchedStep:
        """Queue the sampling of every chunk of ``step`` that samples, in the step's order, and the copy of its
        results to the host. ``prepared``: the two-phase logits processors' ``prepare`` started for this step
        (``logits_preparer.LogitsPreparer.start``; the others run in the sampler)."""
        chunks = step.sampling_chunks
        sampler_output = self._sample(chunks, step.parts, step.order, prepared)
        rows_on_host, num_top, rows_copied = copy_rows_to_host(sampler_output)
        return LaunchedStep(step.scheduled, sampler_output, [c.request.request_id for c in chunks],
                            step.prompt_logprobs, rows_on_host, num_top, rows_copied, record_event(self.device))

    def _sample(self, chunks: list[ScheduledChunk], parts: list[torch.Tensor], order: list[int],
                prepared: Mapping[int, object] | None = None) -> SamplerOutput | None:
        """Sample the chunks' tokens from their logits (``parts`` stacked, row ``order[i]`` for chunk ``i``)."""
        if not chunks:
            return None
        stacked = parts[0] if len(parts) == 1 else torch.cat(parts)
        if order != list(range(len(order))):
            stacked = stacked[to_device(torch.tensor(order), stacked.device)]
        requests = [c.request for c in chunks]
        metadata = SamplingMetadata.from_params(
            [r.params for r in requests],
            seeds=[r.seed for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            eos_token_id=self.eos_token_id,
            positions=[c.end for c in chunks],
            num_output_tokens=[c.end - len(r.prompt_token_ids) for c, r in zip(chunks, requests)],
            bad_words_token_ids=[r.bad_words_token_ids for r in requests],
            logits_processors=self.logits_processors,
            request_ids=[r.request_id for r in requests],
            device=stacked.device,
            prepared=prepared,
        )
        return sample(stacked, metadata, greedy=self.model.ops.greedy_sample)

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


def copy_rows_to_host(out: SamplerOutput | None) -> tuple[torch.Tensor | None, int, torch.Event | None]:
    """Start the sampled rows' copy to the host on the side stream: (the host tensor, n of the top logprobs, the
    event recorded after the copy)."""
    if out is None:
        return None, 0, None
    n = out.top_token_ids.shape[1] if out.top_token_ids is not None else 0
    parts = [out.sampled_token_ids, out.sampled_logprobs, out.sampled_ranks]
    if n:
        parts += [out.top_token_ids.flatten(), out.top_logprobs.flatten()]
    device = out.sampled_token_ids.device
    with beside(device):
        flat = torch.cat([p.to(torch.float64) for p in parts])  # exact for int64 ids and float32
        return to_host(flat), n, record_event(device)

"""Runs one scheduled step: builds the flat batch, calls the model, samples, returns plain results."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from deepinfer_core.engine.decode_graphs import DecodeGraphs
from deepinfer_core.engine.scheduler import SchedulerOutput
from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.sampling.sampler import (
    PromptLogprobsOutput,
    SamplerOutput,
    SamplingMetadata,
    compute_prompt_logprobs,
    sample,
)


@dataclasses.dataclass
class SampledRows:
    """The sampler's per-row results on the host (row order of ``SamplerOutput``), read in one device copy."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_token_ids: list[list[int]]  # [num_rows][n]; empty rows when no logprobs were asked for
    top_logprobs: list[list[float]]

    @classmethod
    def read(cls, out: SamplerOutput) -> SampledRows:
        rows = out.sampled_token_ids.shape[0]
        n = out.top_token_ids.shape[1] if out.top_token_ids is not None else 0
        parts = [out.sampled_token_ids, out.sampled_logprobs, out.sampled_ranks]
        if n:
            parts += [out.top_token_ids.flatten(), out.top_logprobs.flatten()]
        flat = torch.cat([p.to(torch.float64) for p in parts]).tolist()  # exact for int64 ids and float32
        ids, lps, ranks = flat[:rows], flat[rows:2 * rows], flat[2 * rows:3 * rows]
        top_ids, top_lps = flat[3 * rows:3 * rows + rows * n], flat[3 * rows + rows * n:]
        return cls([int(t) for t in ids], lps, [int(r) for r in ranks],
                   [[int(t) for t in top_ids[i * n:(i + 1) * n]] for i in range(rows)],
                   [top_lps[i * n:(i + 1) * n] for i in range(rows)])


@dataclasses.dataclass
class ModelRunnerOutput:
    """What a step produced: sampled tokens (request id -> token) and their log-probabilities."""

    sampled: dict[str, int]
    sampler_output: SamplerOutput | None
    sampled_order: list[str]  # request ids, row order of sampler_output
    prompt_logprobs: dict[str, tuple[int, PromptLogprobsOutput]]  # request id -> (first position, output)
    rows: SampledRows | None = None  # sampler_output on the host


class ModelRunner:
    """Owns the model and its state pools; turns a ``SchedulerOutput`` into sampled tokens."""

    def __init__(self, model, state, eos_token_id: int | None, decode_graphs: DecodeGraphs | None = None):
        self.model = model
        self.state = state
        self.eos_token_id = eos_token_id
        self.device = model.device
        self.decode_graphs = decode_graphs
        self.num_mixed_steps = 0  # steps that replayed a graph for their decodes and ran their prefill eagerly

    def build_batch(self, output: SchedulerOutput) -> tuple[ForwardBatch, list[int], dict[str, tuple[int, int]]]:
        """The flat batch, the logits row of each sampling chunk, and prompt-logprob row ranges."""
        tokens: list[int] = []
        positions: list[int] = []
        query_start = [0]
        sample_rows: list[int] = []
        prompt_rows: dict[str, tuple[int, int]] = {}
        logits_rows: list[int] = []
        for chunk in output.chunks:
            request = chunk.request
            tokens.extend(request.token_slice(chunk.start, chunk.end))
            positions.extend(range(chunk.start, chunk.end))
            first_row = query_start[-1]
            query_start.append(first_row + chunk.num_tokens)
            if request.wants_prompt_logprobs:
                prompt_rows[request.request_id] = (len(logits_rows), chunk.num_tokens)
                logits_rows.extend(range(first_row, first_row + chunk.num_tokens))
            elif chunk.samples:
                logits_rows.append(first_row + chunk.num_tokens - 1)
            if chunk.samples:
                sample_rows.append(len(logits_rows) - 1)
        batch = ForwardBatch(
            input_ids=torch.tensor(tokens, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            query_start=query_start,
            context_lens=[c.start for c in output.chunks],
            slots=[c.request.slot for c in output.chunks],
            block_tables=[c.request.block_ids for c in output.chunks],
            logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=self.device),
            compressed_write_start=[c.request.replay_until for c in output.chunks],
            sliding_floor=[c.request.sliding_floor for c in output.chunks],
        )
        return batch, sample_rows, prompt_rows

    def execute(self, output: SchedulerOutput, while_device_runs: Callable[[], None] | None = None) -> ModelRunnerOutput:
        """Run the step: its decode chunks through the captured graphs (when there are), the rest eagerly
        in one forward; then sample every chunk that samples, in the step's order. ``while_device_runs``: host
        work called once the step is launched, before the host waits for the sampled tokens."""
        graphed = self.decode_graphs.select(output.chunks) if self.decode_graphs is not None else []
        graph_logits = self.decode_graphs.run(graphed) if graphed else None  # [G, V]
        if graph_logits is None:
            graphed = []
        in_graph = {id(c) for c in graphed}
        eager = SchedulerOutput([c for c in output.chunks if id(c) not in in_graph], output.preempted)
        parts = [graph_logits] if graphed else []
        row_of = {id(c): i for i, c in enumerate(graphed)}  # chunk -> row of the stacked sampling logits
        prompt_logprobs = {}
        if eager.chunks:
            self.num_mixed_steps += bool(graphed)
            batch, sample_rows, prompt_rows = self.build_batch(eager)
            logits = self.model.forward(batch, self.state).logits  # [N, V] fp32
            parts.append(logits[sample_rows])
            row_of.update({id(c): len(graphed) + i for i, c in enumerate(c for c in eager.chunks if c.samples)})
            prompt_logprobs = self._prompt_logprobs(eager, logits, prompt_rows)
        sampling_chunks = [c for c in output.chunks if c.samples]
        sampling = [c.request for c in sampling_chunks]
        sampler_output = None
        if sampling:
            stacked = parts[0] if len(parts) == 1 else torch.cat(parts)
            order = [row_of[id(c)] for c in sampling_chunks]
            if order != list(range(len(order))):
                stacked = stacked[torch.tensor(order, device=stacked.device)]
            metadata = SamplingMetadata.from_params(
                [r.params for r in sampling],
                seeds=[r.seed for r in sampling],
                prompt_token_ids=[r.prompt_token_ids for r in sampling],
                output_token_ids=[r.output_token_ids for r in sampling],
                eos_token_id=self.eos_token_id,
                device=stacked.device,
            )
            sampler_output = sample(stacked, metadata)
        if while_device_runs is not None:
            while_device_runs()
        rows = SampledRows.read(sampler_output) if sampler_output is not None else None
        return ModelRunnerOutput(
            sampled={r.request_id: t for r, t in zip(sampling, rows.token_ids if rows else [])},
            sampler_output=sampler_output,
            sampled_order=[r.request_id for r in sampling],
            prompt_logprobs=prompt_logprobs,
            rows=rows,
        )

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
            target_ids = torch.tensor(targets, dtype=torch.long, device=logits.device)
            result[request.request_id] = (chunk.start + 1, compute_prompt_logprobs(
                rows, target_ids, request.params.prompt_logprobs))
        return result

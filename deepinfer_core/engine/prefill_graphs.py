"""Lone prompts prefilled through captured graphs, one per token bucket.

A step that prefills one whole prompt from its first token (no prefix hit, no prompt logprobs) would otherwise run
eagerly, launch by launch, and a prompt's many small kernels can take longer to launch than to run. Here the prompt
is padded to the next bucket (``BUCKETS``) with padding tokens (id 0) after it, and the step replays a graph
captured once per bucket. The host builds the step's layout for the padded chunk into fixed buffers
(``StaticStepModel.place_prefill_inputs``: only the prompt's tokens write state; the padding writes the spare block)
and uploads it in one copy; the graph finishes the layout on the device (``prefill_layout``) and runs the model.
The padding comes after every prompt token, so causal attention keeps it out of every prompt token's view, and the
logits are the last prompt token's. A prompt shorter than ``model.prefill_min_tokens()`` runs eagerly, as does a
step with anything else in it. The backend captures (``Backend.capture_graph``); on a backend without graphs the
same padded step runs eagerly (that is how the CPU tests check it against the eager path).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from deepinfer_core.engine.decode_graphs import capture_or_explain
from deepinfer_core.engine.scheduler import ScheduledChunk
from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.models.interface import StaticStepModel
from deepinfer_core.static_buffers import StaticBuffers

logger = logging.getLogger("deepinfer")

BUCKETS = (512, 1024, 2048, 4096, 8192)


@dataclasses.dataclass
class CapturedPrefill:
    """One captured bucket: its fixed inputs and the callable that replays it."""

    buffers: StaticBuffers
    replay: Callable[[], None]  # runs the step; its logits land in ``PrefillGraphs.logits``


class PrefillGraphs:
    """Runs the steps that prefill one lone prompt through captured graphs (see module docstring)."""

    def __init__(self, model: StaticStepModel, state, capture: Callable, max_tokens: int, spare_slot: int, spare_block: int,
                 buckets: tuple[int, ...] = BUCKETS):
        self.model = model
        self.state = state
        self.capture = capture
        self.buckets = sorted(b for b in buckets if b <= max_tokens)
        self.min_tokens = model.prefill_min_tokens()
        self.spare_slot = spare_slot
        self.spare_block = spare_block
        self.captured: dict[int, CapturedPrefill] = {}
        self.logits = torch.empty(1, model.vocab_size, dtype=torch.float32, device=model.device)
        self.num_replays = 0
        self.disabled_reason: str | None = None

    def bucket(self, chunks: list[ScheduledChunk]) -> int | None:
        """The bucket of a step that is one whole prompt from its first token, which samples and wants no prompt
        logprobs, between ``min_tokens`` and the largest bucket long; else None (the step runs eagerly)."""
        if self.disabled_reason is not None or len(chunks) != 1:
            return None
        chunk, request = chunks[0], chunks[0].request
        if (chunk.start != 0 or not chunk.samples or chunk.wants_prompt_logprobs or chunk.reads_inflight_token
                or request.replay_until or request.sliding_floor or chunk.num_tokens < self.min_tokens):
            return None
        return next((b for b in self.buckets if b >= chunk.num_tokens), None)

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """Logits ``[1, V]`` of a step ``bucket`` takes (valid until the next replay), else None (run it eagerly)."""
        bucket = self.bucket(chunks)
        if bucket is None:
            return None
        step = self.captured.get(bucket) or self._capture(bucket)
        if step is None:
            return None
        chunk = chunks[0]
        self._place(self._padded_batch(chunk, bucket), step.buffers, chunk.num_tokens)
        self.num_replays += 1
        step.replay()
        return self.logits

    def _capture(self, bucket: int) -> CapturedPrefill | None:
        host = self._padded_batch(None, bucket)  # padding only: the capture touches the spare slot and block
        buffers, (batch, inputs) = StaticBuffers.sized(self.model.device,
                                                       lambda buffers: self._place(host, buffers, bucket))
        logits = self.logits

        def step_fn() -> None:
            layout = self.model.prefill_layout(inputs)
            logits.copy_(self.model.forward(batch, self.state, layout=layout).logits)

        replay, self.disabled_reason = capture_or_explain(self.capture, step_fn, f"prefill graph of {bucket} tokens")
        if replay is None:
            return None
        step = CapturedPrefill(buffers, replay)
        self.captured[bucket] = step
        logger.debug("captured a prefill step of %d tokens", bucket)
        return step

    def _place(self, host: ForwardBatch, buffers: StaticBuffers, written: int) -> tuple[ForwardBatch, object]:
        """Write a padded host batch's token ids, positions, logits row and layout inputs (its first ``written``
        tokens writing state) into ``buffers`` and upload them in one copy. Returns the batch and the layout inputs
        over the buffers' device tensors."""
        buffers.rewind()
        batch = dataclasses.replace(host, input_ids=buffers.place(host.input_ids),
                                    positions=buffers.place(host.positions), logits_rows=buffers.place(host.logits_rows))
        inputs = self.model.place_prefill_inputs(batch, self.state, buffers, written, self.spare_block)
        buffers.upload()
        return batch, inputs

    def _padded_batch(self, chunk: ScheduledChunk | None, bucket: int) -> ForwardBatch:
        """The prompt's tokens (none for the capture), then padding tokens to ``bucket``; its block table padded
        with the spare block to the bucket's blocks."""
        tokens = chunk.request.input_tokens(0, chunk.end) if chunk is not None else []
        blocks = -(-bucket // self.state.block_size)
        table = list(chunk.request.block_ids[:blocks]) if chunk is not None else []
        return ForwardBatch(
            input_ids=torch.tensor(tokens + [0] * (bucket - len(tokens)), dtype=torch.long),
            positions=torch.arange(bucket),
            query_start=[0, bucket],
            context_lens=[0],
            slots=[chunk.request.slot if chunk is not None else self.spare_slot],
            block_tables=[table + [self.spare_block] * (blocks - len(table))],
            logits_rows=torch.tensor([max(len(tokens), 1) - 1]),
            compressed_write_start=[0],
            sliding_floor=[0],
        )

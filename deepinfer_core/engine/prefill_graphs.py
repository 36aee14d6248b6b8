"""Lone chunks prefilled through captured graphs, one per (token bucket, context bucket).

A step that prefills one chunk of one request (no prompt logprobs, its last token known on the host) would
otherwise run eagerly, launch by launch, and a prompt's many small kernels can take longer to launch than to run.
Here the chunk is padded to the next bucket (``BUCKETS``) with padding tokens (id 0) after it, and the step replays
a graph captured once per bucket and context bucket. The host builds the step's layout for the padded chunk into
fixed buffers (``StaticStepModel.place_prefill_inputs``: only the chunk's tokens write state; the padding writes the
spare block) and uploads it in one copy; the graph finishes the layout on the device (``prefill_layout``) and runs
the model. The padding comes after every chunk token, so causal attention keeps it out of every chunk token's view,
and the logits are the last chunk token's.

A chunk from token 0 is captured at ``context_len == bucket``. A chunk that starts past token 0 (the replay that
rebuilds the sliding window after a prefix hit, exact or bounded; a chunk after a restored window; a later chunk of
a long prompt) takes the same path (in buckets that are a multiple of the block size, so the compressor windows it
completes are as many wherever it starts) at a context bucket (``bucket * 2^k`` covering the chunk's padded end): where it
starts, where its compressed writes start (``Request.replay_until``) and where its window reads start
(``Request.sliding_floor``) are values in the static buffers, not shapes, so a prefix hit runs the captured kernels
a miss runs. A chunk shorter than ``model.prefill_min_tokens()`` runs eagerly, as does a step with anything else in
it. The backend captures (``Backend.capture_graph``); on a backend without graphs the same padded step runs eagerly
(that is how the CPU tests check it against the eager path). ``num_replays`` counts the steps run this way,
``num_offset_replays`` those of a chunk past token 0.
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

BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192)


@dataclasses.dataclass
class CapturedPrefill:
    """One captured bucket: its fixed inputs and the callable that replays it."""

    buffers: StaticBuffers
    replay: Callable[[], None]  # runs the step; its logits land in ``PrefillGraphs.logits``


class PrefillGraphs:
    """Runs the steps that prefill one lone chunk through captured graphs (see module docstring)."""

    def __init__(self, model: StaticStepModel, state, capture: Callable, max_tokens: int, spare_slot: int, spare_block: int,
                 buckets: tuple[int, ...] = BUCKETS):
        self.model = model
        self.state = state
        self.capture = capture
        self.buckets = sorted(b for b in buckets if b <= max_tokens)
        self.min_tokens = model.prefill_min_tokens()
        self.spare_slot = spare_slot
        self.spare_block = spare_block
        self.captured: dict[tuple[int, int], CapturedPrefill] = {}  # (bucket, context_len) -> its graph
        self.logits = torch.empty(1, model.vocab_size, dtype=torch.float32, device=model.device)
        self.num_replays = 0
        self.num_offset_replays = 0  # of chunks past token 0 (after a prefix hit, a later chunk)
        self.disabled_reason: str | None = None

    def bucket(self, chunks: list[ScheduledChunk]) -> tuple[int, int] | None:
        """The (bucket, context bucket) of a step that is one chunk of one request, which wants no prompt logprobs
        and whose tokens are on the host, between ``min_tokens`` and the largest bucket long; else None (the step runs
        eagerly). A chunk that does not sample (a long prompt's earlier chunk, a prompt split before its last token)
        takes it too: its logits row is left unread."""
        if self.disabled_reason is not None or len(chunks) != 1:
            return None
        chunk = chunks[0]
        if (chunk.wants_prompt_logprobs or chunk.reads_inflight_token
                or chunk.num_tokens < self.min_tokens):
            return None
        bucket = next((b for b in self.buckets if b >= chunk.num_tokens), None)
        if bucket is None or (chunk.start and bucket % self.state.block_size):  # a window count fixed by the bucket
            return None
        return bucket, context_bucket(bucket, chunk.start)

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """Logits ``[1, V]`` of a step ``bucket`` takes (valid until the next replay), else None (run it eagerly)."""
        key = self.bucket(chunks)
        if key is None:
            return None
        step = self.captured.get(key) or self._capture(*key)
        if step is None:
            return None
        chunk = chunks[0]
        self._place(self._padded_batch(chunk, *key), step.buffers, chunk.num_tokens, key[1])
        self.num_replays += 1
        self.num_offset_replays += chunk.start > 0
        step.replay()
        return self.logits

    def _capture(self, bucket: int, context_len: int) -> CapturedPrefill | None:
        host = self._padded_batch(None, bucket, context_len)  # padding only: touches the spare slot and block
        buffers, (batch, inputs) = StaticBuffers.sized(
            self.model.device, lambda buffers: self._place(host, buffers, bucket, context_len))
        logits = self.logits

        def step_fn() -> None:
            layout = self.model.prefill_layout(inputs)
            logits.copy_(self.model.forward(batch, self.state, layout=layout).logits)

        name = f"prefill graph of {bucket} tokens" + (f" at context {context_len}" if context_len > bucket else "")
        replay, self.disabled_reason = capture_or_explain(self.capture, step_fn, name)
        if replay is None:
            return None
        step = CapturedPrefill(buffers, replay)
        self.captured[bucket, context_len] = step
        logger.debug("captured a %s", name)
        return step

    def _place(self, host: ForwardBatch, buffers: StaticBuffers, written: int,
               context_len: int) -> tuple[ForwardBatch, object]:
        """Write a padded host batch's token ids, positions, logits row and layout inputs (its first ``written``
        tokens writing state) into ``buffers`` and upload them in one copy. Returns the batch and the layout inputs
        over the buffers' device tensors."""
        buffers.rewind()
        batch = dataclasses.replace(host, input_ids=buffers.place(host.input_ids),
                                    positions=buffers.place(host.positions), logits_rows=buffers.place(host.logits_rows))
        inputs = self.model.place_prefill_inputs(batch, self.state, buffers, written, self.spare_block,
                                                 context_len=context_len)
        buffers.upload()
        return batch, inputs

    def _padded_batch(self, chunk: ScheduledChunk | None, bucket: int, context_len: int) -> ForwardBatch:
        """The chunk's tokens (none for the capture, which sits at the end of ``context_len``), then padding tokens
        to ``bucket``; its block table padded with the spare block to ``context_len``'s blocks."""
        blocks = -(-context_len // self.state.block_size)
        if chunk is None:
            start, tokens, table, slot, write_start, floor = context_len - bucket, [], [], self.spare_slot, 0, 0
        else:
            request = chunk.request
            start, tokens, table, slot = chunk.start, request.input_tokens(chunk.start, chunk.end), request.block_ids, request.slot
            write_start, floor = request.replay_until, request.sliding_floor
        table = list(table[:blocks])
        return ForwardBatch(
            input_ids=torch.tensor(tokens + [0] * (bucket - len(tokens)), dtype=torch.long),
            positions=torch.arange(start, start + bucket),
            query_start=[0, bucket],
            context_lens=[start],
            slots=[slot],
            block_tables=[table + [self.spare_block] * (blocks - len(table))],
            logits_rows=torch.tensor([max(len(tokens), 1) - 1]),
            compressed_write_start=[write_start],
            sliding_floor=[floor],
        )


def context_bucket(bucket: int, start: int) -> int:
    """The context a chunk of ``bucket`` padded tokens from ``start`` is captured at: ``bucket`` from token 0, else
    the smallest ``bucket * 2^k`` that holds ``start + bucket`` (one graph serves every start up to it)."""
    context = bucket
    while context < start + bucket:
        context *= 2
    return context

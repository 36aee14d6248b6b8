"""Decode steps at static shapes, captured as device graphs once per (batch size, context bucket).

The chunks of a step that fold exactly one token and sample (decode chunks, prompt logprobs aside) are
padded to the next captured batch size with dummy sequences, and their layout to the model's static shape for that
size and context bucket (``StaticStepModel.static_shape``: for DeepSeek-V4, keys to the window and compressed
entries to the context bucket divided by the ratio); the step's other chunks (prefill) run eagerly beside them, so a long prompt chunk never pads the decodes (a lone
prompt replays its own graph: ``engine/prefill_graphs.py``). The host
uploads the step's token ids, positions and per-sequence inputs (context lengths, slots, block tables) into fixed
buffers in one copy (``StaticStepModel.place_decode_inputs``) and replays the graph, which computes the step's
index layout from them on the device (``StaticStepModel.decode_layout``) and runs the model. Dummy sequences read and write only the state's spare slot and spare
block, which the state manager never hands out.

The backend captures (``Backend.capture_graph``): a CUDA graph on NVIDIA; on a backend without graphs
the same static-shape step runs eagerly (that is how the CPU tests check this path against the dynamic one).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from deepinfer_core.engine.scheduler import ScheduledChunk
from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.models.interface import StaticStepModel
from deepinfer_core.static_buffers import StaticBuffers

logger = logging.getLogger("deepinfer")

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
MIN_CONTEXT_BUCKET = 256
FINE_CONTEXT_FROM = 8192  # contexts beyond this take quarter-octave buckets


@dataclasses.dataclass
class CapturedStep:
    """One captured decode shape: its static inputs and the callable that replays it."""

    shape: Any  # the model's static shape
    batch: ForwardBatch  # input_ids / positions / logits_rows are the fixed device buffers
    inputs: Any  # the layout's inputs, in fixed device buffers too
    buffers: StaticBuffers
    replay: Callable[[], None]  # runs the step; its logits land in ``DecodeGraphs.logits``


class DecodeGraphs:
    """Runs decode steps through captured static-shape graphs (see module docstring)."""

    def __init__(self, model: StaticStepModel, state, capture: Callable, sizes: Sequence[int], max_model_len: int,
                 spare_slot: int, spare_block: int):
        self.model = model
        self.state = state
        self.capture = capture
        self.sizes = graph_sizes(sizes)
        multiple = model.block_multiple
        self.max_context = -(-max_model_len // multiple) * multiple
        self.spare_slot = spare_slot
        self.spare_block = spare_block
        self.captured: dict[tuple[int, int], CapturedStep] = {}
        # every graph writes its logits here: one [largest size, vocab] buffer instead of one per captured graph
        self.logits = torch.empty(self.sizes[-1], model.vocab_size, dtype=torch.float32, device=model.device)
        self.num_replays = 0
        self.disabled_reason: str | None = None

    def select(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """The chunks of a step that a captured graph runs: one-token chunks that sample and want no prompt
        logprobs (decode), at most the largest captured size of them; the engine runs the rest eagerly."""
        if self.disabled_reason is not None:
            return []
        decode = [c for c in chunks if c.num_tokens == 1 and c.samples and not c.wants_prompt_logprobs]
        return decode[:self.sizes[-1]]

    def run(self, chunks: list[ScheduledChunk],
            fill_inputs: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor | None:
        """Logits ``[S, V]`` of these one-token chunks, or None when capture failed (run them eagerly).
        ``fill_inputs`` gets the graph's input ids (device, row ``i`` for chunk ``i``) after the host's inputs
        are uploaded and before the replay: it writes the tokens still in flight."""
        size = next(n for n in self.sizes if n >= len(chunks))
        key = (size, self.context_bucket(max(c.end for c in chunks)))
        step = self.captured.get(key) or self._capture(*key)
        if step is None:
            return None
        self._place_inputs(self._padded_batch(chunks, size), step.shape, step.buffers)
        if fill_inputs is not None:
            fill_inputs(step.batch.input_ids)
        self.num_replays += 1
        step.replay()
        return self.logits[:len(chunks)]

    def context_bucket(self, length: int) -> int:
        """The static context length for sequences of up to ``length`` tokens (``context_bucket``), at most
        ``max_model_len`` rounded up."""
        return context_bucket(length, self.model.block_multiple, self.max_context)

    def _capture(self, size: int, context: int) -> CapturedStep | None:
        shape = self.model.static_shape(size, context, self.spare_slot, self.spare_block)
        host = self._padded_batch([], size)  # all dummies: capture touches only the spare slot and block
        buffers, (batch, inputs) = StaticBuffers.sized(self.model.device,
                                                       lambda buffers: self._place_inputs(host, shape, buffers))
        logits = self.logits[:size]

        def step_fn() -> None:
            layout = self.model.decode_layout(inputs, self.state, shape)
            logits.copy_(self.model.forward(batch, self.state, layout=layout).logits)

        replay, self.disabled_reason = capture_or_explain(self.capture, step_fn,
                                                          f"decode graph at batch {size}, context {context}")
        if replay is None:
            return None
        step = CapturedStep(shape, batch, inputs, buffers, replay)
        self.captured[(size, context)] = step
        logger.debug("captured decode step: batch %d, context %d", size, context)
        return step

    def _place_inputs(self, host: ForwardBatch, shape: Any, buffers: StaticBuffers):
        """Write a padded host batch's token ids, positions and layout inputs into ``buffers`` and upload them in
        one copy. Returns the batch and the layout inputs over the buffers' device tensors."""
        buffers.rewind()
        batch = dataclasses.replace(host, input_ids=buffers.place(host.input_ids),
                                    positions=buffers.place(host.positions), logits_rows=buffers.place(host.logits_rows))
        inputs = self.model.place_decode_inputs(host, self.state, shape, buffers)
        buffers.upload()
        return batch, inputs

    def _padded_batch(self, chunks: list[ScheduledChunk], size: int) -> ForwardBatch:
        """The step's one-token sequences on the host, then dummies (token 0 at position 0, spare state)."""
        pad = size - len(chunks)
        starts = [c.start for c in chunks] + [0] * pad
        tokens = [c.request.input_tokens(c.start, c.end)[0] for c in chunks] + [0] * pad
        return ForwardBatch(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            positions=torch.tensor(starts, dtype=torch.long),
            query_start=list(range(size + 1)),
            context_lens=starts,
            slots=[c.request.slot for c in chunks] + [self.spare_slot] * pad,
            block_tables=[c.request.block_ids for c in chunks] + [[self.spare_block]] * pad,
            logits_rows=torch.arange(size),
            compressed_write_start=[c.request.replay_until for c in chunks] + [0] * pad,
            sliding_floor=[c.request.sliding_floor for c in chunks] + [0] * pad,
        )


def context_bucket(length: int, multiple: int, cap: int) -> int:
    """The static context of a captured step for sequences of up to ``length`` tokens: a power of two (at least
    ``MIN_CONTEXT_BUCKET``); beyond ``FINE_CONTEXT_FROM`` the least of 1, 1.25, 1.5 and 1.75 times a power of two that
    covers ``length`` (a decode step's compressed entries, indexer scores and attention grow with the bucket, so a
    bucket pads by at most a quarter there, not double); rounded up to ``multiple``, at most ``cap``."""
    bucket = max(MIN_CONTEXT_BUCKET, 1 << max(0, length - 1).bit_length())
    if bucket > FINE_CONTEXT_FROM:
        half, quarter = bucket // 2, bucket // 8
        bucket = half + quarter * -(-(length - half) // quarter)
    return min(-(-bucket // multiple) * multiple, cap)


def capture_or_explain(capture: Callable, step_fn: Callable[[], None], what: str
                       ) -> tuple[Callable[[], None] | None, str | None]:
    """``capture(step_fn, ())``, or (None, why) where capture fails (e.g. an op that synchronises with the host),
    logged once: the caller runs those steps eagerly from then on."""
    try:
        return capture(step_fn, ()), None
    except RuntimeError as exc:
        reason = f"{what}: capture failed: {exc}"
        logger.warning("%s; such steps run eagerly from now on", reason, exc_info=True)
        return None, reason


def graph_sizes(sizes: Sequence[int], error: type[Exception] = ValueError,
                what: str = "graph batch sizes") -> list[int]:
    """The distinct batch sizes to capture, ascending; ``error`` naming ``what`` when one is not a positive integer."""
    distinct = sorted(set(sizes))
    if not distinct or distinct[0] < 1:
        raise error(f"{what} must be positive integers, got {list(sizes)}")
    return distinct


def default_sizes(max_num_seqs: int) -> list[int]:
    """Captured batch sizes: the defaults up to ``max_num_seqs``, and ``max_num_seqs`` itself."""
    return [n for n in DEFAULT_SIZES if n < max_num_seqs] + [max_num_seqs]

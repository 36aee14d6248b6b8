"""Verification steps at static shapes, captured as device graphs once per (batch size, context bucket, tokens per
sequence): the speculative counterpart of ``engine/decode_graphs.py``, used only when a speculator is configured.

A step whose decode chunks carry draft tokens computes ``1 + d`` tokens of each sequence (its newest token and its
``d`` draft tokens). Here those chunks are padded to ``T = 1 + max d`` tokens each (padding token id 0 after a
sequence's own tokens, at the positions that follow) and to the next captured batch size with dummy sequences
(spare slot, spare block), so the step's shapes depend on (batch size, context bucket, ``T``) alone. Every token of
the padded step writes state, as a draft token does: the model saves the per-sequence rows (sliding-window ring,
compressor carries) of positions ``start + 1 .. start + T - 1`` inside the graph (``StaticVerifyModel
.save_draft_rows``: device ops of fixed shapes) and, after verification, puts back those past each sequence's
accepted tokens (``rollback_draft_state``, device ops only, no host sync): a padding row is a draft token that is
always rejected. Compressed entries and indexer keys a padding row completes land in the sequence's block (or the
spare block past its table) and, like a rejected draft's, are written again before any query reads them.

The host builds the step's index layout into fixed buffers (``StaticVerifyModel.place_verify_inputs``) and uploads it
in one copy; the graph computes the masks (``verify_layout``), saves the draft rows and runs the model over every
row, its logits (and, for a proposer that reads them, the hidden states) landing in buffers the graphs share. The
verification sampling (``spec_decode/verify.py``) then reads each chunk's ``1 + d`` rows. The padding rows of a
sequence come after its own tokens, so causal attention keeps them out of every real row's view.

Ops see an ordinary ``StepLayout`` of ``T`` queries per sequence (what eager verification and the prefill graphs
run), not the one-query ``DecodeLayout``: backend kernels specialised for one query per sequence (the NVIDIA
``decode_attention``) are not taken, their general paths are. On a backend without graphs the same padded step
runs eagerly (how the CPU tests check it against eager verification). ``num_replays`` counts the steps run this way.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from deepinfer_core.device_copy import to_device
from deepinfer_core.engine.decode_graphs import capture_or_explain, context_bucket, graph_sizes
from deepinfer_core.engine.scheduler import ScheduledChunk
from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.models.interface import StaticVerifyModel, missing_members
from deepinfer_core.spec_decode.rows import HiddenStates
from deepinfer_core.static_buffers import StaticBuffers

logger = logging.getLogger("deepinfer")

NO_ROLLBACK = 1 << 62  # keep_until of a dummy sequence: none of its rows is put back


@dataclasses.dataclass
class CapturedVerify:
    """One captured verification shape: its fixed buffers, the callable that replays it, and what it saved."""

    buffers: StaticBuffers
    replay: Callable[[], None]  # runs the step; logits land in ``VerifyGraphs.logits``, hidden states in ``.hidden``
    saved: dict  # "rows": the model's save of the draft rows (refreshed by every replay)


@dataclasses.dataclass
class VerifyStep:
    """A replayed verification step: each chunk's sampling rows, the hidden states, and the save to roll back."""

    logits: torch.Tensor  # [sum(1 + d), V]: chunk i's 1 + d_i rows, in chunk order
    hidden: HiddenStates | None
    saved: Any  # the model's save of the padded step's draft rows
    starts: list[int]  # each graph sequence's first position (dummies: NO_ROLLBACK)
    chunk_ids: list[int]  # id() of the chunk of each real graph sequence

    def rollback(self, model, state, sampling_chunks: list, num_emitted: torch.Tensor | None) -> None:
        """Put back the saved rows past each sequence's kept tokens (``num_emitted [sampling chunks]`` on the device,
        None: one each), without a host sync."""
        index = {id(c): i for i, c in enumerate(sampling_chunks)}
        rows = [index[chunk_id] for chunk_id in self.chunk_ids] + [0] * (len(self.starts) - len(self.chunk_ids))
        host = torch.tensor([rows, self.starts], dtype=torch.long)  # [2, S]
        rows_t, base = to_device(host, model.device).unbind(0)
        emitted = num_emitted[rows_t] if num_emitted is not None else torch.ones_like(base)
        model.rollback_draft_state(state, self.saved, base + emitted)  # [S] first position put back


class VerifyGraphs:
    """Runs verification steps through captured static-shape graphs (see module docstring)."""

    def __init__(self, model: StaticVerifyModel, state, capture: Callable, sizes: Sequence[int], max_model_len: int,
                 max_tokens_per_seq: int, spare_slot: int, spare_block: int, return_hidden: bool = False):
        self.model = model
        self.state = state
        self.capture = capture
        self.sizes = graph_sizes(sizes)
        self.max_tokens_per_seq = max_tokens_per_seq
        multiple = model.block_multiple
        self.max_context = -(-(max_model_len + max_tokens_per_seq) // multiple) * multiple
        self.spare_slot = spare_slot
        self.spare_block = spare_block
        self.return_hidden = return_hidden
        self.captured: dict[tuple[int, int, int], CapturedVerify] = {}
        self.logits: torch.Tensor | None = None  # [largest size x tokens, V], shared by every graph, made at the first
        # capture (an engine whose steps never verify a draft holds none)
        self.hidden: torch.Tensor | None = None  # [rows, ...], made at the first warm-up when return_hidden
        self.num_replays = 0
        self.replays_by_tokens: dict[int, int] = {}  # tokens per sequence -> replays
        self.disabled_reason: str | None = None

    @staticmethod
    def supported(model) -> bool:
        """Whether ``model`` has the members of ``StaticVerifyModel``."""
        return not missing_members(model, StaticVerifyModel)

    def select(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """The chunks a captured verification step runs: decode chunks (a known newest token and its draft, which
        sample and want no prompt logprobs), at most the largest captured size, when at least one of them carries a
        draft; none otherwise (then the decode graphs or the eager path run them)."""
        if self.disabled_reason is not None:
            return []
        decode = [c for c in chunks if c.samples and not c.wants_prompt_logprobs
                  and c.num_tokens == len(c.draft_token_ids) + 1 <= self.max_tokens_per_seq]
        decode = decode[:self.sizes[-1]]
        return decode if any(c.draft_token_ids for c in decode) else []

    def run(self, chunks: list[ScheduledChunk],
            fill_inputs: Callable[[torch.Tensor, list[int]], None] | None = None) -> VerifyStep | None:
        """Replay the step of these chunks, or None when capture failed (run them eagerly). ``fill_inputs(input_ids,
        rows)`` writes the tokens still in flight (row ``rows[i]`` is chunk ``i``'s last token) before the replay."""
        size = next(n for n in self.sizes if n >= len(chunks))
        tokens = max(c.num_tokens for c in chunks)
        key = (size, self.context_bucket(max(c.start for c in chunks) + tokens), tokens)
        step = self.captured.get(key) or self._capture(*key)
        if step is None:
            return None
        batch, _ = self._place(self._padded_batch(chunks, *key), key[1], step.buffers)
        if fill_inputs is not None:
            fill_inputs(batch.input_ids, [i * tokens + c.num_tokens - 1 for i, c in enumerate(chunks)])
        self.num_replays += 1
        self.replays_by_tokens[tokens] = self.replays_by_tokens.get(tokens, 0) + 1
        step.replay()
        rows = [i * tokens + j for i, c in enumerate(chunks) for j in range(c.num_tokens)]
        logits = self.logits[to_device(torch.tensor(rows, dtype=torch.long), self.logits.device)]
        hidden = None
        if self.return_hidden:
            hidden = HiddenStates.of(self.hidden[:size * tokens], chunks, [i * tokens for i in range(len(chunks))])
        starts = [c.start for c in chunks] + [NO_ROLLBACK] * (size - len(chunks))
        return VerifyStep(logits, hidden, step.saved["rows"], starts, [id(c) for c in chunks])

    def context_bucket(self, length: int) -> int:
        """The static context for sequences (padding included) of up to ``length`` tokens
        (``decode_graphs.context_bucket``), at most ``max_model_len`` plus a step's tokens."""
        return context_bucket(length, self.model.block_multiple, self.max_context)

    def _capture(self, size: int, context: int, tokens: int) -> CapturedVerify | None:
        if self.logits is None:
            self.logits = torch.empty(self.sizes[-1] * self.max_tokens_per_seq, self.model.vocab_size,
                                      dtype=torch.float32, device=self.model.device)
        host = self._padded_batch([], size, context, tokens)  # all dummies: capture touches only the spare state
        buffers, (batch, (inputs, save_index)) = StaticBuffers.sized(
            self.model.device, lambda buffers: self._place(host, context, buffers))
        logits = self.logits[:size * tokens]
        saved: dict = {}
        extra = {"return_hidden": True} if self.return_hidden else {}

        def step_fn() -> None:
            saved["rows"] = self.model.save_draft_rows(self.state, *save_index.unbind(0))
            layout = self.model.verify_layout(inputs)
            output = self.model.forward(batch, self.state, layout=layout, **extra)
            logits.copy_(output.logits)
            if self.return_hidden:
                self._hidden_rows(output.final_hidden, size * tokens).copy_(output.final_hidden)

        what = f"verification graph at batch {size}, context {context}, {tokens} tokens per sequence"
        replay, self.disabled_reason = capture_or_explain(self.capture, step_fn, what)
        if replay is None:
            return None
        step = CapturedVerify(buffers, replay, saved)
        self.captured[(size, context, tokens)] = step
        logger.debug("captured a %s", what)
        return step

    def _hidden_rows(self, final_hidden: torch.Tensor, rows: int) -> torch.Tensor:
        """The first ``rows`` rows of the shared hidden-state buffer (made at the first call: a warm-up, outside
        any capture)."""
        if self.hidden is None:
            self.hidden = torch.empty(self.logits.shape[0], *final_hidden.shape[1:], dtype=final_hidden.dtype,
                                      device=final_hidden.device)
        return self.hidden[:rows]

    def _place(self, host: ForwardBatch, context: int, buffers: StaticBuffers):
        """Write a padded host batch (token ids, positions, logits rows, the layout, the draft rows to save) into
        ``buffers`` and upload it in one copy. Returns the batch and (layout inputs, save index ``[3, M]``) over the
        buffers' device tensors."""
        buffers.rewind()
        batch = dataclasses.replace(host, input_ids=buffers.place(host.input_ids),
                                    positions=buffers.place(host.positions), logits_rows=buffers.place(host.logits_rows))
        inputs = self.model.place_verify_inputs(batch, self.state, buffers, self.spare_block, context)
        save_index = buffers.place(_save_index(host))
        buffers.upload()
        return batch, (inputs, save_index)

    def _padded_batch(self, chunks: list[ScheduledChunk], size: int, context: int, tokens: int) -> ForwardBatch:
        """Every chunk's tokens then padding (id 0) to ``tokens``, then dummy sequences (spare slot and block) to
        ``size``; block tables cut or padded with the spare block to ``context``'s blocks."""
        blocks = -(-context // self.state.block_size)
        pad = size - len(chunks)
        ids, starts = [], [c.start for c in chunks] + [0] * pad
        for c in chunks:
            ids += c.request.input_tokens(c.start, c.end) + [0] * (tokens - c.num_tokens)
        ids += [0] * (tokens * pad)
        tables = [list(c.request.block_ids[:blocks]) for c in chunks] + [[]] * pad
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=(torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(tokens)[None, :]).flatten(),
            query_start=list(range(0, (size + 1) * tokens, tokens)),
            context_lens=starts,
            slots=[c.request.slot for c in chunks] + [self.spare_slot] * pad,
            block_tables=[t + [self.spare_block] * (blocks - len(t)) for t in tables],
            logits_rows=torch.arange(size * tokens),
            compressed_write_start=[c.request.replay_until for c in chunks] + [0] * pad,
            sliding_floor=[c.request.sliding_floor for c in chunks] + [0] * pad,
        )


def _save_index(batch: ForwardBatch) -> torch.Tensor:
    """``[3, S * (T - 1)]``: sequence, slot and position of every row after each sequence's first (its draft and
    padding rows: what ``save_draft_rows`` saves)."""
    tokens = batch.query_start[1]
    num_seqs = batch.num_seqs
    seq = torch.arange(num_seqs).repeat_interleave(tokens - 1)
    slots = torch.tensor(batch.slots, dtype=torch.long)[seq]
    offsets = torch.arange(1, tokens).repeat(num_seqs)
    return torch.stack([seq, slots, torch.tensor(batch.context_lens, dtype=torch.long)[seq] + offsets])

"""MTP draft rounds at static shapes, captured as device graphs once per (batch size, fold rows per sequence): the
draft's counterpart of the core's ``engine/verify_graphs.py``.

A draft round folds each sequence's newly verified rows (``1 + accepted`` after a verification step) into the draft
layer's ring and drafts ``k`` tokens autoregressively. Here the round's sequences are padded to ``T`` fold rows each
(``T`` = the round's most rows, at most ``k + 1``) and to the next captured batch size with dummy sequences (the
draft state's spare slot), and one graph runs the whole round: the fold, the ``k - 1`` one-row speculative runs (each
feeding the previous run's argmax and streams, on the device), the confidence of every drafted token, and the ring
restore (``MTPDraft.propose_static``). One graph for all ``k`` tokens rather than ``k`` replays of a one-token graph:
the speculative runs' positions follow the fold's (run ``j`` of a sequence is at its last fold position plus ``j``),
so their layouts are computed inside the round by device ops from a few per-sequence tensors uploaded with the
fold's (a decode step's ``DecodeLayout``), and the round is one launch, with nothing for the host to do between the
tokens; ``k`` is fixed per engine, so it adds no graph keys.

The host builds the fold's layout and those tensors into fixed buffers (``MTPDraft.place_static``) and uploads them
in one copy; the target's hidden states of the fold rows are gathered into a shared input buffer on the device; the drafted
tokens and confidences land in shared output buffers, which the proposer reads once, after the replay. On a backend
without graphs (CPU with ``cuda_graph_sizes``) the same static round runs eagerly: how the tests check it against the
eager round. Sequences folding more than ``k + 1`` rows (the first round after a prompt) draft eagerly beside it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import torch

from deepinfer_core.engine.decode_graphs import capture_or_explain, graph_sizes
from deepinfer_core.models.deepseek_v4.mtp import MTPDraft, StaticDraftInputs, StaticRows
from deepinfer_core.static_buffers import StaticBuffers
from deepinfer_dspark.errors import DSparkError

logger = logging.getLogger("deepinfer")


@dataclasses.dataclass
class CapturedDraft:
    """One captured draft shape: its fixed buffers and the callable that replays it."""

    buffers: StaticBuffers
    inputs: StaticDraftInputs
    replay: Callable[[], None]


class DraftGraphs:
    """Runs MTP draft rounds through captured static-shape graphs (see module docstring)."""

    def __init__(self, draft: MTPDraft, state, capture: Callable, sizes: Sequence[int], k: int, spare_slot: int):
        """``state``: the draft's ``DraftState``, with ``spare_slot`` free for the dummy sequences."""
        self.draft = draft
        self.state = state
        self.capture = capture
        self.sizes = graph_sizes(sizes, DSparkError, "draft graph batch sizes (cuda_graph_sizes)")
        self.k = k
        self.max_rows = min(k + 1, draft.config.sliding_window)  # fold rows per sequence a graph takes
        self.spare_slot = spare_slot
        self.captured: dict[tuple[int, int], CapturedDraft] = {}
        self.hidden: torch.Tensor | None = None  # [largest size x max_rows, hc, D], made at the first capture
        self.token_ids: torch.Tensor | None = None  # [largest size, k]
        self.confidence: torch.Tensor | None = None  # [largest size, k] fp32
        self.num_replays = 0
        self.replays_by_rows: dict[int, int] = {}  # fold rows per sequence -> replays
        self.disabled_reason: str | None = None

    def fits(self, num_rows: int) -> bool:
        """Whether a sequence folding ``num_rows`` rows can ride in a graph."""
        return self.disabled_reason is None and 1 <= num_rows <= self.max_rows

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def run(self, rows: StaticRows, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Draft ``k`` tokens for ``rows``' sequences (at most ``max_batch``, each folding at most ``max_rows``
        rows), ``hidden [sum rows, hc, D]`` the target's streams at their fold rows in order. Returns device views
        ``token_ids [S, k]`` and ``confidence [S, k]`` (valid until the next replay), or None when capture failed
        (draft them eagerly)."""
        size = next(n for n in self.sizes if n >= rows.num_seqs)
        tokens = max(len(t) for t in rows.tokens)
        step = self.captured.get((size, tokens)) or self._capture(size, tokens, hidden)
        if step is None:
            return None
        step.buffers.rewind()
        inputs = self.draft.place_static(rows, size, tokens, self.spare_slot, step.buffers)
        step.buffers.upload()
        source = torch.cat([hidden, hidden.new_zeros(1, *hidden.shape[1:])])  # [rows + 1, hc, D]: a zero pad row
        self.hidden[:size * tokens].copy_(source[inputs.gather])
        self.num_replays += 1
        self.replays_by_rows[tokens] = self.replays_by_rows.get(tokens, 0) + 1
        step.replay()
        return self.token_ids[:rows.num_seqs], self.confidence[:rows.num_seqs]

    def _capture(self, size: int, tokens: int, example: torch.Tensor) -> CapturedDraft | None:
        if self.hidden is None:
            rows = self.max_batch * self.max_rows
            self.hidden = example.new_zeros(rows, *example.shape[1:])
            self.token_ids = torch.zeros(self.max_batch, self.k, dtype=torch.long, device=example.device)
            self.confidence = torch.zeros(self.max_batch, self.k, dtype=torch.float32, device=example.device)
        dummies = StaticRows([], [], [], [])  # all dummies: capture touches only the spare slot
        buffers, inputs = StaticBuffers.sized(self.hidden.device, lambda b: self._placed(dummies, size, tokens, b))
        hidden = self.hidden[:size * tokens]
        token_ids, confidence = self.token_ids[:size], self.confidence[:size]

        def step_fn() -> None:
            drafted, conf = self.draft.propose_static(inputs, self.state, hidden, self.k)
            token_ids.copy_(drafted)
            confidence.copy_(conf)

        what = f"MTP draft graph at batch {size}, {tokens} fold rows per sequence, {self.k} draft tokens"
        replay, self.disabled_reason = capture_or_explain(self.capture, step_fn, what)
        if replay is None:
            return None
        step = CapturedDraft(buffers, inputs, replay)
        self.captured[(size, tokens)] = step
        logger.debug("captured an %s", what)
        return step

    def _placed(self, rows: StaticRows, size: int, tokens: int, buffers: StaticBuffers) -> StaticDraftInputs:
        buffers.rewind()
        inputs = self.draft.place_static(rows, size, tokens, self.spare_slot, buffers)
        buffers.upload()
        return inputs

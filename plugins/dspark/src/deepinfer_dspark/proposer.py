"""The ``mtp`` and ``dspark`` proposers: drafts from the checkpoint's own MTP layers (``mtp.K.*``).

``mtp``: every step each running sequence drafts ``num_speculative_tokens`` tokens (greedy, the MTP layer run
``k`` times: ``deepinfer_core/models/deepseek_v4/mtp.py``) and all of them are verified.

``dspark``: the same drafts, then confidence-scheduled verification: the step verifies at most ``num_verify_tokens``
draft tokens across the batch (default ``verify_fraction`` x sequences x ``k``), given to draft prefixes by largest
marginal expected gain (``allocation.py``); the confidences are the checkpoint's confidence head's, else the draft's
own probability of each token.

The draft keeps its own per-slot state (a sliding-window ring per draft layer) holding only rows built from verified
tokens and the target's hidden states, so a rejection needs no rollback on the draft's side: the next step's rows
start where the verified ones end.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.models.deepseek_v4.mtp import StaticRows
from deepinfer_core.spec_decode.proposer import NO_DRAFT, Draft, DraftBatch, DraftSequence, Proposer
from deepinfer_dspark.allocation import allocate_verification
from deepinfer_dspark.draft_graphs import DraftGraphs
from deepinfer_dspark.errors import DSparkError

if TYPE_CHECKING:
    from deepinfer_core.engine_context import EngineContext
    from deepinfer_core.spec_decode.config import SpeculativeConfig

DSPARK_KEYS = ("num_verify_tokens", "verify_fraction")
DEFAULT_VERIFY_FRACTION = 0.75


def load_draft(target, context: EngineContext | None):
    """The MTP draft layers of the engine's checkpoint (``context.model_dir``), sharing ``target``'s embedding and
    head."""
    from deepinfer_core.models.deepseek_v4.model import DeepseekV4Model
    from deepinfer_core.models.deepseek_v4.mtp import load_mtp_draft

    if not isinstance(target, DeepseekV4Model):
        raise DSparkError(f"MTP drafts need a DeepSeek-V4 model (its mtp.K.* layers); the engine runs a "
                          f"{type(target).__name__}; use speculative_config method 'ngram' instead")
    folder = context.model_dir if context is not None else None
    if folder is None:
        raise DSparkError("the mtp / dspark proposer reads the draft layers from the checkpoint folder, and the "
                          "engine context names none; build the engine from a checkpoint folder")
    draft = load_mtp_draft(Path(folder), target, context.args.load_format if context.args is not None else "auto")
    if draft is None:
        raise DSparkError(f"{folder} holds no MTP draft layers (mtp.0.* tensors with num_nextn_predict_layers >= 1 in "
                          "config.json); use a checkpoint that ships them, or speculative_config method 'ngram'")
    return draft


@dataclasses.dataclass
class _Rows:
    """The draft rows one sequence folds in this step: tokens ``t[i + 1]`` at positions ``[start, end)``."""

    tokens: list[int]
    start: int
    end: int
    floor: int | None  # the ring holds nothing valid below it (rows skipped, truncated or recomputed)


class MtpProposer(Proposer):
    """Fixed-``k`` drafts from the checkpoint's MTP layers (``speculative_config={"method": "mtp", ...}``)."""

    needs_hidden_states = True

    def __init__(self, config: SpeculativeConfig, target, context: EngineContext | None = None, draft=None):
        """``draft``: an ``MTPDraft`` to use instead of the checkpoint's (tests)."""
        self.config = config
        self.k = config.num_speculative_tokens
        self.draft = draft if draft is not None else load_draft(target, context)
        self.state = None
        self.spare_slot = 0
        self.graphs: DraftGraphs | None = None  # static draft rounds, where the engine replays graphs
        self._committed: dict[str, int] = {}  # request id -> draft rows folded (positions < it)
        self._floors: dict[str, int | None] = {}  # request id -> the lowest position its ring holds, when not 0

    def allocate(self, num_slots: int) -> None:
        self.state = self.draft.new_state(num_slots + 1)  # the last slot: the draft graphs' dummy sequences
        self.spare_slot = num_slots
        if self.graphs is not None:
            self.use_graphs(self.graphs.capture, self.graphs.sizes)

    def use_graphs(self, capture, sizes) -> None:
        """Draft through static rounds captured by ``capture`` at these batch sizes (``draft_graphs.py``)."""
        if self.state is None:
            raise DSparkError("use_graphs comes after allocate (the graphs' dummy sequences use the state's spare "
                              "slot)")
        self.graphs = DraftGraphs(self.draft, self.state, capture, sizes, self.k, self.spare_slot)

    def slot_state_bytes(self) -> int:
        c = self.draft.config
        itemsize = torch.empty((), dtype=self.draft.target.dtype).element_size()
        return self.draft.num_layers * c.sliding_window * c.head_dim * itemsize

    def propose(self, batch: DraftBatch) -> list[Draft]:
        if self.state is None:
            self.allocate(1 + max((s.slot for s in batch.sequences), default=0))
        rows = {i: self._rows(seq) for i, seq in enumerate(batch.sequences) if seq.hidden_states is not None}
        rows = {i: r for i, r in rows.items() if r.tokens}
        if not rows:
            return [NO_DRAFT] * len(batch.sequences)
        static = [i for i in rows if self.graphs is not None and self.graphs.fits(len(rows[i].tokens))]
        static = static[:self.graphs.max_batch] if static else []
        drafted = self._draft_static(batch, rows, static) if static else None
        if drafted is None:
            static = []
        eager = [i for i in rows if i not in static]
        parts = [(static, drafted)] if static else []
        if eager:
            parts.append((eager, self._draft_eager(batch, rows, eager)))
        for i in rows:
            self._committed[batch.sequences[i].request_id] = rows[i].end
        token_ids, confidence = {}, {}
        for order, (ids, conf) in parts:  # read once, after every round is queued
            token_ids.update(zip(order, ids.tolist(), strict=True))
            confidence.update(zip(order, conf.tolist(), strict=True))
        order = list(rows)
        seqs = [batch.sequences[i] for i in order]
        counts = [min(self.k, s.max_draft_len) for s in seqs]
        lengths = self.verify_lengths(counts, [confidence[i] for i in order])
        out = [NO_DRAFT] * len(batch.sequences)
        for i, n, count in zip(order, lengths, counts, strict=True):
            if count > 0:
                out[i] = Draft(token_ids[i][:n], None, confidence[i][:n], num_proposed=count)
        return out

    def _draft_eager(self, batch: DraftBatch, rows: dict[int, _Rows], chosen: list[int]):
        """``(token_ids [S, k], confidence [S, k])`` of sequences ``chosen``, through ``MTPDraft.propose``."""
        seqs, chosen_rows = [batch.sequences[i] for i in chosen], [rows[i] for i in chosen]
        forward = ForwardBatch.build([r.tokens for r in chosen_rows], [r.start for r in chosen_rows],
                                     [s.slot for s in seqs], [[] for _ in seqs], device=self.draft.target.device)
        floors = [r.floor for r in chosen_rows]
        if any(f is not None for f in floors):
            forward.sliding_floor = [f if f is not None else 0 for f in floors]
        hidden = torch.cat([self._hidden(seq, r) for seq, r in zip(seqs, chosen_rows, strict=True)])
        drafts = self.draft.propose(forward, self.state, hidden, self.k)
        return drafts.token_ids, drafts.confidence

    def _draft_static(self, batch: DraftBatch, rows: dict[int, _Rows], chosen: list[int]):
        """The same for ``chosen`` through a draft graph (``DraftGraphs``); None when capture failed."""
        seqs, chosen_rows = [batch.sequences[i] for i in chosen], [rows[i] for i in chosen]
        static = StaticRows([r.tokens for r in chosen_rows], [r.start for r in chosen_rows], [s.slot for s in seqs],
                            [r.floor or 0 for r in chosen_rows])
        hidden = torch.cat([self._hidden(seq, r) for seq, r in zip(seqs, chosen_rows, strict=True)])
        return self.graphs.run(static, hidden)

    def verify_lengths(self, drafted: list[int], confidence: list[list[float]]) -> list[int]:
        """How many of each sequence's ``drafted`` tokens to verify (``confidence``: each one's k confidences): all
        of them."""
        return drafted

    def on_finish(self, request_id: str) -> None:
        self._committed.pop(request_id, None)
        self._floors.pop(request_id, None)

    def _rows(self, seq: DraftSequence) -> _Rows:
        """Draft rows ``[first_computed, num_computed_tokens)``: row ``i`` reads ``h[i]`` and ``t[i + 1]``. Only the
        last ``sliding_window`` of them: the draft layers attend over that window alone and a row's key depends on
        its own input only, so earlier rows change neither the last row's draft nor any key a later step reads."""
        first, end = seq.first_computed, seq.num_computed_tokens
        window = self.draft.config.sliding_window
        start = max(first, end - window)
        committed = self._committed.get(seq.request_id, 0)
        floor = self._floors.get(seq.request_id)  # rows below it were never folded (a prefix hit, a truncation)
        if (committed != start or start > first) and start > 0:
            floor = start
        if floor is not None and end - floor >= window:  # out of every later row's window
            floor = None
        self._floors[seq.request_id] = floor
        return _Rows(list(seq.token_ids[start + 1: end + 1]), start, end, floor)

    @staticmethod
    def _hidden(seq: DraftSequence, rows: _Rows) -> torch.Tensor:
        hidden = seq.hidden_states  # [end - first_computed, hc, D]
        if hidden.shape[0] != rows.end - seq.first_computed:
            raise DSparkError(f"request {seq.request_id}: {hidden.shape[0]} hidden-state rows for positions "
                              f"[{seq.first_computed}, {rows.end}); the engine must pass one per computed position")
        return hidden[rows.start - seq.first_computed:]


class DSparkProposer(MtpProposer):
    """MTP drafts with confidence-scheduled verification (``speculative_config={"method": "dspark", ...}``)."""

    def __init__(self, config: SpeculativeConfig, target, context: EngineContext | None = None, draft=None):
        super().__init__(config, target, context, draft)
        options = config.options
        self.num_verify_tokens = options.get("num_verify_tokens")
        self.verify_fraction = options.get("verify_fraction", DEFAULT_VERIFY_FRACTION)
        if self.num_verify_tokens is not None and (not isinstance(self.num_verify_tokens, int)
                                                   or isinstance(self.num_verify_tokens, bool)
                                                   or self.num_verify_tokens < 0):
            raise DSparkError(f"speculative_config num_verify_tokens must be an integer >= 0 (draft tokens verified "
                              f"per step across the batch), got {self.num_verify_tokens!r}")
        if isinstance(self.verify_fraction, bool) or not isinstance(self.verify_fraction, int | float) or not (
                0 < self.verify_fraction <= 1):
            raise DSparkError(f"speculative_config verify_fraction must be a number in (0, 1] (the default budget "
                              f"is that fraction of sequences x num_speculative_tokens), got {self.verify_fraction!r}")

    def budget(self, drafted: list[int]) -> int:
        """This step's verification budget in draft tokens."""
        if self.num_verify_tokens is not None:
            return self.num_verify_tokens
        return round(self.verify_fraction * sum(drafted))

    def verify_lengths(self, drafted: list[int], confidence: list[list[float]]) -> list[int]:
        """The prefixes the budget buys, by largest marginal expected gain."""
        rows = [row[:n] for row, n in zip(confidence, drafted, strict=True)]
        return allocate_verification(rows, self.budget(drafted))

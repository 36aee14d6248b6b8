"""DeepSeek-V4 multi-token-prediction (MTP) draft layers: the checkpoint's ``mtp.K.*`` tensors, run as a drafter.

One draft layer ``mtp.K`` (DeepSeek's names; vLLM ``deepseek_v4_mtp.py`` reads the same):

=============================== ======================================================================
``enorm.weight`` / ``hnorm``    RMSNorms of the next token's embedding and of the previous hidden streams
``e_proj`` / ``h_proj``         ``[D, D]`` projections of each (V4 keeps them apart; V3 fused ``eh_proj``)
block (``attn.*``, ``ffn.*``,   one decoder block, the target's own ``DecoderLayer`` code: a sliding-window
``hc_attn_*``, ...)             layer (V4 configs list a trailing ``compress_ratios`` 0 for it) with a routed MoE
``hc_head_*``, ``norm.weight``  the layer's own stream collapse and final norm
``confidence_head.{weight,      optional (DeepSpec style): ``sigmoid(w . hidden + b)``, the chance the drafted
bias}``                         token is accepted; absent, the draft's own probability of its token stands in
=============================== ======================================================================

The embedding and the vocabulary head are the target's (shared). The forward of draft row ``i`` (at position ``i``)::

    e = e_proj(enorm(embed(t[i + 1])))            # zero at position 0, as vLLM masks it
    streams = h_proj(hnorm(h[i])) + e             # h[i]: the target's last streams [hc, D] at position i
    streams = block(streams)                      # the draft layer's own sliding-window KV over positions
    logits = head(norm(hc_head(streams)))         # predicts t[i + 2]

Drafting ``k`` tokens runs the layer ``k`` times: the first run folds the newly verified rows (target hidden
states) into the draft's state and drafts ``d1`` from the last one; run ``j`` feeds the previous run's streams and
``d(j-1)`` one position further. Speculative rows never stay in the draft's state: the sliding ring rows they
overwrite are restored after drafting, so the draft's state only ever holds rows built from verified tokens and
target hidden states, and a rejection needs no draft rollback.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from deepinfer_core.checkpoint import CheckpointError, iter_checkpoint, plan_checkpoint, read_headers
from deepinfer_core.device_copy import to_device
from deepinfer_core.engine_args import DUMMY
from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.models.deepseek_v4 import weights
from deepinfer_core.models.deepseek_v4.config import SLIDING, ConfigError, DeepseekV4Config
from deepinfer_core.models.deepseek_v4.layout import DecodeInputs, DecodeLayout, StaticShape, StepLayout
from deepinfer_core.models.deepseek_v4.model import (
    DecoderLayer,
    DeepseekV4Model,
    ParameterRegistry,
    StepContext,
    _inference,
    linear,
)
from deepinfer_core.models.deepseek_v4.state import DeepseekV4State
from deepinfer_core.quant.tensors import QuantizedTensor
from deepinfer_core.static_buffers import StaticBuffers

_MTP_NAME = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.+)$")
CONFIDENCE_WEIGHT = "confidence_head.weight"
CONFIDENCE_BIAS = "confidence_head.bias"


def mtp_name(name: str) -> tuple[int, str] | None:
    """``(K, DeepSeek name)`` of a checkpoint tensor of draft layer ``K`` (``mtp.K.*``, or HF's ``model.mtp.K.*``);
    None for any other tensor."""
    match = _MTP_NAME.match(name)
    if match is None:
        return None
    return int(match.group(1)), f"mtp.{match.group(1)}.{match.group(2)}"


def draft_block_config(config: DeepseekV4Config) -> DeepseekV4Config:
    """The config of a draft layer's block alone: one sliding-window layer with a routed (top-k) MoE."""
    return dataclasses.replace(config, num_hidden_layers=1, layer_types=[SLIDING], mlp_layer_types=["moe"],
                               num_nextn_predict_layers=0)


@dataclasses.dataclass
class DraftStep:
    """One draft forward: ``streams [T, hc, D]`` (every row's block output: the next run's previous hidden),
    ``hidden [N, D]``, ``logits [N, V]`` and ``confidence [N]`` (None without a confidence head) at the batch's
    logits rows."""

    streams: torch.Tensor
    hidden: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor | None


@dataclasses.dataclass
class Drafts:
    """``k`` drafted tokens per sequence: ``token_ids [S, k]``, ``logits [S, k, V]`` (fp32), ``confidence [S, k]``
    (the confidence head's, else the draft's probability of its token), ``hidden [S, k, D]`` (what the confidence
    head reads)."""

    token_ids: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor
    hidden: torch.Tensor


class MTPLayer:
    """The parameters of draft layer ``mtp.K`` and its forward (the module docstring gives the formula)."""

    def __init__(self, reg: ParameterRegistry, config: DeepseekV4Config, index: int, confidence_head: bool):
        c, D, hc = config, config.hidden_size, config.hc_mult
        p = f"mtp.{index}"
        self.prefix = p
        self.config = c
        self.enorm = reg.add(f"{p}.enorm.weight", (D,))
        self.hnorm = reg.add(f"{p}.hnorm.weight", (D,))
        self.e_proj = reg.add(f"{p}.e_proj.weight", (D, D))
        self.h_proj = reg.add(f"{p}.h_proj.weight", (D, D))
        self.norm = reg.add(f"{p}.norm.weight", (D,))
        self.hc_head = [reg.add(f"{p}.hc_head_{n}", s) for n, s in (("fn", (hc, hc * D)), ("base", (hc,)),
                                                                    ("scale", (1,)))]
        self.block = DecoderLayer(reg, draft_block_config(c), 0, prefix=p)
        self.confidence_weight = self.confidence_bias = None
        if confidence_head:
            self.confidence_weight = reg.add(f"{p}.{CONFIDENCE_WEIGHT}", (1, D), dtype=torch.float32)
            self.confidence_bias = reg.add(f"{p}.{CONFIDENCE_BIAS}", (1,), dtype=torch.float32)

    def __call__(self, target: DeepseekV4Model, batch: ForwardBatch, state: DeepseekV4State,
                 hidden: torch.Tensor, layout: StepLayout | None = None) -> DraftStep:
        """Draft rows for ``batch`` (row ``i``: token ``t[i + 1]`` at position ``i``), ``hidden [T, hc, D]`` the
        streams each row continues (the target's at position ``i``, or the previous draft run's). ``layout``: the
        batch's layout when the caller built it (a static draft round), else built here."""
        ops, c = target.ops, self.config
        eps = c.rms_norm_eps
        layout = layout or StepLayout(batch, c.sliding_window, state.block_size, target.device)
        rope_args = {t: (target.rope_inv_freq[t], target.rope_scaling[t], target.dtype) for t in ("main", "compress")}
        rope = {t: ops.rope_cos_sin(batch.positions, *rope_args[t]) for t in rope_args}
        ctx = StepContext(layout, state, batch.input_ids, rope, rope_args)
        embeds = ops.embed(batch.input_ids, target.embed)  # [T, D]
        embeds = embeds.masked_fill((batch.positions == 0).unsqueeze(-1), 0)
        e = linear(ops, ops.rms_norm(embeds, self.enorm, eps), self.e_proj)  # [T, D]
        h = linear(ops, ops.rms_norm(hidden.to(target.dtype), self.hnorm, eps), self.h_proj)  # [T, hc, D]
        streams = self.block(ops, h + e.unsqueeze(1), ctx)  # [T, hc, D]
        rows = streams[batch.logits_rows]  # [N, hc, D]
        final = ops.hc_head(rows, *self.hc_head, c.hc_eps, eps)  # [N, D]
        final = ops.rms_norm(final, self.norm, eps)
        logits = ops.logits(final, target.head)  # [N, V]
        return DraftStep(streams, final, logits, self.confidence(final))

    def confidence(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``sigmoid(hidden [N, D] . w + b)`` -> ``[N]`` acceptance probabilities; None without a head."""
        if self.confidence_weight is None:
            return None
        # a row-wise product and sum, not a GEMV: each row's result does not depend on how many rows share the call
        return torch.sigmoid((hidden.float() * self.confidence_weight[0]).sum(-1) + self.confidence_bias[0])  # [N]


class DraftState:
    """The draft layers' state: one single-layer ``DeepseekV4State`` (a sliding ring per slot) per draft layer."""

    def __init__(self, layers: list[DeepseekV4State]):
        self.layers = layers

    @property
    def rings(self) -> list[torch.Tensor]:
        return [state.swa[0] for state in self.layers]  # [slots, W, hd] each

    def save(self, slots: list[int]) -> list[torch.Tensor]:
        """Copies of ``slots``' ring rows (before speculative runs overwrite them)."""
        index = to_device(torch.tensor(slots, dtype=torch.long), self.rings[0].device)  # pinned: no wait for the stream
        return [ring.index_select(0, index) for ring in self.rings]  # [S, W, hd] each

    def restore(self, slots: list[int], saved: list[torch.Tensor]) -> None:
        """Put back what :meth:`save` copied."""
        index = to_device(torch.tensor(slots, dtype=torch.long), self.rings[0].device)
        for ring, rows in zip(self.rings, saved, strict=True):
            ring.index_copy_(0, index, rows)

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy one sequence's rings into another slot (n > 1 samples sharing a prompt)."""
        for ring in self.rings:
            ring[dst] = ring[src]


class MTPDraft:
    """The draft layers of a checkpoint, sharing the target model's embedding, head and op table."""

    def __init__(self, target: DeepseekV4Model, num_layers: int, confidence_head: bool = False,
                 quantized: Mapping[str, QuantizedTensor] | None = None):
        """``quantized``: the draft layers' quantized weights (their ``CheckpointPlan.quantized``), held as stored."""
        if num_layers < 1:
            raise ConfigError(f"an MTP draft needs at least one layer (num_nextn_predict_layers >= 1); got {num_layers}")
        self.target = target
        self.config = target.config
        reg = ParameterRegistry(target.dtype, target.device, quantized)
        self.layers = [MTPLayer(reg, target.config, k, confidence_head) for k in range(num_layers)]
        self.parameters = reg.slots
        self.has_confidence_head = confidence_head

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def new_state(self, num_slots: int, block_size: int | None = None) -> DraftState:
        """The draft's own state: each layer's sliding ring per slot (draft layers keep no paged state)."""
        config = draft_block_config(self.config)
        block_size = block_size or self.config.block_multiple
        return DraftState([DeepseekV4State(config, num_slots, 1, block_size, self.target.dtype, self.target.device)
                           for _ in self.layers])

    def load_weights(self, tensors) -> set[str]:
        """Copy ``(DeepSeek name, tensor)`` pairs into place; returns the names loaded."""
        loaded = set()
        for name, tensor in tensors:
            slot = self.parameters.get(name)
            if slot is None:
                raise CheckpointError(f"unexpected draft tensor {name!r}: an MTP layer has no parameter of that name")
            if tuple(slot.shape) != tuple(tensor.shape):
                raise CheckpointError(f"draft tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                      f"{tuple(slot.shape)}")
            slot.copy_(tensor)
            loaded.add(name)
        return loaded

    def layer(self, step: int) -> MTPLayer:
        """The layer run at draft step ``step`` (0-based): layers in turn, cycling when ``k`` exceeds them."""
        return self.layers[step % self.num_layers]

    @_inference
    def forward(self, batch: ForwardBatch, state: DraftState, hidden: torch.Tensor, step: int = 0) -> DraftStep:
        """One draft run of layer ``step % num_layers`` over ``batch``; its rows are folded into ``state``."""
        index = step % self.num_layers
        return self.layers[index](self.target, batch, state.layers[index], hidden)

    @_inference
    def propose(self, batch: ForwardBatch, state: DraftState, hidden: torch.Tensor, k: int) -> Drafts:
        """Draft ``k`` greedy tokens per sequence of ``batch``.

        ``batch``: each sequence's newly verified draft rows (row ``i``: token ``t[i + 1]`` at position ``i``, its
        context the rows already in ``state``), one logits row per sequence (its last); ``hidden [T, hc, D]``: the
        target's last streams at those positions. Those rows stay in ``state``; the speculative runs 2..k do not
        (the ring rows they overwrite are restored) and read no ring row below ``batch.sliding_floor``. With several
        draft layers, layer ``l > 0`` (first run at step
        ``l``) holds no verified rows: it attends over this round's own rows only (from position ``p + l``).
        The host reads nothing from the device here: every run's positions come from the batch's lists."""
        first = self.forward(batch, state, hidden, 0)
        steps = [first]
        tokens = [first.logits.argmax(-1)]  # [S] each
        confidence = [self.step_confidence(first, tokens[0])]
        saved = state.save(batch.slots) if k > 1 else None
        streams = first.streams[batch.logits_rows]  # [S, hc, D]
        positions = batch.positions[batch.logits_rows]  # [S]
        last = [ctx + n - 1 for ctx, n in zip(batch.context_lens, batch.query_lens, strict=True)]  # host copy
        for j in range(1, k):
            run = _next_batch(batch, tokens[-1], positions + j, [p + j for p in last])
            run.sliding_floor = _run_floors(batch, last, j % self.num_layers)
            step = self.forward(run, state, streams, j)
            steps.append(step)
            tokens.append(step.logits.argmax(-1))
            confidence.append(self.step_confidence(step, tokens[-1]))
            streams = step.streams
        if saved is not None:
            state.restore(batch.slots, saved)
        logits = torch.stack([s.logits for s in steps], dim=1)  # [S, k, V]
        token_ids = torch.stack(tokens, dim=1)  # [S, k]
        hidden = torch.stack([s.hidden for s in steps], dim=1)  # [S, k, D]
        return Drafts(token_ids, logits, torch.stack(confidence, dim=1), hidden)

    def step_confidence(self, step: DraftStep, token_ids: torch.Tensor) -> torch.Tensor:
        """``[S]``: the confidence head's, else the draft's own probability of each drafted ``token_ids [S]``."""
        if self.has_confidence_head:
            return step.confidence
        return step.logits.softmax(-1).gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)

    # ------------------------------------------------------------------ static rounds (draft graphs)
    def place_static(self, rows: StaticRows, num_seqs: int, tokens: int, spare_slot: int,
                     buffers: StaticBuffers) -> StaticDraftInputs:
        """The inputs of a static draft round, built on the host and placed in ``buffers`` (the caller uploads):
        ``rows``' sequences padded to ``tokens`` fold rows each (token 0 after a sequence's own rows, at the
        positions that follow) and to ``num_seqs`` sequences with dummies (``spare_slot``, one row at position 0):
        the fold's layout (sliding keys spanning ``tokens + window - 1`` positions) and the few per-sequence
        tensors the speculative runs' layouts are computed from inside the round. Every shape depends on
        (``num_seqs``, ``tokens``) alone."""
        W = self.config.sliding_window
        if tokens > W:
            raise ConfigError(f"a static draft round folds at most the sliding window ({W}) rows per sequence, got "
                              f"{tokens}; fold longer catch-ups with MTPDraft.propose")
        pad = num_seqs - rows.num_seqs
        real = [len(t) for t in rows.tokens]
        lens = real + [1] * pad
        starts = list(rows.starts) + [0] * pad
        slots = list(rows.slots) + [spare_slot] * pad
        ids = [t for seq in rows.tokens for t in [*seq, *[0] * (tokens - len(seq))]] + [0] * (tokens * pad)
        host = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=(torch.tensor(starts)[:, None] + torch.arange(tokens)[None, :]).flatten(),  # [S * T]
            query_start=list(range(0, (num_seqs + 1) * tokens, tokens)), context_lens=starts, slots=slots,
            block_tables=[[] for _ in slots], logits_rows=torch.tensor([i * tokens + n - 1 for i, n in enumerate(lens)]),
            sliding_floor=list(rows.floors) + [0] * pad)
        layout = StepLayout(host, W, self.config.block_multiple, self.target.device, buffers=buffers, masks=False,
                            context_len=tokens + W)
        fold = dataclasses.replace(host, input_ids=buffers.place(host.input_ids),
                                   positions=buffers.place(host.positions), logits_rows=buffers.place(host.logits_rows))
        owned = torch.tensor(real + [0] * pad)  # [S]: dummies own no row
        kept = (torch.arange(W)[None, :] - torch.tensor(starts)[:, None]) % W < owned[:, None]  # [S, W]
        offsets = torch.arange(tokens)[None, :]  # [1, T]
        first = (torch.cumsum(owned, 0) - owned)[:, None]  # [S, 1]: each sequence's first row of the stacked rows
        gather = torch.where(offsets < owned[:, None], first + offsets, sum(real))  # [S, T]; padding: the zero row
        last = torch.tensor([start + n - 1 for start, n in zip(starts, lens, strict=True)])  # [S]
        slots_t = buffers.place(torch.tensor(slots, dtype=torch.long))
        return StaticDraftInputs(fold, layout, slots_t, buffers.place(kept), buffers.place(gather.flatten()),
                                 buffers.place(last), buffers.place(torch.tensor(host.sliding_floor)))

    @_inference
    def propose_static(self, inputs: StaticDraftInputs, state: DraftState, hidden: torch.Tensor, k: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """A static draft round (what a captured draft graph runs): device ops of fixed shapes only, no host sync.
        ``hidden [S * T, hc, D]``: the target's streams at the fold rows (padding rows: any finite values).
        Returns ``token_ids [S, k]`` and ``confidence [S, k]``, as ``propose`` drafts them.

        The padding rows of the fold write the ring like real rows; the ring rows that no real row wrote are put
        back at once (the speculative runs must not read them), and after the ``k - 1`` speculative runs the ring
        is put back to what the real rows left, as ``propose`` does."""
        rings = state.rings
        before = [ring.index_select(0, inputs.slots) for ring in rings]  # [S, W, hd] each
        inputs.fold_layout.build_masks()
        first = self.layers[0](self.target, inputs.fold, state.layers[0], hidden, inputs.fold_layout)
        kept = inputs.kept[:, :, None]  # [S, W, 1]
        folded = [torch.where(kept, ring.index_select(0, inputs.slots), rows) for ring, rows in zip(rings, before)]
        for ring, rows in zip(rings, folded):
            ring.index_copy_(0, inputs.slots, rows)
        tokens = [first.logits.argmax(-1)]  # [S] each
        confidence = [self.step_confidence(first, tokens[0])]
        streams = first.streams[inputs.fold.logits_rows]  # [S, hc, D]
        for j in range(1, k):
            index = j % self.num_layers
            run, layout = self._static_run(inputs, tokens[-1], j)
            step = self.layers[index](self.target, run, state.layers[index], streams, layout)
            tokens.append(step.logits.argmax(-1))
            confidence.append(self.step_confidence(step, tokens[-1]))
            streams = step.streams
        if k > 1:
            for ring, rows in zip(rings, folded):
                ring.index_copy_(0, inputs.slots, rows)
        return torch.stack(tokens, dim=1), torch.stack(confidence, dim=1)

    def _static_run(self, inputs: StaticDraftInputs, tokens: torch.Tensor, j: int
                    ) -> tuple[ForwardBatch, DecodeLayout]:
        """Speculative run ``j`` of a static round: ``tokens [S]`` at positions ``last + j``, its layout computed by
        device ops (a decode step's, keys padded to the window; no compressed state)."""
        layer = j % self.num_layers
        positions = inputs.last + j  # [S]
        floors = inputs.last + layer if layer else inputs.floors  # layer l > 0: nothing below this round's rows
        S, W = positions.shape[0], self.config.sliding_window
        empty = inputs.slots[:, None][:, :0]  # [S, 0]: no block table (the draft keeps no paged state)
        layout = DecodeLayout(DecodeInputs(positions, inputs.slots, empty, floors, torch.zeros_like(positions)), W,
                              self.config.block_multiple, StaticShape(S, W, W, 0, 0, (), ()), self.target.ops)
        fold = inputs.fold
        run = ForwardBatch(input_ids=tokens, positions=positions, query_start=list(range(S + 1)),
                           context_lens=fold.context_lens, slots=fold.slots, block_tables=fold.block_tables,
                           logits_rows=layout.token_seq)  # the host lists: the fold's (a built layout reads none)
        return run, layout


@dataclasses.dataclass
class StaticRows:
    """The sequences of a static draft round: each one's fold tokens (``t[i + 1]`` of rows ``i`` from ``start``),
    first position, slot and sliding floor (0: none)."""

    tokens: list[list[int]]
    starts: list[int]
    slots: list[int]
    floors: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass
class StaticDraftInputs:
    """A static draft round's inputs in fixed buffers (``MTPDraft.place_static``)."""

    fold: ForwardBatch  # input_ids / positions [S * T], logits_rows [S]: each sequence's last real row
    fold_layout: StepLayout  # masks left to the round (built inside the graph)
    slots: torch.Tensor  # [S]
    kept: torch.Tensor  # [S, W] bool: ring rows a real fold row wrote
    gather: torch.Tensor  # [S * T]: the row of the real fold rows' hidden states (stacked) each fold row reads
    last: torch.Tensor  # [S]: each sequence's last fold position (speculative run j is at last + j)
    floors: torch.Tensor  # [S]: the fold's sliding floors (0: none)


def _run_floors(batch: ForwardBatch, last: list[int], layer: int) -> list[int] | None:
    """Speculative runs' sliding floors: layer ``l > 0`` reads nothing below this round's first row of it
    (``last + l``); layer 0 keeps the fold's floors."""
    if layer:
        return [p + layer for p in last]
    return list(batch.sliding_floor) if batch.sliding_floor is not None else None


def _next_batch(batch: ForwardBatch, tokens: torch.Tensor, positions: torch.Tensor, context: list[int]) -> ForwardBatch:
    """One speculative row per sequence of ``batch``: ``tokens [S]`` at ``positions [S]`` (``context``: the same
    positions on the host)."""
    S = batch.num_seqs
    return ForwardBatch(input_ids=tokens, positions=positions, query_start=list(range(S + 1)),
                        context_lens=context, slots=list(batch.slots), block_tables=[list(b) for b in batch.block_tables],
                        logits_rows=torch.arange(S, device=tokens.device))


_SHARED = ("head.weight", "embed.weight", "emb.tok_emb.weight")  # copies of the target's, which the draft uses


def checkpoint_draft_layers(folder: str | Path) -> dict[int, set[str]]:
    """``{K: DeepSeek names}`` of the ``mtp.K.*`` tensors in a checkpoint folder (empty when it has none)."""
    layers: dict[int, set[str]] = {}
    for tensors in read_headers(folder).values():
        for name in tensors:
            parsed = mtp_name(name)
            if parsed is not None:
                layers.setdefault(parsed[0], set()).add(parsed[1])
    return layers


def expected_draft_tensors(config: DeepseekV4Config, num_layers: int,
                           confidence_head: bool) -> dict[str, weights.Spec]:
    """Every tensor of ``num_layers`` draft layers, ``mtp.K.* -> (shape, kind)`` (``weights.expected_tensors``'s
    form): the block's as a target layer's, then the layer's own."""
    D, hc = config.hidden_size, config.hc_mult
    block = {name.removeprefix("layers.0."): spec for name, spec in
             weights.expected_tensors(draft_block_config(config)).items() if name.startswith("layers.0.")}
    own = {"enorm.weight": ((D,), weights.FP32), "hnorm.weight": ((D,), weights.FP32),
           "e_proj.weight": ((D, D), weights.WEIGHT), "h_proj.weight": ((D, D), weights.WEIGHT),
           "norm.weight": ((D,), weights.FP32), "hc_head_fn": ((hc, hc * D), weights.FP32),
           "hc_head_base": ((hc,), weights.FP32), "hc_head_scale": ((1,), weights.FP32)}
    if confidence_head:
        own.update({CONFIDENCE_WEIGHT: ((1, D), weights.FP32), CONFIDENCE_BIAS: ((1,), weights.FP32)})
    return {f"mtp.{k}.{name}": spec for k in range(num_layers) for name, spec in {**block, **own}.items()}


def _draft_rename(num_layers: int):
    """On-disk name -> DeepSeek name of the first ``num_layers`` draft layers' tensors (None for any other, and for
    a draft layer's copies of the shared embedding and head)."""

    def rename(name: str) -> str | None:
        parsed = mtp_name(name)
        if parsed is None or parsed[0] >= num_layers or parsed[1].endswith(tuple(f".{s}" for s in _SHARED)):
            return None
        return parsed[1]

    return rename


def load_mtp_draft(folder: str | Path, target: DeepseekV4Model, load_format: str = "auto") -> MTPDraft | None:
    """The draft layers of the checkpoint in ``folder`` (``config.num_nextn_predict_layers`` of them), sharing
    ``target``'s embedding and head; None when the config declares none or the checkpoint holds none. Their tensors
    are planned and checked as the target's are (missing, unexpected, mis-shaped); fp8 / fp4 ones are held as stored
    (``quantization_config``), with their scales. ``load_format="dummy"``: random draft layers drawn as the target's
    (``random_weights.draft_tensors``), nothing read."""
    folder = Path(folder)
    config = target.config
    wanted = config.num_nextn_predict_layers
    if load_format == DUMMY:
        return _dummy_draft(target) if wanted > 0 else None
    present = checkpoint_draft_layers(folder)
    if wanted < 1 or not present:
        return None
    missing = [k for k in range(wanted) if k not in present]
    if missing:
        raise CheckpointError(f"{folder}: config.json declares num_nextn_predict_layers={wanted} but the checkpoint "
                              f"has no mtp.{missing[0]}.* tensors; set num_nextn_predict_layers to the draft layers "
                              "it holds")
    confidence = all(f"mtp.{k}.{CONFIDENCE_WEIGHT}" in present[k] for k in range(wanted))
    plan = plan_checkpoint(folder, config, expected_draft_tensors(config, wanted, confidence), _draft_rename(wanted))
    plan.raise_for_problems()
    draft = MTPDraft(target, wanted, confidence_head=confidence, quantized=plan.quantized)
    draft.load_weights(iter_checkpoint(plan, target.dtype, target.device))
    return draft


def _dummy_draft(target: DeepseekV4Model) -> MTPDraft:
    """``target``'s draft layers with the random weights ``load_format="dummy"`` draws (no confidence head)."""
    from deepinfer_core.models.deepseek_v4 import random_weights

    quantized, tensors = random_weights.dummy_weights(target.config, target.dtype, target.device, draft=True)
    draft = MTPDraft(target, target.config.num_nextn_predict_layers, confidence_head=False, quantized=quantized)
    draft.load_weights(tensors)
    return draft

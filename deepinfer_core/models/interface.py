"""The model interface: everything the engine may use of a model, and nothing else.

The engine (``engine/``) and ``LLM`` never import a model package. A model registered for a ``model_type``
(``models/registry.py``, or a plugin's ``deepinfer_register_models``) returns an object that satisfies
``CausalLM``; the registry checks that when it loads one, naming what is missing. A model whose steps can be
replayed from device graphs also satisfies ``StaticStepModel``; the engine captures graphs only for those.

State is opaque to the engine: the model allocates it (``new_state``), says what it costs (``state_bytes``) and
reads / writes it in ``forward`` through the ``ForwardBatch``'s slots and block tables, which the engine's state
manager hands out. A block covers ``block_size`` tokens, a multiple of ``block_multiple``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import torch

from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.ops.table import OpTable
from deepinfer_core.static_buffers import StaticBuffers


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """What a model's state costs in memory at one block size and dtype."""

    per_block: int  # one paged block (what prefix caching keeps per block); 0 when nothing is paged
    per_slot: int  # one running sequence's per-sequence state


@dataclasses.dataclass
class ModelOutput:
    """One step's result: logits of the batch's ``logits_rows`` and, when asked, hidden states of chosen layers."""

    logits: torch.Tensor  # [num_rows, vocab] fp32
    hidden_states: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # layer -> [T, ...]
    final_hidden: torch.Tensor | None = None  # [T, ...] what a draft model reads (``SpeculativeModel.forward``)


class ModelState(Protocol):
    """The state pools ``CausalLM.new_state`` returns; the engine only reads their block size."""

    block_size: int


@runtime_checkable
class CausalLM(Protocol):
    """A causal LM the engine can serve: sizes, state, one forward over a flat batch, prefix replay."""

    ops: OpTable  # the op table the model runs on (the sampler takes ``greedy_sample`` from it)
    device: torch.device
    dtype: torch.dtype

    @property
    def vocab_size(self) -> int:
        """Rows of the logits."""

    @property
    def max_position_embeddings(self) -> int:
        """The longest sequence the model supports (``max_model_len``'s default)."""

    @property
    def block_multiple(self) -> int:
        """A state block's token count must be a multiple of this (1 when any size works)."""

    @property
    def sliding_window(self) -> int:
        """Tokens a sliding-window layer attends (0: none); given to the ``rebuild_sliding_window`` hook."""

    def state_bytes(self, block_size: int, dtype: torch.dtype) -> StateBytes:
        """Bytes of one paged block and one sequence slot of this model's state."""

    def new_state(self, num_slots: int, num_blocks: int, block_size: int) -> ModelState:
        """Allocate state for ``num_slots`` running sequences and ``num_blocks`` paged blocks."""

    def forward(self, batch: ForwardBatch, state: ModelState, layout: Any = None) -> ModelOutput:
        """Fold the batch's tokens into ``state`` and return the logits of ``batch.logits_rows``. ``layout``: one a
        static step built (``StaticStepModel``), else the model builds its own."""

    def prefix_replay_span(self) -> int:
        """Tokens to recompute before a prefix-cache hit so the per-sequence state (sliding windows, carries) the
        cache does not keep is rebuilt exactly; 0 when a hit needs no replay."""


@runtime_checkable
class SlotStateModel(CausalLM, Protocol):
    """A model whose per-sequence state (what a slot holds besides the paged blocks) can be copied out and written
    back, so that a prefix hit restores it instead of rebuilding it (``engine/prefix_state_cache.py``). A model
    without this member keeps the exact rebuild (``prefix_replay_span``)."""

    def slot_state_views(self, state: ModelState, slot: int) -> list[torch.Tensor]:
        """Views of slot ``slot``'s whole per-sequence state in ``state``, in a fixed order. After a step that leaves
        the sequence's computed tokens on a block boundary they are its state there: copies of them written into
        another slot let a sequence with the same first tokens continue from that boundary exactly."""

    def block_state_views(self, state: ModelState, block: int) -> list[torch.Tensor]:
        """Views of paged block ``block``'s whole shareable state in ``state`` (what the model writes for the
        positions the block covers), in a fixed order. After a step that leaves a sequence's computed tokens inside
        its last block, they and ``slot_state_views`` are its whole state there: copies of both, written into another
        sequence's slot and own (fresh) block at the same place in its block table, let a sequence with the same first
        tokens continue from that token exactly."""


@runtime_checkable
class StaticStepModel(CausalLM, Protocol):
    """A model whose decode steps and lone-prompt prefills run at static shapes, so a backend can capture them as
    device graphs (``engine/decode_graphs.py``, ``engine/prefill_graphs.py``).

    A static step has a host phase and a device phase. The host phase writes the step's inputs into fixed
    ``StaticBuffers`` (``place_decode_inputs`` / ``place_prefill_inputs``); the device phase
    (``decode_layout`` / ``prefill_layout``) runs inside the captured graph and returns the layout ``forward``
    takes. Padding rows read and write only ``spare_slot`` and ``spare_block``, which the engine never hands out.
    """

    def static_shape(self, num_seqs: int, context_len: int, spare_slot: int, spare_block: int) -> Any:
        """The fixed sizes of a decode step of ``num_seqs`` one-token sequences at most ``context_len`` long."""

    def place_decode_inputs(self, batch: ForwardBatch, state: ModelState, shape: Any, buffers: StaticBuffers) -> Any:
        """Host phase of a decode step: the padded one-token ``batch``'s layout inputs, placed in ``buffers``."""

    def decode_layout(self, inputs: Any, state: ModelState, shape: Any) -> Any:
        """Device phase of a decode step: its layout, computed from the placed inputs by device ops."""

    def prefill_min_tokens(self) -> int:
        """The shortest prompt a static prefill step takes."""

    def place_prefill_inputs(self, batch: ForwardBatch, state: ModelState, buffers: StaticBuffers, written: int,
                             spare_block: int, context_len: int | None = None) -> Any:
        """Host phase of a lone chunk's prefill padded to a bucket: its layout, placed in ``buffers``; only the
        first ``written`` tokens write state (the padding writes ``spare_block``). The chunk may start past token 0
        (a replay after a prefix hit: ``batch.compressed_write_start`` and ``sliding_floor`` are data, not shapes);
        its shapes depend only on the bucket and ``context_len`` (a bound on the chunk's padded end; None: the
        bucket, a chunk from token 0)."""

    def prefill_layout(self, inputs: Any) -> Any:
        """Device phase of a static prefill step: the layout ``forward`` takes."""


@runtime_checkable
class SpeculativeModel(CausalLM, Protocol):
    """A model that can verify draft tokens (speculative decoding, ``deepinfer_core/spec_decode``): a step may compute
    a sequence's newest token followed by up to ``max_draft_tokens`` draft tokens, and the state written for the
    drafts after the first rejected one is undone before any later step reads it.

    Paged state (compressed entries, indexer keys) needs no undoing when, as in DeepSeek-V4, an entry is written
    again by the step that computes its last token and no query reads it before: the engine rewinds
    ``num_computed_tokens`` and registers prefix-cache blocks only over accepted tokens. Per-sequence state that a
    draft position overwrites (a sliding-window ring, a compressor carry) is saved before the step
    (``save_draft_state``) and put back for the rejected positions (``rollback_draft_state``). A model without these
    members refuses speculative decoding when the engine is built.
    """

    @property
    def max_draft_tokens(self) -> int:
        """The most draft tokens one sequence's step may carry (its per-sequence rings must not wrap inside one
        step's drafts)."""

    def forward(self, batch: ForwardBatch, state: ModelState, layout: Any = None,
                return_hidden: bool = False) -> ModelOutput:
        """``CausalLM.forward``; with ``return_hidden`` also ``ModelOutput.final_hidden``: the hidden state a draft
        model reads, for every token of the batch (the model defines which)."""

    def save_draft_state(self, state: ModelState, slots: list[int], positions: list[list[int]]) -> Any:
        """Before a step: copy the per-sequence state that computing ``positions[i]`` (sequence ``i``'s draft
        positions, in slot ``slots[i]``) will overwrite. Returns an opaque save for ``rollback_draft_state``."""

    def rollback_draft_state(self, state: ModelState, saved: Any, keep_until: torch.Tensor) -> None:
        """After the step: put back the saved state of every position ``>= keep_until[i]`` (int64 ``[num_seqs]`` on
        the model's device: sequence ``i``'s first rejected position), so the state equals that of a run that never
        computed the rejected tokens. Device ops only (no host sync)."""


@runtime_checkable
class StaticVerifyModel(SpeculativeModel, Protocol):
    """A speculative model whose verification steps run at static shapes, so a backend can capture them as device
    graphs (``engine/verify_graphs.py``): every sequence of the step folds the same number of tokens (its newest token,
    its draft, then padding tokens), every one of them writing state as a draft token does, and the rows past a
    sequence's draft are rolled back with its rejected drafts. The draft state is saved inside the graph
    (``save_draft_rows``), rolled back after verification (``rollback_draft_state``, device ops only). A model
    without these members keeps verifying eagerly."""

    def place_verify_inputs(self, batch: ForwardBatch, state: ModelState, buffers: StaticBuffers, spare_block: int,
                            context_len: int) -> Any:
        """Host phase: the layout of a padded step (``batch``: the same token count per sequence, sequences ending
        by ``context_len``, block tables padded with ``spare_block``), placed in ``buffers``; its shapes depend on
        the sequence count, the tokens per sequence and ``context_len`` only."""

    def verify_layout(self, inputs: Any) -> Any:
        """Device phase: the layout ``forward`` takes, computed from the placed inputs by device ops."""

    def save_draft_rows(self, state: ModelState, seq: torch.Tensor, slots: torch.Tensor,
                        positions: torch.Tensor) -> Any:
        """``save_draft_state`` from device tensors ``[M]`` (each row's sequence, slot and position), by device ops of
        fixed shapes; ``rollback_draft_state`` takes its result with ``keep_until`` indexed by ``seq``."""


@runtime_checkable
class ExpertParallelModel(CausalLM, Protocol):
    """A model whose routed experts can be split across ranks (expert parallelism, ``deepinfer_core/distributed``).

    After ``shard_experts``, every ``forward`` (and every ``idle_step``) is a collective over the ranks: all of them
    must make the same number of calls, in the same order.
    """

    def shard_experts(self, rank: int, world_size: int, group: Any = None) -> None:
        """Keep routed experts ``[rank * E / N, (rank + 1) * E / N)`` of every MoE layer (``N = world_size``), drop the
        others, and from now on send each token's routed work to the rank that holds its expert (all-to-all over
        ``group``, None: the default process group)."""

    def idle_step(self) -> None:
        """Take part in one forward's collectives with no tokens of its own (a rank with no work while others step)."""


@dataclasses.dataclass(frozen=True)
class ExpertParallelLayout:
    """How a sharded model's routed experts sit over the expert-parallel ranks: this ``rank`` of ``world_size`` (over
    ``group``, None: the default process group) holds ``slots_per_rank`` physical expert slots of each of its
    ``num_moe_layers`` MoE layers, which route to ``num_logical_experts`` experts."""

    rank: int
    world_size: int
    group: Any
    num_moe_layers: int
    num_logical_experts: int
    slots_per_rank: int


@runtime_checkable
class ExpertBalancedModel(ExpertParallelModel, Protocol):
    """An expert-parallel model whose expert placement can change while it serves (EPLB, ``plugins/eplb``).

    MoE layers are numbered ``0 .. num_moe_layers - 1`` in forward order. Physical slots are numbered rank-major over
    all ranks (rank r holds ``[r * S, (r + 1) * S)`` for ``S = slots_per_rank``); a logical expert may have several
    slots (replicas), each (token, expert) pair going to one of them.
    """

    def expert_parallel_layout(self) -> ExpertParallelLayout | None:
        """The layout after ``shard_experts``; None before (or in one process)."""

    def record_expert_load(self, enabled: bool) -> None:
        """Count (or stop counting) the tokens each MoE layer's router sends to each logical expert."""

    def expert_load(self) -> torch.Tensor:
        """This rank's counts since the last call, ``[num_moe_layers, num_logical_experts]`` int64 on the model's
        device, and zero the counters."""

    def expert_slots(self, layer: int) -> tuple:
        """MoE layer ``layer``'s local expert weights as the experts op takes them: each tensor stacked by this rank's
        physical slot (``[slots_per_rank, ...]``; quantized weights followed by their scales), other arguments (a
        block size) as they are."""

    def set_expert_placement(self, layer: int, phy2log: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor,
                             weights: tuple) -> None:
        """Swap in MoE layer ``layer``'s new placement and this rank's weights for it together: ``phy2log`` ``[P]``
        (logical expert of every physical slot, all ranks), ``log2phy`` ``[E, max_replicas]`` (-1 padded), ``logcnt``
        ``[E]``, ``weights`` shaped like ``expert_slots(layer)`` with ``P / world_size`` slots. Call it only between
        two forwards, on every rank with the same placement."""


def missing_members(model: object, protocol: type = CausalLM) -> list[str]:
    """The members of ``protocol`` that ``model`` lacks (empty: it satisfies the interface)."""
    names = [n for n in dir(protocol) if not n.startswith("_")] + list(getattr(protocol, "__annotations__", {}))
    return sorted({n for n in names if not hasattr(model, n)})

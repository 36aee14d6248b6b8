"""The proposer contract: what a draft method (``"ngram"``, a plugin's ``"mtp"`` / ``"dspark"``) gives the engine.

Once per step, after the step's tokens are read and applied, the engine calls ``Proposer.propose`` with every
running sequence that computed tokens in the step (``DraftBatch``). The proposer returns one ``Draft`` per sequence:
the tokens it guesses follow the sequence's newest token, at most ``max_draft_len`` of them (0: no draft). The next
step computes those tokens as ordinary tokens of the request (the scheduler's token budget counts them) and the
sampler verifies them against the target model (``spec_decode/verify.py``): greedy rows keep the draft while it
equals the target's argmax, random rows follow the standard rejection rule, so the outputs follow the target alone.
Tokens after the first rejection are rolled back (the model's state, the prefix cache) before anything reads them.

A proposer sees the whole batch, so a budgeted one (DSpark) chooses how many tokens of each draft to verify itself
and returns only those (``Draft.num_proposed`` says how many it drafted). The core has no method-specific branch.

Register a method from a plugin::

    @hookimpl
    def deepinfer_register_proposers(registry, context):
        registry.register("mtp", MtpProposer, keys=("draft_tensor_parallel_size",))

``MtpProposer(config, target, context)`` is then built once per engine with the ``SpeculativeConfig``, the target
model (``models/interface.py``'s ``CausalLM``; its weights, e.g. ``mtp.0.*``) and the ``EngineContext``.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from deepinfer_core.errors import DeepInferError
from deepinfer_core.sampling.params import SamplingParams

if TYPE_CHECKING:
    from deepinfer_core.engine_context import EngineContext
    from deepinfer_core.models.interface import CausalLM
    from deepinfer_core.spec_decode.config import SpeculativeConfig


class ProposerError(DeepInferError, ValueError):
    """A proposer registered or built wrongly, or one that returned drafts breaking the contract (too many, too
    long, ids outside the vocabulary, probabilities of the wrong shape); the message names the method."""


@dataclasses.dataclass
class DraftSequence:
    """One running sequence as a proposer sees it after a step.

    Attributes:
        request_id: the completion's id (stable for its life; ``Proposer.on_finish`` ends it).
        slot: the engine's per-sequence slot it holds while running (``0 <= slot < num_slots`` of
            ``Proposer.allocate``); a proposer may key per-sequence state by it.
        token_ids: every token of the sequence so far (prompt, then outputs), the newest last; the newest one is not
            computed by the target yet (the next step computes it, followed by the draft).
        num_computed_tokens: tokens folded into the target's state (positions ``< num_computed_tokens``).
        first_computed: the first position the target computed in this step; ``hidden_states`` row ``i`` is
            position ``first_computed + i``. Lower than the previous step's ``num_computed_tokens`` after a preemption
            (the sequence was recomputed): drop any state past it.
        hidden_states: when the proposer ``needs_hidden_states``: the target's hidden states of positions
            ``[first_computed, num_computed_tokens)`` (what the model's ``forward(..., return_hidden=True)`` returns,
            e.g. DeepSeek-V4's last-layer streams ``[T, hc_mult, hidden]`` before ``hc_head`` and the final norm);
            rejected draft positions are left out. None otherwise.
        num_accepted: draft tokens of this sequence the step accepted (0 without a draft).
        params: the completion's ``SamplingParams``.
        max_draft_len: the longest draft allowed now (``num_speculative_tokens``, less near ``max_tokens`` or
            ``max_model_len``); 0 means no draft this step (e.g. a prompt chunk that did not finish the prompt).
    """

    request_id: str
    slot: int
    token_ids: list[int]
    num_computed_tokens: int
    first_computed: int
    hidden_states: torch.Tensor | None
    num_accepted: int
    params: SamplingParams
    max_draft_len: int


@dataclasses.dataclass
class DraftBatch:
    """Every running sequence that computed tokens in the step, in the step's order."""

    sequences: list[DraftSequence]


@dataclasses.dataclass
class Draft:
    """A sequence's draft: the tokens to verify, next token first.

    Attributes:
        token_ids: at most ``max_draft_len`` token ids (empty: no draft).
        draft_probs: float32 ``[len(token_ids), vocab]``, the distribution ``q`` each token was drawn from (random
            rows are verified by ``u <= p(x) / q(x)``); None means deterministic drafts (``q`` one-hot on the token).
        confidences: optional per-token estimates that the token is accepted (for metrics and budgeted proposers).
        num_proposed: tokens drafted before the proposer chose which to verify (None: ``len(token_ids)``); counted
            in ``deepinfer:spec_decode_num_draft_tokens``.
    """

    token_ids: list[int]
    draft_probs: torch.Tensor | None = None
    confidences: list[float] | None = None
    num_proposed: int | None = None

    @property
    def num_drafted(self) -> int:
        return len(self.token_ids) if self.num_proposed is None else self.num_proposed


NO_DRAFT = Draft([])


class Proposer(abc.ABC):
    """A draft method (see module docstring). Subclasses implement ``propose``; the rest has defaults."""

    needs_hidden_states: bool = False
    """True: the engine runs the target with ``return_hidden=True`` and fills ``DraftSequence.hidden_states``
    (decode steps then run eagerly, not from captured graphs)."""

    def allocate(self, num_slots: int) -> None:
        """Called once before the first step with the engine's number of sequence slots (``max_num_seqs``), for a
        proposer that keeps per-sequence state (the MTP draft layer's own KV)."""

    def slot_state_bytes(self) -> int:
        """Bytes of per-sequence state the proposer keeps per slot (the engine's memory budget counts them)."""
        return 0

    def use_graphs(self, capture: Callable, sizes: Sequence[int]) -> None:
        """Called once after ``allocate`` where the engine replays static steps as device graphs (a GPU, or
        ``cuda_graph_sizes``): ``capture(fn, ())`` is the backend's ``capture_graph``, ``sizes`` the captured batch
        sizes. A proposer running a model of its own may capture its draft steps (the MTP draft rounds); the
        default drafts eagerly."""

    @abc.abstractmethod
    def propose(self, batch: DraftBatch) -> list[Draft]:
        """One ``Draft`` per ``batch.sequences`` entry, in order, each at most ``max_draft_len`` tokens."""

    def on_rollback(self, request_id: str, num_tokens: int) -> None:
        """The sequence kept only its first ``num_tokens`` tokens (draft tokens after the first rejection were
        removed); state the proposer wrote for later positions is stale."""

    def on_finish(self, request_id: str) -> None:
        """The sequence finished or was preempted (a preempted one comes back with ``first_computed`` 0)."""


ProposerFactory = Callable[["SpeculativeConfig", "CausalLM", "EngineContext | None"], Proposer]


class ProposerRegistry:
    """Proposer factories by method name; the core registers ``"ngram"``, plugins more through
    ``deepinfer_register_proposers``."""

    def __init__(self) -> None:
        self._factories: dict[str, tuple[ProposerFactory, tuple[str, ...]]] = {}

    def register(self, method: str, factory: ProposerFactory, keys: Sequence[str] = ()) -> None:
        """Register ``factory(config, target, context) -> Proposer`` for ``speculative_config["method"] == method``;
        ``keys``: the ``speculative_config`` keys the method takes besides ``method`` and
        ``num_speculative_tokens`` (any other key is refused). Registering a method again replaces it."""
        if not isinstance(method, str) or not method:
            raise ProposerError(f"a proposer method is a non-empty string, got {method!r}")
        if not callable(factory):
            raise ProposerError(f"proposer {method!r}: the factory {factory!r} is not callable")
        self._factories[method] = (factory, tuple(keys))

    def methods(self) -> dict[str, tuple[str, ...]]:
        """Each registered method's extra keys."""
        return {method: keys for method, (_, keys) in self._factories.items()}

    def build(self, config: SpeculativeConfig, target: CausalLM, context: EngineContext | None) -> Proposer:
        """The proposer of ``config.method`` for ``target``."""
        factory, _ = self._factories[config.method]
        proposer = factory(config, target, context)
        if not isinstance(proposer, Proposer):
            raise ProposerError(f"the factory of proposer {config.method!r} returned a {type(proposer).__name__}, not "
                                "a deepinfer_core.spec_decode.Proposer")
        return proposer


def default_registry(plugin_manager: Any = None, context: EngineContext | None = None) -> ProposerRegistry:
    """The core's proposers (``"ngram"``) plus what plugins register through ``deepinfer_register_proposers``."""
    from deepinfer_core.spec_decode.ngram import NGRAM_KEYS, NgramProposer

    registry = ProposerRegistry()
    registry.register("ngram", NgramProposer, keys=NGRAM_KEYS)
    if plugin_manager is not None:
        from deepinfer_core.plugins import call_hook

        call_hook(plugin_manager, "deepinfer_register_proposers", registry=registry, context=context)
    return registry

"""Logits processors: per-request code that changes a step's logits before sampling (vLLM's logits processors).

A processor is any callable ``processor(logits, rows) -> logits``:

* ``logits``: float32 ``[num_rows, vocab]`` on the device, one row per request sampled this step that the processor
  applies to, after the built-in controls (penalties, ``min_tokens``, ``allowed_token_ids``, ``bad_words``,
  ``logit_bias``). Rows that only compute prompt tokens this step are never passed.
* ``rows``: one ``LogitsRow`` per logits row, in the same order.

It returns logits of the same shape (it may change ``logits`` in place and return it). It runs outside any captured
device graph, on every backend, one call per step. Two optional attributes refine it (``LogitsProcessor`` gives the
defaults; a plain function gets them too):

* ``applies_to(params) -> bool``: whether the processor touches a request with these ``SamplingParams``; the others'
  rows are left out of ``logits``, and a step with no row left skips the processor (and keeps the greedy fast path).
* ``needs_latest_tokens``: with asynchronous scheduling the token a request sampled in the step before may still be
  on the device when the next step is planned, so ``LogitsRow.output_token_ids`` lacks it (``num_output_tokens``
  counts it). ``True`` makes the engine read that token first for the requests the processor applies to, as it does
  for penalties: ``output_token_ids`` is then complete, at the cost of the overlap for those steps.
* ``validate_params(params)``: called when the engine takes a request the processor applies to; raising
  ``ValueError`` / ``TypeError`` refuses that request alone (``RequestRejectedError`` with the message), where a
  processor that raised in a step would fail the whole step (vLLM's ``validate_params``).
* ``applies_structured_outputs``: True on a processor that enforces ``SamplingParams.structured_outputs`` (the
  ``deepinfer-structured-output`` plugin's); the engine refuses a request with ``structured_outputs`` that no such
  processor applies to, rather than ignore the constraint.
* ``prepare(rows) -> handle`` and ``apply(logits, rows, handle) -> logits``: a two-phase processor, whose host work
  (a grammar's token mask) leaves the critical path. The engine calls ``prepare`` on its host worker thread as soon as
  every row's output tokens are on the host: before the step's forward pass is launched when they already are (the
  synchronous loop; the CPU), otherwise while the device runs that forward pass (asynchronous scheduling reads the
  previous step's tokens then). ``rows`` are complete there (``len(output_token_ids) == num_output_tokens``). The
  sampler then calls ``apply`` with the handle ``prepare`` returned, waiting for it only if it has not finished. Such
  a processor needs no ``needs_latest_tokens``. ``prepare`` runs beside the engine's thread: it may touch only the
  processor's own state, guarded against ``validate_params`` (which runs on the engine's thread). Called as a plain
  processor (hand-built ``SamplingMetadata``), it is ``apply(logits, rows, prepare(rows))``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from deepinfer_core.errors import DeepInferError
from deepinfer_core.sampling.params import SamplingParams


class LogitsProcessorError(DeepInferError, RuntimeError):
    """A logits processor raised, or returned something other than logits of the input's shape."""


@dataclasses.dataclass(frozen=True)
class LogitsRow:
    """What a logits processor knows about one row of the step's logits.

    Attributes:
        request_id: the completion's id (``"<prompt id>-<i>"`` for completion ``i`` of ``n``).
        params: the request's ``SamplingParams`` (``extra_args`` carries what a plugin reads).
        prompt_token_ids: the prompt's token ids (read-only).
        output_token_ids: the ids generated so far that the host has read (read-only); with asynchronous scheduling
            the latest one may still be in flight (see ``num_output_tokens`` and ``needs_latest_tokens``).
        num_output_tokens: tokens generated before the one being sampled, in-flight ones included.
    """

    request_id: str
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    num_output_tokens: int


@runtime_checkable
class LogitsProcessorLike(Protocol):
    """The shape of a logits processor: a callable from (logits, rows) to logits."""

    def __call__(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor: ...


class LogitsProcessor:
    """Base class for logits processors (optional: any callable with the same signature works).

    Subclasses implement ``__call__`` and may override ``applies_to``, ``validate_params`` and
    ``needs_latest_tokens``.
    """

    needs_latest_tokens: bool = False

    def applies_to(self, params: SamplingParams) -> bool:
        """Whether this processor changes the logits of a request with ``params`` (default: every request)."""
        del params
        return True

    def validate_params(self, params: SamplingParams) -> None:
        """Raise ``ValueError`` to refuse a request this processor applies to when the engine takes it (default:
        accept)."""
        del params

    def __call__(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        """The processed logits ``[len(rows), vocab]``."""
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(logits, rows)")


class TwoPhaseLogitsProcessor(LogitsProcessor):
    """Base class for a processor whose host work runs off the critical path: ``prepare(rows)`` on the engine's
    worker thread once the rows' tokens are on the host, ``apply(logits, rows, handle)`` in the sampler (the module
    docstring says when each runs)."""

    def prepare(self, rows: Sequence[LogitsRow]) -> object:
        """The host work for ``rows`` (complete output ids); returns the handle ``apply`` gets."""
        raise NotImplementedError(f"{type(self).__name__} must implement prepare(rows)")

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow], handle: object) -> torch.Tensor:
        """The processed logits ``[len(rows), vocab]``, from ``handle`` (what ``prepare(rows)`` returned)."""
        raise NotImplementedError(f"{type(self).__name__} must implement apply(logits, rows, handle)")

    def __call__(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        """Both phases at once, on the caller's thread."""
        return self.apply(logits, rows, self.prepare(rows))


def processor_name(processor: Callable) -> str:
    """A readable name for error messages: the function's or the class's qualified name."""
    named = processor if hasattr(processor, "__qualname__") else type(processor)
    return f"{named.__module__}.{named.__qualname__}"


def applies_to(processor: Callable, params: SamplingParams) -> bool:
    """``processor.applies_to(params)``, or True for a processor without that method."""
    check = getattr(processor, "applies_to", None)
    return True if check is None else bool(check(params))


def validate_params(processor: Callable, params: SamplingParams) -> None:
    """``processor.validate_params(params)`` if it has that method (raises to refuse the request)."""
    check = getattr(processor, "validate_params", None)
    if check is not None:
        check(params)


def needs_latest_tokens(processor: Callable) -> bool:
    """``processor.needs_latest_tokens``, or False for a processor without that attribute."""
    return bool(getattr(processor, "needs_latest_tokens", False))


def is_two_phase(processor: Callable) -> bool:
    """Whether ``processor`` has ``prepare`` and ``apply`` (a two-phase processor)."""
    return callable(getattr(processor, "prepare", None)) and callable(getattr(processor, "apply", None))


def check_processors(processors: Sequence[object], source: str) -> list[Callable]:
    """``processors`` as a list after checking each is a callable instance; raise ``TypeError`` naming ``source``."""
    if isinstance(processors, (str, bytes)) or not isinstance(processors, Sequence):
        raise TypeError(f"{source} must be a list of logits processors, got {processors!r}")
    for processor in processors:
        if isinstance(processor, type):
            raise TypeError(f"{source}: {processor.__qualname__} is a class; pass an instance of it")
        if not callable(processor):
            raise TypeError(f"{source}: {processor!r} is not callable; a logits processor is called as "
                            "processor(logits, rows) -> logits")
    return list(processors)


@dataclasses.dataclass(frozen=True)
class ProcessorRows:
    """One processor and the step's rows it applies to (indices into the step's logits, ascending); for a two-phase
    processor, ``prepared``: its ``prepare`` started on the engine's worker thread (an object whose ``result()`` is the
    handle, waiting for it if need be), or None to prepare in the sampler."""

    processor: Callable
    indices: tuple[int, ...]
    prepared: object | None = None


def apply_logits_processors(logits: torch.Tensor, plan: Sequence[ProcessorRows],
                            rows: Sequence[LogitsRow]) -> torch.Tensor:
    """Run each processor of ``plan`` on its rows of ``logits`` ``[num_rows, vocab]``, in order; returns new logits.

    A processor that applies to every row gets the whole tensor; one that applies to some gets those rows gathered
    and its result scattered back, so the other rows are untouched bit for bit.
    """
    if not plan:
        return logits
    logits = logits.clone()  # [num_rows, vocab]; the caller's tensor stays as it was
    for entry in plan:
        if len(entry.indices) == logits.shape[0]:
            logits = _call(entry, logits, rows)
            continue
        index = torch.tensor(entry.indices, dtype=torch.long).to(logits.device, non_blocking=True)  # [k]
        picked = _call(entry, logits.index_select(0, index), [rows[i] for i in entry.indices])  # [k, V]
        logits.index_copy_(0, index, picked)
    return logits


def _run(entry: ProcessorRows, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
    processor = entry.processor
    if not is_two_phase(processor):
        return processor(logits, rows)
    handle = entry.prepared.result() if entry.prepared is not None else processor.prepare(rows)
    return processor.apply(logits, rows, handle)


def _call(entry: ProcessorRows, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
    processor = entry.processor
    try:
        out = _run(entry, logits, rows)
    except Exception as exc:
        raise LogitsProcessorError(
            f"logits processor {processor_name(processor)} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
        got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise LogitsProcessorError(f"logits processor {processor_name(processor)} returned {got}; it must return "
                                   f"logits of the input's shape {tuple(logits.shape)}")
    return out.float()


__all__ = [
    "LogitsProcessor",
    "LogitsProcessorError",
    "LogitsProcessorLike",
    "LogitsRow",
    "ProcessorRows",
    "TwoPhaseLogitsProcessor",
    "applies_to",
    "apply_logits_processors",
    "check_processors",
    "is_two_phase",
    "needs_latest_tokens",
    "validate_params",
]

"""Runs the two-phase logits processors' ``prepare`` on a host worker thread, off the step's critical path.

A two-phase processor (``sampling/logits_processor.py``: a grammar's token masks) does its host work in
``prepare(rows)`` and its device work in ``apply`` in the sampler. The engine starts ``prepare`` here as soon as every
row the step samples has its output tokens on the host: before the forward pass is launched when they already are,
or, under asynchronous scheduling, right after reading the previous step's tokens while the device runs this step's
forward pass. The tokens just read are passed in (``latest``), because the scheduler appends them to their requests
only after ``prepare`` has started.

``start`` returns once the worker thread has begun the first ``prepare``. Started and left to itself, the worker would
wait for the interpreter lock while the engine's thread runs Python (applying the previous step's results), up to the
switch interval (5 ms) before Python forces a handover: longer than a batch's masks take. Waiting for it hands the
lock over at once; the engine's thread takes it back when the worker's prepare releases it (llguidance computes the
masks without it), so the masks are computed beside the engine's own host work and the forward pass.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from deepinfer_core.engine.scheduler import ScheduledChunk, SchedulerOutput
from deepinfer_core.sampling.logits_processor import LogitsRow, applies_to, is_two_phase


@dataclasses.dataclass
class PrepareStats:
    """Where the two-phase processors' host time went: ``prepare_s`` on the worker thread, of which the sampler
    waited ``wait_s`` (the rest overlapped the device and the engine's own host work)."""

    prepare_s: float = 0.0
    wait_s: float = 0.0
    num_prepares: int = 0
    num_rows: int = 0

    @property
    def hidden_share(self) -> float | None:
        """The share of ``prepare_s`` the engine did not wait for (None before any prepare)."""
        return None if self.prepare_s <= 0 else max(0.0, 1.0 - self.wait_s / self.prepare_s)


class PreparedHandle:
    """A ``prepare`` running on the worker thread; ``result()`` is its handle, waiting only if it has not finished."""

    def __init__(self, future: Future, stats: PrepareStats):
        self._future = future
        self._stats = stats

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> object:
        if not self._future.done():
            start = time.perf_counter()
            self._future.exception()  # waits
            self._stats.wait_s += time.perf_counter() - start
        return self._future.result()


class OutputSoFar(Sequence[int]):
    """A request's output ids as ``prepare`` sees them: the first ``length`` of its append-only list (the engine's
    thread may append meanwhile), then ``tail``: the token the engine has just read, if any, and for a verified draft
    position the draft tokens before it."""

    __slots__ = ("_ids", "_length", "_tail")

    def __init__(self, ids: Sequence[int], length: int, tail: Sequence[int] = ()):
        self._ids, self._length, self._tail = ids, length, tuple(tail)

    def __len__(self) -> int:
        return self._length + len(self._tail)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            head = list(self._ids[start:min(stop, self._length)])  # [start, stop) of the live list, as of prepare
            return head + list(self._tail[max(start - self._length, 0):max(stop - self._length, 0)])
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("output token index out of range")
        return self._ids[index] if index < self._length else self._tail[index - self._length]


class LogitsPreparer:
    """Starts the ``prepare`` of each two-phase processor among ``processors`` (the sampler's list, same order)."""

    def __init__(self, processors: Sequence[Callable]):
        self.processors = list(processors)
        self._two_phase = [k for k, p in enumerate(self.processors) if is_two_phase(p)]
        self._pool: ThreadPoolExecutor | None = None  # started on first use
        self.stats = PrepareStats()

    def applies(self, scheduled: SchedulerOutput) -> bool:
        """Whether a two-phase processor applies to a row the step samples."""
        return bool(self._two_phase) and any(
            applies_to(self.processors[k], c.request.params) for c in scheduled.chunks if c.samples
            for k in self._two_phase)

    def start(self, scheduled: SchedulerOutput, latest: Mapping[str, int] | None = None) -> dict[int, PreparedHandle]:
        """Start ``prepare`` for each two-phase processor on the step's sampled rows it applies to; returns index in
        ``processors`` -> handle (``SamplingMetadata.from_params(prepared=...)``). ``latest``: tokens of the step
        before that the host has read but not yet appended to their requests (request id -> token id)."""
        chunks = [c for c in scheduled.chunks if c.samples]
        started = {}
        begun = threading.Event()  # set by the worker when it begins the first prepare (the module docstring)
        for k in self._two_phase:
            processor = self.processors[k]
            rows = [row for c in chunks if applies_to(processor, c.request.params) for row in rows_of(c, latest or {})]
            if rows:
                future = self._executor().submit(self._prepare, processor, rows, None if started else begun)
                started[k] = PreparedHandle(future, self.stats)
        if started:
            begun.wait()
        return started

    def _prepare(self, processor, rows: list[LogitsRow], begun: threading.Event | None = None) -> object:
        start = time.perf_counter()
        if begun is not None:
            begun.set()
        try:
            return processor.prepare(rows)
        finally:
            self.stats.prepare_s += time.perf_counter() - start
            self.stats.num_prepares += 1
            self.stats.num_rows += len(rows)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-prepare")
        return self._pool

    def shutdown(self) -> None:
        """Stop the worker thread (after the prepare in progress, if any)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def rows_of(chunk: ScheduledChunk, latest: Mapping[str, int]) -> list[LogitsRow]:
    """The ``LogitsRow`` of each position a sampling chunk samples, with its output complete: the request's read
    tokens, the one just read but not appended yet (``latest``), and for the position after draft token ``j`` the
    drafts before it (the rows the sampler verifies them with)."""
    request = chunk.request
    drafts = list(chunk.draft_token_ids)
    count = chunk.end - len(drafts) - len(request.prompt_token_ids)  # output tokens before the first sampled one
    known = len(request.output_token_ids)
    extra = [latest[request.request_id]] if known == count - 1 and request.request_id in latest else []
    if known + len(extra) != count:
        raise RuntimeError(f"request {request.request_id}: {count} output tokens precede this step but the host has "
                           f"{known}{' and the one just read' if extra else ''}; a two-phase logits processor needs "
                           "them all")
    return [LogitsRow(request.request_id, request.params, request.prompt_token_ids,
                      OutputSoFar(request.output_token_ids, known, extra + drafts[:j]), count + j)
            for j in range(len(drafts) + 1)]


__all__ = ["LogitsPreparer", "OutputSoFar", "PrepareStats", "PreparedHandle", "rows_of"]

"""``LLM(data_parallel_size=N)`` from one process: N ranks started with torch.multiprocessing (spawn), each building
its own engine (``worker.rank_main``); the parent sends every rank each ``generate`` call and takes the outputs.

A rank that raises or dies stops every rank, and the call fails with ``RankFailedError`` carrying that rank's
traceback. Nothing waits forever: the ranks' collectives time out after ``DEEPINFER_DISTRIBUTED_TIMEOUT`` seconds
(then they raise, and the parent reports it), start-up has that long too, and stopping joins each process with a
timeout before terminating and then killing it.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from deepinfer_core.distributed import messages
from deepinfer_core.distributed.rank import rank_from_environment, timeout
from deepinfer_core.distributed.worker import RankLaunch, rank_main
from deepinfer_core.engine_args import EngineArgs
from deepinfer_core.errors import DeepInferError
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.sampling.params import SamplingParams

_POLL_S = 0.2
_STOP_S = 10.0


class RankFailedError(DeepInferError, RuntimeError):
    """A rank of a data-parallel engine raised, died or did not start in time; every rank has been stopped, and the
    message carries the failing rank's traceback (or exit code)."""


def spawns_ranks(args: EngineArgs) -> bool:
    """Whether ``LLM`` starts ranks itself: more than one asked for, and this process is not already a rank."""
    return args.data_parallel_size > 1 and rank_from_environment() is None


class SpawnedRanks:
    """The ranks an ``LLM`` started, and the parent's side of talking to them."""

    def __init__(self, model: str | os.PathLike | None, kwargs: Mapping[str, Any], world_size: int):
        plain = messages.plain_engine_kwargs(kwargs)
        context = torch.multiprocessing.get_context("spawn")
        self.world_size = world_size
        self.stats: list[dict[str, Any]] = []  # per rank, after each generate (``DataParallelWorker.stats``)
        self._outbox = context.Queue()
        self._inboxes = [context.Queue() for _ in range(world_size)]
        threads = max(1, torch.get_num_threads() // world_size)
        port = _free_port()
        model = None if model is None else str(model)
        self._processes = [
            context.Process(target=rank_main, name=f"deepinfer-rank-{rank}", daemon=True,
                            args=(RankLaunch(rank, world_size, port, model, plain, threads, os.getpid()),
                                  self._inboxes[rank], self._outbox))
            for rank in range(world_size)]
        for process in self._processes:
            process.start()
        self._finalizer = weakref.finalize(self, _stop, self._processes, self._inboxes, self._outbox)
        self._await(deadline=time.monotonic() + timeout().total_seconds())

    def generate(self, llm, prompts: Sequence[Any], params: Sequence[SamplingParams]) -> list[RequestOutput]:
        """Every rank gets every prompt (each runs its share); the outputs come back in input order."""
        if not self._finalizer.alive:
            raise RankFailedError("this LLM's ranks have stopped (an earlier failure or shutdown); build a new LLM")
        message = ("generate", [messages.plain_prompt(p) for p in prompts],
                   [messages.params_to_plain(p) for p in params])
        for inbox in self._inboxes:
            inbox.put(message)
        replies = self._await()
        self.stats = [reply["stats"] for reply in replies]
        return [messages.output_from_plain(o) for o in replies[0]["outputs"]]

    def shutdown(self) -> None:
        """Stop every rank (politely, then by signal); safe to call twice."""
        self._finalizer()

    def _await(self, deadline: float | None = None) -> list[Any]:
        """One reply from every rank, by rank; fails on an error reply, a dead rank, or the deadline."""
        replies: dict[int, Any] = {}
        while len(replies) < self.world_size:
            try:
                kind, rank, payload = self._outbox.get(timeout=_POLL_S)
            except queue.Empty:
                self._check_running(deadline)
                continue
            if kind == "error":
                self._fail(self._died_first(rank) + f"rank {rank} of {self.world_size} failed:\n{payload}")
            replies[rank] = payload
        return [replies[rank] for rank in range(self.world_size)]

    def _check_running(self, deadline: float | None) -> None:
        dead = [(rank, p.exitcode) for rank, p in enumerate(self._processes) if not p.is_alive()]
        if dead:
            try:  # a rank that raised sent its traceback before exiting
                kind, rank, payload = self._outbox.get(timeout=1.0)
                if kind == "error":
                    self._fail(f"rank {rank} of {self.world_size} failed:\n{payload}")
            except queue.Empty:
                pass
            rank, code = dead[0]
            self._fail(f"rank {rank} of {self.world_size} died (exit code {code}) without a reply")
        if deadline is not None and time.monotonic() > deadline:
            self._fail(f"the ranks did not start within {timeout().total_seconds():.0f} s "
                       "(DEEPINFER_DISTRIBUTED_TIMEOUT)")

    def _died_first(self, failed: int) -> str:
        """A rank that died without a word is the likelier cause of another rank's error (its peers see the
        connection close): named first when there is one."""
        time.sleep(_POLL_S)
        reported = {failed}
        while True:
            try:
                kind, rank, _ = self._outbox.get_nowait()
            except queue.Empty:
                break
            if kind == "error":
                reported.add(rank)
        dead = [(rank, p.exitcode) for rank, p in enumerate(self._processes)
                if rank not in reported and not p.is_alive()]
        return "".join(f"rank {rank} of {self.world_size} died (exit code {code}); " for rank, code in dead)

    def _fail(self, message: str) -> None:
        _stop(self._processes, self._inboxes, self._outbox, polite=False)
        self._finalizer.detach()
        raise RankFailedError(message)


def _stop(processes, inboxes, outbox, polite: bool = True) -> None:
    """Stop the ranks: ask them (``polite``), wait up to ``_STOP_S``, then terminate, then kill."""
    if polite:
        for inbox, process in zip(inboxes, processes, strict=True):
            if process.is_alive():
                inbox.put(("stop", None, None))
        _join(processes, _STOP_S)
    for process in processes:
        if process.is_alive():
            process.terminate()
    _join(processes, _STOP_S)
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(_STOP_S)
    for q in [*inboxes, outbox]:
        q.close()
        q.cancel_join_thread()


def _join(processes, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))


def _free_port() -> int:
    """A TCP port free now on the loopback interface, for the rendezvous (rank 0 listens on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

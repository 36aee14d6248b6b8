"""Two-phase logits processors (``prepare`` on the engine's worker thread, ``apply`` in the sampler) on the embedded
tiny model: the rows ``prepare`` gets are complete under both loops, it runs off the engine's thread, the outputs of
the asynchronous loop are the synchronous loop's, and other requests keep their tokens."""

from __future__ import annotations

import itertools
import sys
import threading
import time

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.logits_preparer import LogitsPreparer, OutputSoFar, rows_of
from deepinfer_core.engine.request import Request
from deepinfer_core.engine.scheduler import ScheduledChunk, SchedulerOutput
from deepinfer_core.sampling.logits_processor import TwoPhaseLogitsProcessor, is_two_phase


class SameParity(TwoPhaseLogitsProcessor):
    """Allows only tokens of the parity of the row's latest output token (a rule that needs that token)."""

    def __init__(self):
        self.threads, self.complete = set(), []

    def applies_to(self, params: SamplingParams) -> bool:
        return bool((params.extra_args or {}).get("parity"))

    def prepare(self, rows):
        self.threads.add(threading.current_thread().name)
        self.complete += [len(row.output_token_ids) == row.num_output_tokens for row in rows]
        return torch.tensor([row.output_token_ids[-1] % 2 if row.output_token_ids else 0 for row in rows])

    def apply(self, logits, rows, handle):
        parity = torch.arange(logits.shape[1], device=logits.device) % 2  # [vocab]
        return logits.masked_fill_(parity[None, :] != handle.to(logits.device)[:, None], float("-inf"))


PROMPTS = ["def fibonacci(n):", "hello", "import os\n", "class A:"]


def _params():
    steered = SamplingParams(temperature=0.8, seed=3, max_tokens=16, n=2, extra_args={"parity": True})
    return [steered, SamplingParams(temperature=0, max_tokens=16), steered, SamplingParams(temperature=0, max_tokens=16)]


def _run(async_scheduling: bool):
    processor = SameParity()
    llm = LLM(max_num_seqs=6, enforce_eager=True, async_scheduling=async_scheduling, logits_processors=[processor])
    return llm.generate(PROMPTS, _params(), use_tqdm=False), processor, llm


def test_prepare_gets_complete_rows_off_the_engine_thread_and_both_loops_agree():
    sync, sync_processor, _ = _run(False)
    overlapped, processor, llm = _run(True)
    assert [[c.token_ids for c in o.outputs] for o in overlapped] == [[c.token_ids for c in o.outputs] for o in sync]
    assert processor.threads == sync_processor.threads == {"deepinfer-prepare_0"}
    assert processor.complete and all(processor.complete) and all(sync_processor.complete)
    assert llm.engine.num_overlapped_steps > 0 and llm.engine.preparer.stats.num_rows > 0
    for output in overlapped[::2]:
        for completion in output.outputs:
            ids = completion.token_ids
            assert all(a % 2 == b % 2 for a, b in itertools.pairwise(ids)), ids
    plain = LLM(max_num_seqs=6, enforce_eager=True).generate(PROMPTS[1::2], _params()[1::2], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in overlapped[1::2]] == [o.outputs[0].token_ids for o in plain]


def test_the_two_phase_contract_and_a_prefix_view_of_the_output():
    processor = SameParity()
    assert is_two_phase(processor) and not is_two_phase(lambda logits, rows: logits)
    ids = [1, 2, 3]
    view = OutputSoFar(ids, 3, [8])
    ids.append(5)  # the engine's thread appends meanwhile: the view keeps what it was given
    assert list(view) == [1, 2, 3, 8] and view[1:] == [2, 3, 8] and view[4:] == [] and view[-1] == 8
    assert list(OutputSoFar(ids, 2)) == [1, 2] and view[::2] == [1, 3] and view[0:3] == [1, 2, 3]
    drafted = OutputSoFar(ids, 4, [8, 6, 7])
    assert len(drafted) == 7 and drafted[3:6] == [5, 8, 6] and drafted[5:] == [6, 7] and drafted[6] == 7


def test_a_drafted_chunk_has_one_complete_row_per_verified_position():
    request = Request("r-0", "r", 0, [10, 11], SamplingParams(), seed=0, arrival=0, output_token_ids=[4, 5],
                      draft_token_ids=[6, 7])
    request.num_inflight_tokens = 1  # the token of the step before, read by the host but not appended yet
    chunk = ScheduledChunk(request, 4, 3)  # the in-flight token and the two drafts
    rows = rows_of(chunk, {"r-0": 9})
    assert [list(r.output_token_ids) for r in rows] == [[4, 5, 9], [4, 5, 9, 6], [4, 5, 9, 6, 7]]
    assert [r.num_output_tokens for r in rows] == [3, 4, 5]
    with pytest.raises(RuntimeError, match="a two-phase logits processor needs them all"):
        rows_of(chunk, {})


class Blocking(TwoPhaseLogitsProcessor):
    """Notes when its prepare begins, then waits to be released."""

    def __init__(self):
        self.began_at, self.release = None, threading.Event()

    def prepare(self, rows):
        self.began_at = time.perf_counter()
        self.release.wait(30)
        return len(rows)

    def apply(self, logits, rows, handle):
        return logits


def test_start_returns_once_the_worker_has_begun_prepare():
    """Left to itself the worker waits for the interpreter lock while the engine's thread runs Python (up to the
    switch interval); ``start`` hands it over first, so prepare begins while the engine's thread keeps running Python."""
    request = Request("r-0", "r", 0, [10, 11], SamplingParams(), seed=0, arrival=0, output_token_ids=[4, 5])
    scheduled = SchedulerOutput([ScheduledChunk(request, 3, 1)], [])
    processor = Blocking()
    preparer = LogitsPreparer([processor])
    processor.release.set()
    assert preparer.start(scheduled)[0].result() == 1  # the worker thread exists now, idle
    processor.began_at = None
    processor.release.clear()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # no forced handover during the loop below
    try:
        handle = preparer.start(scheduled)[0]
        busy_until = time.perf_counter() + 0.05
        while time.perf_counter() < busy_until:  # the engine's thread runs Python
            pass
        assert processor.began_at is not None and processor.began_at < busy_until
        assert not handle.done()  # start did not wait for prepare to finish
    finally:
        sys.setswitchinterval(interval)
        processor.release.set()
        preparer.shutdown()

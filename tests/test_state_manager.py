"""State manager and scheduler: exact block ids, prefix-cache behaviour, invariants under random load.

The model is not involved: a step here is schedule() then update() with chosen tokens, which is
all the allocator and the scheduler see of a step.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.engine.prefix_replay import PrefixHit, PrefixReplay
from deepinfer_core.engine.request import Request, RequestStatus
from deepinfer_core.engine.scheduler import FcfsScheduler
from deepinfer_core.engine.state_manager import StateManager, chain_hashes
from deepinfer_core.sampling.params import SamplingParams

BLOCK = 4


def _request(rid: int, tokens: list[int], max_tokens: int = 3) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    return Request(request_id=str(rid), group_id=str(rid), sample_index=0, prompt_token_ids=tokens,
                   params=params, seed=rid, arrival=rid)


class _ChosenReplay(PrefixReplay):
    """A replay start chosen by the test (a plugin's ``rebuild_sliding_window`` choice, without a plugin)."""

    def __init__(self, choose):
        super().__init__(replay_span=0, sliding_window=0)
        self.choose = choose

    def start(self, hit: PrefixHit, num_cached_tokens: int) -> int:
        return self.choose(hit.request, num_cached_tokens)


def _scheduler(num_blocks=16, num_slots=4, budget=64, replay=lambda r, hit: hit, mixed=False):
    manager = StateManager(num_blocks, num_slots, BLOCK)
    return manager, FcfsScheduler(manager, num_slots, budget, max_model_len=1 << 20, eos_token_id=None,
                                  prefix_replay=_ChosenReplay(replay), mixed_chunks=mixed)


def _step(scheduler, token=7):
    out = scheduler.schedule()
    sampled = {c.request.request_id: token for c in out.chunks if c.samples}
    return out, scheduler.update(out, sampled)


def test_fresh_allocation_takes_blocks_in_order():
    _, scheduler = _scheduler()
    a, b = _request(0, list(range(9))), _request(1, list(range(100, 105)))
    scheduler.add(a)
    scheduler.add(b)
    out, _ = _step(scheduler)
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == [("0", 0, 9), ("1", 0, 5)]
    assert a.block_ids == [0, 1, 2] and b.block_ids == [3, 4]
    assert a.slot != b.slot
    assert len(a.block_hashes) == 2 and len(b.block_hashes) == 1  # full blocks are registered


def test_prefix_hit_shares_blocks_and_leaves_one_token():
    manager, scheduler = _scheduler()
    prompt = list(range(12))
    first = _request(0, prompt)
    scheduler.add(first)
    while scheduler.has_unfinished():
        _step(scheduler)
    second = _request(1, prompt)  # identical prompt: 2 full blocks usable (one token must be computed)
    scheduler.add(second)
    out, _ = _step(scheduler)
    assert second.num_cached_tokens == 8
    assert second.block_ids[:2] == first_blocks(prompt, manager)
    assert out.chunks[0].start == 8 and out.chunks[0].num_tokens == 4
    assert manager.hits == 1


def first_blocks(prompt, manager):
    return [manager.cached[h] for h in chain_hashes(prompt[:8], BLOCK)]


def test_replay_policy_decides_the_restart_point():
    _, scheduler = _scheduler(replay=lambda request, hit: hit - 4)
    prompt = list(range(20))
    scheduler.add(_request(0, prompt))
    while scheduler.has_unfinished():
        _step(scheduler)
    again = _request(1, prompt + [1])
    scheduler.add(again)
    out, _ = _step(scheduler)
    chunk = out.chunks[0]
    assert again.num_cached_tokens == 20 and chunk.start == 16 and again.replay_until == 20
    assert again.sliding_floor == 16


def test_lru_evicts_the_oldest_unreferenced_block_first():
    manager = StateManager(num_blocks=3, num_slots=2, block_size=BLOCK)
    a, b = _request(0, list(range(8))), _request(1, list(range(50, 54)))
    for request in (a, b):
        manager.admit(request, [])
        manager.allocate(request, request.num_tokens)
        manager.commit(request, request.num_tokens)
    manager.release(a)  # blocks 1 then 0 become free (tail first)
    manager.release(b)  # then block 2
    assert list(manager.free_blocks) == [1, 0, 2]
    c = _request(2, list(range(90, 94)))
    manager.admit(c, [])
    manager.allocate(c, 4)
    assert c.block_ids == [1]
    assert len(manager.cached) == 2  # the evicted block's hash is gone, the others stay cached


def test_preemption_frees_the_latest_arrival_and_it_recomputes():
    manager, scheduler = _scheduler(num_blocks=5, num_slots=2)
    a, b = _request(0, list(range(7)), max_tokens=6), _request(1, list(range(30, 37)), max_tokens=6)
    scheduler.add(a)
    scheduler.add(b)
    preempted = []
    while scheduler.has_unfinished():
        out, _ = _step(scheduler)
        preempted += [r.request_id for r in out.preempted]
        manager.check_invariants(scheduler.running)
    assert preempted and set(preempted) == {"1"}
    assert a.output_token_ids == [7] * 6 and b.output_token_ids == [7] * 6
    assert b.num_preemptions >= 1 and scheduler.num_preemptions == len(preempted)


@pytest.mark.parametrize("mixed", [False, True])
def test_decodes_wait_while_prompt_tokens_fold_unless_mixed(mixed):
    """Without mixed chunks a step with prompt work (an admission, a prompt's next chunk) plans no decode; the
    running request decodes once no prompt tokens are left. With them, decodes ride along in every step."""
    _, scheduler = _scheduler(num_slots=3, budget=6, mixed=mixed)
    scheduler.add(_request(0, [1, 2, 3], max_tokens=4))
    _step(scheduler)  # request 0 prefilled: it decodes from now on
    scheduler.add(_request(1, list(range(10, 20)), max_tokens=2))  # 10 prompt tokens: two chunks
    plans = [[(c.request.request_id, c.num_tokens) for c in _step(scheduler)[0].chunks] for _ in range(3)]
    if mixed:
        assert plans == [[("0", 1), ("1", 5)], [("0", 1), ("1", 5)], [("0", 1), ("1", 1)]]
    else:
        assert plans == [[("1", 6)], [("1", 4)], [("0", 1), ("1", 1)]]


def test_prompt_chunks_padded_to_the_longest_stay_within_two_budgets():
    """A long prompt chunk with short prompts behind it: only as many join the step as keep (prompt chunks) x
    (longest chunk) within twice the token budget; the rest wait for the next step."""
    _, scheduler = _scheduler(num_blocks=64, num_slots=8, budget=40)
    scheduler.add(_request(0, list(range(30)), max_tokens=1))
    for rid in range(1, 6):
        scheduler.add(_request(rid, [rid, rid + 1], max_tokens=1))
    out, _ = _step(scheduler)
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("0", 30), ("1", 2)]  # 3 x 30 > 80
    out, _ = _step(scheduler)
    assert [c.request.request_id for c in out.chunks] == ["2", "3", "4", "5"]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(6, 24), num_slots=st.integers(1, 5),
       budget=st.integers(1, 40), mixed=st.booleans())
def test_allocator_invariants_under_random_workloads(seed, num_blocks, num_slots, budget, mixed):
    rng = random.Random(seed)
    manager, scheduler = _scheduler(num_blocks, num_slots, budget,
                                    replay=lambda r, hit: max(0, hit - rng.choice([0, 3, 8])), mixed=mixed)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(0, 12))] for _ in range(3)]
    requests = []
    for rid in range(rng.randrange(1, 9)):
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 8))]
        max_tokens = rng.randrange(1, 6)
        if -(-(len(tokens) + max_tokens) // BLOCK) > num_blocks:
            continue  # the engine refuses such a request up front
        requests.append(_request(rid, tokens, max_tokens))
        scheduler.add(requests[-1])
    steps = 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        assert out.chunks, "scheduler stalled with pending requests"
        assert out.num_tokens <= budget
        prompt_chunks = [c.num_tokens for c in out.chunks if c.num_tokens > 1]
        assert len(prompt_chunks) < 2 or len(prompt_chunks) * max(prompt_chunks) <= 2 * budget
        assert len({c.request.request_id for c in out.chunks}) == len(out.chunks)
        for chunk in out.chunks:
            assert len(chunk.request.block_ids) * BLOCK >= chunk.end  # blocks cover what is computed
        manager.check_invariants([r for r in requests if r.status == RequestStatus.RUNNING])
        token = rng.randrange(50)
        scheduler.update(out, {c.request.request_id: token for c in out.chunks if c.samples})
        steps += 1
        assert steps < 2000
    assert all(r.is_finished and len(r.output_token_ids) == r.params.max_tokens for r in requests)
    assert manager.refcount == [0] * num_blocks
    assert sorted(manager.free_slots) == list(range(num_slots))
    manager.check_invariants([])

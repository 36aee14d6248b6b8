"""``plan_transfers``: applying the planned copies to the old slots gives exactly the new placement."""

from __future__ import annotations

import pytest
import torch
from deepinfer_eplb import EplbError, Placement, Transfer, plan_transfers, rebalance_experts
from eplb_trace import zipf_trace


def apply(old: Placement, transfers: list[Transfer], num_ranks: int) -> torch.Tensor:
    """Simulate the step boundary: every copy reads the OLD slots (staging), then all land at once."""
    per_rank = old.num_physical // num_ranks
    result = old.phy2log.clone()
    for t in transfers:
        source_slots = range(t.src_rank * per_rank, (t.src_rank + 1) * per_rank)
        assert any(old.phy2log[t.layer, s] == t.expert for s in source_slots), t  # the source holds the expert
        assert t.slot // per_rank == t.dst_rank
        result[t.layer, t.slot] = t.expert
    return result


def test_transfers_turn_the_old_placement_into_the_new_one():
    trace = zipf_trace(20, 3, 32, 64, 4, 1.0, seed=3)  # [steps, layers, experts]
    old = rebalance_experts(trace[:10].sum(0), 40, 1, 1, 4)
    new = rebalance_experts(trace[10:].sum(0), 40, 1, 1, 4)
    transfers = plan_transfers(old, new, 4)
    assert torch.equal(apply(old, transfers, 4), new.phy2log)
    changed = int((old.phy2log != new.phy2log).sum())
    assert len(transfers) == changed > 0  # one copy per changed slot, none for a slot that keeps its expert


def test_a_copy_already_on_the_rank_is_used_locally():
    old = Placement.from_slots(torch.tensor([[0, 1, 2, 0]]), torch.tensor([[0, 0, 0, 1]]), 3)
    new = Placement.from_slots(torch.tensor([[0, 0, 2, 1]]), torch.tensor([[0, 1, 0, 0]]), 3)
    assert plan_transfers(old, new, 2) == [Transfer(0, 1, 0, 0, 0), Transfer(0, 3, 1, 0, 1)]


def test_placements_must_match():
    with pytest.raises(EplbError, match="placements differ in layers or experts"):
        plan_transfers(Placement.identity(1, 4), Placement.identity(2, 4), 2)


def test_initial_placement_replicates_the_next_ranks_experts():
    """The engine's starting layout: the plain layout's experts per rank, then replicas of the next rank's first
    experts in the extra slots; the identity without extra slots."""
    start = Placement.initial(2, 8, 12, 4)
    assert start.phy2log[1].tolist() == [0, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7, 0]
    assert start.logcnt[1].tolist() == [2, 1, 2, 1, 2, 1, 2, 1]
    assert torch.equal(Placement.initial(3, 8, 8, 4).phy2log, Placement.identity(3, 8).phy2log)
    with pytest.raises(EplbError, match="do not split evenly"):
        Placement.initial(1, 8, 10, 4)


def test_a_change_of_slot_count_moves_every_slot():
    """Plain layout (4 experts, 2 ranks) to 6 slots: every new slot is one copy, from its own rank when that rank
    held the expert."""
    new = Placement.initial(1, 4, 6, 2)  # rank 0: experts 0, 1, 2; rank 1: 2, 3, 0
    transfers = plan_transfers(Placement.identity(1, 4), new, 2)
    assert [(t.slot, t.expert, t.src_rank, t.dst_rank) for t in transfers] == [
        (0, 0, 0, 0), (1, 1, 0, 0), (2, 2, 1, 0), (3, 2, 1, 1), (4, 3, 1, 1), (5, 0, 0, 1)]


@pytest.mark.parametrize("phy2log, replica, match", [
    ([[0, 1, 3]], [[0, 0, 0]], r"expert ids outside \[0, 3\)"),
    ([[0, 1, 1]], [[0, 0, 1]], "every logical expert needs at least one physical slot"),
    ([[0, 1, 2, 0]], [[0, 0, 0, 0]], "two slots of one expert share a replica number"),
    ([[0, 1, 2, 0]], [[0, 0, 0, 2]], r"replica numbers must run 0 \.\. count - 1"),
])
def test_inconsistent_slots_are_refused(phy2log, replica, match):
    with pytest.raises(EplbError, match=match):
        Placement.from_slots(torch.tensor(phy2log), torch.tensor(replica), 3)

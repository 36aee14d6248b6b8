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
    with pytest.raises(EplbError, match="placements differ in shape"):
        plan_transfers(Placement.identity(1, 4), Placement.identity(2, 4), 2)


@pytest.mark.parametrize("phy2log, replica, match", [
    ([[0, 1, 3]], [[0, 0, 0]], r"expert ids outside \[0, 3\)"),
    ([[0, 1, 1]], [[0, 0, 1]], "every logical expert needs at least one physical slot"),
    ([[0, 1, 2, 0]], [[0, 0, 0, 0]], "two slots of one expert share a replica number"),
    ([[0, 1, 2, 0]], [[0, 0, 0, 2]], r"replica numbers must run 0 \.\. count - 1"),
])
def test_inconsistent_slots_are_refused(phy2log, replica, match):
    with pytest.raises(EplbError, match=match):
        Placement.from_slots(torch.tensor(phy2log), torch.tensor(replica), 3)

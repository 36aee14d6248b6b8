"""``rank_loads`` / ``moe_lb`` by hand, and the figure on a skewed routing trace (64 experts over 8 ranks)."""

from __future__ import annotations

import pytest
import torch
from deepinfer_eplb import (
    EplbConfig,
    EplbError,
    ExpertBalancer,
    LoadWindow,
    Placement,
    moe_lb,
    rank_loads,
    rebalance_experts,
)
from deepinfer_eplb.balance import layer_balance
from eplb_trace import zipf_trace


def test_rank_loads_split_an_expert_evenly_over_its_replicas():
    load = torch.tensor([[6, 2, 1, 3]])
    placement = Placement.from_slots(torch.tensor([[0, 1, 0, 2, 3, 0]]), torch.tensor([[0, 0, 1, 0, 0, 2]]), 4)
    assert placement.logcnt.tolist() == [[3, 1, 1, 1]]
    assert rank_loads(load, placement, 3).tolist() == [[4.0, 3.0, 5.0]]  # 2+2 | 2+1 | 3+2
    assert moe_lb(load, placement, 3) == pytest.approx(5 / 4)


def test_identity_placement_is_the_layout_without_eplb():
    load = torch.tensor([[4, 0, 1, 1], [1, 1, 1, 1]])
    identity = Placement.identity(2, 4)
    assert identity.log2phy.squeeze(-1).tolist() == [[0, 1, 2, 3]] * 2
    assert rank_loads(load, identity, 2).tolist() == [[4.0, 2.0], [2.0, 2.0]]
    assert layer_balance(load, identity, 2).tolist() == [pytest.approx(4 / 3), 1.0]
    assert moe_lb(load, identity, 2) == pytest.approx((4 / 3 + 1) / 2)


def test_a_layer_without_load_counts_as_balanced():
    assert moe_lb(torch.zeros(1, 4), Placement.identity(1, 4), 2) == 1.0


def test_shapes_are_checked():
    with pytest.raises(EplbError, match=r"load must be \[layers, num_logical\] = \[1, 4\]"):
        moe_lb(torch.zeros(2, 4), Placement.identity(1, 4), 2)
    with pytest.raises(EplbError, match="4 physical expert slots do not split evenly over 3 ranks"):
        moe_lb(torch.zeros(1, 4), Placement.identity(1, 4), 3)


LAYERS, EXPERTS, RANKS, TOKENS, TOP_K, EXPONENT = 4, 64, 8, 256, 6, 1.0


def test_skewed_trace_balances_to_within_ten_percent():
    """Zipf(1.0) expert popularity, top-6 of 64 experts, 256 tokens a step, 8 ranks. The balancer plans from a
    100-step window every 100 steps; the figure is measured on the 100 steps after the plan (unseen load)."""
    trace = zipf_trace(200, LAYERS, EXPERTS, TOKENS, TOP_K, EXPONENT, seed=0)  # [steps, layers, experts]
    balancer = ExpertBalancer(EplbConfig(num_redundant_experts=RANKS, window_size=100, step_interval=100),
                              LAYERS, EXPERTS, RANKS)
    plans = [balancer.record(step) for step in trace[:100]]
    assert plans[:99] == [None] * 99 and plans[99] is balancer.placement
    unseen = trace[100:].sum(0)  # [layers, experts]
    without = moe_lb(unseen, Placement.identity(LAYERS, EXPERTS), RANKS)
    with_eplb = moe_lb(unseen, balancer.placement, RANKS)
    no_spares = moe_lb(unseen, rebalance_experts(trace[:100].sum(0), EXPERTS, 1, 1, RANKS), RANKS)
    print(f"moe_lb without EPLB {without:.3f}, rebalanced without redundant experts {no_spares:.3f}, "
          f"with one redundant expert per rank {with_eplb:.3f}")
    assert without > 1.5  # the trace is skewed
    assert with_eplb < no_spares < without
    assert with_eplb <= 1.10
    report = balancer.reports[-1]
    assert report.step == 100 and report.moe_lb_before > 1.5 and report.moe_lb_after <= 1.05


def test_window_feeds_the_plan_the_last_steps_only():
    """A popularity shift: after it, the plan follows the new hot experts once the old steps left the window."""
    old = zipf_trace(50, 1, EXPERTS, TOKENS, TOP_K, EXPONENT, seed=1)
    new = zipf_trace(50, 1, EXPERTS, TOKENS, TOP_K, EXPONENT, seed=2)  # another random order of popularity
    window = LoadWindow(1, EXPERTS, window_size=50, step_interval=50)
    for step in torch.cat([old, new]):
        window.record(step)
    assert torch.equal(window.load(), new.sum(0))

"""``LoadWindow``: the sliding sum of per-step loads and the rebalance clock; ``ExpertBalancer`` on top of it."""

from __future__ import annotations

import pytest
import torch
from deepinfer_eplb import EplbConfig, EplbConfigError, EplbError, ExpertBalancer, LoadWindow


def step(value: int) -> torch.Tensor:
    return torch.full((2, 3), value)  # [layers, experts]


def test_sums_the_last_window_size_steps():
    window = LoadWindow(2, 3, window_size=3, step_interval=10)
    assert window.load().eq(0).all()
    for value in (1, 2, 3):
        window.record(step(value))
    assert window.load().eq(6).all()
    window.record(step(10))  # step 1 leaves the window
    assert window.load().eq(15).all() and window.num_recorded == 4


def test_load_is_a_copy():
    window = LoadWindow(2, 3, window_size=2, step_interval=1)
    window.record(step(1))
    window.load().add_(100)
    assert window.load().eq(1).all()


def test_due_every_step_interval_steps_after_each_rebalance():
    window = LoadWindow(2, 3, window_size=2, step_interval=3)
    assert [window.record(step(1)) for _ in range(3)] == [False, False, True]
    assert window.due
    window.mark_rebalanced()
    assert [window.record(step(1)) for _ in range(3)] == [False, False, True]
    assert window.load().eq(2).all()  # the window keeps its steps across a rebalance


def test_bad_shapes_and_sizes_are_named():
    with pytest.raises(EplbError, match=r"step load must be \[layers, num_experts\] = \[2, 3\], got \[3, 2\]"):
        LoadWindow(2, 3, 4, 4).record(torch.zeros(3, 2))
    with pytest.raises(EplbError, match="window_size must be a positive int, got 0"):
        LoadWindow(2, 3, 0, 4)


def test_balancer_rebalances_every_interval_and_reports():
    balancer = ExpertBalancer(EplbConfig(num_redundant_experts=2, window_size=4, step_interval=2), 1, 6, 2)
    assert balancer.placement.num_physical == 8 and balancer.placement.logcnt.sum() == 8
    hot = torch.tensor([[60, 1, 1, 1, 1, 1]])  # expert 0 takes most tokens
    assert balancer.record(hot) is None
    placement = balancer.record(hot)
    assert placement is balancer.placement and placement.logcnt[0, 0] == 3  # both spares go to expert 0
    report = balancer.reports[-1]
    assert report.step == 2 and report.moe_lb_after < report.moe_lb_before
    assert [balancer.record(hot) is None for _ in range(4)] == [True, False, True, False]


def test_balancer_refuses_slots_that_do_not_split_over_the_ranks():
    with pytest.raises(EplbConfigError, match=r"6 experts \+ 1 redundant .* = 7 slots do not split evenly over 2"):
        ExpertBalancer(EplbConfig(num_redundant_experts=1), 1, 6, 2)

"""``ExpertBalancer``: one engine's EPLB state: the load window, the current placement, and when to replace it."""

from __future__ import annotations

import dataclasses
import logging

import torch

from deepinfer_eplb.balance import moe_lb
from deepinfer_eplb.config import EplbConfig
from deepinfer_eplb.errors import EplbError
from deepinfer_eplb.load_window import LoadWindow
from deepinfer_eplb.placement import Placement
from deepinfer_eplb.rebalance import rebalance_experts

log = logging.getLogger("deepinfer.eplb")


@dataclasses.dataclass(frozen=True)
class RebalanceReport:
    """One rebalance: the step it happened after, and ``moe_lb`` of the window's load under the old and new
    placements."""

    step: int
    moe_lb_before: float
    moe_lb_after: float


class ExpertBalancer:
    """Records each step's router load and hands out a new ``Placement`` every ``config.step_interval`` steps.

    ``num_ranks`` expert-parallel ranks over ``num_nodes`` nodes; ``num_groups`` is the routing's expert groups (1
    for DeepSeek-V4, whose router has no group limit). The first placement is ``initial`` (the engine's: ``Placement.initial``), or
    else one planned from a uniform load; either way valid for ``num_experts + num_redundant_experts`` slots.
    """

    def __init__(self, config: EplbConfig, num_layers: int, num_experts: int, num_ranks: int, num_nodes: int = 1,
                 num_groups: int = 1, device: torch.device | str = "cpu", initial: Placement | None = None):
        self.config = config
        self.topology = (config.num_physical(num_experts, num_ranks), num_groups, num_nodes, num_ranks)
        self.window = LoadWindow(num_layers, num_experts, config.window_size, config.step_interval, device)
        if initial is None:
            initial = rebalance_experts(torch.ones(num_layers, num_experts), *self.topology)
        elif tuple(initial.phy2log.shape) != (num_layers, self.topology[0]):
            raise EplbError(f"initial placement has phy2log {list(initial.phy2log.shape)}, the balancer plans "
                            f"[{num_layers}, {self.topology[0]}]")
        self.placement = initial
        self.reports: list[RebalanceReport] = []

    @property
    def num_ranks(self) -> int:
        return self.topology[3]

    def record(self, step_load: torch.Tensor) -> Placement | None:
        """Add one step's load ``[layers, num_experts]``; return the new placement when a rebalance is due (the
        caller moves the weights before the next step), else None."""
        if not self.window.record(step_load):
            return None
        return self.rebalance()

    def rebalance(self) -> Placement:
        """Plan a placement from the window's load now, make it current, log and keep its ``RebalanceReport``."""
        load = self.window.load()  # [layers, num_experts]
        new = rebalance_experts(load, *self.topology)
        report = RebalanceReport(self.window.num_recorded, moe_lb(load, self.placement, self.num_ranks),
                                 moe_lb(load, new, self.num_ranks))
        log.info("EPLB rebalance after step %d: moe_lb %.3f -> %.3f over the last %d steps", report.step,
                 report.moe_lb_before, report.moe_lb_after, min(self.window.num_recorded, self.window.window_size))
        self.placement = new
        self.reports.append(report)
        self.window.mark_rebalanced()
        return new

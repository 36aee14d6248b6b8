"""``EplbRuntime``: EPLB on one rank of a running engine: the router's load in, placements out, weights moved.

Built at engine start (``plugin.deepinfer_engine_start``) on each rank of an expert-parallel engine. It moves the
model from its plain layout to ``Placement.initial`` (only with redundant experts), switches the routers' load
counting on, and at every step boundary (``deepinfer_step_boundary``, the same point on every rank) all-reduces the
step's load over the ranks (sum), feeds its ``ExpertBalancer`` and, when a rebalance is due, moves the weights to
the new placement before the next step and sets its figures in the engine's metrics (``EplbMetrics``). Every rank
records the same summed load, so every rank plans the same placement.
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from deepinfer_core.metrics import MetricsRegistry
from deepinfer_core.models.interface import ExpertBalancedModel
from deepinfer_eplb.balance import moe_lb
from deepinfer_eplb.balancer import ExpertBalancer, RebalanceReport
from deepinfer_eplb.config import ENABLE, EplbConfig
from deepinfer_eplb.errors import EplbConfigError
from deepinfer_eplb.mover import move_experts
from deepinfer_eplb.placement import Placement

log = logging.getLogger("deepinfer.eplb")


class EplbRuntime:
    """One rank's balancer over ``model`` (an ``ExpertBalancedModel`` already sharded over more than one rank)."""

    def __init__(self, config: EplbConfig, model: object, metrics: MetricsRegistry | None = None):
        if not isinstance(model, ExpertBalancedModel):
            raise EplbConfigError(f"{ENABLE}=True: {type(model).__name__} cannot change its expert placement (it does "
                                  "not implement models/interface.py's ExpertBalancedModel)")
        layout = model.expert_parallel_layout()
        if layout is None or layout.world_size < 2:
            raise EplbConfigError(f"{ENABLE}=True balances experts over expert-parallel ranks, and this engine has "
                                  "one: use data_parallel_size > 1 (or torchrun) with enable_expert_parallel=True")
        self.model, self.layout = model, layout
        layers, experts, ranks = layout.num_moe_layers, layout.num_logical_experts, layout.world_size
        initial = Placement.initial(layers, experts, config.num_physical(experts, ranks), ranks)
        self.balancer = ExpertBalancer(config, layers, experts, ranks, _num_nodes(ranks), device=model.device,
                                       initial=initial)
        self.figures = EplbMetrics(metrics or MetricsRegistry())
        if config.num_redundant_experts:
            self.figures.copies.inc(move_experts(model, layout, Placement.identity(layers, experts), initial))
        model.record_expert_load(True)
        log.info("EPLB on rank %d of %d: %d MoE layers, %d experts in %d slots (%d per rank), window %d steps, "
                 "rebalance every %d", layout.rank, ranks, layers, experts, initial.num_physical,
                 initial.num_physical // ranks, config.window_size, config.step_interval)

    def step_boundary(self) -> None:
        """Record the step's load summed over the ranks; move the experts when a rebalance is due."""
        load = self.model.expert_load()  # [layers, experts], this rank's tokens
        dist.all_reduce(load, group=self.layout.group)
        old = self.balancer.placement
        new = self.balancer.record(load)
        if new is not None:
            self.figures.copies.inc(move_experts(self.model, self.layout, old, new))
            self.figures.rebalanced(self.balancer.reports[-1], moe_lb(self.balancer.window.load(),
                                                                      Placement.identity(*load.shape),
                                                                      self.layout.world_size))


class EplbMetrics:
    """EPLB's figures in the engine's ``MetricsRegistry`` (``engine.metrics``; ``LLM.get_metrics()``, a rank's
    ``stats["metrics"]``, ``deepinfer bench``), set at each rebalance from the load window it planned from:

    - ``deepinfer:eplb_moe_lb``: busiest rank's load / mean rank load under the new placement;
    - ``deepinfer:eplb_moe_lb_before``: the same load under the placement it replaced (what served lately);
    - ``deepinfer:eplb_moe_lb_static``: the same load in the plain layout (what EPLB off would give);
    - ``deepinfer:eplb_rebalances`` and ``deepinfer:eplb_expert_copies_received`` (this rank's, from others).
    """

    def __init__(self, registry: MetricsRegistry):
        self.moe_lb = registry.gauge("deepinfer:eplb_moe_lb", "EPLB: busiest rank / mean rank load, new placement")
        self.before = registry.gauge("deepinfer:eplb_moe_lb_before", "EPLB: moe_lb of the replaced placement")
        self.static = registry.gauge("deepinfer:eplb_moe_lb_static", "EPLB: moe_lb of the plain layout")
        self.rebalances = registry.counter("deepinfer:eplb_rebalances", "EPLB rebalances")
        self.copies = registry.counter("deepinfer:eplb_expert_copies_received",
                                       "expert weight copies this rank received from other ranks")

    def rebalanced(self, report: RebalanceReport, static: float) -> None:
        self.moe_lb.set(report.moe_lb_after)
        self.before.set(report.moe_lb_before)
        self.static.set(static)
        self.rebalances.inc()


def _num_nodes(world_size: int) -> int:
    """Nodes of the launch: the world over the ranks per node (``LOCAL_WORLD_SIZE``, set by torchrun and by
    ``LLM(data_parallel_size=...)``), 1 when unknown."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
    return max(1, world_size // max(1, per_node))

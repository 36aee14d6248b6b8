"""``EplbRuntime``: EPLB on one rank of a running engine: the router's load in, placements out, weights moved.

Built at engine start (``plugin.deepinfer_engine_start``) on each rank of an expert-parallel engine. It moves the
model from its plain layout to ``Placement.initial`` (only with redundant experts), switches the routers' load
counting on, and at every step boundary (``deepinfer_step_boundary``, the same point on every rank) all-reduces the
step's load over the ranks (sum), feeds its ``ExpertBalancer`` and, when a rebalance is due, moves the weights to
the new placement before the next step. Every rank records the same summed load, so every rank plans the same
placement.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch.distributed as dist

from deepinfer_core.models.interface import ExpertBalancedModel
from deepinfer_eplb.balance import moe_lb
from deepinfer_eplb.balancer import ExpertBalancer
from deepinfer_eplb.config import ENABLE, EplbConfig
from deepinfer_eplb.errors import EplbConfigError
from deepinfer_eplb.mover import move_experts
from deepinfer_eplb.placement import Placement

log = logging.getLogger("deepinfer.eplb")


class EplbRuntime:
    """One rank's balancer over ``model`` (an ``ExpertBalancedModel`` already sharded over more than one rank)."""

    def __init__(self, config: EplbConfig, model: object):
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
        self.num_received = 0  # expert copies this rank received from others, in all
        if config.num_redundant_experts:
            self.num_received += move_experts(model, layout, Placement.identity(layers, experts), initial)
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
            self.num_received += move_experts(self.model, self.layout, old, new)

    def metrics(self) -> Mapping[str, float]:
        """Balance over the load window (the last ``window_size`` steps, summed over the ranks): ``moe_lb`` under the
        current placement, ``moe_lb_static`` under the plain layout (what EPLB off would give), ``moe_lb_planned``
        (the latest rebalance's own figure, logged with it; absent before one), the rebalances so far and the expert
        copies this rank received."""
        balancer, ranks = self.balancer, self.layout.world_size
        load = balancer.window.load()  # [layers, experts]
        figures = {"moe_lb": moe_lb(load, balancer.placement, ranks),
                   "moe_lb_static": moe_lb(load, Placement.identity(*load.shape), ranks),
                   "eplb_rebalances": len(balancer.reports), "eplb_expert_copies_received": self.num_received}
        if balancer.reports:
            figures["moe_lb_planned"] = balancer.reports[-1].moe_lb_after
        return figures


def _num_nodes(world_size: int) -> int:
    """Nodes of the launch: the world over the ranks per node (``LOCAL_WORLD_SIZE``, set by torchrun and by
    ``LLM(data_parallel_size=...)``), 1 when unknown."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
    return max(1, world_size // max(1, per_node))

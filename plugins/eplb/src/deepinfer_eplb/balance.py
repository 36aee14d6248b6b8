"""The balance figure ``moe_lb``: the busiest rank's expert load over the mean rank load, for a placement.

A logical expert's tokens are assumed split evenly over its replicas (the engine must pick replicas that way, e.g.
round-robin), which is the assumption ``rebalance_experts`` plans with. 1.0 is perfect balance; a rank count of
``R`` bounds it by ``R``.
"""

from __future__ import annotations

import torch

from deepinfer_eplb.errors import EplbError
from deepinfer_eplb.placement import Placement


def rank_loads(load: torch.Tensor, placement: Placement, num_ranks: int) -> torch.Tensor:
    """The load each rank serves, per layer: ``[layers, num_ranks]`` (float64) from ``load`` ``[layers, num_logical]``
    (tokens per logical expert) under ``placement``."""
    _check_shapes(load, placement)
    per_rank = placement.slots_per_rank(num_ranks)
    load = load.detach().double().cpu()
    slot_load = load.gather(-1, placement.phy2log) / placement.logcnt.gather(-1, placement.phy2log)  # [L, P]
    return slot_load.view(placement.num_layers, num_ranks, per_rank).sum(-1)  # [layers, num_ranks]


def layer_balance(load: torch.Tensor, placement: Placement, num_ranks: int) -> torch.Tensor:
    """``max / mean`` of the rank loads of each layer: ``[layers]`` (float64); 1.0 for a layer with no load."""
    per_rank = rank_loads(load, placement, num_ranks)  # [layers, num_ranks]
    mean = per_rank.mean(-1)  # [layers]
    ratio = per_rank.max(-1).values / mean.clamp_min(torch.finfo(torch.float64).tiny)
    return torch.where(mean > 0, ratio, torch.ones_like(ratio))


def moe_lb(load: torch.Tensor, placement: Placement, num_ranks: int) -> float:
    """The balance figure: the mean over MoE layers of (busiest rank's load / mean rank load)."""
    return float(layer_balance(load, placement, num_ranks).mean())


def _check_shapes(load: torch.Tensor, placement: Placement) -> None:
    expected = (placement.num_layers, placement.num_logical)
    if tuple(load.shape) != expected:
        raise EplbError(f"load must be [layers, num_logical] = {list(expected)} to match the placement, "
                         f"got {list(load.shape)}")

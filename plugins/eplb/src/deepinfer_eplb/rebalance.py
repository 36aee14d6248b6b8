"""``rebalance_experts``: deepseek-ai/EPLB's placement of logical experts onto physical slots, nodes and GPUs.

Hierarchical policy (when the expert groups divide evenly over the nodes): pack whole expert groups onto nodes
(balanced packing of group loads), so the experts one token may pick under group-limited routing stay inside one
node; replicate experts inside each node (greedy on load per replica); pack each node's replicas onto its GPUs
(balanced packing of replica loads). Global policy otherwise: the same with one group and one node, so replicas
may land on any GPU.
"""

from __future__ import annotations

import torch

from deepinfer_eplb.errors import EplbError
from deepinfer_eplb.packing import balanced_packing
from deepinfer_eplb.placement import Placement
from deepinfer_eplb.replication import replicate_experts


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> Placement:
    """Place ``weight.shape[1]`` logical experts into ``num_replicas`` physical slots on ``num_gpus`` GPUs.

    Arguments:
    - ``weight`` ``[layers, num_logical]``: the load of each logical expert (tokens routed to it), per MoE layer;
    - ``num_replicas``: physical expert slots in all, a multiple of ``num_gpus`` and at least ``num_logical``;
    - ``num_groups``: expert groups (of equal size) of group-limited routing; ``num_logical`` must be a multiple;
    - ``num_nodes``: server nodes (fast links inside a node); the hierarchical policy needs
      ``num_groups % num_nodes == 0``, otherwise the global policy runs;
    - ``num_gpus``: GPUs (ranks) in all, a multiple of ``num_nodes``.

    Returns the ``Placement`` ``(phy2log [layers, num_replicas], log2phy [layers, num_logical, max_replicas],
    logcnt [layers, num_logical])``, int64 on the CPU; slots are numbered GPU-major (GPU ``g`` holds slots
    ``g * num_replicas / num_gpus`` onward).
    """
    _check(weight, num_replicas, num_groups, num_nodes, num_gpus)
    load = weight.detach().double().cpu()  # [layers, num_logical]
    if num_groups % num_nodes == 0:
        phy2log, replica = _hierarchical(load, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, replica = _hierarchical(load, num_replicas, 1, 1, num_gpus)
    return Placement.from_slots(phy2log, replica, load.shape[1])


def _check(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> None:
    if weight.dim() != 2 or weight.shape[0] < 1 or weight.shape[1] < 1:
        raise EplbError(f"weight must be [layers, num_logical_experts] with both >= 1, got {tuple(weight.shape)}")
    if weight.is_complex() or not torch.isfinite(weight.double()).all() or (weight < 0).any():
        raise EplbError("weight must hold finite, non-negative expert loads")
    for name, value in (("num_replicas", num_replicas), ("num_groups", num_groups), ("num_nodes", num_nodes),
                        ("num_gpus", num_gpus)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EplbError(f"{name} must be a positive int, got {value!r}")
    num_logical = weight.shape[1]
    if num_logical % num_groups:
        raise EplbError(f"{num_logical} logical experts do not split into {num_groups} equal groups")
    if num_gpus % num_nodes:
        raise EplbError(f"num_gpus ({num_gpus}) must be a multiple of num_nodes ({num_nodes})")
    if num_replicas % num_gpus:
        raise EplbError(f"num_replicas ({num_replicas}) must be a multiple of num_gpus ({num_gpus})")
    if num_replicas < num_logical:
        raise EplbError(f"num_replicas ({num_replicas}) is below the {num_logical} logical experts: "
                             "every expert needs a slot")


def _hierarchical(load: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                  num_gpus: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The hierarchical policy: ``(phy2log, replica)``, both ``[layers, num_replicas]``."""
    layers, num_logical = load.shape
    per_node = num_logical // num_nodes  # logical experts per node
    slots_per_node = num_replicas // num_nodes
    # 1. groups to nodes; "node-major" ids number the experts node by node (node 0's first)
    log2nm = _node_major_ids(load, num_groups, num_nodes)  # [layers, num_logical]
    nm2log = torch.argsort(log2nm, dim=-1)  # [layers, num_logical], the inverse permutation
    node_load = load.gather(-1, nm2log).view(layers * num_nodes, per_node)  # [layers * nodes, per_node]
    # 2. replicas inside each node
    slot2nm, replica, nm_count = replicate_experts(node_load, slots_per_node)  # [layers * nodes, slots_per_node]
    # 3. each node's replicas to its GPUs; a slot's final place is gpu * slots_per_gpu + rank in that GPU
    slot_load = (node_load / nm_count).gather(-1, slot2nm)  # [layers * nodes, slots_per_node]
    gpu, rank = balanced_packing(slot_load, num_gpus // num_nodes)
    place = gpu * (num_replicas // num_gpus) + rank  # [layers * nodes, slots_per_node]
    order = torch.argsort(place, dim=-1)  # slot found at each final place
    node_offset = torch.arange(num_nodes, dtype=torch.int64).repeat(layers).unsqueeze(-1) * per_node
    placed_nm = (slot2nm.gather(-1, order) + node_offset).view(layers, num_replicas)  # [layers, num_replicas]
    phy2log = nm2log.gather(-1, placed_nm)
    return phy2log, replica.gather(-1, order).view(layers, num_replicas)


def _node_major_ids(load: torch.Tensor, num_groups: int, num_nodes: int) -> torch.Tensor:
    """Pack expert groups onto nodes; each logical expert's id when experts are numbered node by node, a node's
    groups in the order the packing gave them, a group's experts in their own order: ``[layers, num_logical]``."""
    layers, num_logical = load.shape
    group_size = num_logical // num_groups
    group_load = load.view(layers, num_groups, group_size).sum(-1)  # [layers, num_groups]
    node, rank = balanced_packing(group_load, num_nodes)  # [layers, num_groups] each
    first = (node * (num_groups // num_nodes) + rank) * group_size  # [layers, num_groups]
    return (first.unsqueeze(-1) + torch.arange(group_size, dtype=torch.int64)).flatten(1)  # [layers, num_logical]

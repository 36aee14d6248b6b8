"""``move_experts``: one rank's side of going from one expert placement to the next, over torch.distributed.

For each MoE layer, every rank builds staging stacks for its new slots, reading only the old weights: a slot whose
expert it held before is copied locally, the others are received from the rank ``plan_transfers`` names, while this
rank sends the experts others ask of it (point-to-point over the model's expert-parallel group: gloo on CPU, the
device backend's collective library elsewhere). Every tensor the experts op takes moves, so quantized experts move
with their scales; tensors travel as their bytes (``uint8`` views), whatever their dtype. Once a layer's copies
are all in, the model swaps the staging stacks and the layer's maps together (``set_expert_placement``); the old
stacks are dropped. Called between two steps on every rank with the same placements.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deepinfer_core.models.interface import ExpertBalancedModel, ExpertParallelLayout
from deepinfer_eplb.migration import Transfer, plan_transfers
from deepinfer_eplb.placement import Placement


def move_experts(model: ExpertBalancedModel, layout: ExpertParallelLayout, old: Placement, new: Placement) -> int:
    """Move this rank's expert weights from ``old`` to ``new``, layer by layer; returns the copies received from
    other ranks (this rank's share of the traffic)."""
    transfers = plan_transfers(old, new, layout.world_size)
    received = 0
    for layer in range(new.num_layers):
        mine = [t for t in transfers if t.layer == layer]
        weights = _staged_layer(model, layout, layer, old.phy2log[layer].tolist(), new.phy2log[layer].tolist(), mine)
        model.set_expert_placement(layer, new.phy2log[layer], new.log2phy[layer], new.logcnt[layer], weights)
        received += sum(1 for t in mine if t.dst_rank == layout.rank and t.src_rank != layout.rank)
    return received


def _staged_layer(model: ExpertBalancedModel, layout: ExpertParallelLayout, layer: int, before: list[int],
                  after: list[int], transfers: list[Transfer]) -> tuple:
    """This rank's new expert stacks of ``layer``, filled from its old ones and from other ranks."""
    rank, world = layout.rank, layout.world_size
    old = model.expert_slots(layer)
    old_per, new_per = len(before) // world, len(after) // world
    mine_before = before[rank * old_per:(rank + 1) * old_per]
    staging = tuple(w.new_empty((new_per, *w.shape[1:])) if isinstance(w, torch.Tensor) else w for w in old)
    tensors = [i for i, w in enumerate(old) if isinstance(w, torch.Tensor)]
    remote = {t.slot: t for t in transfers if t.dst_rank == rank and t.src_rank != rank}
    works = []
    for index, t in enumerate(transfers):
        if t.src_rank == rank and t.dst_rank != rank:
            source = mine_before.index(t.expert)
            works += [_p2p(dist.isend, old[i][source], t.dst_rank, index * len(tensors) + n, layout)
                      for n, i in enumerate(tensors)]
        elif t.slot in remote and remote[t.slot] is t:
            works += [_p2p(dist.irecv, staging[i][t.slot - rank * new_per], t.src_rank, index * len(tensors) + n,
                           layout) for n, i in enumerate(tensors)]
    for local in range(new_per):
        slot = rank * new_per + local
        if slot in remote:
            continue
        expert = after[slot]
        source = local if old_per == new_per and mine_before[local] == expert else mine_before.index(expert)
        for i in tensors:
            staging[i][local].copy_(old[i][source])
    for work in works:
        work.wait()
    return staging


def _p2p(op, tensor: torch.Tensor, peer: int, tag: int, layout: ExpertParallelLayout):
    """``dist.isend`` / ``dist.irecv`` of ``tensor``'s bytes with group rank ``peer``."""
    if layout.group is not None:
        peer = dist.get_global_rank(layout.group, peer)
    return op(tensor.view(torch.uint8), peer, group=layout.group, tag=tag)

"""Expert parallelism for DeepSeek-V4: each rank keeps a share of every MoE layer's routed experts and runs them
through the ``moe_experts_expert_parallel`` op (``deepinfer_core/ops/expert_parallel.py``).

Applied to a loaded model (``DeepseekV4Model.shard_experts``): rank r first holds experts ``[r * E / N, (r + 1) * E /
N)``, physical slot ``i`` holding logical expert ``i``. ``set_placement`` later swaps in another placement (EPLB: any
expert in any slot, replicas included) with this rank's weights for it; ``expert_load`` hands out the routers'
counts. The router, shared expert, attention and norms are untouched and keep running on this rank's own tokens.
A model that is never sharded runs exactly as before.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any

import torch

from deepinfer_core.engine_args import EngineArgsError
from deepinfer_core.models.interface import ExpertParallelLayout
from deepinfer_core.ops.expert_parallel import ExpertShard

if TYPE_CHECKING:
    from deepinfer_core.models.deepseek_v4.model import DeepseekV4Model, MoE

EP_OP = "moe_experts_expert_parallel"
_EXPERT_NAME = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(.+)$")


class PlacementError(EngineArgsError):
    """A new expert placement does not fit the sharded model (shapes, slot counts); the message says what."""


def expert_range(num_experts: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(first, count)``: rank ``rank`` of ``world_size`` holds physical experts ``[first, first + count)``."""
    if num_experts % world_size:
        raise EngineArgsError(f"expert parallelism splits the {num_experts} routed experts evenly over ranks; "
                              f"data_parallel_size={world_size} does not divide {num_experts}")
    count = num_experts // world_size
    return rank * count, count


def shard_model(model: DeepseekV4Model, rank: int, world_size: int, group: Any = None) -> None:
    """Keep this rank's routed experts in every MoE layer and drop the others' weights."""
    first, count = expert_range(model.config.n_routed_experts, rank, world_size)
    dropped: list[torch.Tensor] = []
    for index, layer in enumerate(model.layers):
        moe = layer.ffn
        stacks = [w for w in moe.expert_weights if isinstance(w, torch.Tensor)]
        shard = _shard_moe(model, moe, rank, world_size, first, count, group)
        moe.param_suffixes = _param_suffixes(model, index, stacks, first)
        _point_parameters(model, index, moe, list(range(first, first + count)))
        dropped += stacks
    model._allocated = [t for t in model._allocated if not any(t is d for d in dropped)]
    model.expert_layout = ExpertParallelLayout(rank, world_size, group, len(model.layers),
                                               model.config.n_routed_experts, shard.count)


def _shard_moe(model: DeepseekV4Model, moe: MoE, rank: int, world_size: int, first: int, count: int,
               group: Any) -> ExpertShard:
    """Switch ``moe`` to the expert-parallel op over clones of its local experts' weights."""
    lo, hi = first, first + count
    local = tuple(w[lo:hi].clone() if isinstance(w, torch.Tensor) else w for w in moe.expert_weights)
    local_op = getattr(model.ops, moe.experts_op)
    limit = moe.limit
    shard = ExpertShard(rank, world_size, first, count, local, None, group)  # type: ignore[arg-type]

    def run_local(rows: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return local_op(rows, local_ids, weights, *shard.local_weights, limit)  # [R, D]

    shard.run_local = run_local
    moe.experts_op, moe.expert_weights = EP_OP, (shard,)
    moe.w1 = moe.w2 = moe.w3 = None  # the full stacks go; ``shard.local_weights`` holds this rank's experts
    model._allocated.extend(w for w in local if isinstance(w, torch.Tensor))
    return shard


def _param_suffixes(model: DeepseekV4Model, layer: int, stacks: list[torch.Tensor], expert: int) -> dict[str, int]:
    """Which stack (index among the tensors of ``expert_weights``) each checkpoint name of an expert addresses:
    ``{"w1.weight": 0, ...}``, read off ``expert``'s views into the full stacks."""
    suffixes = {}
    for name, view in model.parameters.items():
        match = _EXPERT_NAME.match(name)
        if match is None or int(match.group(1)) != layer or int(match.group(2)) != expert:
            continue
        for index, full in enumerate(stacks):
            if view.data_ptr() == full[expert].data_ptr() and view.shape == full[expert].shape:
                suffixes[match.group(3)] = index
    return suffixes


def _point_parameters(model: DeepseekV4Model, layer: int, moe: MoE, local_experts: list[int]) -> None:
    """Checkpoint names of this layer's experts address the local stacks (an expert's first local slot); the names
    of experts this rank does not hold go."""
    for name in [n for n in model.parameters if (m := _EXPERT_NAME.match(n)) and int(m.group(1)) == layer]:
        del model.parameters[name]
    stacks = [w for w in moe.expert_weights[0].local_weights if isinstance(w, torch.Tensor)]
    for slot, expert in enumerate(local_experts):
        for suffix, index in moe.param_suffixes.items():
            model.parameters.setdefault(f"layers.{layer}.ffn.experts.{expert}.{suffix}", stacks[index][slot])


def layout(model: DeepseekV4Model) -> ExpertParallelLayout | None:
    """The model's expert-parallel layout; None before ``shard_model``."""
    return getattr(model, "expert_layout", None)


def record_load(model: DeepseekV4Model, enabled: bool) -> None:
    for layer in model.layers:
        layer.ffn.record_load = enabled


def expert_load(model: DeepseekV4Model) -> torch.Tensor:
    """Every MoE layer's tokens per logical expert since the last call ``[layers, E]``; the counters restart at 0."""
    load = torch.stack([layer.ffn.expert_load for layer in model.layers])  # [layers, E]
    for layer in model.layers:
        layer.ffn.expert_load.zero_()
    return load


def local_slots(model: DeepseekV4Model, layer: int) -> tuple:
    """MoE layer ``layer``'s local expert weights, stacked by this rank's physical slot."""
    return _shard(model, layer).local_weights


def set_placement(model: DeepseekV4Model, layer: int, phy2log: torch.Tensor, log2phy: torch.Tensor,
                  logcnt: torch.Tensor, weights: tuple) -> None:
    """Swap MoE layer ``layer``'s placement and local weights together (``ExpertBalancedModel.set_expert_placement``)."""
    info = layout(model)
    shard = _shard(model, layer)
    E = model.config.n_routed_experts
    if phy2log.dim() != 1 or phy2log.shape[0] % info.world_size or logcnt.shape != (E,) or log2phy.shape[0] != E:
        raise PlacementError(f"layer {layer}: phy2log must be [P] with P a multiple of {info.world_size} ranks, "
                             f"log2phy [{E}, max_replicas], logcnt [{E}]; got {list(phy2log.shape)}, "
                             f"{list(log2phy.shape)}, {list(logcnt.shape)}")
    count = phy2log.shape[0] // info.world_size
    _check_weights(layer, shard.local_weights, weights, count)
    device = model.device
    new_tensors = [w for w in weights if isinstance(w, torch.Tensor)]
    old_tensors = [w for w in shard.local_weights if isinstance(w, torch.Tensor)]
    shard.local_weights = tuple(weights)
    shard.first, shard.count = info.rank * count, count
    identity = count * info.world_size == E and torch.equal(phy2log.cpu(), torch.arange(E))
    shard.slot_to_logical = None if identity else phy2log.to(device)
    model.layers[layer].ffn.expert_map.set_replicas(log2phy.to(device), logcnt.to(device), offset=info.rank)
    model._allocated = [t for t in model._allocated if not any(t is o for o in old_tensors)] + new_tensors
    mine = phy2log[info.rank * count:(info.rank + 1) * count].tolist()
    _point_parameters(model, layer, model.layers[layer].ffn, mine)
    model.expert_layout = dataclasses.replace(info, slots_per_rank=count)


def _check_weights(layer: int, old: tuple, new: tuple, count: int) -> None:
    if len(old) != len(new):
        raise PlacementError(f"layer {layer}: {len(new)} expert weight arguments, the experts op takes {len(old)}")
    for index, (a, b) in enumerate(zip(old, new, strict=True)):
        if isinstance(a, torch.Tensor):
            ok = (isinstance(b, torch.Tensor) and b.dtype == a.dtype and b.shape[1:] == a.shape[1:]
                  and b.shape[0] == count and b.device == a.device)
            if not ok:
                got = f"{b.dtype} {list(b.shape)}" if isinstance(b, torch.Tensor) else type(b).__name__
                raise PlacementError(f"layer {layer}: expert weight {index} must be {a.dtype} "
                                     f"[{count}, {', '.join(map(str, a.shape[1:]))}] on {a.device}, got {got}")
        elif a != b:
            raise PlacementError(f"layer {layer}: expert argument {index} must stay {a!r}, got {b!r}")


def _shard(model: DeepseekV4Model, layer: int) -> ExpertShard:
    info = layout(model)
    if info is None:
        raise PlacementError("the model's experts are not sharded: expert placements need shard_experts first "
                             "(data_parallel_size > 1 with enable_expert_parallel=True)")
    if not 0 <= layer < info.num_moe_layers:
        raise PlacementError(f"MoE layer {layer} out of range: the model has {info.num_moe_layers}")
    return model.layers[layer].ffn.expert_weights[0]


def idle_step(model: DeepseekV4Model) -> None:
    """One forward's expert-parallel collectives with no tokens: this rank serves the others' tokens routed to its
    experts, layer by layer, as a forward would."""
    c = model.config
    x = torch.empty((0, c.hidden_size), dtype=model.dtype, device=model.device)  # [0, D]
    ids = torch.empty((0, c.num_experts_per_tok), dtype=torch.long, device=model.device)  # [0, k]
    weights = torch.empty((0, c.num_experts_per_tok), dtype=torch.float32, device=model.device)  # [0, k]
    with torch.inference_mode():
        for layer in model.layers:
            moe = layer.ffn
            getattr(model.ops, moe.experts_op)(x, ids, weights, *moe.expert_weights, moe.limit)

"""Expert parallelism for DeepSeek-V4: each rank keeps a contiguous share of every MoE layer's routed experts and
runs them through the ``moe_experts_expert_parallel`` op (``deepinfer_core/ops/expert_parallel.py``).

Applied to a loaded model (``DeepseekV4Model.shard_experts``); the router, shared expert, attention and norms are
untouched and keep running on this rank's own tokens. A model that is never sharded runs exactly as before.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch

from deepinfer_core.engine_args import EngineArgsError
from deepinfer_core.ops.expert_parallel import ExpertShard

if TYPE_CHECKING:
    from deepinfer_core.models.deepseek_v4.model import DeepseekV4Model, MoE

EP_OP = "moe_experts_expert_parallel"
_EXPERT_NAME = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.")


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
        _repoint_parameters(model, index, stacks, shard.local_weights, first, count)
        dropped += stacks
    model._allocated = [t for t in model._allocated if not any(t is d for d in dropped)]


def _shard_moe(model: DeepseekV4Model, moe: MoE, rank: int, world_size: int, first: int, count: int,
               group: Any) -> ExpertShard:
    """Switch ``moe`` to the expert-parallel op over clones of its local experts' weights."""
    lo, hi = first, first + count
    local = tuple(w[lo:hi].clone() if isinstance(w, torch.Tensor) else w for w in moe.expert_weights)
    local_op = getattr(model.ops, moe.experts_op)
    limit = moe.limit

    def run_local(rows: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return local_op(rows, local_ids, weights, *local, limit)  # [R, D]

    shard = ExpertShard(rank, world_size, first, count, local, run_local, group)
    moe.experts_op, moe.expert_weights = EP_OP, (shard,)
    moe.w1 = moe.w2 = moe.w3 = None  # the full stacks go; ``shard.local_weights`` holds this rank's experts
    model._allocated.extend(w for w in local if isinstance(w, torch.Tensor))
    return shard


def _repoint_parameters(model: DeepseekV4Model, layer: int, stacks: list[torch.Tensor], local: tuple,
                        first: int, count: int) -> None:
    """Checkpoint names of this layer's local experts now address the local stacks; the others' names go."""
    local_stacks = [w for w in local if isinstance(w, torch.Tensor)]
    for name in [n for n in model.parameters if (m := _EXPERT_NAME.match(n)) and int(m.group(1)) == layer]:
        expert = int(_EXPERT_NAME.match(name).group(2))
        view = model.parameters.pop(name)
        if not first <= expert < first + count:
            continue
        for full, part in zip(stacks, local_stacks, strict=True):
            if view.data_ptr() == full[expert].data_ptr() and view.shape == full[expert].shape:
                model.parameters[name] = part[expert - first]
                break


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

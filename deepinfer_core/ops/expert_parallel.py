"""Reference op of expert parallelism: routed experts split across ranks, tokens dispatched to the rank that holds
their expert and combined back, with ``torch.distributed.all_to_all_single`` (gloo, NCCL or HCCL).

The spec a backend's dispatch / combine kernels (DeepEP-like) must match: the same tokens reach the same experts,
and each token's routed outputs are summed in the order of ``reference.routed_sum`` (by expert id, then slot), so a
token's result equals the one-process ``moe_experts`` up to the experts' own GEMMs over other row counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from deepinfer_core.ops.table import reference_op


@dataclasses.dataclass
class ExpertShard:
    """One MoE layer's routed experts on this rank: physical experts ``[first, first + count)`` of
    ``count * world_size``, and how to run them.

    ``run_local(rows [R, D], local_ids [R, 1], weights [R, 1]) -> [R, D]`` runs the local experts (the model's
    ``moe_experts`` op, or its quantized variant, over ``local_weights``); ``group`` is the process group the
    experts are split over (None: the default group). ``slot_to_logical`` ``[count * world_size]``: the logical
    expert of every physical slot when they differ (EPLB's placements, replicas), so the combine sums a token's
    outputs in logical expert order whatever slots served them; None: slot ``i`` holds expert ``i``."""

    rank: int
    world_size: int
    first: int
    count: int
    local_weights: tuple
    run_local: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    group: dist.ProcessGroup | None = None
    slot_to_logical: torch.Tensor | None = None


@dataclasses.dataclass
class Dispatched:
    """What dispatch hands the experts and keeps for the combine."""

    rows: torch.Tensor  # [R, D] rows this rank's experts compute, from every rank
    local_ids: torch.Tensor  # [R] their expert, counted from ``ExpertShard.first``
    order: torch.Tensor  # [P] this rank's (token, slot) pairs, grouped by owner rank
    send_splits: list[int]  # pairs sent to each rank
    recv_splits: list[int]  # rows received from each rank


def dispatch(x: torch.Tensor, ids: torch.Tensor, shard: ExpertShard) -> Dispatched:
    """Send every (token, slot) pair's row to the rank holding its expert (``ids``: ``[T, k]`` physical experts)."""
    k = ids.shape[1]
    flat = ids.reshape(-1)  # [P = T * k]
    owner = torch.div(flat, shard.count, rounding_mode="floor")  # [P]
    order = torch.argsort(owner, stable=True)  # [P] grouped by owner, (token, slot) order inside
    send_counts = torch.bincount(owner, minlength=shard.world_size)  # [N]
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=shard.group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    rows = _exchange(x[order // k], recv_splits, send_splits, shard)  # [R, D]
    local_ids = _exchange((flat - owner * shard.count)[order], recv_splits, send_splits, shard)
    return Dispatched(rows, local_ids, order, send_splits, recv_splits)


def combine(expert_rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, sent: Dispatched,
            shard: ExpertShard, out_dtype: torch.dtype) -> torch.Tensor:
    """Return each computed row to its token's rank and sum a token's ``weights``-scaled expert outputs by logical
    expert id, then slot, as ``routed_sum`` does. ``expert_rows``: ``[R, D]``, the experts' outputs of ``sent.rows``."""
    T, k = ids.shape
    back = _exchange(expert_rows, sent.send_splits, sent.recv_splits, shard)  # [P, D], in ``sent.order``
    outputs = torch.empty_like(back)
    outputs[sent.order] = back  # [P, D] in (token, slot) order
    scale = weights.reshape(-1, 1).to(outputs.dtype)  # [P, 1]
    scaled = (outputs * scale).to(out_dtype).view(T, k, outputs.shape[-1])  # [T, k, D]
    logical = ids if shard.slot_to_logical is None else shard.slot_to_logical[ids]  # [T, k]
    by_expert = torch.sort(logical, dim=1, stable=True).indices  # [T, k]
    scaled = scaled.gather(1, by_expert.unsqueeze(-1).expand_as(scaled))
    out = torch.zeros((T, scaled.shape[-1]), dtype=out_dtype, device=scaled.device)  # [T, D]
    for slot in range(k):
        out += scaled[:, slot]
    return out


@reference_op
def moe_experts_expert_parallel(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, shard: ExpertShard,
                                limit: float) -> torch.Tensor:
    """Routed experts split across ranks: ``moe_experts``'s result (``[T, D]``) for this rank's tokens.

    ``x``: ``[T, D]`` (T may be 0: a rank with no tokens still serves the others); ``ids`` / ``weights``: ``[T, k]``
    (physical expert slots over all ranks). Every rank of ``shard.group`` must call it for the same layer at once:
    three all-to-alls (counts, rows, expert ids) to dispatch, one to combine. ``limit`` is the SwiGLU clamp, already
    bound in ``shard.run_local``.
    """
    sent = dispatch(x, ids, shard)
    ones = torch.ones((sent.rows.shape[0], 1), dtype=weights.dtype, device=x.device)  # [R, 1]
    expert_rows = shard.run_local(sent.rows, sent.local_ids.unsqueeze(1), ones)  # [R, D]
    return combine(expert_rows, ids, weights, sent, shard, x.dtype)


def _exchange(tensor: torch.Tensor, recv_splits: list[int], send_splits: list[int],
              shard: ExpertShard) -> torch.Tensor:
    """``all_to_all_single`` of ``tensor``'s rows: ``send_splits[r]`` rows to rank r, ``recv_splits[r]`` from it."""
    out = tensor.new_empty((sum(recv_splits), *tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), recv_splits, send_splits, group=shard.group)
    return out

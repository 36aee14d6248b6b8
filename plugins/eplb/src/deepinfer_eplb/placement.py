"""``Placement``: which logical expert each physical expert slot holds, per MoE layer, and the maps derived from it.

Physical slots are numbered rank-major: with ``P`` slots over ``R`` ranks, rank ``r`` holds slots
``r * P / R .. (r + 1) * P / R - 1``. A ``Placement`` is a NamedTuple, so ``phy2log, log2phy, logcnt = placement``
unpacks it like deepseek-ai/EPLB's return value.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from deepinfer_eplb.errors import EplbError


class Placement(NamedTuple):
    """Expert placement of every MoE layer (int64 tensors on the CPU).

    - ``phy2log`` ``[layers, num_physical]``: the logical expert held by each physical slot;
    - ``log2phy`` ``[layers, num_logical, max_replicas]``: the physical slots of each logical expert, its replica 0
      first, padded with -1;
    - ``logcnt`` ``[layers, num_logical]``: how many physical slots each logical expert has (at least 1).
    """

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_physical(self) -> int:
        return self.phy2log.shape[1]

    @property
    def num_logical(self) -> int:
        return self.logcnt.shape[1]

    @classmethod
    def identity(cls, num_layers: int, num_experts: int) -> Placement:
        """No redundancy, expert ``e`` in slot ``e`` (the model's default ``ExpertMap``): the placement without EPLB."""
        phy2log = torch.arange(num_experts, dtype=torch.int64).repeat(num_layers, 1)  # [layers, experts]
        replica = torch.zeros_like(phy2log)
        return cls.from_slots(phy2log, replica, num_experts)

    @classmethod
    def initial(cls, num_layers: int, num_experts: int, num_physical: int, num_ranks: int) -> Placement:
        """The placement an engine starts from: rank ``r`` keeps the plain layout's experts ``[r * E / N, (r + 1) *
        E / N)`` and fills its ``(P - E) / N`` extra slots with replicas of the experts that follow them (the next
        rank's first ones), so every rank's redundant slots hold different experts. The identity when ``P == E``."""
        if num_experts % num_ranks or num_physical % num_ranks or num_physical < num_experts:
            raise EplbError(f"{num_experts} experts in {num_physical} slots do not split evenly over {num_ranks} ranks")
        base, extra = num_experts // num_ranks, (num_physical - num_experts) // num_ranks
        row = []
        for rank in range(num_ranks):
            row += list(range(rank * base, (rank + 1) * base))
            row += [((rank + 1) * base + j) % num_experts for j in range(extra)]
        phy2log = torch.tensor(row, dtype=torch.int64).repeat(num_layers, 1)  # [layers, num_physical]
        return cls.from_slots(phy2log, _replica_numbers(phy2log, num_experts), num_experts)

    @classmethod
    def from_slots(cls, phy2log: torch.Tensor, replica: torch.Tensor, num_logical: int) -> Placement:
        """Build the maps from ``phy2log`` and each slot's replica number (both ``[layers, num_physical]``)."""
        layers, num_physical = phy2log.shape
        if replica.shape != phy2log.shape or phy2log.numel() == 0:
            raise EplbError(f"phy2log and replica must be the same non-empty [layers, num_physical] shape, got "
                            f"{list(phy2log.shape)} and {list(replica.shape)}")
        if phy2log.min() < 0 or phy2log.max() >= num_logical:
            raise EplbError(f"phy2log holds expert ids outside [0, {num_logical})")
        logcnt = torch.zeros(layers, num_logical, dtype=torch.int64)
        logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))  # [layers, num_logical]
        width = int(logcnt.max())
        log2phy = torch.full((layers, num_logical * width), -1, dtype=torch.int64)
        slots = torch.arange(num_physical, dtype=torch.int64).expand(layers, num_physical)
        if logcnt.min() < 1:
            raise EplbError("every logical expert needs at least one physical slot; phy2log leaves some out")
        if replica.min() < 0 or (replica >= logcnt.gather(1, phy2log)).any():
            raise EplbError("replica numbers must run 0 .. count - 1 for each expert")
        log2phy.scatter_(1, phy2log * width + replica, slots)
        if int((log2phy >= 0).sum()) != layers * num_physical:
            raise EplbError("two slots of one expert share a replica number")
        return cls(phy2log, log2phy.view(layers, num_logical, width), logcnt)

    def slots_per_rank(self, num_ranks: int) -> int:
        """Physical slots each of ``num_ranks`` ranks holds; EplbError if they do not split evenly."""
        if num_ranks < 1 or self.num_physical % num_ranks:
            raise EplbError(f"{self.num_physical} physical expert slots do not split evenly over {num_ranks} ranks")
        return self.num_physical // num_ranks

    def experts_on_rank(self, layer: int, rank: int, num_ranks: int) -> list[int]:
        """The logical experts rank ``rank`` holds in ``layer``, in slot order."""
        per_rank = self.slots_per_rank(num_ranks)
        return self.phy2log[layer, rank * per_rank:(rank + 1) * per_rank].tolist()


def _replica_numbers(phy2log: torch.Tensor, num_logical: int) -> torch.Tensor:
    """Each slot's replica number: how many slots before it (in slot order) hold the same expert."""
    replica = torch.zeros_like(phy2log)
    for layer, row in enumerate(phy2log.tolist()):
        seen = [0] * num_logical
        for slot, expert in enumerate(row):
            replica[layer, slot] = seen[expert]
            seen[expert] += 1
    return replica

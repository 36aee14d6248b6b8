"""Replication: spread ``num_physical`` slots over ``num_logical`` experts so the heaviest replica is as light as
the greedy rule makes it.

Every expert gets one slot; each further slot goes to the expert whose load per replica is highest right now
(equal: lower index), as in deepseek-ai/EPLB's ``replicate_experts``.
"""

from __future__ import annotations

import torch

from deepinfer_eplb.errors import EplbError


def replicate_experts(weight: torch.Tensor, num_physical: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replicate the experts of every row of ``weight`` (``[rows, num_logical]`` loads) into ``num_physical`` slots.

    Returns int64 tensors:
    - ``phy2log`` ``[rows, num_physical]``: the logical expert of each slot; slots ``0 .. num_logical - 1`` hold
      experts ``0 .. num_logical - 1`` in order, the extra slots follow in the order they were handed out;
    - ``replica`` ``[rows, num_physical]``: which copy of its expert each slot is (0 for the first);
    - ``logcnt`` ``[rows, num_logical]``: how many slots each expert has (at least 1).
    """
    rows, num_logical = weight.shape
    if num_physical < num_logical:
        raise EplbError(f"replicate_experts: {num_physical} slots cannot hold {num_logical} experts")
    load = weight.double().cpu()  # [rows, num_logical]
    phy2log = torch.arange(num_physical, dtype=torch.int64).repeat(rows, 1)  # [rows, num_physical]
    replica = torch.zeros(rows, num_physical, dtype=torch.int64)
    logcnt = torch.ones(rows, num_logical, dtype=torch.int64)
    row_ids = torch.arange(rows)
    for slot in range(num_logical, num_physical):
        hottest = torch.argmax(load / logcnt, dim=-1)  # [rows]; first maximum on ties
        phy2log[:, slot] = hottest
        replica[:, slot] = logcnt[row_ids, hottest]
        logcnt[row_ids, hottest] += 1
    return phy2log, replica, logcnt

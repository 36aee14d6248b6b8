"""``plan_transfers``: which expert weights must move between ranks to go from one placement to the next."""

from __future__ import annotations

from typing import NamedTuple

from deepinfer_eplb.errors import EplbError
from deepinfer_eplb.placement import Placement


class Transfer(NamedTuple):
    """Copy logical expert ``expert``'s weights of ``layer`` from rank ``src_rank`` into physical slot ``slot`` (on
    rank ``dst_rank``). ``src_rank == dst_rank`` is a copy inside one rank."""

    layer: int
    slot: int
    expert: int
    src_rank: int
    dst_rank: int


def plan_transfers(old: Placement, new: Placement, num_ranks: int) -> list[Transfer]:
    """The copies that turn ``old`` into ``new``: one per slot whose expert changes, in (layer, slot) order (every
    slot when the two differ in slots per rank, e.g. from the plain layout to one with redundant experts).

    The source is the destination rank itself when it held the expert before, otherwise the rank holding it that
    has been asked for the fewest copies so far (lowest rank on ties). Sources are read from the old placement:
    the caller receives into staging buffers and swaps them in only after every transfer of the step boundary.
    """
    if old.num_layers != new.num_layers or old.num_logical != new.num_logical:
        raise EplbError(f"placements differ in layers or experts: {list(old.logcnt.shape)} vs "
                        f"{list(new.logcnt.shape)} (a rebalance keeps the layers and the experts)")
    per_rank, old_per_rank = new.slots_per_rank(num_ranks), old.slots_per_rank(num_ranks)
    same_slots = per_rank == old_per_rank
    transfers = []
    for layer in range(new.num_layers):
        before, after = old.phy2log[layer].tolist(), new.phy2log[layer].tolist()
        holders = _holders(before, old_per_rank)
        sends = [0] * num_ranks
        for slot, expert in enumerate(after):
            if same_slots and before[slot] == expert:
                continue
            dst = slot // per_rank
            src = dst if dst in holders[expert] else min(holders[expert], key=lambda rank: (sends[rank], rank))
            sends[src] += src != dst
            transfers.append(Transfer(layer, slot, expert, src, dst))
    return transfers


def _holders(phy2log: list[int], per_rank: int) -> dict[int, set[int]]:
    """Logical expert -> the ranks holding it."""
    holders: dict[int, set[int]] = {}
    for slot, expert in enumerate(phy2log):
        holders.setdefault(expert, set()).add(slot // per_rank)
    return holders

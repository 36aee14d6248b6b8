"""Balanced packing: ``n`` weighted items into ``m`` packs of exactly ``n / m`` items each, pack loads kept even.

The greedy rule (deepseek-ai/EPLB's ``balanced_packing``): take the items heaviest first (equal weights: lower
index first) and put each into the lightest pack that still has room (equal loads: lower pack index first).
"""

from __future__ import annotations

import torch

from deepinfer_eplb.errors import EplbError


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack the items of every row of ``weight`` (``[rows, items]``) into ``num_packs`` packs of equal item count.

    Returns ``(pack_index, rank_in_pack)``, both int64 ``[rows, items]``: the pack of each item and its position
    in that pack (0 for the first item the pack received). ``items`` must be a multiple of ``num_packs``.
    """
    rows, items = weight.shape
    if num_packs < 1 or items % num_packs:
        raise EplbError(f"balanced_packing: {items} items do not split evenly into {num_packs} packs")
    per_pack = items // num_packs
    if per_pack == 1:  # one item per pack: item i is pack i
        pack_index = torch.arange(items, dtype=torch.int64).expand(rows, items).clone()  # [rows, items]
        return pack_index, torch.zeros(rows, items, dtype=torch.int64)
    order = torch.sort(weight.double().cpu(), dim=-1, descending=True, stable=True).indices  # [rows, items]
    pack_index = torch.empty(rows, items, dtype=torch.int64)
    rank_in_pack = torch.empty(rows, items, dtype=torch.int64)
    values = weight.double().cpu().tolist()
    for row in range(rows):
        packs, ranks = _pack_row(values[row], order[row].tolist(), num_packs, per_pack)
        pack_index[row] = torch.tensor(packs)
        rank_in_pack[row] = torch.tensor(ranks)
    return pack_index, rank_in_pack


def _pack_row(values: list[float], order: list[int], num_packs: int, per_pack: int) -> tuple[list[int], list[int]]:
    """One row: the pack and rank of each item, visiting items in ``order`` (heaviest first)."""
    load = [0.0] * num_packs
    count = [0] * num_packs
    packs = [0] * len(values)
    ranks = [0] * len(values)
    for item in order:
        pack = min((p for p in range(num_packs) if count[p] < per_pack), key=load.__getitem__)
        packs[item], ranks[item] = pack, count[pack]
        load[pack] += values[item]
        count[pack] += 1
    return packs, ranks

"""``balanced_packing`` and ``replicate_experts``, the two greedy steps, on hand-checked inputs."""

from __future__ import annotations

import pytest
import torch
from deepinfer_eplb import EplbError, balanced_packing, replicate_experts


def test_heaviest_first_into_the_lightest_pack_with_room():
    # sorted: 9 (A), 7 (B), 6 (B: 7 < 9), 5 (A: 9 < 13), 2 (B: A is full), 1 (B)... packs of 3
    pack, rank = balanced_packing(torch.tensor([[5, 9, 2, 7, 6, 1]]), 2)
    assert pack.tolist() == [[0, 0, 1, 1, 1, 0]]
    assert rank.tolist() == [[1, 0, 2, 0, 1, 2]]


def test_ties_go_to_the_lower_index():
    pack, rank = balanced_packing(torch.tensor([[1, 1, 1, 1]]), 2)  # items in index order, packs alternate
    assert pack.tolist() == [[0, 1, 0, 1]] and rank.tolist() == [[0, 0, 1, 1]]


def test_one_item_per_pack_keeps_the_order():
    pack, rank = balanced_packing(torch.tensor([[3, 9, 1], [1, 2, 3]]), 3)
    assert pack.tolist() == [[0, 1, 2], [0, 1, 2]] and rank.eq(0).all()


def test_rows_are_packed_independently():
    first = [5, 9, 2, 7, 6, 1]
    pack, _ = balanced_packing(torch.tensor([first, first[-1:] + first[:-1]]), 2)  # row 1: row 0 rotated by one
    assert pack[0].tolist() == [0, 0, 1, 1, 1, 0]
    assert pack[1].tolist() == [0, 0, 0, 1, 1, 1]  # the same packs, rotated alike


def test_items_must_split_evenly():
    with pytest.raises(EplbError, match="5 items do not split evenly into 2 packs"):
        balanced_packing(torch.ones(1, 5), 2)


def test_each_spare_slot_goes_to_the_highest_load_per_replica():
    # loads 8, 3, 5; slots 4..6 go to 8 (8 > 5), then 5 (4 < 5), then 8 (4 > 3 = 5/... 2.5)
    phy2log, replica, logcnt = replicate_experts(torch.tensor([[8.0, 3.0, 5.0]]), 6)
    assert phy2log.tolist() == [[0, 1, 2, 0, 2, 0]]
    assert replica.tolist() == [[0, 0, 0, 1, 1, 2]]
    assert logcnt.tolist() == [[3, 1, 2]]


def test_replication_needs_a_slot_per_expert():
    with pytest.raises(EplbError, match="2 slots cannot hold 3 experts"):
        replicate_experts(torch.ones(1, 3), 2)

"""``BoundedReplay``: the adopted length and the replay start, for DeepSeek-V4's numbers and the tiny model's."""

from __future__ import annotations

import pytest
from deepinfer_swa_replay import ROLLBACK_TOKENS, BoundedReplay

V4 = BoundedReplay(window=128)


def test_v4_keeps_134_tokens_after_the_hit():
    assert ROLLBACK_TOKENS == 6 and V4.reserve == 134


@pytest.mark.parametrize(("num_tokens", "hit", "adopted"), [
    (1024, 896, 768),  # the repeated 1,024-token prompt: 1024 - 134 = 890, down to 768
    (1024, 640, 640),  # a hit below the cap is adopted whole
    (390, 384, 256),  # 390 - 134 = 256: exactly on a block boundary
    (389, 384, 0),  # 389 - 134 = 255 -> 128, not above the window: not adopted
    (263, 256, 0),  # 263 - 134 = 129 -> 128: not adopted
    (134, 0, 0),
    (100, 0, 0),  # shorter than the reserve
])
def test_adopted_length_on_v4_blocks(num_tokens, hit, adopted):
    assert V4.adopted(num_tokens, hit, block_size=128) == adopted


def test_adopted_length_on_smaller_blocks():
    replay = BoundedReplay(window=8)
    assert replay.reserve == 14
    assert replay.adopted(100, 96, block_size=8) == 80  # 100 - 14 = 86 -> 80
    assert replay.adopted(30, 24, block_size=8) == 16  # 30 - 14 = 16
    assert replay.adopted(29, 24, block_size=8) == 0  # 15 -> 8, not above the window
    assert replay.adopted(1000, 40, block_size=8) == 40


def test_replay_starts_one_window_before_the_hit():
    assert V4.start(768) == 640
    assert BoundedReplay(window=8).start(16) == 8

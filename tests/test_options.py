"""The one reading of a boolean that the environment variables and the plugins' options share."""

from __future__ import annotations

import pytest

from deepinfer_core.options import parse_flag


@pytest.mark.parametrize("value, flag", [(True, True), (False, False), (1, True), (0, False), ("on", True),
                                         (" Yes ", True), ("TRUE", True), ("off", False), ("0", False), ("No", False)])
def test_flags_read_as_booleans(value, flag):
    assert parse_flag(value) is flag


@pytest.mark.parametrize("value", [2, -1, 0.5, "", "maybe", "10", None, [1]])
def test_anything_else_is_not_a_flag(value):
    assert parse_flag(value) is None

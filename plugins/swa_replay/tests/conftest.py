"""Fixtures for the SWA bounded replay plugin's tests.

Tiny checkpoints come from the core's test factory (``tests/v4_factory.py`` of this repository), put on
``sys.path`` here, so the plugin tests build the models the core's tests use.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_CORE_TESTS = Path(__file__).resolve().parents[3] / "tests"
if (_CORE_TESTS / "v4_factory.py").is_file() and str(_CORE_TESTS) not in sys.path:
    sys.path.append(str(_CORE_TESTS))


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """A tiny V4 checkpoint: six layers (sliding, CSA, HCA twice), window 8, vocab 64."""
    pytest.importorskip("transformers")
    v4_factory = pytest.importorskip("v4_factory", reason="needs the repository's tests/v4_factory.py")
    folder = tmp_path_factory.mktemp("swa_replay") / "ckpt"
    v4_factory.tiny_checkpoint(folder, layer_types=v4_factory.ALL_TYPES * 2, hc_mult=2)
    return folder

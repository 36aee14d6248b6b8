"""Fixtures for the DSpark plugin's tests.

Tiny checkpoints (with an MTP draft layer) come from the core's test factory (``tests/v4_factory.py`` of this
repository), put on ``sys.path`` here, so the plugin tests build the models the core's tests use.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_CORE_TESTS = Path(__file__).resolve().parents[3] / "tests"
if (_CORE_TESTS / "v4_factory.py").is_file() and str(_CORE_TESTS) not in sys.path:
    sys.path.append(str(_CORE_TESTS))


@pytest.fixture(scope="session")
def mtp_ckpt(tmp_path_factory):
    """A tiny V4 checkpoint (sliding, CSA, HCA; window 8, vocab 64) with one MTP layer and a confidence head."""
    pytest.importorskip("transformers")
    v4_factory = pytest.importorskip("v4_factory", reason="needs the repository's tests/v4_factory.py")
    folder = tmp_path_factory.mktemp("dspark") / "ckpt"
    v4_factory.tiny_checkpoint_with_mtp(folder, v4_factory.ReferenceMTP(seed=7, confidence=True))
    return folder

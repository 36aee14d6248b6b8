"""Fixtures for the batch-invariant plugin's tests.

Tiny checkpoints come from the core's test factory (``tests/v4_factory.py`` of this repository), put on
``sys.path`` here, so the plugin tests build exactly the models the core's tests use.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run under Triton's interpreter (test_triton_interpreter.py). Triton
    # reads this when it is first imported, so it is set before any test module imports it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import deepinfer_batch_invariant
import pytest
from deepinfer_batch_invariant.plugin import ENV, ENV_MTP_VARLEN

_CORE_TESTS = Path(__file__).resolve().parents[3] / "tests"
if (_CORE_TESTS / "v4_factory.py").is_file() and str(_CORE_TESTS) not in sys.path:
    sys.path.append(str(_CORE_TESTS))


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    """Every test starts with the mode off and without the plugin's environment variables."""
    for name in (ENV, ENV_MTP_VARLEN, "DEEPINFER_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    deepinfer_batch_invariant.reset()
    yield
    deepinfer_batch_invariant.reset()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """A tiny V4 checkpoint (sliding, CSA, HCA layers; vocab 64) whose indexer keeps only 4 entries."""
    pytest.importorskip("transformers")
    v4_factory = pytest.importorskip("v4_factory", reason="needs the repository's tests/v4_factory.py")
    folder = tmp_path_factory.mktemp("batch_invariant") / "ckpt"
    v4_factory.tiny_checkpoint(folder, index_topk=4)
    return folder


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "nvidia: needs an NVIDIA GPU (SM90 or SM100) and the nvidia_sm100 backend")


def _nvidia_probe() -> tuple[bool, str]:
    try:
        from deepinfer_nvidia_sm100.probe import probe
    except ImportError as exc:
        return False, f"the nvidia_sm100 backend is not installed ({exc})"
    found = probe()
    return found.available, found.reason


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any("nvidia" in item.keywords for item in items):
        return
    available, reason = _nvidia_probe()
    for item in items:
        if "nvidia" in item.keywords and not available:
            item.add_marker(pytest.mark.skip(reason=f"needs an SM90/SM100 GPU: {reason}"))

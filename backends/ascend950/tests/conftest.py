"""Fixtures for the Ascend 950 backend's tests.

Two kinds of tests live here:

* ``test_contract_*.py``: CONTRACT tests. They run on the CPU with ``contract_reference`` (plain-torch
  stand-ins of torch_npu's documented op semantics) injected in place of torch_npu, and compare the adapters
  with ``deepinfer_core.ops.reference``. They never import torch_npu and say nothing about hardware.
* ``test_npu_*.py``: HARDWARE tests, marked ``npu`` and ``ci_npu`` (``hardware.hardware_marks``); they skip
  unless the ``ascend950`` probe finds an Ascend 950 with CANN and torch_npu.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # `import contract_reference` from every test module
    sys.path.insert(0, str(HERE))


@pytest.fixture
def stand_in():
    """The CPU stand-in module for torch_npu (contract tests only)."""
    import contract_reference

    return contract_reference


@pytest.fixture
def npu_ops(stand_in):
    """The adapters wired to the CPU stand-ins."""
    from deepinfer_ascend950.ops import NpuOps

    return NpuOps(stand_in)


@pytest.fixture
def fake_torch_npu(tmp_path: Path):
    """A site folder holding a fake, CANN-less torch_npu, registered the way the real wheel registers itself.

    The real torch-npu wheel declares ``[torch.backends] torch_npu = torch_npu:_autoload`` (its
    entry_points.txt); torch's ``_import_device_backends`` loads every entry point of group ``torch.backends``
    at ``import torch`` unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``. Without CANN, importing the real
    torch_npu fails on libhccl.so; the fake fails the same way. Returns the folder (use as PYTHONPATH).
    """
    site = tmp_path / "site"
    package = site / "torch_npu"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent('''\
        raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")

        def _autoload():
            pass
        '''))
    info = site / "torch_npu-2.13.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.13.0\n")
    (info / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")
    return site

"""The torch-npu requirement is stated twice (this package's `npu` extra, the core's `ascend950` extra): keep
them equal, and keep the core's extras pointing at this version."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1]
ROOT = PACKAGE.parents[1]


def _pyproject(folder: Path) -> dict:
    return tomllib.loads((folder / "pyproject.toml").read_text())


def test_npu_extra_pins_the_torch_2_13_series_of_torch_npu():
    project = _pyproject(PACKAGE)["project"]
    assert project["dependencies"] == ["deepinfer>=0.1,<0.2"]  # no torch-npu in the base requirements
    assert project["optional-dependencies"]["npu"] == ["torch-npu>=2.13.0rc1,<2.14; sys_platform == 'linux'"]
    assert project["entry-points"]["deepinfer.backends"] == {"ascend950": "deepinfer_ascend950.probe:probe"}


def test_core_extras_match():
    if not (ROOT / "deepinfer_core").is_dir():
        pytest.skip("not running from the repository")
    package = _pyproject(PACKAGE)["project"]
    extras = _pyproject(ROOT)["project"]["optional-dependencies"]
    expected = [f"deepinfer-ascend950=={package['version']}", *package["optional-dependencies"]["npu"]]
    assert extras["ascend950"] == expected
    # `all` carries the distribution but not torch-npu: that would break `import torch` wherever CANN is missing.
    assert expected[0] in extras["all"]
    assert not any(req.startswith("torch-npu") for req in extras["all"])

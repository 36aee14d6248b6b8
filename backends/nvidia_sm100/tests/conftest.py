"""Skip GPU tests where no supported GPU is present (marker ``nvidia``; ``sm100`` for SM100-only)."""

from __future__ import annotations

import pytest
from deepinfer_nvidia_sm100.probe import probe


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "nvidia: needs an NVIDIA GPU (SM90 or SM100)")
    config.addinivalue_line("markers", "sm100: needs an NVIDIA SM100 GPU")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    found = probe()
    is_sm100 = found.available and "sm100 path" in found.reason
    for item in items:
        if "nvidia" in item.keywords and not found.available:
            item.add_marker(pytest.mark.skip(reason=f"needs an SM90/SM100 GPU: {found.reason}"))
        elif "sm100" in item.keywords and not is_sm100:
            item.add_marker(pytest.mark.skip(reason=f"needs an SM100 GPU: {found.reason}"))

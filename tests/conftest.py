"""Shared fixtures for the core tests. Keep this file small and generic."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest


@pytest.fixture
def make_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Path]]:
    """Create installed-looking distributions in a temp dir on ``sys.path`` (real entry-point discovery).

    ``make_distribution("deepinfer-x", entry_points={"deepinfer.plugins": {"x": "x_plugin"}},
    modules={"x_plugin": "source"})`` writes ``x_plugin.py`` and ``deepinfer_x-0.1.0.dist-info/`` with
    ``METADATA`` and ``entry_points.txt``. Returns the directory (also usable as ``PYTHONPATH`` for a
    subprocess). Modules imported from it are dropped from ``sys.modules`` afterwards.
    """
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    before = set(sys.modules)

    def make(
        name: str,
        version: str = "0.1.0",
        entry_points: Mapping[str, Mapping[str, str]] | None = None,
        modules: Mapping[str, str] | None = None,
    ) -> Path:
        for module, source in (modules or {}).items():
            (site / f"{module}.py").write_text(textwrap.dedent(source))
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        lines = []
        for group, eps in (entry_points or {}).items():
            lines += [f"[{group}]", *(f"{ep_name} = {value}" for ep_name, value in eps.items()), ""]
        (info / "entry_points.txt").write_text("\n".join(lines))
        return site

    yield make
    for module in set(sys.modules) - before:
        if str(getattr(sys.modules[module], "__file__", "") or "").startswith(str(site)):
            del sys.modules[module]

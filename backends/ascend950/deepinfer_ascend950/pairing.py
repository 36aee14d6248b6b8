"""torch / torch-npu / CANN pairings, and the version check the probe runs (metadata only, no imports).

torch-npu is built against one torch minor series and pins it in its wheel metadata; CANN must in turn
match torch-npu. ``PAIRINGS`` is the table docs/ascend950.md prints. Each row says where it comes from:

* ``pypi-metadata``: the ``Requires-Dist`` of the cp311 x86_64 wheel on PyPI, read with
  ``pip install --dry-run --report`` (confirmed here for the torch pin only).
* ``torch-npu-readme``: the "Ascend Auxiliary Software" table of the torch-npu README shipped as the
  PyPI description of torch-npu 2.13.0 (a document, not a test).
* ``reference-engine``: what the reference DeepInfer engine ran with (taken from its notes, not re-checked).
* ``unconfirmed``: no source at hand.

Nothing in this table was run on an Ascend device by this project.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Pairing:
    """One torch-npu release: the torch it requires, the CANN it was paired with, and the sources."""

    torch_npu: str
    torch: str  # the torch requirement of the torch-npu wheel
    cann: str  # CANN release(s) documented for this torch-npu, or "?" when unconfirmed
    torch_source: str
    cann_source: str


PAIRINGS: tuple[Pairing, ...] = (
    Pairing("2.14.0", "torch==2.14.0.*", "?", "pypi-metadata", "unconfirmed"),
    Pairing("2.13.0", "torch==2.13.0.*", "?", "pypi-metadata", "unconfirmed"),
    Pairing("2.13.0rc1", "torch==2.13.0", "CANN 9.2", "pypi-metadata", "reference-engine"),
    Pairing("2.12.0", "torch==2.12.0", "?", "pypi-metadata", "unconfirmed"),
    Pairing("2.12.0rc1", "torch==2.12.0", "CANN 8.5.0", "pypi-metadata", "torch-npu-readme"),
    Pairing("2.11.0", "torch==2.11.0+cpu", "?", "pypi-metadata", "unconfirmed"),
    Pairing("2.11.0rc1", "torch 2.11.0", "CANN 8.5.0", "torch-npu-readme", "torch-npu-readme"),
    Pairing("2.10.0rc2", "torch 2.10.0", "CANN 8.5.0", "torch-npu-readme", "torch-npu-readme"),
    Pairing("2.9.0", "torch 2.9.0", "CANN 8.5.0", "torch-npu-readme", "torch-npu-readme"),
    Pairing("2.8.0.post2", "torch 2.8.0", "CANN 8.5.0", "torch-npu-readme", "torch-npu-readme"),
    Pairing("2.8.0", "torch 2.8.0", "CANN 8.3.RC1", "torch-npu-readme", "torch-npu-readme"),
    Pairing("2.7.1.post2", "torch 2.7.1", "CANN 8.5.0", "torch-npu-readme", "torch-npu-readme"),
    Pairing("2.7.1", "torch 2.7.1", "CANN 8.3.RC1", "torch-npu-readme", "torch-npu-readme"),
    Pairing("2.6.0.post5", "torch 2.6.0", "CANN 8.5.0", "torch-npu-readme", "torch-npu-readme"),
    Pairing("2.6.0.post3", "torch 2.6.0", "CANN 8.3.RC1", "torch-npu-readme", "torch-npu-readme"),
    Pairing("2.6.0", "torch 2.6.0", "CANN 8.2.RC1", "torch-npu-readme", "torch-npu-readme"),
    Pairing("2.5.1.post1", "torch 2.5.1", "CANN 8.2.RC1", "torch-npu-readme", "torch-npu-readme"),
    Pairing("2.5.1", "torch 2.5.1", "CANN 8.1.RC1", "torch-npu-readme", "torch-npu-readme"),
)
"""Newest first. The core requires torch>=2.4 but is tested with torch 2.13 only."""

RECOMMENDED_CANN = "9.2"
"""The CANN release the reference engine ran torch-npu 2.13.0rc1 with (not re-checked here)."""


def minor_series(version: str) -> tuple[int, int] | None:
    """``"2.13.0+cpu"`` / ``"2.13.0rc1"`` / ``"2.12.0.post3"`` -> ``(2, 13)``; None when unparsable."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_pair(torch_version: str, torch_npu_version: str) -> str | None:
    """None when torch-npu's minor series matches torch's, else a sentence saying what to install."""
    want, have = minor_series(torch_version), minor_series(torch_npu_version)
    if want is None or have is None or want == have:
        return None
    series = f"{want[0]}.{want[1]}"
    return (
        f"torch-npu {torch_npu_version} is built for torch {have[0]}.{have[1]} but torch {torch_version} is "
        f"installed; install the torch-npu of the torch {series} series (pip install 'torch-npu=={series}.*', "
        "pairing table in docs/ascend950.md)"
    )

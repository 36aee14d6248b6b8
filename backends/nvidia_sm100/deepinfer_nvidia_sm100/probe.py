"""Cheap probe for the ``deepinfer.backends`` entry point ``nvidia_sm100``.

Imports only torch at module level (the core already did) and touches ``torch.cuda`` only inside
``probe()``: device count and compute capability. No Triton, no CUDA extension, no kernel compile.
"""

from __future__ import annotations

from typing import Any

from deepinfer_core.backends.base import ProbeResult

NAME = "nvidia_sm100"
BACKEND_CLASS = "deepinfer_nvidia_sm100.backend:NvidiaBackend"
SUPPORTED_MAJORS = {9: "sm90", 10: "sm100"}
"""Compute capability major -> kernel path. 9.x: Hopper (H100, H200); 10.x: Blackwell (B200, GB200)."""


def short_name(device_name: str) -> str:
    """``"NVIDIA A100-SXM4-80GB"`` -> ``"A100"``; ``"NVIDIA H200"`` -> ``"H200"``."""
    name = device_name.removeprefix("NVIDIA").strip()
    return name.replace("-", " ").split()[0] if name else device_name


def arch_path(capability: tuple[int, int]) -> str | None:
    """The kernel path (``"sm90"`` / ``"sm100"``) for a compute capability, or None if unsupported."""
    return SUPPORTED_MAJORS.get(capability[0])


def probe(cuda: Any = None) -> ProbeResult:
    """Whether an SM90 / SM100 GPU is here. ``cuda`` defaults to ``torch.cuda`` (tests pass a fake)."""
    if cuda is None:
        import torch

        if torch.version.cuda is None:
            return _result(False, f"no CUDA device (torch {torch.__version__} is built without CUDA)")
        cuda = torch.cuda
    try:
        count = cuda.device_count() if cuda.is_available() else 0
    except Exception as exc:  # noqa: BLE001  (a broken driver is a reason, not a crash)
        return _result(False, f"no CUDA device (CUDA initialisation failed: {type(exc).__name__}: {exc})")
    if count == 0:
        return _result(False, "no CUDA device")
    major, minor = cuda.get_device_capability(0)
    name = cuda.get_device_name(0)
    path = arch_path((major, minor))
    if path is None:
        return _result(False, f"compute capability {major}.{minor} ({short_name(name)}): needs 9.x or 10.x")
    return _result(True, f"found {count} x {name} (compute capability {major}.{minor}: {path} path)")


def _result(available: bool, reason: str) -> ProbeResult:
    return ProbeResult(name=NAME, available=available, reason=reason, backend_class=BACKEND_CLASS,
                       is_accelerator=True, device_type="cuda")

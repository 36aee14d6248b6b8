"""The CPU backend: the reference ops on the host CPU. Always available; the fallback of selection.

Registered through the core's own entry point ``cpu = "deepinfer_core.backends.cpu:probe"``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import torch

from deepinfer_core.backends.base import Backend, Capabilities, MemoryInfo, ProbeResult
from deepinfer_core.backends.host_threads import HostThreads, cpu_host_threads

NAME = "cpu"


def probe() -> ProbeResult:
    """The CPU is always there."""
    return ProbeResult(
        name=NAME,
        available=True,
        reason=f"host CPU, {os.cpu_count() or 1} logical cores, torch {torch.__version__}",
        backend_class=f"{__name__}:CpuBackend",
        is_accelerator=False,
        device_type="cpu",
    )


class CpuBackend(Backend):
    """The reference ops, with CPU fast paths for the ops that are many tiny tensor ops (``cpu_ops``)."""

    name = NAME
    device_type = "cpu"
    probe = staticmethod(probe)

    @property
    def device(self) -> torch.device:
        """``cpu`` (one device, whatever the index)."""
        return torch.device("cpu")

    def capabilities(self) -> Capabilities:
        """fp32/bf16/fp16 through plain torch; no graphs, no fp8 matmuls, gloo for torch.distributed."""
        return Capabilities(
            dtypes=(torch.float32, torch.bfloat16, torch.float16),
            distributed_backend="gloo",
            verified_on_hardware=frozenset({"dtypes", "distributed_backend"}),
        )

    @classmethod
    def host_thread_choice(cls) -> HostThreads:
        """One thread per physical core that other processes leave idle (``host_threads.cpu_host_threads``)."""
        return cpu_host_threads()

    def op_overrides(self) -> Mapping[str, Callable]:
        """Fewer-dispatch versions of norms, RoPE and mHC mixing (checked against the reference ops)."""
        from deepinfer_core.backends.cpu_ops import OVERRIDES

        return dict(OVERRIDES)

    def memory_info(self) -> MemoryInfo:
        """Host memory: available (``MemAvailable``) and physical total."""
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return MemoryInfo(free_bytes=_available_bytes(total), total_bytes=total)


def _available_bytes(total: int) -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        return total

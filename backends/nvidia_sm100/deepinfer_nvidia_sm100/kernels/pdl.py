"""Programmatic dependent launch (PDL, SM90 and later) for the backend's Triton kernels.

A kernel launched with PDL may be scheduled while the kernel before it on the stream is still running; it then
waits (``griddepcontrol.wait``) before touching memory, so it sees everything its predecessor wrote, and lets its own
successor launch at once (``griddepcontrol.launch_dependents``). What overlaps is the launch itself: at batch 1 a
decode step is ~360 short kernels back to back, and each boundary costs launch latency. Captured into a CUDA graph,
the launches become programmatic edges.

Every kernel that takes part starts with ``begin(PDL)``; its launch passes ``**pdl.launch()``: ``PDL=True`` and
``launch_pdl=True`` when ``DEEPINFER_NVIDIA_PDL`` is on (the default; ``0`` turns it off) and Triton compiles for a
GPU, else ``PDL=False`` alone (Triton's interpreter has no ``griddepcontrol``).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer_nvidia_sm100 import envs


def enabled() -> bool:
    """Whether launches use PDL: ``DEEPINFER_NVIDIA_PDL`` on (the default) and not under Triton's interpreter."""
    return envs.DEEPINFER_NVIDIA_PDL and not _interpreted()


def _interpreted() -> bool:
    """Whether Triton's interpreter runs the kernels: ``TRITON_INTERPRET`` set to anything but 0 / false / no / off."""
    return os.environ.get("TRITON_INTERPRET", "0").strip() not in ("0", "false", "no", "off", "")


def launch() -> dict:
    """The launch arguments of a kernel that starts with ``begin(PDL)``."""
    return {"PDL": True, "launch_pdl": True} if enabled() else {"PDL": False}


@triton.jit
def begin(PDL: tl.constexpr):
    """A PDL kernel's first statement: wait until the previous kernel's writes are visible, then let the next one
    launch (a no-op unless ``PDL``)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()

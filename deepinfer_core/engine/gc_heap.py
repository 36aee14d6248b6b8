"""Python's garbage collector kept off the engine's long-lived objects.

A full (generation 2) collection walks every object the collector tracks: the model's parameters and layers, the
captured decode graphs, what torch / Triton / TileLang built at import and compile time. In a host-bound step (an
eager batch-1 prefill launches ~2,000 kernels from Python) such a pause lands on the request's first token. Once the
engine is built, and after each decode graph capture, ``freeze()`` collects once and moves everything that survived
into the permanent generation (``gc.freeze``), which later collections skip; what requests allocate is collected as
before. ``unfreeze()`` (an engine's shutdown, and the interpreter's exit) hands them back, so reference cycles among
them are still freed. ``DEEPINFER_GC_FREEZE=0`` leaves the collector alone.
"""

from __future__ import annotations

import atexit
import functools
import gc
import os

ENV = "DEEPINFER_GC_FREEZE"


def freeze() -> bool:
    """Collect, then exempt every surviving object from later collections; False (and nothing done) when
    ``DEEPINFER_GC_FREEZE=0``."""
    if os.environ.get(ENV, "1") == "0":
        return False
    gc.collect()
    gc.freeze()
    _unfreeze_at_exit()
    return True


@functools.cache
def _unfreeze_at_exit() -> None:
    atexit.register(unfreeze)  # frozen objects left at exit are never finalised (nanobind reports them as leaks)


def unfreeze() -> None:
    """Return frozen objects to the collector (an engine shutting down: its reference cycles become collectable)."""
    gc.unfreeze()

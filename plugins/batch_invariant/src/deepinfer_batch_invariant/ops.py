"""Which implementation each op gets in batch-invariant mode, per backend."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from deepinfer_core.ops.table import reference_ops

SOURCE = "batch_invariant"
log = logging.getLogger("deepinfer.batch_invariant")


def implementations(backend_name: str) -> dict[str, Callable]:
    """Op name -> batch-invariant implementation for ``backend_name`` (every op of the reference table).

    Ops with a variant get it; ops whose reference is already invariant get the reference op itself, so
    a backend's own fast path (which may not be invariant) is replaced too. An op this plugin has not
    reviewed (added to the core later) also gets its reference op, with a warning.
    """
    if backend_name != "cpu":
        raise ValueError(f"no batch-invariant ops for backend {backend_name!r}")
    from deepinfer_batch_invariant.cpu_ops import REFERENCE_KEPT, VARIANTS

    chosen = {}
    for name, reference in reference_ops().items():
        if name not in VARIANTS and name not in REFERENCE_KEPT:
            log.warning("op %r is not reviewed for batch invariance; using its reference implementation", name)
        chosen[name] = VARIANTS.get(name, reference)
    return chosen


def install(op_table: Any, backend_name: str) -> None:
    """Override every op of ``op_table`` with its batch-invariant implementation."""
    for name, fn in implementations(backend_name).items():
        op_table.override(name, fn, source=SOURCE)

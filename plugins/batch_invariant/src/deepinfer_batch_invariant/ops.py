"""Which implementation each op gets in batch-invariant mode, per backend."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from deepinfer_batch_invariant import quantized
from deepinfer_core.ops.table import DERIVED, reference_ops

SOURCE = "batch_invariant"
log = logging.getLogger("deepinfer.batch_invariant")


def implementations(backend_name: str, offered: Mapping[str, Callable] | None = None) -> dict[str, Callable]:
    """Op name -> batch-invariant implementation for ``backend_name`` (every op of the reference table).

    Ops with a variant get it; ops whose reference is already invariant get the reference op itself, so
    a backend's own fast path (which may not be invariant) is replaced too. An op this plugin has not
    reviewed (added to the core later) also gets its reference op, with a warning. ``offered``: the backend's own
    batch-invariant ops (``OpTable.variants("batch_invariant")``, ``Backend.op_variants``), taken over this plugin's
    forms; the ops made of parts (``DERIVED``) and the quantized-weight ops that the backend does not offer are then
    rebuilt over the chosen parts, so a fused backend kernel is used wherever a part of it is.
    """
    variants, kept = variant_tables(backend_name)
    chosen = {}
    for name, reference in reference_ops().items():
        if name not in variants and name not in kept:
            log.warning("op %r is not reviewed for batch invariance; using its reference implementation", name)
        chosen[name] = variants.get(name, reference)
    offered = dict(offered or {})
    if not offered:
        return chosen
    chosen.update(offered)
    changed = set(offered)
    for name, (parts, build, _) in DERIVED.items():  # parts come before the ops made of them
        if name not in offered and changed & set(parts):
            chosen[name] = build(*(chosen[part] for part in parts))
            changed.add(name)
    chosen.update({name: fn for name, fn in quantized.variants(chosen).items() if name not in offered})
    return chosen


def variant_tables(backend_name: str) -> tuple[dict[str, Callable], dict[str, str]]:
    """``(VARIANTS, REFERENCE_KEPT)`` of ``backend_name``'s module: ``cpu_ops`` for ``cpu``, ``cuda_ops``
    (Triton, imported here and only here) for ``nvidia_sm100``."""
    if backend_name == "cpu":
        from deepinfer_batch_invariant import cpu_ops as module
    elif backend_name == "nvidia_sm100":
        from deepinfer_batch_invariant import cuda_ops as module
    else:
        raise ValueError(f"no batch-invariant ops for backend {backend_name!r}")
    return module.VARIANTS, module.REFERENCE_KEPT


def install(op_table: Any, backend_name: str) -> None:
    """Override every op of ``op_table`` with its batch-invariant implementation: the backend's own where it offers
    one (``op_table.variants("batch_invariant")``; source ``"batch_invariant (<backend>)"``), else this plugin's
    (source ``"batch_invariant"``)."""
    offered = op_table.variants(SOURCE)
    for name, fn in implementations(backend_name, offered).items():
        op_table.override(name, fn, source=f"{SOURCE} ({backend_name})" if name in offered else SOURCE)

"""The plugin module the ``deepinfer.plugins`` entry point ``template`` names.

It claims the feature option ``count_rms_norm``. When an engine is configured with it, every op table
built afterwards gets an ``rms_norm`` that forwards to the op it replaces and counts its calls.
It does not implement ``deepinfer_supported_backends``: wrapping an op works on every backend. A plugin
limited to some backends returns their names from that hook, e.g. ``["cpu", "nvidia_sm100"]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from deepinfer_core.hookspecs import hookimpl

DEEPINFER_HOOK_API_VERSION = 1  # the hook API this plugin was written against; the core checks it

OPTION = "count_rms_norm"
SOURCE = "template"  # how op_table.sources() names our override


class _Counter:
    """The plugin's state for this process: whether counting is on, and how many calls it saw."""

    def __init__(self) -> None:
        self.enabled = False
        self.calls = 0


_state = _Counter()


def calls() -> int:
    """How many times a counting ``rms_norm`` ran in this process."""
    return _state.calls


def reset() -> None:
    """Zero the counter and switch counting off (tests)."""
    _state.enabled = False
    _state.calls = 0


def counting(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` wrapped so that each call is counted; arguments and result pass through unchanged."""

    def rms_norm(*args: Any, **kwargs: Any) -> Any:
        _state.calls += 1
        return fn(*args, **kwargs)

    rms_norm.__wrapped__ = fn  # type: ignore[attr-defined]
    return rms_norm


@hookimpl
def deepinfer_feature_options() -> dict[str, str]:
    """Claim our option so the core accepts it."""
    return {OPTION: "count calls to the rms_norm op (deepinfer_plugin_template.calls())"}


@hookimpl
def deepinfer_configure(options: Mapping[str, Any]) -> None:
    """Switch counting on or off for the engine being built."""
    _state.enabled = bool(options.get(OPTION, False))


@hookimpl
def deepinfer_register_ops(op_table: Any, backend_name: str) -> None:
    """Wrap whatever implements ``rms_norm`` now (reference or the backend's) with the counter."""
    del backend_name  # the same wrapper fits every backend
    if _state.enabled:
        op_table.override("rms_norm", counting(op_table.rms_norm), source=SOURCE)

"""The plugin module the ``deepinfer.plugins`` entry point ``template`` names.

It claims the feature option ``count_rms_norm``. When an engine is configured with it, that engine's op table gets
an ``rms_norm`` that forwards to the op it replaces and counts its calls in that engine's counter.
It does not implement ``deepinfer_supported_backends``: wrapping an op works on every backend. A plugin
limited to some backends returns their names from that hook, e.g. ``["cpu", "nvidia_sm100"]``.

Per-engine state: ``deepinfer_configure`` puts this engine's ``Counter`` in ``context.plugin_state`` and
``deepinfer_register_ops`` reads it from the same context; nothing lives in module globals, so two engines in one
process count separately and an engine built without the option counts nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from deepinfer_core.engine_context import EngineContext
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.ops.table import OpTable

DEEPINFER_HOOK_API_VERSION = 1  # the hook API this plugin was written against; the core checks it

OPTION = "count_rms_norm"
SOURCE = "template"  # how op_table.sources() names our override, and our key in context.plugin_state


class Counter:
    """One engine's count of ``rms_norm`` calls."""

    def __init__(self) -> None:
        self.calls = 0


def calls(context: EngineContext) -> int:
    """How many times the counting ``rms_norm`` of ``context``'s engine ran (0 when it does not count)."""
    counter = context.plugin_state.get(SOURCE)
    return counter.calls if isinstance(counter, Counter) else 0


def counting(fn: Callable[..., Any], counter: Counter) -> Callable[..., Any]:
    """``fn`` wrapped so that each call is counted in ``counter``; arguments and result pass through unchanged."""

    def rms_norm(*args: Any, **kwargs: Any) -> Any:
        counter.calls += 1
        return fn(*args, **kwargs)

    rms_norm.__wrapped__ = fn  # type: ignore[attr-defined]
    return rms_norm


@hookimpl
def deepinfer_feature_options() -> dict[str, str]:
    """Claim our option so the core accepts it."""
    return {OPTION: "count calls to the rms_norm op (deepinfer_plugin_template.calls(llm.context))"}


@hookimpl
def deepinfer_configure(options: Mapping[str, object], context: EngineContext) -> None:
    """Give the engine being built a counter when it asks for one."""
    if options.get(OPTION, False):
        context.plugin_state[SOURCE] = Counter()


@hookimpl
def deepinfer_register_ops(op_table: OpTable, context: EngineContext) -> None:
    """Wrap whatever implements ``rms_norm`` now (reference or the backend's) with this engine's counter."""
    counter = context.plugin_state.get(SOURCE)
    if isinstance(counter, Counter):
        op_table.override("rms_norm", counting(op_table.rms_norm, counter), source=SOURCE)

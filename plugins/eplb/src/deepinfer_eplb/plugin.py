"""The ``deepinfer.plugins`` entry point ``eplb``: the ``enable_eplb`` and ``eplb_config`` feature options, and
EPLB in a running expert-parallel engine.

``deepinfer_feature_options`` claims the two options, so ``LLM(..., enable_eplb=True, eplb_config={...})`` and
``--option enable_eplb=true`` are accepted; ``deepinfer_configure`` validates them (``config.resolve``; EPLB needs
``enable_expert_parallel=True``) and keeps the engine's ``EplbConfig`` (or None when off) in
``context.plugin_state["eplb"]``, where ``engine_config`` reads it. On each rank, ``deepinfer_engine_start`` builds
the rank's ``EplbRuntime`` (refusing an engine of one rank; its figures, ``moe_lb`` first, go to ``engine.metrics``),
and ``deepinfer_step_boundary`` records the load and moves experts when a rebalance is due.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deepinfer_core.engine_context import EngineContext
from deepinfer_core.hookspecs import hookimpl
from deepinfer_eplb.config import CONFIG, ENABLE, EplbConfig, resolve
from deepinfer_eplb.errors import EplbConfigError
from deepinfer_eplb.runtime import EplbRuntime

DEEPINFER_HOOK_API_VERSION = 1

NAME = "eplb"  # the entry-point name, and this plugin's key in EngineContext.plugin_state
RUNTIME = "eplb.runtime"  # the rank's EplbRuntime, beside the config


def engine_config(context: EngineContext) -> EplbConfig | None:
    """The ``EplbConfig`` ``deepinfer_configure`` decided for ``context``'s engine; None when EPLB is off."""
    return context.plugin_state.get(NAME)


def engine_runtime(context: EngineContext | None) -> EplbRuntime | None:
    """The ``EplbRuntime`` of ``context``'s engine (a rank balancing experts); None when it has none."""
    return None if context is None else context.plugin_state.get(RUNTIME)


@hookimpl
def deepinfer_feature_options() -> dict[str, str]:
    return {
        ENABLE: "expert-parallel load balancing: redundant experts placed by router load (deepinfer-eplb)",
        CONFIG: "EPLB settings: {num_redundant_experts, window_size, step_interval} (a mapping or a JSON object)",
    }


@hookimpl
def deepinfer_configure(options: Mapping[str, Any], context: EngineContext) -> None:
    """Validate ``enable_eplb`` / ``eplb_config`` and keep the engine's ``EplbConfig`` in its plugin state."""
    config = resolve(options)
    args = context.args
    if config is not None and args is not None and not args.enable_expert_parallel:
        raise EplbConfigError(f"{ENABLE}=True balances routed experts over expert-parallel ranks; pass "
                              "enable_expert_parallel=True with data_parallel_size > 1 (or launch with torchrun)")
    context.plugin_state[NAME] = config


@hookimpl
def deepinfer_engine_start(engine) -> None:
    """Start balancing on this rank (moving to the initial placement when there are redundant experts)."""
    config = engine_config(engine.context) if engine.context is not None else None
    if config is not None:
        engine.context.plugin_state[RUNTIME] = EplbRuntime(config, engine.model, engine.metrics)


@hookimpl
def deepinfer_step_boundary(engine) -> None:
    """Record the step's router load (all ranks summed); rebalance and move experts when due."""
    runtime = engine_runtime(engine.context)
    if runtime is not None:
        runtime.step_boundary()

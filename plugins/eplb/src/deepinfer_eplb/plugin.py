"""The ``deepinfer.plugins`` entry point ``eplb``: the ``enable_eplb`` and ``eplb_config`` feature options.

``deepinfer_feature_options`` claims the two options, so ``LLM(..., enable_eplb=True, eplb_config={...})`` and
``--option enable_eplb=true`` are accepted; ``deepinfer_configure`` validates them (``config.resolve``) and keeps the
engine's ``EplbConfig`` (or None when off) in ``context.plugin_state["eplb"]``, where ``engine_config`` reads it.

Not wired yet: counting the router's load and moving expert weights need the distributed engine (README, "Engine
integration"). Until then an engine with EPLB on runs exactly as without it, and says so in its log.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from deepinfer_core.engine_context import EngineContext
from deepinfer_core.hookspecs import hookimpl
from deepinfer_eplb.config import CONFIG, ENABLE, EplbConfig, resolve

DEEPINFER_HOOK_API_VERSION = 1

NAME = "eplb"  # the entry-point name, and this plugin's key in EngineContext.plugin_state

log = logging.getLogger("deepinfer.eplb")


def engine_config(context: EngineContext) -> EplbConfig | None:
    """The ``EplbConfig`` ``deepinfer_configure`` decided for ``context``'s engine; None when EPLB is off."""
    return context.plugin_state.get(NAME)


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
    context.plugin_state[NAME] = config
    if config is not None:
        log.warning("EPLB options accepted (%s), but this engine does not balance experts yet: load counting and "
                    "weight moves wait for the distributed engine (deepinfer-eplb README)", config)

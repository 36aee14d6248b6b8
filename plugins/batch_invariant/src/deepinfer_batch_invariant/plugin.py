"""The ``deepinfer.plugins`` entry point ``batch_invariant``: bitwise batch-invariant inference.

Enabled per engine by the feature option ``batch_invariant`` (``LLM(..., batch_invariant=True)``) or, when
the option is not given, by ``DEEPINFER_BATCH_INVARIANT=1`` (read when the engine is configured, not at
import). An explicit option wins over the environment, so ``batch_invariant=False`` turns the mode off
even with the variable set.

How the state stays per engine: the core calls ``deepinfer_configure`` (historic) for every engine it
builds and builds that engine's op table right after it (``LLM.__init__``: ``configure_plugins`` then
``Backend.make_op_table``). The plugin records the decision of the latest configure call and applies it
in ``deepinfer_register_ops``; a table, once built, keeps its ops. A second ``LLM`` on the same plugin
manager runs configure again, so a batch-invariant engine never leaks the mode into the next one (or
the other way round). A plugin registered after some configure calls gets them replayed in order, so it
too ends in the latest engine's state.

Backends: ``deepinfer_supported_backends`` returns ``["cpu", "nvidia_sm100"]``, so the core refuses
``batch_invariant=True`` on any other backend before loading weights. When the mode comes
from the environment variable the core's check does not see it (it only looks at options the user
passed), so ``deepinfer_register_ops`` raises the same ``UnsupportedBackendError`` itself; that too
happens before any weight is loaded.

``DEEPINFER_ENABLE_MTP_VARLEN``: the reference engine's switch (0 for deterministic sampling with
speculative decoding). This engine has no speculative decoding yet, so the value changes nothing; it is
validated (0 or 1) and logged as having no effect.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from deepinfer_batch_invariant import envs
from deepinfer_core.engine_context import EngineContext
from deepinfer_core.errors import UnsupportedBackendError
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.options import parse_flag as read_flag

DEEPINFER_HOOK_API_VERSION = 1

OPTION = "batch_invariant"
ENV = "DEEPINFER_BATCH_INVARIANT"
ENV_MTP_VARLEN = "DEEPINFER_ENABLE_MTP_VARLEN"
SOURCE = "batch_invariant"
SUPPORTED_BACKENDS = ("cpu", "nvidia_sm100")

log = logging.getLogger("deepinfer.batch_invariant")

@dataclasses.dataclass(frozen=True)
class State:
    """What ``deepinfer_configure`` decided for one engine (kept in its context's ``plugin_state``)."""

    enabled: bool = False
    source: str | None = None  # "option", "env" or None (off by default)
    mtp_varlen: bool | None = None  # DEEPINFER_ENABLE_MTP_VARLEN as parsed; None when unset


_state = State()


def state(context: EngineContext | None = None) -> State:
    """The decision for ``context``'s engine; without a context (or for one never configured), the latest engine's
    configured in this process."""
    decided = context.plugin_state.get(SOURCE) if context is not None else None
    return decided if isinstance(decided, State) else _state


def reset() -> None:
    """Back to "off, never configured" (tests)."""
    global _state
    _state = State()


def parse_flag(value: Any, name: str) -> bool:
    """An option's ``True`` / ``False`` from a bool, 0 / 1, or a string such as "1", "true", "off"; ValueError
    otherwise."""
    flag = read_flag(value)
    if flag is not None:
        return flag
    raise ValueError(f"{name} must be a boolean (true/false, 1/0), got {value!r}")


def resolve(options: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> State:
    """The state for an engine configured with ``options`` under ``environ`` (default ``os.environ``)."""
    if OPTION in options:
        enabled, source = parse_flag(options[OPTION], f"option {OPTION}"), "option"
    else:
        enabled, source = envs.get(ENV, environ), "env"
    return State(enabled, source if enabled else None, envs.get(ENV_MTP_VARLEN, environ))


# ----------------------------------------------------------------------------- hooks
@hookimpl
def deepinfer_feature_options() -> dict[str, str]:
    return {OPTION: f"bitwise identical logits whatever the batch (also {ENV}=1); backends cpu and nvidia_sm100"}


@hookimpl
def deepinfer_supported_backends() -> list[str]:
    return list(SUPPORTED_BACKENDS)


@hookimpl
def deepinfer_configure(options: Mapping[str, Any], context: EngineContext) -> None:
    """Decide on/off for the engine being built (option first, then the environment), in its context."""
    global _state
    decided = resolve(options)
    context.plugin_state[SOURCE] = decided
    _state = decided  # for op tables built without their engine's context
    if decided.enabled:
        log.info("batch-invariant mode on (from %s)", "option batch_invariant" if decided.source == "option" else ENV)
    if decided.mtp_varlen is not None:
        log.info("%s=%d has no effect: this engine has no speculative decoding (MTP / DSpark) yet, and decoding "
                 "is already deterministic per request seed", ENV_MTP_VARLEN, decided.mtp_varlen)


@hookimpl
def deepinfer_register_ops(op_table: Any, backend_name: str, context: EngineContext) -> None:
    """In batch-invariant mode (as decided for ``context``'s engine), pin every op of the table to a
    batch-invariant implementation."""
    if not state(context).enabled:
        return
    if backend_name not in SUPPORTED_BACKENDS:
        raise UnsupportedBackendError(
            f"plugin {SOURCE!r} (enabled by {ENV}) does not support backend {backend_name!r}; it supports: "
            f"{', '.join(SUPPORTED_BACKENDS)}. Unset {ENV} or choose one of those backends")
    from deepinfer_batch_invariant.ops import install

    install(op_table, backend_name)

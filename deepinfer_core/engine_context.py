"""``EngineContext``: what a plugin knows about one engine, and where it keeps its state for that engine.

``LLM`` builds one per engine, before the op table and the model, and hands it to ``deepinfer_configure``,
``deepinfer_register_ops``, ``deepinfer_register_models`` and ``deepinfer_logits_processors``; the engine keeps it
as ``engine.context`` for the lifecycle hooks. Two engines in one process have two contexts, so a plugin that keeps
its per-engine decisions in ``context.plugin_state`` (not in module globals) never leaks them from one engine into
the other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from deepinfer_core.engine_args import EngineArgs
    from deepinfer_core.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, eq=False)
class EngineContext:
    """One engine's configuration as plugins see it (read-only), plus a per-engine place for plugin state.

    Attributes:
        backend_name: the selected backend's entry-point name (``"cpu"``, ``"nvidia_sm100"``, ...).
        options: the feature options the user set (``LLM(my_option=...)``, ``--option my_option=...``), read-only.
        backend_reason: why that backend was selected (explicit request, the only accelerator, CPU fallback).
        device: the torch device the model runs on.
        dtype: the model's torch dtype.
        model_dir: the checkpoint folder, or None outside an engine (tests).
        model_config: the checkpoint's ``config.json``, read-only (empty outside an engine).
        tokenizer: the engine's ``deepinfer_core.tokenizer.Tokenizer`` (``encode``, ``decode``,
            ``eos_token_ids``), or None outside an engine.
        args: the ``EngineArgs`` the engine was built from, or None outside an engine.
        plugin_state: a dict for plugins, empty when the engine is created; a plugin keeps what it decided for
            this engine under its own key (its entry-point name), e.g. in ``deepinfer_configure``, and reads it
            back in its other hooks.
    """

    backend_name: str
    options: Mapping[str, object] = dataclasses.field(default_factory=dict)
    backend_reason: str = ""
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    model_dir: Path | None = None
    model_config: Mapping[str, object] = dataclasses.field(default_factory=dict)
    tokenizer: Tokenizer | None = None
    args: EngineArgs | None = None
    plugin_state: dict[str, object] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))
        object.__setattr__(self, "model_config", MappingProxyType(dict(self.model_config)))


__all__ = ["EngineContext"]

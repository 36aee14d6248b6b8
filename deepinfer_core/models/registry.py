"""Model registry: config.json ``model_type`` -> the function that builds that model from a folder."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path

from deepinfer_core.errors import DeepInferError
from deepinfer_core.models.interface import CausalLM, missing_members

ModelLoader = Callable[..., CausalLM]  # (folder, ops, dtype=, device=[, load_format=]) -> model


class UnknownModelTypeError(DeepInferError, ValueError):
    """A checkpoint whose model_type no registered loader handles."""


class ConfigFileError(DeepInferError, ValueError):
    """A checkpoint's config.json that is not a readable JSON object."""


class InvalidModelError(DeepInferError, TypeError):
    """A registered loader returned an object that lacks part of the model interface (``models/interface.py``)."""


class ModelRegistry:
    """Loaders by ``model_type``; the core registers DeepSeek-V4, plugins add more via a hook."""

    def __init__(self) -> None:
        self._loaders: dict[str, ModelLoader] = {}

    def register(self, model_type: str, loader: ModelLoader) -> None:
        """Register ``loader(folder, ops, dtype=..., device=...) -> model`` for ``model_type``; the model must satisfy
        ``models.interface.CausalLM`` (and ``StaticStepModel`` for its steps to run from device graphs). A loader
        that takes a ``load_format`` keyword is given the engine's when it is not ``"auto"`` (``"dummy"``: random
        weights, nothing read but config.json)."""
        self._loaders[model_type] = loader

    def model_types(self) -> list[str]:
        return sorted(self._loaders)

    def load(self, folder: Path, ops, dtype, device, load_format: str = "auto"):
        """Build the model in ``folder`` with the loader of its config.json ``model_type`` (``load_format``: see
        ``register``)."""
        model_type = read_model_type(folder)
        loader = self._loaders.get(model_type)
        if loader is None:
            raise UnknownModelTypeError(
                f"unknown model_type {model_type!r} in {folder / 'config.json'}; supported: {self.model_types()}. "
                "Use a DeepSeek-V4 checkpoint, or install a plugin that registers this model type."
            )
        extra = {}
        if load_format != "auto":
            if not _takes_keyword(loader, "load_format"):
                raise UnknownModelTypeError(
                    f"the loader registered for model_type {model_type!r} reads checkpoints only; it takes no "
                    f"load_format, so load_format={load_format!r} cannot apply: use load_format='auto'")
            extra["load_format"] = load_format
        model = loader(folder, ops, dtype=dtype, device=device, **extra)
        missing = missing_members(model, CausalLM)
        if missing:
            raise InvalidModelError(
                f"the loader registered for model_type {model_type!r} returned a {type(model).__name__} that lacks "
                f"{missing} of the model interface (deepinfer_core.models.interface.CausalLM); add them to the model")
        return model


def read_model_type(folder: Path) -> str | None:
    """The ``model_type`` of ``folder``'s config.json (None when it has none)."""
    return read_model_config(folder).get("model_type")


def read_model_config(folder: Path) -> dict:
    """``folder``'s config.json as a dict; ``UnknownModelTypeError`` without one, ``ConfigFileError`` naming the file
    when it is not a JSON object."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise UnknownModelTypeError(f"{folder} has no config.json; point at a checkpoint folder") from None
    except ValueError as exc:  # invalid JSON, or bytes that are not UTF-8
        raise ConfigFileError(f"{path} is not valid JSON ({exc}); fix or re-download it") from None
    if not isinstance(config, dict):
        raise ConfigFileError(f"{path} holds a {type(config).__name__}, not a JSON object; fix or re-download it")
    return config


def _takes_keyword(fn: Callable[..., object], name: str) -> bool:
    """Whether ``fn`` accepts the keyword argument ``name`` (by name or through ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    return any(p.name == name or p.kind == inspect.Parameter.VAR_KEYWORD for p in params)


def default_registry(plugin_manager=None, context=None) -> ModelRegistry:
    """The core's models plus whatever plugins register through ``deepinfer_register_models`` (given ``context``, the
    engine's ``EngineContext``, or None)."""
    from deepinfer_core.models.deepseek_v4.loader import load_deepseek_v4

    registry = ModelRegistry()
    registry.register("deepseek_v4", load_deepseek_v4)
    if plugin_manager is not None:
        from deepinfer_core.plugins import call_hook

        call_hook(plugin_manager, "deepinfer_register_models", registry=registry, context=context)
    return registry

"""The plugin's errors; both derive from the core's ``DeepInferError`` and from ``ValueError``."""

from __future__ import annotations

from deepinfer_core.errors import DeepInferError


class EplbError(DeepInferError, ValueError):
    """An EPLB function was given loads, a placement or a topology it cannot work with; the message says which."""


class EplbConfigError(EplbError):
    """The ``enable_eplb`` / ``eplb_config`` options hold a value the plugin does not accept."""

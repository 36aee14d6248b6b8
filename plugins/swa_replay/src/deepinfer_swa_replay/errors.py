"""The plugin's errors; they derive from the core's ``DeepInferError`` and from ``ValueError``."""

from __future__ import annotations

from deepinfer_core.errors import DeepInferError


class SwaReplayError(DeepInferError, ValueError):
    """Bounded replay was given something it cannot work with; the message says what."""


class SwaReplayOptionError(SwaReplayError):
    """The ``enable_swa_replay`` option holds a value that is not a boolean."""

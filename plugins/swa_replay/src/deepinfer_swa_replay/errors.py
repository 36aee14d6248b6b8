"""The plugin's errors; they derive from the core's ``DeepInferError`` and from ``ValueError``."""

from __future__ import annotations

from deepinfer_core.errors import DeepInferError


class SwaReplayError(DeepInferError, ValueError):
    """Bounded replay was given something it cannot work with; the message says what."""


class SwaReplayOptionError(SwaReplayError):
    """The ``enable_swa_replay`` option holds a value that is not a boolean."""


class SwaHostCacheError(SwaReplayError):
    """The SWA host cache cannot run with this engine (its model state cannot be copied per slot)."""


class SwaHostCacheOptionError(SwaHostCacheError):
    """An ``enable_swa_host_cache`` / ``swa_host_cache_bytes`` / ``swa_host_cache_ttl_s`` option holds a bad value,
    or a size is given with the cache off."""

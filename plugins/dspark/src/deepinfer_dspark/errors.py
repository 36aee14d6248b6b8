"""The plugin's errors; they derive from the core's ``DeepInferError`` and from ``ValueError``."""

from __future__ import annotations

from deepinfer_core.errors import DeepInferError


class DSparkError(DeepInferError, ValueError):
    """The ``mtp`` / ``dspark`` proposer cannot run: a checkpoint without MTP draft layers, a model that is not
    DeepSeek-V4, or a bad ``speculative_config`` value (``num_verify_tokens``, ``verify_fraction``); the message says
    which and what to do."""

"""``SpeculativeConfig``: vLLM's ``speculative_config`` dict, checked against the registered proposers.

``LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})``; without
one, ``DEEPINFER_USE_NEXTN_DECODE=k`` (the reference engine's variable) means ``{"method": "dspark",
"num_speculative_tokens": k}``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from deepinfer_core.errors import DeepInferError

COMMON_KEYS = ("method", "num_speculative_tokens")
"""Keys every method takes; a proposer declares the rest (``ProposerRegistry.register(..., keys=...)``)."""

NEXTN_METHOD = "dspark"
"""The method ``DEEPINFER_USE_NEXTN_DECODE`` selects, as in the reference engine."""


class SpeculativeConfigError(DeepInferError, ValueError):
    """A ``speculative_config`` (or ``DEEPINFER_USE_NEXTN_DECODE``) the engine cannot run: an unknown method or key,
    a bad ``num_speculative_tokens``, more draft tokens than the model can roll back; the message says which."""


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """One engine's speculative decoding: the proposer ``method``, at most ``num_speculative_tokens`` draft tokens
    per sequence per step, and the method's own keys (``options``, read-only, e.g. ``prompt_lookup_max``)."""

    method: str
    num_speculative_tokens: int
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], methods: Mapping[str, tuple[str, ...]]) -> SpeculativeConfig:
        """Parse vLLM's dict; ``methods``: each registered method's extra keys. Refuses an unknown method or key,
        and a ``num_speculative_tokens`` that is not an integer >= 1."""
        if not isinstance(config, Mapping):
            raise SpeculativeConfigError(f"speculative_config must be a dict like {{'method': 'ngram', "
                                         f"'num_speculative_tokens': 3}}, got {type(config).__name__}")
        method = config.get("method")
        if method not in methods:
            raise SpeculativeConfigError(f"speculative_config method {method!r} is not registered; registered "
                                         f"methods: {sorted(methods)} (a plugin such as deepinfer-dspark adds more)")
        unknown = sorted(set(config) - set(COMMON_KEYS) - set(methods[method]))
        if unknown:
            raise SpeculativeConfigError(f"speculative_config keys {unknown} are not understood by method {method!r}; "
                                         f"it takes {sorted(COMMON_KEYS + tuple(methods[method]))}")
        k = config.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise SpeculativeConfigError(f"speculative_config num_speculative_tokens must be an integer >= 1, "
                                         f"got {k!r}")
        options = {key: value for key, value in config.items() if key not in COMMON_KEYS}
        return cls(method, k, options)


def resolve_speculative_config(config: Mapping[str, Any] | None, nextn: int | None,
                               methods: Mapping[str, tuple[str, ...]]) -> SpeculativeConfig | None:
    """The engine's ``SpeculativeConfig``: ``config`` when given, else ``DEEPINFER_USE_NEXTN_DECODE`` (``nextn``) as
    ``{"method": "dspark", "num_speculative_tokens": nextn}``, else None (no speculation)."""
    if config is not None:
        return SpeculativeConfig.from_dict(config, methods)
    if nextn is None or nextn == 0:
        return None
    if NEXTN_METHOD not in methods:
        raise SpeculativeConfigError(f"DEEPINFER_USE_NEXTN_DECODE={nextn} asks for {NEXTN_METHOD!r} speculative "
                                     f"decoding, but no proposer {NEXTN_METHOD!r} is registered (registered: "
                                     f"{sorted(methods)}); install deepinfer-dspark or unset the variable")
    return SpeculativeConfig.from_dict({"method": NEXTN_METHOD, "num_speculative_tokens": nextn}, methods)


def parse_json_config(text: str) -> dict[str, Any]:
    """``--speculative-config JSON`` (the command line's form, vLLM's flag) as a dict; refused clearly when it is not
    a JSON object."""
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise SpeculativeConfigError(f"--speculative-config {text!r} is not valid JSON ({exc}); pass an object like "
                                     """'{"method": "ngram", "num_speculative_tokens": 3}'""") from None
    if not isinstance(config, dict):
        raise SpeculativeConfigError(f"--speculative-config {text!r} is a JSON {type(config).__name__}; pass an "
                                     """object like '{"method": "ngram", "num_speculative_tokens": 3}'""")
    return config

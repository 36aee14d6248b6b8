"""``EplbConfig``: the ``enable_eplb`` and ``eplb_config`` feature options, validated.

``LLM(..., enable_eplb=True, eplb_config={"num_redundant_experts": 8, "window_size": 1000, "step_interval": 3000})``
(vLLM's names and defaults), or on the command line ``--option enable_eplb=true --option
eplb_config='{"num_redundant_experts": 8}'`` (a JSON object). Keys left out take their defaults.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from deepinfer_core.options import parse_flag as read_flag
from deepinfer_eplb.errors import EplbConfigError

ENABLE = "enable_eplb"
CONFIG = "eplb_config"



@dataclasses.dataclass(frozen=True)
class EplbConfig:
    """How the engine balances expert load.

    - ``num_redundant_experts``: extra physical expert slots per MoE layer in all (not per rank); the logical
      experts plus these must split evenly over the expert-parallel ranks;
    - ``window_size``: engine steps whose router load the next placement is planned from;
    - ``step_interval``: engine steps between two rebalances.
    """

    num_redundant_experts: int = 0
    window_size: int = 1000
    step_interval: int = 3000

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            least = 0 if field.name == "num_redundant_experts" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise EplbConfigError(f"{CONFIG}[{field.name!r}] must be an int >= {least}, got {value!r}")

    def num_physical(self, num_logical: int, num_ranks: int) -> int:
        """Physical expert slots per layer for ``num_logical`` experts over ``num_ranks`` ranks; EplbConfigError
        naming the numbers when they do not split evenly."""
        total = num_logical + self.num_redundant_experts
        if num_ranks < 1 or total % num_ranks:
            raise EplbConfigError(
                f"{num_logical} experts + {self.num_redundant_experts} redundant ({CONFIG}['num_redundant_experts']) "
                f"= {total} slots do not split evenly over {num_ranks} expert-parallel ranks; choose "
                f"num_redundant_experts so the sum is a multiple of {num_ranks}")
        return total


KEYS = tuple(field.name for field in dataclasses.fields(EplbConfig))


def resolve(options: Mapping[str, Any]) -> EplbConfig | None:
    """The engine's ``EplbConfig`` from its feature options, or None when EPLB is off."""
    enabled = _flag(options.get(ENABLE, False))
    raw = options.get(CONFIG)
    if not enabled:
        if raw is not None:
            raise EplbConfigError(f"{CONFIG} is set but {ENABLE} is not; pass {ENABLE}=True to balance experts")
        return None
    return parse_config(raw)


def parse_config(raw: Any) -> EplbConfig:
    """An ``EplbConfig`` from a mapping, a JSON object string, or None (every default)."""
    if raw is None:
        return EplbConfig()
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise EplbConfigError(f"{CONFIG} must be a JSON object such as "
                                  f'\'{{"num_redundant_experts": 8}}\', got {raw!r} ({exc})') from None
    if not isinstance(raw, Mapping):
        raise EplbConfigError(f"{CONFIG} must be a mapping with keys {', '.join(KEYS)}, got {type(raw).__name__}")
    unknown = sorted(str(key) for key in raw if key not in KEYS)
    if unknown:
        raise EplbConfigError(f"{CONFIG} has unknown key(s) {', '.join(map(repr, unknown))}; "
                              f"the keys are {', '.join(KEYS)}")
    return EplbConfig(**raw)


def _flag(value: Any) -> bool:
    flag = read_flag(value)
    if flag is not None:
        return flag
    raise EplbConfigError(f"{ENABLE} must be a boolean (true/false, 1/0), got {value!r}")

"""Values of feature options and switches: the one reading of a boolean the core and plugins share."""

from __future__ import annotations

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def parse_flag(value: object) -> bool | None:
    """``value`` as a bool: a bool, the integers 0 / 1, or one of ``TRUE_WORDS`` / ``FALSE_WORDS`` in any case and
    with surrounding spaces; None when it is none of these (the caller raises its own error, naming the option)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in TRUE_WORDS | FALSE_WORDS:
        return value.strip().lower() in TRUE_WORDS
    return None

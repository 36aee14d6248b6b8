"""Structured output: constrain a request's completion to a JSON schema, a regex, a grammar or a choice (vLLM's
``StructuredOutputsParams``).

The core only carries and checks the constraint; a logits processor applies it (the ``deepinfer-structured-output``
plugin, ``pip install 'deepinfer[structured-output]'``). An engine without a processor that applies to a request
with ``structured_outputs`` refuses it (``RequestRejectedError``) rather than ignoring the constraint.
"""

from __future__ import annotations

import dataclasses
import json as _json
from collections.abc import Mapping, Sequence
from typing import Any

from deepinfer_core.errors import DeepInferError

PLUGIN_HINT = ("structured_outputs needs the deepinfer-structured-output plugin: "
               "pip install 'deepinfer[structured-output]' (or pip install -e plugins/structured_output)")


class StructuredOutputsError(DeepInferError, ValueError):
    """A ``StructuredOutputsParams`` that does not name exactly one well-formed constraint."""


@dataclasses.dataclass
class StructuredOutputsParams:
    """Exactly one constraint on a request's output (vLLM's names).

    Args:
        json: a JSON schema, as a dict or as a JSON string (the output is a JSON value that satisfies it).
        regex: a regular expression the whole output matches.
        choice: a non-empty list of strings; the output is one of them.
        grammar: a context-free grammar (Lark, or GBNF as llama.cpp writes it).
        json_object: True for any JSON object (``response_format={"type": "json_object"}``).
        disable_any_whitespace: JSON without whitespace between tokens (``{"a":1}``); by default any JSON
            whitespace is allowed there, which a weak model may repeat until ``max_tokens``.

    Which grammar features are supported is the plugin's library's (llguidance's) choice; a schema, regex or
    grammar it cannot compile refuses the request when the engine takes it.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise StructuredOutputsError(f"structured_outputs.json_object must be a bool or None, got "
                                         f"{self.json_object!r}")
        if self.json_object:
            given.append("json_object")
        if not isinstance(self.disable_any_whitespace, bool):
            raise StructuredOutputsError(f"structured_outputs.disable_any_whitespace must be a bool, got "
                                         f"{self.disable_any_whitespace!r}")
        if len(given) != 1:
            raise StructuredOutputsError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object; "
                f"got {', '.join(given) if given else 'none'}")
        if self.json is not None:
            self._check_json()
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise StructuredOutputsError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, Sequence):
                raise StructuredOutputsError(f"structured_outputs.choice must be a list of strings, got "
                                             f"{self.choice!r}")
            self.choice = list(self.choice)
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise StructuredOutputsError("structured_outputs.choice must be a non-empty list of non-empty "
                                             f"strings, got {self.choice!r}")

    def _check_json(self) -> None:
        if isinstance(self.json, str):
            try:
                schema = _json.loads(self.json)
            except ValueError as exc:
                raise StructuredOutputsError(f"structured_outputs.json is not valid JSON: {exc}") from None
        elif isinstance(self.json, Mapping):
            schema = self.json = dict(self.json)
        else:
            raise StructuredOutputsError(f"structured_outputs.json must be a JSON schema (a dict or a JSON string), "
                                         f"got {type(self.json).__name__}")
        if not isinstance(schema, (dict, bool)):
            raise StructuredOutputsError(f"structured_outputs.json must be a JSON schema object, got {schema!r}")

    @property
    def kind(self) -> str:
        """The constraint set: ``"json"``, ``"regex"``, ``"choice"``, ``"grammar"`` or ``"json_object"``."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def schema(self) -> dict[str, Any] | bool | None:
        """The JSON schema as a Python value (``{"type": "object"}`` for ``json_object``), or None."""
        if self.json_object:
            return {"type": "object"}
        if self.json is None:
            return None
        return _json.loads(self.json) if isinstance(self.json, str) else self.json

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutputsParams | None:
        """``value`` as ``StructuredOutputsParams``: None, an instance, or a mapping of its fields (JSON requests)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise StructuredOutputsError(f"structured_outputs has unknown fields {unknown}; it takes json, "
                                             "regex, choice, grammar, json_object, disable_any_whitespace")
            return cls(**value)
        raise StructuredOutputsError(f"structured_outputs must be a StructuredOutputsParams, a dict of its fields or "
                                     f"None, got {value!r} ({type(value).__name__})")


__all__ = ["PLUGIN_HINT", "StructuredOutputsError", "StructuredOutputsParams"]

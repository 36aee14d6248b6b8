"""``--option NAME=VALUE``: plugin feature options on the command line (``deepinfer generate``, ``deepinfer bench``).

The value is parsed as JSON when it parses (``true``, ``3``, ``0.5``, ``[1, 2]``, ``{"a": 1}``, ``null``) and kept as a
string otherwise (``--option mode=fast``). The options reach ``LLM(...)`` as keywords, where an option no loaded
plugin claims is refused by name (``UnknownOptionError``); an engine argument (``--option seed=3``) is refused here,
since it has its own flag or ``LLM`` keyword.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from deepinfer_core.errors import DeepInferError

FLAG = "--option"


class CommandLineOptionError(DeepInferError, ValueError):
    """A ``--option`` that is not ``NAME=VALUE``, names an engine argument, or is given twice."""


def add_option_argument(parser: argparse.ArgumentParser) -> None:
    """Add the repeatable ``--option NAME=VALUE`` flag (collected raw in ``args.option``)."""
    parser.add_argument(FLAG, action="append", default=[], metavar="NAME=VALUE", dest="option",
                        help="a feature option for the plugins (repeat for several); VALUE is JSON when it parses, "
                             "else a string, e.g. --option batch_invariant=true")


def parse_options(items: Sequence[str]) -> dict[str, Any]:
    """``["a=1", "b=x"]`` -> ``{"a": 1, "b": "x"}``; raise ``CommandLineOptionError`` naming the bad item."""
    from deepinfer_core.engine_args import EngineArgs

    engine_arguments = {f.name for f in dataclasses.fields(EngineArgs)}
    options: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier():
            raise CommandLineOptionError(f"{FLAG} {item!r} is not NAME=VALUE with NAME a Python identifier; "
                                         f"write e.g. {FLAG} batch_invariant=true")
        if name in engine_arguments:
            raise CommandLineOptionError(f"{FLAG} {item!r}: {name!r} is an engine argument, not a plugin option; use "
                                         f"its own flag (--{name.replace('_', '-')}) where the command has one")
        if name in options:
            raise CommandLineOptionError(f"{FLAG} {name} is given twice; give each option once")
        options[name] = parse_value(raw)
    return options


def parse_value(raw: str) -> Any:
    """``raw`` as JSON when it parses, else the string itself."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw

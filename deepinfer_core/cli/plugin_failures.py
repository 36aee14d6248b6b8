"""Plugins that failed to load, reported by the commands that build an engine (``generate``, ``bench``)."""

from __future__ import annotations

import sys


def report_plugin_failures(command: str, verbose: int) -> None:
    """One line on stderr per plugin that failed to load (its traceback too with ``-v``)."""
    import logging

    from deepinfer_core.plugins import get_plugin_manager

    quiet = logging.getLogger("deepinfer.plugins")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the lines below say it once
    try:
        pm = get_plugin_manager()
    finally:
        quiet.setLevel(level)
    hint = "" if verbose else " (-v shows the traceback)"
    for record in pm.failures():
        print(f"{command}: warning: plugin {record.name!r} ({record.distribution or 'unknown distribution'}) failed "
              f"to load and is left out: {record.error}{hint}", file=sys.stderr)
        if verbose and record.traceback:
            print(record.traceback.rstrip(), file=sys.stderr)

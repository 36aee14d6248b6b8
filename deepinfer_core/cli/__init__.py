"""The ``deepinfer`` command line (console script ``deepinfer``, or ``python -m deepinfer_core.cli``).

Modules: ``main`` (the parser, ``deepinfer env`` and ``deepinfer plugins``, the subcommand registry
``SUBCOMMAND_MODULES``), ``generate`` (``deepinfer generate``) and ``bench`` (``deepinfer bench``).

The package exports the entry point ``main``, which hides the module of the same name as an attribute:
reach the module with ``from deepinfer_core.cli.main import ...`` or ``importlib.import_module``.
"""

from __future__ import annotations

from deepinfer_core.cli.main import main

__all__ = ["main"]

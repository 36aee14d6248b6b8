"""Every exception class of the core and of the installed backend / plugin distributions derives from
``DeepInferError``, and ``deepinfer_core.errors`` names each of the core's that lives in another module."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from importlib import metadata
from types import ModuleType

import pytest

from deepinfer_core import errors
from deepinfer_core.errors import DeepInferError

ROOT = "deepinfer_core"
GROUPS = ("deepinfer.backends", "deepinfer.plugins")


def package_roots() -> list[str]:
    """The core, then the top-level package of every installed backend and plugin entry point."""
    roots = {ep.value.split(":")[0].split(".")[0] for group in GROUPS for ep in metadata.entry_points(group=group)}
    return [ROOT, *sorted(roots - {ROOT})]


def walk(root: str) -> list[ModuleType]:
    """Every module of package ``root``. A module whose import needs a third-party package missing here (a vendor
    runtime) is left out; any other import failure fails the test."""
    package = importlib.import_module(root)
    modules = [package]
    for info in pkgutil.walk_packages(package.__path__, f"{root}."):
        try:
            modules.append(importlib.import_module(info.name))
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] in package_roots():
                raise
    return modules


def defined_exceptions(module: ModuleType) -> list[type[BaseException]]:
    """The exception classes ``module`` defines at its top level (warnings are not errors)."""
    return [
        obj
        for obj in vars(module).values()
        if inspect.isclass(obj)
        and issubclass(obj, Exception)
        and not issubclass(obj, Warning)
        and obj.__module__ == module.__name__
    ]


@pytest.mark.parametrize("root", package_roots())
def test_every_exception_derives_from_deepinfer_error(root):
    found = [cls for module in walk(root) for cls in defined_exceptions(module)]
    if root == ROOT:
        assert DeepInferError in found and len(found) > 10, found  # the walk saw the core's modules
    stray = [f"{cls.__module__}.{cls.__qualname__}" for cls in found if not issubclass(cls, DeepInferError)]
    assert not stray, f"derive these from deepinfer_core.errors.DeepInferError (and their built-in base): {stray}"


def test_errors_docstring_names_every_core_exception_outside_it():
    found = [cls for module in walk(ROOT) for cls in defined_exceptions(module) if cls.__module__ != errors.__name__]
    missing = [
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in found
        if f"``{cls.__module__}.{cls.__qualname__}``" not in errors.__doc__
    ]
    assert not missing, f"list these in deepinfer_core/errors.py's docstring: {missing}"

"""The hook contract is documented where it is defined, and docs/plugins.md is generated from it."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer_core import hookspecs

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"
SPECS = hookspecs.hook_specs()


def test_docs_embed_the_current_hook_reference():
    document = DOC.read_text(encoding="utf-8")
    assert hookspecs.replace_reference(document) == document, (
        "docs/plugins.md is out of date with deepinfer_core/hookspecs.py; "
        "run `python -m deepinfer_core.hookspecs --write docs/plugins.md`"
    )


def test_every_hook_appears_in_the_docs():
    document = DOC.read_text(encoding="utf-8")
    for spec in SPECS:
        assert f"### `{spec.__name__}(" in document


def test_markdown_command_prints_the_reference():
    out = subprocess.run(
        [sys.executable, "-m", "deepinfer_core.hookspecs", "--markdown"], capture_output=True, text=True, check=True
    ).stdout
    assert out == hookspecs.render_markdown()


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.__name__)
def test_every_spec_says_when_it_runs_its_arguments_and_its_return(spec):
    doc = inspect.getdoc(spec) or ""
    for section in ("Runs:", "Arguments:", "Return:"):
        assert f"\n{section}" in doc, f"{spec.__name__} docstring lacks a {section!r} section"
    for name in inspect.signature(spec).parameters:
        assert f"``{name}``" in doc, f"{spec.__name__} docstring does not describe argument {name!r}"


def test_contract_shape():
    names = [spec.__name__ for spec in SPECS]
    assert all(name.startswith("deepinfer_") for name in names)
    assert hookspecs.HOOK_API_VERSION == 1
    opts = {spec.__name__: spec.deepinfer_spec for spec in SPECS}
    assert opts["deepinfer_configure"]["historic"]
    assert opts["deepinfer_rebuild_sliding_window"]["firstresult"]
    for required in (
        "deepinfer_feature_options",
        "deepinfer_supported_backends",
        "deepinfer_register_ops",
        "deepinfer_register_models",
        "deepinfer_before_step",
        "deepinfer_after_step",
        "deepinfer_engine_start",
        "deepinfer_engine_shutdown",
    ):
        assert required in names


def test_replace_reference_needs_the_markers():
    with pytest.raises(ValueError, match="markers"):
        hookspecs.replace_reference("# no markers here\n")

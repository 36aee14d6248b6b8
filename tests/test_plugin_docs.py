"""docs/plugins.md stays true: its op catalogue is the op table's, and "everything a plugin may rely on" is exactly
what the plugin template (its plugins and their tests) imports from the core."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from deepinfer_core.ops.catalogue import render_catalogue, replace_catalogue
from deepinfer_core.ops.table import reference_ops

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "plugins.md"
TEMPLATE = ROOT / "examples" / "plugin-template"


def test_docs_embed_the_current_op_catalogue():
    document = DOC.read_text(encoding="utf-8")
    assert replace_catalogue(document) == document, (
        "docs/plugins.md's op catalogue is out of date with the op table; "
        "run `python -m deepinfer_core.hookspecs --write docs/plugins.md`")


def test_the_catalogue_lists_every_op_once():
    rows = re.findall(r"^\| `(\w+)` \|", render_catalogue(), flags=re.MULTILINE)
    assert rows == sorted(reference_ops())


def _core_imports(folder: Path) -> set[tuple[str, str]]:
    found = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "deepinfer_core":
                found |= {(node.module, alias.name) for alias in node.names}
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("deepinfer_core") for a in node.names), f"{path}: import names"
    return found


def _documented_api() -> set[tuple[str, str]]:
    document = DOC.read_text(encoding="utf-8")
    block = document.split("<!-- BEGIN PLUGIN API -->")[1].split("<!-- END PLUGIN API -->")[0]
    documented = set()
    for module, names in re.findall(r"^- `([\w.]+)`: (.+)$", block, flags=re.MULTILINE):
        documented |= {(module, name) for name in re.findall(r"`(\w+)`", names)}
    return documented


def test_everything_a_plugin_may_rely_on_is_what_the_template_imports():
    imported = _core_imports(TEMPLATE / "src") | _core_imports(TEMPLATE / "tests")
    documented = _documented_api()
    assert documented == imported, (
        f"docs/plugins.md lists {sorted(documented - imported)} that the template does not import, and misses "
        f"{sorted(imported - documented)} that it does")

"""``deepinfer_core.envs``: the typed parser and its errors, reads at call time, each variable declared once, no
``DEEPINFER_*`` read outside the declarations, no undeclared name in code, docs or scripts, and the table of
docs/configuration.md as the declarations generate it."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import tomllib
from functools import cache
from pathlib import Path

import pytest

from deepinfer_core import envs
from deepinfer_core.envs import Variable, Variables
from deepinfer_core.errors import DeepInferError, EnvironmentVariableError

REPO = Path(__file__).resolve().parents[1]
SKIPPED_DIRS = {".git", ".venv", "venv", ".tox", "build", "dist", "__pycache__", ".ruff_cache", ".pytest_cache",
                ".hypothesis", "node_modules"}
TEXT_SUFFIXES = frozenset({".py", ".sh", ".md", ".toml", ".ini", ".cfg", ".txt", ".yml", ".yaml"})
NAME = re.compile(r"DEEPINFER_[A-Z0-9_]*\*?")  # names; a pattern (`DEEPINFER_NVIDIA_*`) is left out below
ENVIRON = re.compile(r"\benviron\b")  # os.environ, an ``environ`` argument; not "environment"
NOT_VARIABLES = {"DEEPINFER_HOOK_API_VERSION"}  # a plugin module's attribute (docs/plugins.md), not a variable
EXAMPLE_PREFIX = "DEEPINFER_MYFEATURE_"  # docs/plugins.md's example package

PENDING_READS: set[str] = set()
"""Files under a concurrent rewrite that still read a variable directly; switch each to ``envs``, then drop it."""


# ----------------------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("raw, value", [("1", True), ("TRUE", True), (" yes ", True), ("On", True), ("0", False),
                                        ("false", False), ("NO", False), ("off", False)])
def test_booleans_accept_the_usual_spellings_in_any_case(raw, value):
    assert Variable("DEEPINFER_T", bool, None, "t").read({"DEEPINFER_T": raw}) is value


@pytest.mark.parametrize("kind, default", [(bool, True), (int, 7), (str, "x"), (Path, None)])
@pytest.mark.parametrize("environ", [{}, {"DEEPINFER_T": ""}, {"DEEPINFER_T": "  "}])
def test_unset_or_blank_means_the_default(kind, default, environ):
    assert Variable("DEEPINFER_T", kind, default, "t").read(environ) == default


def test_ints_strings_and_paths():
    assert Variable("DEEPINFER_T", int, None, "t").read({"DEEPINFER_T": " -3 "}) == -3
    assert Variable("DEEPINFER_T", str, None, "t").read({"DEEPINFER_T": " a,b "}) == "a,b"
    assert Variable("DEEPINFER_T", Path, None, "t").read({"DEEPINFER_T": "~/x"}) == Path.home() / "x"


@pytest.mark.parametrize("kind, raw, accepted", [(bool, "2", "a boolean (1/0, true/false, yes/no, on/off)"),
                                                 (bool, "enabled", "a boolean"), (int, "1.5", "an integer"),
                                                 (int, "many", "an integer")])
def test_a_malformed_value_names_the_variable_the_value_and_what_is_accepted(kind, raw, accepted):
    with pytest.raises(EnvironmentVariableError) as caught:
        Variable("DEEPINFER_T", kind, None, "t").read({"DEEPINFER_T": raw})
    assert isinstance(caught.value, DeepInferError) and isinstance(caught.value, ValueError)
    assert str(caught.value).startswith(f"DEEPINFER_T must be {accepted}") and repr(raw) in str(caught.value)


@pytest.mark.parametrize("args, error", [(("PLAIN", str, None, "m"), ValueError),
                                         (("DEEPINFER_lower", str, None, "m"), ValueError),
                                         (("DEEPINFER_T", float, None, "m"), TypeError),
                                         (("DEEPINFER_T", str, None, "two\nlines"), ValueError),
                                         (("DEEPINFER_T", str, None, " "), ValueError)])
def test_a_declaration_is_checked(args, error):
    with pytest.raises(error):
        Variable(*args)


def test_defaults_as_users_write_them():
    assert [Variable("DEEPINFER_T", kind, default, "t").default_text
            for kind, default in [(bool, True), (bool, False), (int, 3), (Path, None)]] == ["1", "0", "3", "unset"]


# ----------------------------------------------------------------------------------------------- reads
def test_module_attributes_read_the_environment_at_access_time(monkeypatch):
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    assert envs.DEEPINFER_ACCELERATOR is None
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", " cpu ")
    assert envs.DEEPINFER_ACCELERATOR == "cpu" and envs.get("DEEPINFER_ACCELERATOR") == "cpu"
    monkeypatch.setenv("DEEPINFER_BENCH_CACHE", "~/bench")
    assert envs.DEEPINFER_BENCH_CACHE == Path.home() / "bench"


def test_a_given_mapping_replaces_the_environment(monkeypatch):
    monkeypatch.setenv("DEEPINFER_PLUGINS", "none")
    assert envs.get("DEEPINFER_PLUGINS", {}) is None
    assert envs.get("DEEPINFER_PLUGINS", {"DEEPINFER_PLUGINS": "a,b"}) == "a,b"


def test_undeclared_names_fail_loudly():
    with pytest.raises(AttributeError, match="DEEPINFER_NOPE"):
        _ = envs.DEEPINFER_NOPE
    with pytest.raises(KeyError, match="DEEPINFER_NOPE is not declared by deepinfer"):
        envs.get("DEEPINFER_NOPE")


def test_settings_and_undeclared_list_what_is_set():
    environ = {"DEEPINFER_PLUGINS": "none", "DEEPINFER_TYPO": "1", "HOME": "/root"}
    assert envs.settings(environ) == {"DEEPINFER_PLUGINS": "none", "DEEPINFER_TYPO": "1"}
    assert envs.undeclared([envs.VARIABLES], environ) == ["DEEPINFER_TYPO"]


# ----------------------------------------------------------------------------------------------- declared once
def test_a_name_is_declared_once_per_package_and_once_in_all():
    one = Variable("DEEPINFER_T", bool, False, "t")
    with pytest.raises(ValueError, match="DEEPINFER_T is declared twice by x"):
        Variables("x", one, one)
    with pytest.raises(ValueError, match="DEEPINFER_T is declared by both x and y"):
        envs.check_declared_once([Variables("x", one), Variables("y", one)])


def test_entry_points_add_the_packages_declarations(make_distribution):
    module = ("from deepinfer_core.envs import Variable, Variables\n"
              "VARIABLES = Variables('deepinfer-x', Variable('DEEPINFER_X_ON', bool, False, 'x on'))\n")
    make_distribution("deepinfer-x", entry_points={"deepinfer.envs": {"x": "x_envs:VARIABLES"}},
                      modules={"x_envs": module})
    groups = envs.declarations()
    assert groups[0] is envs.VARIABLES and "DEEPINFER_X_ON" in next(g for g in groups if g.owner == "deepinfer-x")
    assert "| `DEEPINFER_X_ON` | bool | 0 | deepinfer-x | x on |" in envs.markdown_table(groups)


def test_an_entry_point_that_is_not_variables_is_refused(make_distribution):
    make_distribution("deepinfer-y", entry_points={"deepinfer.envs": {"y": "y_envs:VARIABLES"}},
                      modules={"y_envs": "VARIABLES = {}\n"})
    with pytest.raises(TypeError, match="y_envs:VARIABLES"):
        envs.declarations()


# ----------------------------------------------------------------------------------------------- the repository
@cache
def _files(suffixes: frozenset[str]) -> tuple[Path, ...]:
    """The repository's files with these suffixes (virtual environments, caches and build output left out)."""
    found = []
    for folder, subfolders, names in os.walk(REPO):
        subfolders[:] = [name for name in subfolders if name not in SKIPPED_DIRS and not name.endswith(".egg-info")]
        found += [Path(folder, name) for name in names if Path(name).suffix in suffixes]
    return tuple(sorted(found))


@cache
def package_envs() -> dict[Path, Variables]:
    """Each package's ``envs.py`` of this repository (not the core's), loaded from its file: the packages need not
    be installed."""
    found = {}
    for index, path in enumerate(_files(frozenset({".py"}))):
        if path.name != "envs.py" or path == REPO / "deepinfer_core" / "envs.py" or "tests" in path.parts:
            continue
        spec = importlib.util.spec_from_file_location(f"_repository_envs_{index}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        found[path] = module.VARIABLES
    return found


def repository_declarations() -> list[Variables]:
    """The core's declarations, then each package's by owner, as ``envs.declarations()`` orders installed ones."""
    return [envs.VARIABLES, *sorted(package_envs().values(), key=lambda group: group.owner)]


def _declared_names() -> set[str]:
    return {variable.name for group in repository_declarations() for variable in group}


def test_the_repository_declares_each_variable_once():
    groups = repository_declarations()
    assert len(groups) >= 3, [group.owner for group in groups]  # the core, the NVIDIA backend, batch_invariant
    envs.check_declared_once(groups)


def test_each_package_lists_its_envs_under_the_entry_point_group():
    for path, group in package_envs().items():
        root = next(parent for parent in path.parents if (parent / "pyproject.toml").is_file())
        project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
        listed = project.get("entry-points", {}).get(envs.ENTRY_POINT_GROUP, {})
        assert f"{path.parent.name}.envs:VARIABLES" in listed.values(), f"list it in {root}/pyproject.toml"
        assert group.owner == project["name"], f"{path}: Variables({project['name']!r}, ...)"


def _constant_names() -> dict[str, str]:
    """Every ``NAME = "DEEPINFER_..."`` assignment of the repository's Python files, by identifier."""
    found = {}
    for path in _files(frozenset({".py"})):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, str) and mentioned(node.value.value) == {node.value.value}:
                found.update({target.id: node.value.value for target in node.targets if isinstance(target, ast.Name)})
    return found


def _variable_read(key: ast.expr, constants: dict[str, str]) -> str | None:
    """The ``DEEPINFER_*`` name ``key`` stands for (a literal, or a constant assigned one), else None."""
    if isinstance(key, ast.Constant) and isinstance(key.value, str) and mentioned(key.value) == {key.value}:
        return key.value
    identifier = key.id if isinstance(key, ast.Name) else key.attr if isinstance(key, ast.Attribute) else None
    return constants.get(identifier)


def _direct_reads(tree: ast.AST, constants: dict[str, str]) -> list[tuple[int, str]]:
    """``(line, name)`` of each ``environ.get(NAME)``, ``os.getenv(NAME)``, ``environ[NAME]`` and ``NAME in
    environ`` in ``tree``."""
    reads = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if node.func.attr == "getenv" or (node.func.attr == "get" and ENVIRON.search(ast.unparse(node.func.value))):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and ENVIRON.search(
                ast.unparse(node.value)):
            key = node.slice
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In) and ENVIRON.search(
                ast.unparse(node.comparators[0])):
            key = node.left
        name = None if key is None else _variable_read(key, constants)
        if name is not None:
            reads.append((node.lineno, name))
    return reads


def test_no_code_reads_a_variable_outside_the_declarations():
    constants, stray, stale = _constant_names(), [], []
    for path in _files(frozenset({".py"})):
        relative = path.relative_to(REPO).as_posix()
        if path.name == "envs.py":
            continue
        reads = _direct_reads(ast.parse(path.read_text(), relative), constants)
        if relative in PENDING_READS:
            stale += [] if reads else [relative]
            continue
        stray += [f"{relative}:{line} reads {name}" for line, name in reads]
    assert not stray, "read these through the envs.py that declares them (docs/configuration.md):\n" + "\n".join(stray)
    assert not stale, f"these read through envs now: remove them from PENDING_READS in tests/test_envs.py: {stale}"


def test_the_detector_finds_each_kind_of_read():
    source = ('ENV = "DEEPINFER_A"\nos.environ.get("DEEPINFER_B")\nos.getenv(ENV)\n(os.environ if e is None else e)'
              '.get(mod.ENV)\nos.environ["DEEPINFER_C"]\n"DEEPINFER_D" in os.environ\nos.environ["DEEPINFER_E"] = "1"\n'
              'monkeypatch.setenv("DEEPINFER_F", "1")\nreport["environment"]["DEEPINFER_G"]\n')
    reads = _direct_reads(ast.parse(source), {"ENV": "DEEPINFER_A"})
    assert sorted(reads) == [(2, "DEEPINFER_B"), (3, "DEEPINFER_A"), (4, "DEEPINFER_A"), (5, "DEEPINFER_C"),
                             (6, "DEEPINFER_D")]


def mentioned(text: str) -> set[str]:
    """The variable names ``text`` mentions (not patterns such as ``DEEPINFER_*``, plugin attributes or the docs'
    example package's)."""
    names = {name for name in NAME.findall(text) if not name.endswith(("_", "*")) and not name.startswith(EXAMPLE_PREFIX)}
    return names - NOT_VARIABLES


def test_mentions_are_names_not_patterns():
    assert mentioned("DEEPINFER_NVIDIA_* and DEEPINFER_TL_*, DEEPINFER_*, `DEEPINFER_A_B=0`, DEEPINFER_, "
                     "DEEPINFER_MYFEATURE_ON") == {"DEEPINFER_A_B"}


def test_code_docs_and_scripts_mention_only_declared_variables():
    declared, unknown = _declared_names(), []
    for path in _files(TEXT_SUFFIXES):
        if path.name != "test_envs.py":  # these tests make up names
            names = mentioned(path.read_text(errors="replace")) - declared
            unknown += [f"{path.relative_to(REPO).as_posix()}: {name}" for name in sorted(names)]
    assert not unknown, "declare these in an envs.py, or stop mentioning them (docs/configuration.md):\n" + "\n".join(
        unknown)


def test_the_configuration_page_lists_the_declarations():
    page = REPO / "docs" / "configuration.md"
    text = page.read_text()
    expected = envs.replace_table(text, envs.markdown_table(repository_declarations()))
    assert text == expected, ("docs/configuration.md's table differs from the declarations: with every package of "
                              "the repository installed, run `python -m deepinfer_core.envs --write "
                              "docs/configuration.md`")


def test_the_installed_packages_declare_what_their_files_do():
    """Where this repository's packages are installed, their entry points give the same declarations."""
    from_files = {group.owner: [v.name for v in group] for group in repository_declarations()}
    installed = {group.owner: [v.name for v in group] for group in envs.declarations()}
    assert installed == {owner: names for owner, names in from_files.items() if owner in installed}
    if len(installed) < len(from_files):
        pytest.skip(f"not installed here: {sorted(set(from_files) - set(installed))}")

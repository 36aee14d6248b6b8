"""The ``deepinfer`` console script, run as users run it (subprocess), plus the subcommand registry."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer_core.cli.main import SUBCOMMAND_MODULES, main

BROKEN = "DEEPINFER_HOOK_API_VERSION = 1\nraise RuntimeError('boom in cli test plugin')\n"
GOOD = "DEEPINFER_HOOK_API_VERSION = 1\ndef deepinfer_feature_options():\n    return {'shiny': 'x'}\n"


@pytest.fixture(scope="module")
def console_script() -> Path:
    script = Path(sys.executable).parent / "deepinfer"
    if not script.exists():
        pytest.fail(f"console script {script} is missing: install the core into this venv (pip install -e .)")
    return script


def run(script: Path, *args: str, pythonpath: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("DEEPINFER_ACCELERATOR", "DEEPINFER_PLUGINS")}
    if pythonpath is not None:
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), environ.get("PYTHONPATH")]))
    environ.update(env)
    cmd = [str(script), *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, env=environ, timeout=300)


@pytest.fixture
def plugin_site(make_distribution) -> Path:
    make_distribution(
        "deepinfer-broken-cli",
        "3.1.4",
        entry_points={"deepinfer.plugins": {"brokencli": "brokencli_plugin"}},
        modules={"brokencli_plugin": BROKEN},
    )
    return make_distribution(
        "deepinfer-good-cli",
        entry_points={"deepinfer.plugins": {"goodcli": "goodcli_plugin"}},
        modules={"goodcli_plugin": GOOD},
    )


def test_python_m_deepinfer_core_cli_runs_the_same_command():
    result = run(Path(sys.executable), "-m", "deepinfer_core.cli", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: deepinfer ")
    for name in ("env", "plugins", "generate", "bench"):
        assert f"    {name} " in result.stdout, result.stdout
    assert "unavailable" not in result.stdout  # every registered subcommand module imported


def test_env_reports_python_torch_backends_and_the_choice(console_script):
    import torch

    result = run(console_script, "env")
    assert result.returncode == 0, result.stderr
    assert f"Python     {platform.python_version()}" in result.stdout
    assert f"torch      {torch.__version__}" in result.stdout
    assert "  cpu            available" in result.stdout
    assert "Selected backend: " in result.stdout


def test_env_json(console_script):
    result = run(console_script, "env", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    cpu = next(b for b in report["backends"] if b["name"] == "cpu")
    assert cpu["available"] is True and cpu["distribution"] == "deepinfer"
    assert report["deepinfer"]["hook_api_version"] == 1
    assert report["selected"]["name"] and report["selected"]["why"]


def test_env_with_an_unknown_backend_fails_naming_it(console_script):
    result = run(console_script, "env", "--backend", "tpu9000")
    assert result.returncode == 1
    assert "unknown backend 'tpu9000'" in result.stdout
    assert "cpu" in result.stdout.split("installed backends: ")[1].split(" (aliases")[0].split(", ")


def test_env_honours_deepinfer_accelerator(console_script):
    result = run(console_script, "env", "--json", DEEPINFER_ACCELERATOR="cpu")
    report = json.loads(result.stdout)
    assert {k: report["selected"][k] for k in ("name", "why")} == {"name": "cpu",
                                                                   "why": "requested by DEEPINFER_ACCELERATOR=cpu"}


def test_plugins_lists_loaded_and_failed_plugins(console_script, plugin_site):
    result = run(console_script, "plugins", pythonpath=plugin_site)
    assert result.returncode == 1  # a plugin failed
    out = result.stdout
    assert "goodcli  [deepinfer-good-cli 0.1.0]  api 1  loaded" in out
    assert "hooks: deepinfer_feature_options" in out
    assert "brokencli  [deepinfer-broken-cli 3.1.4]  api -  failed" in out
    assert "RuntimeError: boom in cli test plugin" in out
    assert "Traceback" not in out and "deepinfer plugins -v" in out

    verbose = run(console_script, "plugins", "-v", pythonpath=plugin_site).stdout
    assert "Traceback (most recent call last)" in verbose and "brokencli_plugin.py" in verbose


def test_plugins_json_and_allow_list(console_script, plugin_site):
    result = run(console_script, "plugins", "--json", pythonpath=plugin_site, DEEPINFER_PLUGINS="goodcli")
    assert result.returncode == 0, result.stdout
    status = {p["name"]: p["status"] for p in json.loads(result.stdout)["plugins"]}
    assert status["goodcli"] == "loaded" and status["brokencli"] == "skipped"


def test_plugins_none(console_script, plugin_site):
    result = run(console_script, "plugins", "--json", pythonpath=plugin_site, DEEPINFER_PLUGINS="none")
    assert result.returncode == 0
    assert {p["status"] for p in json.loads(result.stdout)["plugins"]} == {"skipped"}


# --- the subcommand registry (in process) -------------------------------------------------------------------

HELLO = """
HELP = "say hello"

def add_arguments(parser):
    parser.add_argument("who")

def run(args):
    print(f"hello {args.who}")
    return 3
"""


def test_registered_subcommand_runs(make_distribution, monkeypatch, capsys):
    make_distribution("hello-cmd", modules={"hello_cmd": HELLO})
    monkeypatch.setitem(SUBCOMMAND_MODULES, "hello", "hello_cmd")
    assert main(["hello", "world"]) == 3
    assert capsys.readouterr().out == "hello world\n"


def test_broken_subcommand_does_not_break_the_others(monkeypatch, capsys):
    monkeypatch.setitem(SUBCOMMAND_MODULES, "generate", "no_such_module_for_generate")
    assert main(["generate"]) == 1
    assert "cannot import no_such_module_for_generate" in capsys.readouterr().err
    assert main(["env", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["selected"]["name"]

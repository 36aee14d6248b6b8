"""`deepinfer env` on a machine with torch_npu installed and no CANN (this machine, simulated honestly).

A fake ``torch_npu`` package whose import raises ``ImportError('libhccl.so: cannot open shared object file')``
is registered in torch's real auto-load entry-point group ``torch.backends`` (torch/__init__.py,
``_import_device_backends``), exactly as the torch-npu wheel registers ``torch_npu = torch_npu:_autoload``.
Then ``import torch`` fails unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``, as with the real wheel without CANN.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from deepinfer_ascend950.probe import CANN_HOME_VARIABLES, DEFAULT_TOOLKIT_DIRS, find_cann

pytestmark = pytest.mark.skipif(
    find_cann().found, reason="this host has CANN: the no-CANN simulation does not apply"
)


def _deepinfer(site: Path, *args: str, autoload: bool, extra_env=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (*CANN_HOME_VARIABLES, "TORCH_DEVICE_BACKEND_AUTOLOAD")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env["DEEPINFER_PLUGINS"] = "none"
    if not autoload:
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    env.update(extra_env or {})
    return subprocess.run([sys.executable, "-m", "deepinfer_core.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300, check=False)


def test_the_fake_breaks_import_torch_like_the_real_wheel(fake_torch_npu):
    env = {**os.environ, "PYTHONPATH": str(fake_torch_npu)}
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    run = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, env=env, timeout=300,
                         check=False)
    assert run.returncode != 0
    assert "Failed to load the backend extension: torch_npu" in run.stderr
    assert "libhccl.so: cannot open shared object file" in run.stderr


def test_env_without_autoload_switch_prints_the_fix_not_a_traceback(fake_torch_npu):
    run = _deepinfer(fake_torch_npu, "env", autoload=True)
    assert run.returncode == 1
    assert "Traceback" not in run.stderr
    assert "`import torch` failed" in run.stderr
    assert "Failed to load the backend extension: torch_npu" in run.stderr
    assert "libhccl.so: cannot open shared object file" in run.stderr
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in run.stderr


def test_env_with_autoload_off_names_ascend950_unavailable_and_why(fake_torch_npu):
    run = _deepinfer(fake_torch_npu, "env", autoload=False)
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    line = next(line for line in run.stdout.splitlines() if line.strip().startswith("ascend950"))
    assert "unavailable" in line
    assert "CANN not found (no ASCEND_HOME_PATH" in line
    assert "libhccl.so not loadable" in line
    assert "none verified on Ascend 950 hardware" in line
    assert "Selected backend: cpu" in run.stdout


def test_env_json_with_autoload_off(fake_torch_npu):
    run = _deepinfer(fake_torch_npu, "env", "--json", autoload=False)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    ascend = next(b for b in report["backends"] if b["name"] == "ascend950")
    assert ascend["available"] is False and ascend["distribution"] == "deepinfer-ascend950"
    assert ascend["reason"].startswith("CANN not found")
    assert report["selected"]["name"] == "cpu"


def test_explicit_choice_fails_with_the_probe_reason(fake_torch_npu):
    run = _deepinfer(fake_torch_npu, "env", "--backend", "ascend", autoload=False)
    assert run.returncode == 1
    assert "BackendUnavailableError: backend 'ascend950' (requested as 'ascend') is not available here: CANN not found" \
        in run.stdout


def test_cann_home_set_but_import_fails(fake_torch_npu, tmp_path):
    home = tmp_path / "cann"
    home.mkdir()
    run = _deepinfer(fake_torch_npu, "env", "--json", autoload=False, extra_env={"ASCEND_HOME_PATH": str(home)})
    ascend = next(b for b in json.loads(run.stdout)["backends"] if b["name"] == "ascend950")
    assert "`import torch_npu` failed: ImportError: libhccl.so" in ascend["reason"]


def test_probing_imports_no_torch_npu(fake_torch_npu):
    code = (
        "import sys\n"
        "from deepinfer_core.backends import registry\n"
        "registry.probe_backends()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch_npu'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in CANN_HOME_VARIABLES}
    env.update(PYTHONPATH=str(fake_torch_npu), TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                         check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_default_toolkit_dir_is_the_documented_one():
    assert DEFAULT_TOOLKIT_DIRS == ("/usr/local/Ascend/ascend-toolkit",)

"""The ascend950 probe: each step's outcome and reason, with the environment injected (no torch_npu needed)."""

from __future__ import annotations

import types

import pytest
from deepinfer_ascend950 import pairing
from deepinfer_ascend950.probe import BACKEND_CLASS, find_cann, is_ascend950, run_probe

INSTALLED = object()  # what find_spec returns when torch_npu is installed


def _no_import(name):
    raise AssertionError(f"the probe imported {name} although it must not get that far")


def _fake_torch_npu(names, available=True):
    npu = types.SimpleNamespace(
        is_available=lambda: available, device_count=lambda: len(names), get_device_name=lambda i: names[i]
    )
    return types.SimpleNamespace(npu=npu, __version__="2.13.0")


def _probe(tmp_path, env=None, *, installed=True, module=None, import_error=None, toolkit=False, **kwargs):
    toolkit_dir = tmp_path / "ascend-toolkit"
    if toolkit:
        toolkit_dir.mkdir(exist_ok=True)

    def import_module(name):
        if import_error is not None:
            raise import_error
        if module is None:
            return _no_import(name)
        return module

    kwargs.setdefault("find_library", lambda name: None)
    return run_probe(
        env or {},
        find_spec=lambda name: INSTALLED if installed else None,
        import_module=import_module,
        toolkit_dirs=[str(toolkit_dir)],
        torch_version="2.13.0+cpu",
        npu_version=kwargs.pop("npu_version", "2.13.0"),
        loaded_modules=kwargs.pop("loaded_modules", {}),
        **kwargs,
    )


def test_not_installed(tmp_path):
    result = _probe(tmp_path, installed=False)
    assert not result.available and result.name == "ascend950" and result.device_type == "npu"
    assert result.is_accelerator and result.backend_class == BACKEND_CLASS
    assert result.reason.startswith("torch_npu is not installed")
    assert "pip install 'deepinfer[ascend950]'" in result.reason


def test_torch_npu_of_another_torch_series(tmp_path):
    result = _probe(tmp_path, npu_version="2.12.0")
    assert not result.available
    assert "torch-npu 2.12.0 is built for torch 2.12 but torch 2.13.0+cpu is installed" in result.reason
    assert "torch-npu==2.13.*" in result.reason


def test_no_cann_stops_before_importing_torch_npu(tmp_path):
    result = _probe(tmp_path)  # module=None: importing would fail the test
    assert not result.available
    assert result.reason.startswith(
        "CANN not found (no ASCEND_HOME_PATH, no ASCEND_TOOLKIT_HOME, no "
    )
    assert "libhccl.so not loadable); install CANN 9.2 and source set_env.sh" in result.reason
    assert "or set TORCH_DEVICE_BACKEND_AUTOLOAD=0 to keep `import torch` working without it" in result.reason


def test_no_cann_with_autoload_off_says_to_keep_it_off(tmp_path):
    result = _probe(tmp_path, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert "until then keep TORCH_DEVICE_BACKEND_AUTOLOAD=0 set" in result.reason


def test_cann_home_variable_that_is_not_a_directory_counts_as_missing(tmp_path):
    result = _probe(tmp_path, {"ASCEND_HOME_PATH": str(tmp_path / "nope")})
    assert "ASCEND_HOME_PATH=" in result.reason and "is not a directory" in result.reason


def test_cann_found_but_torch_npu_import_fails(tmp_path):
    home = tmp_path / "ascend-toolkit" / "latest"
    (home / "lib64").mkdir(parents=True)
    (home / "lib64" / "libhccl.so").write_text("")
    (tmp_path / "ascend-toolkit" / "set_env.sh").write_text("")
    error = ImportError("libhccl.so: cannot open shared object file: No such file or directory")
    result = _probe(tmp_path, {"ASCEND_HOME_PATH": str(home)}, import_error=error)
    assert not result.available
    assert f"CANN was found (ASCEND_HOME_PATH={home})" in result.reason
    assert "`import torch_npu` failed: ImportError: libhccl.so: cannot open shared object file" in result.reason
    assert f"source {tmp_path / 'ascend-toolkit' / 'set_env.sh'} in this shell" in result.reason
    assert f"libhccl.so: {home / 'lib64' / 'libhccl.so'}" in result.reason


def test_libhccl_on_the_loader_path_counts_as_cann(tmp_path):
    lib = tmp_path / "lib64"
    lib.mkdir()
    (lib / "libhccl.so").write_text("")
    status = find_cann({"LD_LIBRARY_PATH": f"/nonexistent:{lib}"}, toolkit_dirs=[], find_library=lambda n: None)
    assert status.found and status.hccl_loadable and status.how == f"libhccl.so at {lib / 'libhccl.so'}"
    status = find_cann({}, toolkit_dirs=[], find_library=lambda n: "libhccl.so")
    assert status.found and status.how == "libhccl.so at libhccl.so"


def test_a_broken_find_library_does_not_break_the_probe(tmp_path):
    def broken(name):
        raise OSError("no ldconfig here")

    assert not find_cann({}, toolkit_dirs=[], find_library=broken).found


def test_no_visible_npu(tmp_path):
    result = _probe(tmp_path, toolkit=True, module=_fake_torch_npu([], available=False))
    assert not result.available and "torch.npu.is_available() is False" in result.reason
    assert "npu-smi info" in result.reason


def test_other_ascend_chips_are_not_this_backend(tmp_path):
    result = _probe(tmp_path, toolkit=True, module=_fake_torch_npu(["Ascend910B3", "Ascend910B3"]))
    assert not result.available
    assert result.reason.startswith("found 2 x Ascend910B3; this backend targets Ascend 950")


def test_ascend950_available(tmp_path):
    result = _probe(tmp_path, toolkit=True, module=_fake_torch_npu(["Ascend950PR"] * 8))
    assert result.available
    assert result.reason.startswith("found 8 x Ascend950PR (torch_npu 2.13.0, CANN: ")


def test_already_auto_loaded_by_torch_skips_cann_and_import(tmp_path):
    result = _probe(tmp_path, loaded_modules={"torch_npu": _fake_torch_npu(["Ascend950DT"])})
    assert result.available and "CANN: loaded by torch at import" in result.reason


def test_device_query_errors_are_reasons(tmp_path):
    module = types.SimpleNamespace(npu=types.SimpleNamespace(is_available=lambda: 1 / 0))
    result = _probe(tmp_path, toolkit=True, module=module)
    assert not result.available and "querying the NPUs failed: ZeroDivisionError" in result.reason


@pytest.mark.parametrize("case", ["not installed", "no cann", "available"])
def test_every_reason_says_capabilities_are_unverified(tmp_path, case):
    kwargs = {"not installed": {"installed": False}, "no cann": {},
              "available": {"toolkit": True, "module": _fake_torch_npu(["Ascend950PR"])}}[case]
    assert _probe(tmp_path, **kwargs).reason.endswith("declared, none verified on Ascend 950 hardware")


@pytest.mark.parametrize("name,expected", [
    ("Ascend950PR", True), ("Ascend950DT", True), ("Ascend 950PR", True), ("Ascend910_95", True),
    ("Ascend910B3", False), ("Ascend910_9392", False), ("Ascend310P3", False),
])
def test_soc_names(name, expected):
    assert is_ascend950(name) is expected


def test_pairing_checks():
    assert pairing.minor_series("2.13.0+cpu") == (2, 13)
    assert pairing.minor_series("2.13.0rc1") == (2, 13)
    assert pairing.minor_series("2.12.0.post3") == (2, 12)
    assert pairing.check_pair("2.13.0+cpu", "2.13.0rc1") is None
    assert pairing.check_pair("2.13.0", "2.14.0") is not None
    reference_engine = [p for p in pairing.PAIRINGS if p.cann_source == "reference-engine"]
    assert [(p.torch_npu, p.cann) for p in reference_engine] == [("2.13.0rc1", "CANN 9.2")]

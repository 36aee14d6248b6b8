"""Probe and backend contract on any machine (a fake ``torch.cuda`` stands in for GPUs)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from deepinfer_nvidia_sm100 import probe as probe_mod

from deepinfer_core.backends import registry
from deepinfer_core.errors import BackendUnavailableError


class FakeCuda:
    def __init__(self, devices=(), fail=None):
        self.devices = list(devices)  # (name, (major, minor))
        self.fail = fail

    def is_available(self):
        if self.fail:
            raise self.fail
        return bool(self.devices)

    def device_count(self):
        return len(self.devices)

    def get_device_capability(self, i):
        return self.devices[i][1]

    def get_device_name(self, i):
        return self.devices[i][0]


def test_no_device_is_unavailable_with_reason():
    result = probe_mod.probe(FakeCuda())
    assert not result.available and result.reason == "no CUDA device"
    assert result.is_accelerator and result.device_type == "cuda" and result.name == "nvidia_sm100"


def test_a100_is_refused_naming_what_was_found():
    result = probe_mod.probe(FakeCuda([("NVIDIA A100-SXM4-80GB", (8, 0))]))
    assert not result.available
    assert result.reason == "compute capability 8.0 (A100): needs 9.x or 10.x"


@pytest.mark.parametrize("name, cap, path", [("NVIDIA H200", (9, 0), "sm90"), ("NVIDIA H100 80GB HBM3", (9, 0), "sm90"),
                                             ("NVIDIA B200", (10, 0), "sm100"), ("NVIDIA GB200", (10, 0), "sm100")])
def test_hopper_and_blackwell_are_available(name, cap, path):
    result = probe_mod.probe(FakeCuda([(name, cap)] * 8))
    assert result.available and f"8 x {name}" in result.reason and f"{path} path" in result.reason
    assert result.backend_class == "deepinfer_nvidia_sm100.backend:NvidiaBackend"


def test_broken_driver_is_a_reason_not_a_crash():
    result = probe_mod.probe(FakeCuda(fail=RuntimeError("driver too old")))
    assert not result.available and "driver too old" in result.reason


def test_real_probe_here_matches_torch():
    result = probe_mod.probe()
    if not torch.cuda.is_available():
        assert not result.available and result.reason.startswith("no CUDA device")


def test_importing_package_and_probe_imports_no_cuda_extension():
    code = ("import sys, deepinfer_nvidia_sm100, deepinfer_nvidia_sm100.probe as p; p.probe(); "
            "bad = [m for m in ('triton', 'tilelang', 'deepinfer_nvidia_sm100.kernels', "
            "'deepinfer_nvidia_sm100.backend') if m in sys.modules]; print(bad); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_registered_entry_point_and_explicit_choice_fails_loudly_without_gpu():
    installed = registry.installed_backends()
    assert installed["nvidia_sm100"].value == "deepinfer_nvidia_sm100.probe:probe"
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(BackendUnavailableError, match="no CUDA device"):
        registry.choose_backend("nvidia")
    assert registry.choose_backend(env={}).name == "cpu"


def test_backend_class_is_a_backend_and_arch_paths():
    from deepinfer_nvidia_sm100.backend import VERIFIED, NvidiaBackend

    from deepinfer_core.backends.base import Backend

    assert issubclass(NvidiaBackend, Backend) and NvidiaBackend.name == "nvidia_sm100"
    assert probe_mod.arch_path((9, 0)) == "sm90" and probe_mod.arch_path((10, 0)) == "sm100"
    assert probe_mod.arch_path((8, 9)) is None and probe_mod.arch_path((12, 0)) is None
    assert VERIFIED["sm100"] == frozenset()  # nothing has run on SM100 hardware

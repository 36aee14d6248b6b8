"""Backend discovery and selection through real entry points, and the CPU backend's contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from deepinfer_core.backends import Backend, ProbeResult, registry
from deepinfer_core.backends.cpu import CpuBackend, probe
from deepinfer_core.backends.host_threads import cpu_host_threads, cpu_threads_for, others_load, physical_cores
from deepinfer_core.errors import BackendUnavailableError, InvalidBackendError, UnknownBackendError
from deepinfer_core.ops.table import DERIVED, OpTable, UnknownOpError

FAKE_BACKEND = """
from deepinfer_core.backends.base import Backend, Capabilities, MemoryInfo, ProbeResult

AVAILABLE = {available}

def probe():
    reason = "found 1 x FakeAccel" if AVAILABLE else "no FakeAccel device: driver not loaded"
    return ProbeResult("{name}", AVAILABLE, reason, __name__ + ":FakeBackend", True, "meta")

class FakeBackend(Backend):
    name = "{name}"
    device_type = "meta"
    probe = staticmethod(probe)

    def capabilities(self):
        return Capabilities(dtypes=(), distributed_backend="gloo")

    def memory_info(self):
        return MemoryInfo(0, 0)
"""


@pytest.fixture(autouse=True)
def _no_accelerator_env(monkeypatch):
    monkeypatch.delenv(registry.ENV_ACCELERATOR, raising=False)


@pytest.fixture
def fake_backend(make_distribution):
    """Install a fake accelerator backend ``name`` (probe says available or not)."""

    def install(name: str, available: bool, probe_value: str | None = None) -> None:
        module = f"fake_{name}_backend"
        make_distribution(
            f"deepinfer-fake-{name}",
            entry_points={"deepinfer.backends": {name: probe_value or f"{module}:probe"}},
            modules={module: FAKE_BACKEND.format(name=name, available=available)},
        )

    return install


def real_accelerator_available() -> bool:
    return any(p.available and p.is_accelerator for p in registry.probe_backends().values())


# --- the CPU backend ------------------------------------------------------------------------------------


def test_cpu_probe_is_available_and_not_an_accelerator():
    result = probe()
    assert result == CpuBackend.probe()
    assert result.available and not result.is_accelerator
    assert (result.name, result.device_type) == ("cpu", "cpu")
    assert registry.load_backend_class(result) is CpuBackend


def test_cpu_backend_contract():
    backend = CpuBackend()
    caps = backend.capabilities()
    assert backend.device == torch.device("cpu")
    assert torch.float32 in caps.dtypes and caps.distributed_backend == "gloo"
    assert not caps.device_graphs and not caps.fp8 and caps.is_verified("dtypes") and not caps.is_verified("fp8")
    memory = backend.memory_info()
    assert 0 < memory.free_bytes <= memory.total_bytes
    overrides = backend.op_overrides()
    sources = backend.make_op_table().sources()
    for name in OpTable().names():  # reference ops, then the backend's overrides and the ops derived from them
        derived_from = set(DERIVED[name][0]) & set(overrides) if name in DERIVED else set()
        expected = "cpu" if name in overrides else "cpu (" if derived_from else "reference"
        assert sources[name] == expected or derived_from and sources[name].startswith(expected), (name, sources[name])
    step = lambda x: x + 1
    assert backend.capture_graph(step, (torch.zeros(1),)) is step


def test_cpu_is_registered_through_the_core_entry_point():
    entry = registry.installed_backends()["cpu"]
    assert entry.value == "deepinfer_core.backends.cpu:probe"
    assert entry.distribution == "deepinfer"


def test_base_class_demands_the_contract():
    class Half(Backend):
        name = "half"
        device_type = "cpu"

    with pytest.raises(NotImplementedError, match="probe"):
        Half.probe()
    with pytest.raises(NotImplementedError, match="capabilities"):
        Half().capabilities()


# --- selection --------------------------------------------------------------------------------------------


def test_without_accelerators_cpu_is_selected():
    if real_accelerator_available():
        pytest.skip("a real accelerator backend is available on this machine")
    choice = registry.choose_backend()
    assert choice.name == "cpu"
    assert isinstance(registry.select_backend(), CpuBackend)


def test_explicit_unavailable_backend_raises_with_its_probe_reason(fake_backend):
    fake_backend("fakeaccel", available=False)
    with pytest.raises(BackendUnavailableError, match=r"'fakeaccel'.*no FakeAccel device: driver not loaded"):
        registry.select_backend("fakeaccel")
    assert registry.choose_backend().name == "cpu"  # unavailable: never chosen automatically


def test_accelerator_env_is_explicit_too(fake_backend, monkeypatch):
    fake_backend("fakeaccel", available=False)
    monkeypatch.setenv(registry.ENV_ACCELERATOR, "fakeaccel")
    with pytest.raises(BackendUnavailableError, match=r"DEEPINFER_ACCELERATOR=fakeaccel.*driver not loaded"):
        registry.choose_backend()
    assert registry.choose_backend("cpu").name == "cpu"  # the argument beats the environment


def test_unknown_backend_is_named_back_with_the_known_ones(fake_backend):
    fake_backend("fakeaccel", available=False)
    with pytest.raises(UnknownBackendError) as info:
        registry.select_backend("tpu9000")
    message = str(info.value)
    assert "unknown backend 'tpu9000'" in message
    installed = message.split("installed backends: ")[1].split(" (aliases")[0].split(", ")
    assert {"cpu", "fakeaccel"} <= set(installed)


def test_reference_engine_names_map_to_our_backends(fake_backend, monkeypatch):
    fake_backend("nvidia_sm100", available=True)
    fake_backend("ascend950", available=True)
    monkeypatch.setenv(registry.ENV_ACCELERATOR, "nvidia")
    assert registry.choose_backend().name == "nvidia_sm100"
    assert registry.choose_backend("ascend").name == "ascend950"
    backend = registry.select_backend("NVIDIA")
    assert backend.name == "nvidia_sm100" and backend.device == torch.device("meta")


def test_alias_for_a_missing_backend_says_what_to_install(monkeypatch):
    monkeypatch.setitem(registry.ALIASES, "gpu9", "gpu9_backend")
    monkeypatch.setitem(registry.DISTRIBUTIONS, "gpu9_backend", "deepinfer-gpu9")
    with pytest.raises(UnknownBackendError, match=r"'gpu9_backend' \(requested as 'gpu9'\).*deepinfer-gpu9"):
        registry.choose_backend("gpu9")


def test_the_one_available_accelerator_is_selected(fake_backend):
    if real_accelerator_available():
        pytest.skip("a real accelerator backend is available on this machine")
    fake_backend("fakeaccel", available=True)
    fake_backend("offline", available=False)
    choice = registry.choose_backend()
    assert (choice.name, choice.why) == ("fakeaccel", "the only available accelerator backend")


def test_several_accelerators_pick_the_first_by_name_and_say_so(fake_backend):
    fake_backend("zeta", available=True)
    fake_backend("alpha", available=True)
    choice = registry.choose_backend()
    assert choice.name == "alpha"
    assert "several accelerator backends are available (alpha, " in choice.why and "zeta)" in choice.why


def test_a_broken_probe_makes_the_backend_unavailable_not_the_registry(fake_backend):
    fake_backend("broken", available=True, probe_value="no_such_module_xyz:probe")
    probes = registry.probe_backends()
    assert not probes["broken"].available
    assert "ModuleNotFoundError" in probes["broken"].reason
    assert registry.choose_backend().name == "cpu"
    with pytest.raises(BackendUnavailableError, match="no_such_module_xyz"):
        registry.choose_backend("broken")


def test_backend_class_must_subclass_backend():
    bogus = ProbeResult("bogus", True, "", "collections:OrderedDict", True, "cpu")
    with pytest.raises(InvalidBackendError, match="not a Backend subclass"):
        registry.load_backend_class(bogus)


def test_probing_imports_no_vendor_extension():
    code = (
        "import sys\n"
        "from deepinfer_core.backends import registry\n"
        "registry.probe_backends()\n"
        "vendor = ('torch_npu', 'tilelang', 'deep_gemm', 'flash_mla', 'deep_ep')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in vendor))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_cpu_threads_take_the_idle_physical_cores_and_at_least_one():
    assert cpu_threads_for(physical_cores=8, others_load=0.2).count == 8
    assert cpu_threads_for(physical_cores=8, others_load=2.6).count == 5
    busy = cpu_threads_for(physical_cores=2, others_load=3.4)  # the busy 2-core machine: one thread, not a pool
    assert busy.count == 1
    assert "2 physical core(s) usable, about 2 busy" in busy.why and "OMP_NUM_THREADS overrides" in busy.why
    assert 1 <= physical_cores() <= (os.cpu_count() or 1)
    assert others_load() >= 0.0


def test_env_names_the_engine_threads_and_why_and_omp_num_threads_wins():
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "DEEPINFER_ACCELERATOR")}
    chosen = subprocess.run([sys.executable, "-m", "deepinfer_core.cli", "env", "--json", "--backend", "cpu"],
                            capture_output=True, text=True, check=True, env=environ).stdout
    threads = json.loads(chosen)["selected"]["threads"]
    assert threads["count"] >= 1 and "idle core" in threads["why"]
    forced = subprocess.run([sys.executable, "-m", "deepinfer_core.cli", "env", "--backend", "cpu"],
                            capture_output=True, text=True, check=True, env={**environ, "OMP_NUM_THREADS": "1"}).stdout
    assert "Engine CPU threads: 1 (OMP_NUM_THREADS=1 chose)" in forced


class _HostThreadsBackend(CpuBackend):
    """The CPU backend with a device backend's thread choice (``Backend.host_thread_choice``: ``host_threads``),
    not the CPU backend's own (the cores other processes leave idle, which moves with the machine's load)."""

    host_threads = 1  # as a device backend's, whose host only builds layouts and reads tokens
    host_thread_choice = classmethod(Backend.host_thread_choice.__func__)


def test_a_device_backends_host_threads_set_torchs_cpu_threads_unless_omp_num_threads_chose(monkeypatch):
    from deepinfer_core.llm import _limit_host_threads

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(2)
        _limit_host_threads(CpuBackend())  # the CPU backend computes the model on the cores others leave idle
        assert torch.get_num_threads() == min(2, cpu_host_threads().count)
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        _limit_host_threads(_HostThreadsBackend())  # the user chose
        assert torch.get_num_threads() == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        _limit_host_threads(_HostThreadsBackend())
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


class _InvariantBackend(CpuBackend):
    """A backend offering one op of its own for the batch-invariant mode (``Backend.op_variants``)."""

    @staticmethod
    def invariant_norm(x, weight, eps):
        return x * weight

    def op_variants(self, kind):
        return {"rms_norm": self.invariant_norm} if kind == "batch_invariant" else {}


def test_the_op_table_hands_a_plugin_the_backends_variants_without_installing_them():
    table = _InvariantBackend().make_op_table()
    assert table.variants("batch_invariant") == {"rms_norm": _InvariantBackend.invariant_norm}
    assert table.variants("something_else") == {}
    assert table.sources()["rms_norm"] != "batch_invariant" and table.rms_norm is not _InvariantBackend.invariant_norm
    assert CpuBackend().make_op_table().variants("batch_invariant") == {}
    assert OpTable().variants("batch_invariant") == {}


def test_a_variant_of_an_unknown_op_is_refused_naming_it():
    table = OpTable(variants=lambda kind: {"no_such_op": abs})
    with pytest.raises(UnknownOpError, match="no_such_op"):
        table.variants("batch_invariant")

"""CONTRACT tests (CPU, not hardware): the backend class with ``contract_reference`` in place of torch_npu.

They check the glue (op table sources, declared capabilities, memory query, ACL graph capture / replay
bookkeeping) and that nothing imports torch_npu; they cannot check a device.
"""

from __future__ import annotations

import sys

import pytest
import torch
from deepinfer_ascend950.backend import Ascend950Backend

from deepinfer_core.backends import registry
from deepinfer_core.errors import BackendUnavailableError

OVERRIDDEN = {"rms_norm", "unweighted_rms_norm", "apply_rope", "apply_rope_", "sink_attention", "moe_route_topk",
              "moe_experts"}


@pytest.fixture
def backend(stand_in):
    return Ascend950Backend(device_index=0, npu_module=stand_in)


def test_contract_op_table_sources(backend):
    sources = backend.make_op_table().sources()
    assert {name for name, source in sources.items() if source == "ascend950"} == OVERRIDDEN
    assert sources["linear"] == "reference" and sources["moe_route_hash"] == "reference"


def test_contract_capabilities_are_declared_and_none_verified(backend):
    caps = backend.capabilities()
    assert caps.distributed_backend == "hccl" and caps.device_graphs
    assert caps.verified_on_hardware == frozenset()
    assert not any(caps.is_verified(name) for name in ("dtypes", "distributed_backend", "device_graphs", "fp8"))
    assert caps.as_dict()["verified_on_hardware"] == []


def test_contract_device_and_memory(backend):
    # torch.device("npu") exists only once torch_npu has renamed torch's privateuse1 backend to "npu".
    assert (backend.device_type, backend.device_index) == ("npu", 0)
    memory = backend.memory_info()
    assert (memory.free_bytes, memory.total_bytes) == (48 << 30, 64 << 30)  # the stand-in's made-up numbers


def test_contract_graph_capture_replays_with_new_inputs(backend, stand_in):
    def step(x, y, scale):
        return x * scale + y

    x, y = torch.ones(3), torch.zeros(3)
    replay = backend.capture_graph(step, (x, y, 2.0))
    graph = replay.graph
    assert isinstance(graph, stand_in.NPUGraph) and graph.captured
    # A CPU cannot record device work: recompute the captured output in place, as a device replay would.
    graph.on_replay = lambda: replay.static_output.copy_(step(*replay.static_inputs))
    out = replay(torch.full((3,), 5.0), torch.ones(3), 2.0)
    assert graph.replays == 1 and torch.equal(out, torch.full((3,), 11.0))
    assert out is replay.static_output  # overwritten by the next replay, like CUDA graphs
    assert torch.equal(x, torch.ones(3))  # the caller's example tensors are not captured buffers
    with pytest.raises(TypeError, match="takes 3 arguments"):
        replay(x)


def test_contract_nothing_imported_torch_npu(backend):
    backend.make_op_table()
    assert "torch_npu" not in sys.modules


def test_installed_entry_point_and_explicit_selection():
    entry = registry.installed_backends()["ascend950"]
    assert (entry.value, entry.distribution) == ("deepinfer_ascend950.probe:probe", "deepinfer-ascend950")
    if registry.probe_backend(entry).available:
        pytest.skip("an Ascend 950 is available here")
    with pytest.raises(BackendUnavailableError, match="backend 'ascend950' .* is not available here"):
        registry.choose_backend(env={"DEEPINFER_ACCELERATOR": "ascend"})
    assert registry.choose_backend(env={}).name == "cpu"

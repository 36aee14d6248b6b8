"""The Ascend 950 backend class: imported only when the backend is selected; it loads torch_npu then.

UNVERIFIED ON HARDWARE: nothing here has run on an Ascend 950 (docs/ascend950.md lists what has not).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from deepinfer_ascend950 import capabilities as _capabilities
from deepinfer_ascend950.ops import NpuOps
from deepinfer_ascend950.probe import DEVICE_TYPE, NAME, probe
from deepinfer_core.backends.base import Backend, Capabilities, MemoryInfo

DISTRIBUTED_BACKEND = "hccl"
"""torch.distributed backend name torch_npu registers (``torch_npu.distributed.is_hccl_available``)."""

GRAPH_WARMUP_RUNS = 2


class Ascend950Backend(Backend):
    """torch_npu fused ops on an Ascend 950 NPU; ACL graph capture through ``torch.npu.NPUGraph``."""

    name = NAME
    device_type = DEVICE_TYPE
    probe = staticmethod(probe)

    def __init__(self, device_index: int | None = None, *, npu_module: Any = None) -> None:
        """``npu_module``: the torch_npu module (default: imported now) or a stand-in with its API (tests)."""
        super().__init__(device_index)
        self._npu = npu_module if npu_module is not None else importlib.import_module("torch_npu")

    def capabilities(self) -> Capabilities:
        """Declared, none verified on hardware (``verified_on_hardware`` is empty)."""
        return _capabilities.DECLARED

    def memory_info(self) -> MemoryInfo:
        """``torch.npu.mem_get_info(device)``: free and total bytes of this NPU."""
        free, total = self._npu.npu.mem_get_info(self.device_index or 0)
        return MemoryInfo(free_bytes=int(free), total_bytes=int(total))

    def op_overrides(self) -> Mapping[str, Callable]:
        """The torch_npu adapters of ``deepinfer_ascend950.ops``; every other op is the reference op."""
        return NpuOps(self._npu).overrides()

    def capture_graph(self, fn: Callable[..., Any], example_inputs: tuple[Any, ...]) -> Callable[..., Any]:
        """Capture ``fn`` into an ACL graph (``torch.npu.NPUGraph``) and return a replaying callable."""
        return capture_acl_graph(self._npu.npu, fn, example_inputs)


def capture_acl_graph(npu: Any, fn: Callable[..., Any], example_inputs: tuple[Any, ...]) -> Callable[..., Any]:
    """Warm ``fn`` up on a side stream, capture it once into ``npu.NPUGraph``, return ``replay(*inputs)``.

    ``npu`` is ``torch_npu.npu`` (``torch.npu`` once torch_npu is loaded). The API mirrors CUDA graphs and is
    documented in torch-npu 2.13.0 ``torch_npu/npu/graphs.py`` (``NPUGraph``, ``graph(npu_graph, pool=None,
    stream=None, auto_dispatch_capture=False, capture_error_mode="global")``, "beta"). ``auto_dispatch_capture=True``
    routes ops that have NPU-graph handlers (npu_fused_infer_attention_score_v2 among them, see
    ``torch_npu/npu/_npugraph_handlers/ifa_handler.py``) through their capture-safe ``.out`` variants.
    Unverified on hardware.

    ``replay`` copies its tensor arguments into the captured input buffers, replays, and returns the captured
    output tensors: they are overwritten by the next replay (clone to keep them). Non-tensor arguments are
    baked into the graph at capture time and must not change.
    """
    static_inputs = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in example_inputs)
    side = npu.Stream()
    side.wait_stream(npu.current_stream())
    with npu.stream(side):
        for _ in range(GRAPH_WARMUP_RUNS):  # tiling, workspace and allocator warm-up outside the capture
            fn(*static_inputs)
    npu.current_stream().wait_stream(side)
    graph = npu.NPUGraph()
    with npu.graph(graph, auto_dispatch_capture=True):
        static_output = fn(*static_inputs)

    def replay(*inputs: Any) -> Any:
        if len(inputs) != len(static_inputs):
            raise TypeError(f"captured graph takes {len(static_inputs)} arguments, got {len(inputs)}")
        for buffer, value in zip(static_inputs, inputs):
            if isinstance(buffer, torch.Tensor):
                buffer.copy_(value)
        graph.replay()
        return static_output

    replay.graph = graph  # type: ignore[attr-defined]
    replay.static_inputs = static_inputs  # type: ignore[attr-defined]
    replay.static_output = static_output  # type: ignore[attr-defined]
    return replay

"""The backend contract: what a device backend tells the core and what it provides.

A backend distribution registers, in entry-point group ``deepinfer.backends``, a cheap ``probe()``
callable returning a ``ProbeResult``. The probe's module must not import vendor extensions (torch_npu,
CUDA extension modules, tilelang) at import time: ``deepinfer env`` probes every installed backend on
every machine. When the backend is selected, the core imports ``ProbeResult.backend_class`` (a
``"module:Class"`` path to a ``Backend`` subclass) and instantiates it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch

from deepinfer_core.backends.host_threads import HostThreads
from deepinfer_core.ops.table import OpTable


@dataclass(frozen=True)
class ProbeResult:
    """What a backend's probe found on this machine.

    ``reason`` says why the backend is or is not usable ("no CUDA device", "torch_npu not installed",
    "found 8 x NVIDIA B200"); it is shown by ``deepinfer env`` and carried by ``BackendUnavailableError``.
    """

    name: str
    available: bool
    reason: str
    backend_class: str  # "package.module:ClassName", imported only when the backend is selected
    is_accelerator: bool
    device_type: str  # torch device type: "cpu", "cuda", "npu"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``deepinfer env --json``)."""
        return asdict(self)


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do. ``verified_on_hardware`` names the capabilities checked on the real device
    (the others are implemented but so far only tested elsewhere, e.g. in emulation or on CPU)."""

    dtypes: tuple[torch.dtype, ...]
    distributed_backend: str  # torch.distributed backend name: "nccl", "hccl" or "gloo"
    #: the backend captures and replays static-shape steps as device graphs through ``Backend.capture_graph``
    #: (CUDA graphs on NVIDIA, ACL graphs on Ascend); ``LLM`` then captures decode steps unless ``enforce_eager``
    device_graphs: bool = False
    #: the backend offers batch-invariant variants of its ops (``Backend.op_variants("batch_invariant")``), which the
    #: batch-invariant plugin installs over its own portable forms
    batch_invariant: bool = False
    fp8: bool = False
    verified_on_hardware: frozenset[str] = field(default_factory=frozenset)

    def is_verified(self, capability: str) -> bool:
        """Whether ``capability`` (a field name such as ``"fp8"``) was verified on the real device."""
        return capability in self.verified_on_hardware

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form: dtypes as names, the verified set as a sorted list."""
        out = asdict(self)
        out["dtypes"] = [str(dtype).removeprefix("torch.") for dtype in self.dtypes]
        out["verified_on_hardware"] = sorted(self.verified_on_hardware)
        return out


@dataclass(frozen=True)
class MemoryInfo:
    """Device memory in bytes, as the device reports it now."""

    free_bytes: int
    total_bytes: int


class Backend:
    """Base class of every backend. Subclasses set ``name`` and ``device_type`` and implement ``probe``,
    ``capabilities`` and ``memory_info``; ``op_overrides`` and ``capture_graph`` have safe defaults."""

    name: ClassVar[str] = ""
    device_type: ClassVar[str] = ""
    #: tokens one engine step may take when the user gives no ``max_num_batched_tokens``: small on a CPU (a step's
    #: latency grows with it), larger on an accelerator, where long prefill steps run nearer the compute peak
    default_max_num_batched_tokens: ClassVar[int] = 2048
    #: whether the engine plans and launches a step before reading the previous step's tokens when the user does
    #: not say (``LLM(async_scheduling=None)``): worth it where the device runs behind the host (GPUs), not on a
    #: CPU, whose ops finish before the host moves on
    default_async_scheduling: ClassVar[bool] = False
    #: torch's CPU threads where the model runs on a device and the host only builds step layouts and reads tokens:
    #: ``LLM`` sets ``torch.set_num_threads`` to it unless ``OMP_NUM_THREADS`` chose; None keeps torch's default
    #: (a CPU backend computes the model with them, and chooses its count in ``host_thread_choice``)
    host_threads: ClassVar[int | None] = None

    def __init__(self, device_index: int | None = None) -> None:
        self.device_index = device_index

    @classmethod
    def probe(cls) -> ProbeResult:
        """Whether this backend can run here, and why (cheap; must not import vendor extensions)."""
        raise NotImplementedError(f"{cls.__name__} must implement probe()")

    @property
    def device(self) -> torch.device:
        """The torch device tensors for this backend live on."""
        return torch.device(self.device_type, self.device_index)

    def capabilities(self) -> Capabilities:
        """What this backend supports (dtypes, device graphs, batch invariance, fp8, distributed backend)."""
        raise NotImplementedError(f"{type(self).__name__} must implement capabilities()")

    def memory_info(self) -> MemoryInfo:
        """Free and total device memory, in bytes."""
        raise NotImplementedError(f"{type(self).__name__} must implement memory_info()")

    @classmethod
    def host_thread_choice(cls) -> HostThreads | None:
        """torch's CPU thread count for this backend and why (``host_threads``), or None to keep torch's; ``LLM``
        applies it unless ``OMP_NUM_THREADS`` is set."""
        if cls.host_threads is None:
            return None
        return HostThreads(cls.host_threads, f"{cls.name} computes on its device; the host only builds step "
                                              "layouts and reads tokens, where a thread pool waits on itself")

    def op_overrides(self) -> Mapping[str, Callable]:
        """Op name -> this backend's implementation; ops left out use the reference op."""
        return {}

    def make_op_table(self, plugin_manager: Any = None, context: Any = None) -> OpTable:
        """The op table the model calls: reference ops, then this backend's overrides, then the plugins'
        ``deepinfer_register_ops`` (when ``plugin_manager`` is given) with ``context``, the engine's
        ``EngineContext`` (default: a bare one of this backend, without options)."""
        table = OpTable(self.op_overrides(), source=self.name, variants=self.op_variants)
        if plugin_manager is not None:
            from deepinfer_core.engine_context import EngineContext
            from deepinfer_core.plugins import call_hook

            context = context if context is not None else EngineContext(self.name)
            call_hook(plugin_manager, "deepinfer_register_ops", op_table=table, backend_name=self.name,
                      context=context)
        return table

    def op_variants(self, kind: str) -> Mapping[str, Callable]:
        """This backend's own implementations of ops for a mode that a feature plugin turns on, by ``kind``; the op
        table hands them to the plugin (``OpTable.variants``), which installs them. Default: none.

        ``"batch_invariant"``: ops whose result for one row (token, query, window, sequence) is bitwise the same
        whatever the other rows are: each kernel runs with one configuration (tiles, splits, warps) chosen from the
        model's and the weights' shapes only, never from the number of rows; no atomics; reductions in a fixed order.
        The backend knows its kernels' reduction orders, so it can run its fast kernels this way; the
        batch-invariant plugin keeps its own portable forms for the ops not offered. A backend that offers them sets
        ``Capabilities.batch_invariant``."""
        del kind
        return {}

    def capture_graph(self, fn: Callable[..., Any], example_inputs: tuple[Any, ...]) -> Callable[..., Any]:
        """Return a callable equivalent to ``fn`` that replays a captured device graph (CUDA / ACL graphs).

        ``example_inputs`` fix the shapes to capture. The default does no capture and returns ``fn``.
        """
        del example_inputs
        return fn

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, device={self.device})"

"""Device backends: the contract (``base``), discovery and selection (``registry``), and the CPU backend."""

from deepinfer_core.backends.base import Backend, Capabilities, MemoryInfo, ProbeResult
from deepinfer_core.backends.registry import (
    BackendChoice,
    choose_backend,
    installed_backends,
    probe_backends,
    select_backend,
)
from deepinfer_core.errors import BackendUnavailableError, UnknownBackendError

__all__ = [
    "Backend",
    "BackendChoice",
    "BackendUnavailableError",
    "Capabilities",
    "MemoryInfo",
    "ProbeResult",
    "UnknownBackendError",
    "choose_backend",
    "installed_backends",
    "probe_backends",
    "select_backend",
]

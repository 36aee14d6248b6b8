"""Backend discovery and selection over entry-point group ``deepinfer.backends``.

Selection rule (``choose_backend``):

1. Explicit wins: ``select_backend(name)`` (``LLM(backend=...)``, ``--backend``), else the environment
   variable ``DEEPINFER_ACCELERATOR``. The reference engine's values are accepted: ``nvidia`` means
   ``nvidia_sm100`` and ``ascend`` means ``ascend950``. An unknown name raises ``UnknownBackendError``
   listing the installed ones; an installed but unavailable backend raises ``BackendUnavailableError``
   with that backend's own probe reason. An explicit choice never falls back.
2. Otherwise the one available accelerator backend. If several are available the first by name is
   taken and the choice says so (set ``DEEPINFER_ACCELERATOR`` to pick another).
3. Otherwise ``cpu``.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deepinfer_core import envs
from deepinfer_core.backends.base import Backend, ProbeResult
from deepinfer_core.errors import BackendUnavailableError, InvalidBackendError, UnknownBackendError

try:
    import importlib_metadata as metadata
except ImportError:  # pragma: no cover
    from importlib import metadata  # type: ignore[no-redef]

ENTRY_POINT_GROUP = "deepinfer.backends"
ENV_ACCELERATOR = "DEEPINFER_ACCELERATOR"
CPU = "cpu"

ALIASES: dict[str, str] = {"nvidia": "nvidia_sm100", "ascend": "ascend950"}
"""The reference engine's ``DEEPINFER_ACCELERATOR`` values -> our backend entry-point names."""

DISTRIBUTIONS: dict[str, str] = {"nvidia_sm100": "deepinfer-nvidia-sm100", "ascend950": "deepinfer-ascend950"}
"""Backends shipped as separate distributions, for the hint in 'not installed' errors."""

_CORE_ENTRY_POINTS = {CPU: "deepinfer_core.backends.cpu:probe"}
"""The core's own backends, used when the core runs from a source tree without installed metadata."""

log = logging.getLogger("deepinfer.backends")


@dataclass(frozen=True)
class BackendEntry:
    """One installed backend: its entry point and the distribution that provides it."""

    name: str
    value: str
    distribution: str | None
    version: str | None


@dataclass(frozen=True)
class BackendChoice:
    """The outcome of selection: which backend, its probe, and a sentence saying why it was chosen."""

    name: str
    probe: ProbeResult
    why: str


def installed_backends() -> dict[str, BackendEntry]:
    """Every backend registered in ``deepinfer.backends``, by name (the first found on sys.path wins)."""
    found: dict[str, BackendEntry] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        name, version = (dist.metadata["Name"], dist.version) if dist is not None else (None, None)
        found.setdefault(ep.name, BackendEntry(ep.name, ep.value, name, version))
    for name, value in _CORE_ENTRY_POINTS.items():
        found.setdefault(name, BackendEntry(name, value, "deepinfer", None))
    return dict(sorted(found.items()))


def probe_backend(entry: BackendEntry) -> ProbeResult:
    """Run one backend's probe. A probe that cannot be imported or raises yields an unavailable result."""
    try:
        result = _import(entry.value)()
    except Exception as exc:  # noqa: BLE001  (a broken backend is reported, not fatal, until it is chosen)
        return _unavailable(entry, f"probe {entry.value} failed: {type(exc).__name__}: {exc}")
    if not isinstance(result, ProbeResult):
        return _unavailable(entry, f"probe {entry.value} returned {type(result).__name__}, not a ProbeResult")
    warning = name_mismatch(entry, result)
    if warning:
        log.warning("%s", warning)
    return result


def name_mismatch(entry: BackendEntry, probe: ProbeResult) -> str | None:
    """A warning when a probe names its backend differently from its entry point, else None (selection, errors and
    plugins use the entry-point name)."""
    if probe.name == entry.name:
        return None
    return (f"backend entry point {entry.name!r} ({entry.distribution or 'unknown distribution'}) has a probe that "
            f"names itself {probe.name!r}; selection uses {entry.name!r}: make ProbeResult.name and the entry-point "
            "name the same")


def probe_backends() -> dict[str, ProbeResult]:
    """Probe every installed backend, by name."""
    return {name: probe_backend(entry) for name, entry in installed_backends().items()}


def requested_backend(name: str | None = None, env: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """The explicitly requested backend name (aliases resolved) and where it came from, or None."""
    if name:
        source = f"requested as {name!r}"
    else:
        name = envs.get(ENV_ACCELERATOR, env) or ""
        source = f"requested by {ENV_ACCELERATOR}={name}"
    if not name:
        return None
    key = name.strip().lower()
    return ALIASES.get(key, key), source


def choose_backend(name: str | None = None, env: Mapping[str, str] | None = None) -> BackendChoice:
    """Apply the selection rule (module docstring) without instantiating the backend."""
    installed = installed_backends()
    explicit = requested_backend(name, env)
    if explicit is not None:
        return _choose_explicit(*explicit, installed)
    probes = {backend: probe_backend(entry) for backend, entry in installed.items()}
    accelerators = sorted(n for n, p in probes.items() if p.available and p.is_accelerator)
    if len(accelerators) == 1:
        return BackendChoice(accelerators[0], probes[accelerators[0]], "the only available accelerator backend")
    if accelerators:
        why = (
            f"several accelerator backends are available ({', '.join(accelerators)}); took the first by name. "
            f"Set {ENV_ACCELERATOR} or pass backend= to choose"
        )
        log.warning("%s: %s", accelerators[0], why)
        return BackendChoice(accelerators[0], probes[accelerators[0]], why)
    others = "; ".join(f"{n}: {p.reason}" for n, p in probes.items() if n != CPU)
    why = f"no accelerator backend is available: {others}" if others else "no accelerator backend is installed"
    return BackendChoice(CPU, probes[CPU], why)


def select_backend(name: str | None = None, env: Mapping[str, str] | None = None, **kwargs: Any) -> Backend:
    """Choose a backend (``choose_backend``) and instantiate it; ``kwargs`` go to its constructor."""
    choice = choose_backend(name, env)
    backend = load_backend_class(choice.probe)(**kwargs)
    log.info("backend %s: %s", choice.name, choice.why)
    return backend


def load_backend_class(probe: ProbeResult) -> type[Backend]:
    """Import ``probe.backend_class`` and check that it is a ``Backend`` subclass."""
    try:
        cls = _import(probe.backend_class)
    except Exception as exc:
        raise BackendUnavailableError(
            f"backend {probe.name!r} probed available but {probe.backend_class} cannot be imported: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise InvalidBackendError(f"backend {probe.name!r}: {probe.backend_class} is not a Backend subclass")
    return cls


def _choose_explicit(name: str, source: str, installed: dict[str, BackendEntry]) -> BackendChoice:
    if name not in installed:
        hint = f"; install the {DISTRIBUTIONS[name]} distribution" if name in DISTRIBUTIONS else ""
        aliases = ", ".join(f"{alias} -> {target}" for alias, target in ALIASES.items())
        raise UnknownBackendError(
            f"unknown backend {name!r} ({source}); installed backends: {', '.join(installed)} "
            f"(aliases: {aliases}){hint}"
        )
    probe = probe_backend(installed[name])
    if not probe.available:
        raise BackendUnavailableError(f"backend {name!r} ({source}) is not available here: {probe.reason}")
    return BackendChoice(name, probe, source)


def _unavailable(entry: BackendEntry, reason: str) -> ProbeResult:
    return ProbeResult(entry.name, False, reason, "", is_accelerator=entry.name != CPU, device_type="unknown")


def _import(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj

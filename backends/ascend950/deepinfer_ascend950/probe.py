"""The ``ascend950`` probe (entry point ``deepinfer.backends``): cheap, and it never imports torch_npu blindly.

Why care: torch_npu registers itself in torch's ``torch.backends`` entry-point group, so once it is installed
``import torch`` auto-loads it; without CANN that load fails ("Failed to load the backend extension:
torch_npu", caused by ``libhccl.so: cannot open shared object file``) and ``import torch`` itself raises. With
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` torch imports, but ``import torch_npu`` still fails on libhccl.so.

So the probe checks, in this order, and stops at the first miss:

1. torch_npu installed? ``importlib.util.find_spec`` (finds the package, runs none of it).
2. torch-npu built for the installed torch's minor series? (distribution metadata only)
3. CANN present? ``ASCEND_HOME_PATH`` / ``ASCEND_TOOLKIT_HOME``, ``/usr/local/Ascend/ascend-toolkit``,
   ``libhccl.so`` on the loader path (``LD_LIBRARY_PATH``, then ``ctypes.util.find_library``).
4. Only then ``import torch_npu`` (guarded), ``torch.npu.is_available()`` and the device names: every
   visible NPU must be an Ascend 950 (SoC name ``Ascend950...``; torch_npu's own torchair check
   ``is_arch35`` groups ``Ascend910_95...`` with it, so that prefix is accepted too).

When torch already auto-loaded torch_npu (CANN present, autoload on), steps 3-4 reduce to the device query.
"""

from __future__ import annotations

import ctypes.util
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer_ascend950 import capabilities
from deepinfer_ascend950.pairing import RECOMMENDED_CANN, check_pair

NAME = "ascend950"
DEVICE_TYPE = "npu"
BACKEND_CLASS = "deepinfer_ascend950.backend:Ascend950Backend"
CANN_HOME_VARIABLES = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
DEFAULT_TOOLKIT_DIRS = ("/usr/local/Ascend/ascend-toolkit",)
ASCEND950_SOC_PREFIXES = ("Ascend950", "Ascend910_95")
AUTOLOAD_VARIABLE = "TORCH_DEVICE_BACKEND_AUTOLOAD"
"""torch's switch for auto-loading ``torch.backends`` entry points (torch/__init__.py, _import_device_backends)."""


@dataclass(frozen=True)
class CannStatus:
    """Where CANN was found (``how``), or every place that was checked and missed (``misses``)."""

    found: bool
    how: str = ""
    home: str | None = None
    hccl: str | None = None  # libhccl.so as the loader finds it, or under the toolkit's lib64
    hccl_loadable: bool = False
    misses: tuple[str, ...] = field(default_factory=tuple)


def find_cann(
    env: Mapping[str, str] | None = None,
    toolkit_dirs: Sequence[str] = DEFAULT_TOOLKIT_DIRS,
    find_library: Callable[[str], str | None] = ctypes.util.find_library,
) -> CannStatus:
    """Look for a CANN toolkit without loading any of it."""
    env = os.environ if env is None else env
    misses: list[str] = []
    homes: list[tuple[str, str]] = []  # (directory, how it was found)
    for variable in CANN_HOME_VARIABLES:
        value = env.get(variable)
        if not value:
            misses.append(f"no {variable}")
        elif Path(value).is_dir():
            homes.append((value, f"{variable}={value}"))
        else:
            misses.append(f"{variable}={value} is not a directory")
    for directory in toolkit_dirs:
        if Path(directory).is_dir():
            homes.append((directory, f"{directory} exists"))
        else:
            misses.append(f"no {directory}")
    loadable = _hccl_on_loader_path(env, find_library)
    under_home = next(
        (str(p) for home, _ in homes for p in (Path(home) / "lib64" / "libhccl.so",
                                                Path(home) / "latest" / "lib64" / "libhccl.so") if p.exists()),
        None,
    )
    if homes:
        home, how = homes[0]
        return CannStatus(True, how, home, loadable or under_home, loadable is not None, tuple(misses))
    if loadable:
        return CannStatus(True, f"libhccl.so at {loadable}", None, loadable, True, tuple(misses))
    misses.append("libhccl.so not loadable")
    return CannStatus(False, misses=tuple(misses))


def _hccl_on_loader_path(env: Mapping[str, str], find_library: Callable[[str], str | None]) -> str | None:
    for directory in env.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        if directory and (Path(directory) / "libhccl.so").exists():
            return str(Path(directory) / "libhccl.so")
    try:
        return find_library("hccl")  # ldconfig cache, then the compiler's / linker's search path
    except Exception:  # noqa: BLE001  (a broken toolchain must not break the probe)
        return None


def set_env_script(home: str | None) -> str:
    """CANN's set_env.sh for a toolkit home (it sits in the home or, for ``.../latest``, one level up)."""
    if home:
        for candidate in (Path(home) / "set_env.sh", Path(home).parent / "set_env.sh"):
            if candidate.is_file():
                return str(candidate)
    return "CANN's set_env.sh"


def is_ascend950(device_name: str) -> bool:
    """Whether a ``torch.npu.get_device_name()`` value names an Ascend 950 SoC."""
    return device_name.replace(" ", "").startswith(ASCEND950_SOC_PREFIXES)


def torch_npu_version() -> str | None:
    """The installed torch-npu distribution's version (metadata only), or None."""
    from importlib import metadata

    for name in ("torch_npu", "torch-npu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def probe() -> Any:
    """Entry point ``deepinfer.backends:ascend950``: whether this backend can run here, and why."""
    return run_probe()


def run_probe(
    env: Mapping[str, str] | None = None,
    *,
    find_spec: Callable[[str], Any] = importlib.util.find_spec,
    import_module: Callable[[str], Any] = importlib.import_module,
    toolkit_dirs: Sequence[str] = DEFAULT_TOOLKIT_DIRS,
    find_library: Callable[[str], str | None] = ctypes.util.find_library,
    torch_version: str | None = None,
    npu_version: str | None = None,
    loaded_modules: Mapping[str, Any] | None = None,
) -> Any:
    """The probe with its environment injectable (tests). Returns a ``ProbeResult``."""
    import torch

    from deepinfer_core.backends.base import ProbeResult

    env = os.environ if env is None else env
    loaded_modules = sys.modules if loaded_modules is None else loaded_modules

    def result(available: bool, reason: str) -> ProbeResult:
        return ProbeResult(NAME, available, f"{reason}; {capabilities.summary()}", BACKEND_CLASS, True, DEVICE_TYPE)

    # 1. installed?
    try:
        spec = find_spec("torch_npu")
    except (ImportError, ValueError) as exc:  # e.g. a half-imported torch_npu left in sys.modules
        spec, spec_error = None, f" ({type(exc).__name__}: {exc})"
    else:
        spec_error = ""
    if spec is None:
        return result(False, (
            f"torch_npu is not installed{spec_error}; on an Ascend 950 host with CANN {RECOMMENDED_CANN} run "
            "`pip install 'deepinfer[ascend950]'` (torch-npu for torch 2.13; pairing table in docs/ascend950.md)"
        ))
    # 2. paired with this torch?
    installed = npu_version if npu_version is not None else torch_npu_version()
    mismatch = check_pair(torch_version or torch.__version__, installed) if installed else None
    if mismatch:
        return result(False, mismatch)
    label = f"torch_npu {installed or '(version unknown)'}"
    # 3. CANN present? (skipped when torch already auto-loaded torch_npu: then it loaded fine)
    module = loaded_modules.get("torch_npu")
    cann = CannStatus(True, "loaded by torch at import") if module is not None else find_cann(
        env, toolkit_dirs, find_library)
    if not cann.found:
        install = (f"CANN not found ({', '.join(cann.misses)}); install CANN {RECOMMENDED_CANN} and source set_env.sh "
                   f"(e.g. {DEFAULT_TOOLKIT_DIRS[0]}/set_env.sh)")
        if env.get(AUTOLOAD_VARIABLE) == "0":
            return result(False, (
                f"{install}; until then keep {AUTOLOAD_VARIABLE}=0 set: with {label} installed and no CANN, "
                "`import torch` fails without it"
            ))
        return result(False, f"{install}, or set {AUTOLOAD_VARIABLE}=0 to keep `import torch` working without it "
                             f"({label} is installed)")
    # 4. import (guarded), then ask the device.
    if module is None:
        try:
            module = import_module("torch_npu")
        except Exception as exc:  # noqa: BLE001  (ImportError/OSError/RuntimeError from CANN libraries)
            return result(False, (
                f"{label} is installed and CANN was found ({cann.how}) but `import torch_npu` failed: "
                f"{type(exc).__name__}: {exc}; source {set_env_script(cann.home)} in this shell so the loader "
                f"finds CANN's lib64 (libhccl.so: {cann.hccl or 'not found'}), and check that the CANN release "
                f"matches {label} (pairing table in docs/ascend950.md)"
            ))
    try:
        npu = module.npu
        if not npu.is_available():
            return result(False, (
                f"{label} imported (CANN: {cann.how}) but torch.npu.is_available() is False: no NPU is visible "
                "to this process; check the driver (`npu-smi info`) and ASCEND_RT_VISIBLE_DEVICES"
            ))
        count = int(npu.device_count())
        names = [str(npu.get_device_name(i)) for i in range(count)]
    except Exception as exc:  # noqa: BLE001
        return result(False, f"{label} imported but querying the NPUs failed: {type(exc).__name__}: {exc}")
    others = sorted({n for n in names if not is_ascend950(n)})
    if not names or others:
        found = ", ".join(sorted(set(names))) or "no devices"
        return result(False, (
            f"found {count} x {found}; this backend targets Ascend 950 (SoC names {'/'.join(ASCEND950_SOC_PREFIXES)}"
            "...), other Ascend SoCs are not supported by deepinfer-ascend950"
        ))
    return result(True, f"found {count} x {names[0]} ({label}, CANN: {cann.how})")

"""The ``deepinfer`` parser and its built-in subcommands ``deepinfer env`` and ``deepinfer plugins``.

Adding a subcommand: write a module with ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int`` (the exit code), next to this one in ``deepinfer_core/cli/``, and add one line to
``SUBCOMMAND_MODULES``. A module that fails to import does not break the other subcommands: its subcommand
prints the error and exits 1.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import platform
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

SUBCOMMAND_MODULES: dict[str, str] = {
    # name -> module exposing HELP, add_arguments(parser), run(args) -> int
    "generate": "deepinfer_core.cli.generate",
    "bench": "deepinfer_core.cli.bench",
    "quantize": "deepinfer_core.cli.quantize",
}


@dataclass(frozen=True)
class Subcommand:
    """One ``deepinfer <name>`` subcommand."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# --- deepinfer env ---------------------------------------------------------------------------------------


def env_report(backend: str | None = None) -> dict[str, Any]:
    """Python, torch, the ``DEEPINFER_*`` variables set, the installed backends with their probe results, and which
    backend would be selected."""
    import torch

    from deepinfer_core import envs, hookspecs
    from deepinfer_core.backends import registry
    from deepinfer_core.errors import DeepInferError

    backends = []
    for name, entry in registry.installed_backends().items():
        probe = registry.probe_backend(entry)
        backends.append({**probe.as_dict(), "name": name, "distribution": entry.distribution, "version": entry.version,
                         "warning": registry.name_mismatch(entry, probe)})
    try:
        choice = registry.choose_backend(backend)
        selected: dict[str, Any] = {"name": choice.name, "why": choice.why, "threads": _engine_threads(choice)}
    except DeepInferError as exc:
        selected = {"name": None, "error": f"{type(exc).__name__}: {exc}"}
    return {
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "platform": platform.platform(),
        "deepinfer": {"version": _version("deepinfer"), "hook_api_version": hookspecs.HOOK_API_VERSION},
        "torch": {
            "version": torch.__version__,
            "cuda_build": torch.version.cuda,
            "hip_build": torch.version.hip,
            "debug": torch.version.debug,
            "threads": torch.get_num_threads(),
        },
        "environment": envs.settings(),
        "undeclared": envs.undeclared(envs.declarations()),
        "backends": backends,
        "selected": selected,
    }


def _engine_threads(choice) -> dict[str, Any]:
    """The torch CPU threads an engine on the chosen backend would run with, and why (``LLM`` applies this)."""
    import os

    import torch

    from deepinfer_core.backends import registry
    from deepinfer_core.backends.host_threads import OMP_VARIABLE

    if OMP_VARIABLE in os.environ:
        return {"count": torch.get_num_threads(), "why": f"{OMP_VARIABLE}={os.environ[OMP_VARIABLE]} chose"}
    try:
        decided = registry.load_backend_class(choice.probe).host_thread_choice()
    except Exception as exc:  # noqa: BLE001  (the report shows why instead of failing)
        return {"count": None, "why": f"cannot ask backend {choice.name}: {type(exc).__name__}: {exc}"}
    if decided is None:
        return {"count": torch.get_num_threads(), "why": "torch's default; the backend keeps it"}
    return {"count": min(decided.count, torch.get_num_threads()), "why": decided.why}


def _add_env_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--backend", help="show what selecting this backend explicitly would do")


def _run_env(args: argparse.Namespace) -> int:
    report = env_report(args.backend)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(_format_env(report))
    return 0 if report["selected"]["name"] else 1


def _format_env(report: dict[str, Any]) -> str:
    py, torch_info, core = report["python"], report["torch"], report["deepinfer"]
    lines = [
        f"Python     {py['version']} ({py['executable']})",
        f"Platform   {report['platform']}",
        f"deepinfer  {core['version']} (hook API {core['hook_api_version']})",
        (
            f"torch      {torch_info['version']} (CUDA build: {torch_info['cuda_build'] or 'none'}, "
            f"HIP build: {torch_info['hip_build'] or 'none'}, threads: {torch_info['threads']})"
        ),
    ]
    lines += [f"{name}={value}" for name, value in report["environment"].items()]
    lines += [f"warning: {name} is set, but no installed package reads it (docs/configuration.md)"
              for name in report["undeclared"]]
    lines += ["", "Backends:"]
    for b in report["backends"]:
        state = "available" if b["available"] else "unavailable"
        kind = "accelerator" if b["is_accelerator"] else "host"
        origin = f"{b['distribution'] or '?'} {b['version'] or ''}".strip()
        lines.append(f"  {b['name']:<14} {state:<12} {kind:<12} {b['reason']}  [{origin}]")
        if b["warning"]:
            lines.append(f"    warning: {b['warning']}")
    selected = report["selected"]
    lines.append("")
    if selected["name"]:
        lines.append(f"Selected backend: {selected['name']} ({selected['why']})")
        threads = selected["threads"]
        lines.append(f"Engine CPU threads: {threads['count']} ({threads['why']})")
    else:
        lines.append(f"Selected backend: none: {selected['error']}")
    return "\n".join(lines)


# --- deepinfer plugins -----------------------------------------------------------------------------------


def plugins_report() -> dict[str, Any]:
    """Every plugin the process tried to load: distribution, version, hook API version, hooks, status."""
    from deepinfer_core import envs, hookspecs, plugins

    logging.getLogger("deepinfer.plugins").setLevel(logging.ERROR)  # the report shows the failures itself
    pm = plugins.get_plugin_manager()
    return {
        "hook_api_version": hookspecs.HOOK_API_VERSION,
        "entry_point_group": plugins.ENTRY_POINT_GROUP,
        "environment": {plugins.ENV_PLUGINS: envs.get(plugins.ENV_PLUGINS)},
        "plugins": [record.as_dict() for _, record in sorted(pm.records.items())],
    }


def _add_plugins_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _run_plugins(args: argparse.Namespace) -> int:
    report = plugins_report()
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(_format_plugins(report, verbose=args.verbose > 0))
    return 1 if any(p["status"] in ("failed", "missing") for p in report["plugins"]) else 0


def _format_plugins(report: dict[str, Any], verbose: bool) -> str:
    rows = report["plugins"]
    header = f"Hook API version {report['hook_api_version']}; entry-point group {report['entry_point_group']}"
    if not rows:
        return f"{header}\nNo plugins installed."
    lines = [header, ""]
    for p in rows:
        origin = f"{p['distribution'] or '?'} {p['version'] or ''}".strip()
        api = "-" if p["hook_api_version"] is None else p["hook_api_version"]
        lines.append(f"{p['name']}  [{origin}]  api {api}  {p['status']}")
        if p["hooks"]:
            lines.append(f"    hooks: {', '.join(p['hooks'])}")
        if p["error"]:
            lines.append(f"    {p['error']}")
        if verbose and p["traceback"]:
            lines += ["    " + line for line in p["traceback"].rstrip().splitlines()]
    if not verbose and any(p["traceback"] for p in rows):
        lines += ["", "Run `deepinfer plugins -v` for full tracebacks."]
    return "\n".join(lines)


# --- the parser ------------------------------------------------------------------------------------------

BUILTIN_SUBCOMMANDS = (
    Subcommand("env", "show Python, torch and the installed backends", _add_env_arguments, _run_env),
    Subcommand("plugins", "list installed plugins and their load status", _add_plugins_arguments, _run_plugins),
)


def _module_subcommand(name: str, module_path: str) -> Subcommand:
    """A registered subcommand; if its module cannot be imported, one that reports that and exits 1."""
    try:
        module = importlib.import_module(module_path)
        return Subcommand(name, module.HELP, module.add_arguments, module.run)
    except Exception as exc:  # noqa: BLE001  (one broken subcommand must not break `env` and `plugins`)
        error = f"deepinfer {name}: cannot import {module_path}: {type(exc).__name__}: {exc}"
        detail = traceback.format_exc()

        def report_error(args: argparse.Namespace) -> int:
            print(error, file=sys.stderr)
            if args.verbose:
                print(detail, file=sys.stderr)
            return 1

        return Subcommand(name, f"(unavailable: {type(exc).__name__})", lambda parser: None, report_error)


def subcommands() -> list[Subcommand]:
    """The built-in subcommands followed by those in ``SUBCOMMAND_MODULES``."""
    return [*BUILTIN_SUBCOMMANDS, *(_module_subcommand(n, m) for n, m in SUBCOMMAND_MODULES.items())]


class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser that adds the subcommand's options only when it is parsed or its help is shown.

    Some option lists come from modules that import torch (``bench --preset``'s choices), so ``deepinfer --help``
    and every other subcommand parse without importing them. Before adding the options it checks that ``import
    torch`` works, and exits 1 with the fix where it does not (``torch_import_problem``).
    """

    def __init__(self, *args: Any, add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._pending_arguments = add_arguments

    def _add_pending_arguments(self) -> None:
        add, self._pending_arguments = self._pending_arguments, None
        if add is None:
            return
        problem = torch_import_problem()
        if problem is not None:  # say how to fix a broken `import torch` instead of dying in a traceback
            print(problem, file=sys.stderr)
            raise SystemExit(1)
        add(self)

    def parse_known_args(self, args=None, namespace=None):
        self._add_pending_arguments()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._add_pending_arguments()
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    """The ``deepinfer`` argument parser with every subcommand (each adds its options when it is parsed)."""
    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepInfer, open: inference for DeepSeek-V4.")
    parser.add_argument("--version", action="version", version=f"deepinfer {_version('deepinfer')}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="count", default=0,
                        help="-v: what the engine is doing (info logs) and tracebacks; -vv: debug logs too")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_SubcommandParser)
    for command in subcommands():
        child = sub.add_parser(command.name, help=command.help, description=command.help, parents=[common],
                               add_arguments=command.add_arguments)
        child.set_defaults(run=command.run)
    return parser


INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT: what a shell reports for a command Ctrl-C stopped


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point: parse ``argv`` and run the subcommand; returns its exit code (130 after Ctrl-C,
    with one line on stderr instead of a traceback)."""
    try:
        args = build_parser().parse_args(argv)
        configure_logging(args.verbose)
        return args.run(args)
    except KeyboardInterrupt:
        print("deepinfer: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE


def configure_logging(verbose: int) -> None:
    """Warnings only by default; ``-v`` adds DeepInfer's info logs (model, backend, sizes, timings), ``-vv`` every
    library's debug logs."""
    logging.basicConfig(level=logging.DEBUG if verbose > 1 else logging.WARNING, format="%(name)s: %(message)s")
    if verbose == 1:
        logging.getLogger("deepinfer").setLevel(logging.INFO)


# --- `import torch` guard --------------------------------------------------------------------------------
# torch auto-loads out-of-tree device extensions registered in entry-point group "torch.backends" (torch/__init__.py,
# _import_device_backends). One that cannot load makes `import torch` itself raise, e.g. torch_npu installed
# without CANN: "Failed to load the backend extension: torch_npu" caused by "libhccl.so: cannot open shared object
# file". Every subcommand needs torch, so its parser checks before adding its options and prints the fix (added
# with the ascend950 backend, issue 7; see docs/ascend950.md). The cause chain names the failing extension;
# torch_npu is only the worked example.

TORCH_AUTOLOAD_VARIABLE = "TORCH_DEVICE_BACKEND_AUTOLOAD"


def torch_import_problem() -> str | None:
    """None when ``import torch`` works; else what failed (the whole cause chain) and how to fix it."""
    try:
        import torch  # noqa: F401
    except Exception as exc:  # noqa: BLE001  (any failure here must become a message, not a traceback)
        chain, seen, current = [], set(), exc
        while current is not None and id(current) not in seen:
            seen.add(id(current))
            chain.append(f"{type(current).__name__}: {current}")
            current = current.__cause__ or current.__context__
        lines = ["deepinfer: `import torch` failed, so no command can run.", *(f"  {c}" for c in chain)]
        if "backend extension" in str(exc):
            lines += [
                "A torch device extension (entry-point group 'torch.backends') failed to load while torch imported.",
                (
                    "Fix: install and activate the runtime that extension needs (for torch_npu: CANN, then source its "
                    "set_env.sh; docs/ascend950.md),"
                ),
                (
                    f"or set {TORCH_AUTOLOAD_VARIABLE}=0 to import torch without auto-loading device extensions "
                    "(`deepinfer env` then says why that backend is unavailable), or uninstall the extension."
                ),
            ]
        else:
            lines.append("Fix: reinstall torch (`pip install torch==2.13.0`, the CPU build) in this environment.")
        return "\n".join(lines)
    return None


def _version(distribution: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"

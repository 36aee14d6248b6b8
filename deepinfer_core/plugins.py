"""The plugin manager: loads ``deepinfer.plugins`` entry points into one pluggy manager per process.

``get_plugin_manager()`` is the one entry point the rest of the core uses. It discovers the entry points
of group ``deepinfer.plugins``, loads each by name (sorted), checks its declared hook API version and its
hook implementations against ``deepinfer_core.hookspecs``, and keeps going when one plugin is broken:
the failure is recorded (entry-point name, distribution, error, full traceback), logged, and shown by
``deepinfer plugins``. The result is cached for the process; a spawned worker builds its own.

Environment: ``DEEPINFER_PLUGINS`` unset or empty loads every installed plugin; ``DEEPINFER_PLUGINS=a,b``
loads only the entry points named ``a`` and ``b``; ``DEEPINFER_PLUGINS=none`` loads none.
``DEEPINFER_STRICT_PLUGINS=1`` makes ``check_strict`` (called by ``LLM``) refuse to run while any plugin failed.

The core calls hooks only through ``call_hook`` / ``call_historic_hook``: an implementation that raises fails the
call with an error naming the plugin, its distribution, the hook and the original exception.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import threading
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy

from deepinfer_core import envs, hookspecs
from deepinfer_core.engine_context import EngineContext
from deepinfer_core.errors import (
    DeepInferError,
    PluginHookError,
    PluginValidationError,
    StrictPluginsError,
    UnknownOptionError,
    UnsupportedBackendError,
)

try:  # the stdlib version lacks some selection helpers on older Pythons; the backport is a core dependency
    import importlib_metadata as metadata
except ImportError:  # pragma: no cover
    from importlib import metadata  # type: ignore[no-redef]

ENTRY_POINT_GROUP = "deepinfer.plugins"
ENV_PLUGINS = "DEEPINFER_PLUGINS"
ENV_STRICT = "DEEPINFER_STRICT_PLUGINS"
HOOK_PREFIX = "deepinfer_"

LOADED, FAILED, SKIPPED, MISSING = "loaded", "failed", "skipped", "missing"

log = logging.getLogger("deepinfer.plugins")


@dataclass
class PluginRecord:
    """What happened to one plugin: loaded, failed (with its error and traceback), skipped or missing."""

    name: str
    status: str
    value: str = ""
    distribution: str | None = None
    version: str | None = None
    hook_api_version: Any = None
    hooks: list[str] = field(default_factory=list)
    error: str | None = None
    traceback: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``deepinfer plugins --json``)."""
        return dict(vars(self))


class PluginManager(pluggy.PluginManager):
    """pluggy's manager for project ``"deepinfer"`` plus a record of every plugin it tried to load.

    Unlike plain pluggy, functions named ``deepinfer_*`` count as hook implementations even without the
    ``@hookimpl`` marker, so a misspelt hook name is reported instead of silently ignored.
    """

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}

    def parse_hookimpl_opts(self, plugin: Any, name: str) -> Any:
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith(HOOK_PREFIX) and inspect.isroutine(getattr(plugin, name, None)):
            opts = {}
        return opts

    def loaded_names(self) -> list[str]:
        """Names of the plugins that loaded, sorted."""
        return sorted(name for name, record in self.records.items() if record.status == LOADED)

    def failures(self) -> list[PluginRecord]:
        """Records of the plugins that failed to import or validate."""
        return [record for record in self.records.values() if record.status == FAILED]


# --- loading ---------------------------------------------------------------------------------------


def new_plugin_manager() -> PluginManager:
    """A manager with the hookspecs and no plugins (tests and embedders build their own with this)."""
    return PluginManager()


def discover_entry_points(group: str = ENTRY_POINT_GROUP) -> list[metadata.EntryPoint]:
    """Installed entry points of ``group``, one per name (the first found on ``sys.path`` wins), sorted."""
    unique: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=group):
        unique.setdefault(ep.name, ep)
    return [unique[name] for name in sorted(unique)]


def allow_list(env: Mapping[str, str] | None = None) -> set[str] | None:
    """Entry-point names allowed by ``DEEPINFER_PLUGINS``: ``None`` for all, an empty set for none."""
    raw = envs.get(ENV_PLUGINS, env) or ""
    if not raw:
        return None
    names = {part.strip() for part in raw.split(",") if part.strip()}
    return set() if names <= {"none"} else names - {"none"}


def load_plugins(
    pm: PluginManager,
    entry_points: Iterable[metadata.EntryPoint] | None = None,
    env: Mapping[str, str] | None = None,
) -> PluginManager:
    """Load ``entry_points`` (default: every installed ``deepinfer.plugins`` one) into ``pm``.

    Honours ``DEEPINFER_PLUGINS``; skips names already recorded, so calling it twice is harmless.
    Never raises for a broken plugin: see ``pm.failures()``.
    """
    eps = discover_entry_points() if entry_points is None else sorted(entry_points, key=lambda ep: ep.name)
    allowed = allow_list(env)
    for ep in eps:
        if ep.name in pm.records:
            continue
        if allowed is not None and ep.name not in allowed:
            reason = f"{ENV_PLUGINS}=none" if not allowed else f"not listed in {ENV_PLUGINS}"
            pm.records[ep.name] = _record(ep, SKIPPED, error=reason)
            continue
        _load_entry_point(pm, ep)
    for name in sorted((allowed or set()) - {ep.name for ep in eps} - set(pm.records)):
        known = ", ".join(ep.name for ep in eps) or "none"
        message = f"plugin {name!r} is listed in {ENV_PLUGINS} but not installed (installed plugins: {known})"
        pm.records[name] = PluginRecord(name=name, status=MISSING, error=message)
        log.warning(message)
    return pm


def register_plugin(
    pm: PluginManager,
    plugin: Any,
    name: str,
    distribution: str | None = None,
    version: str | None = None,
) -> PluginRecord:
    """Validate and register an already-imported ``plugin`` under ``name``; raise ``PluginValidationError``.

    Use it to register a plugin programmatically (e.g. ``LLM(plugins=[module])``); entry-point plugins go
    through the same checks.
    """
    who = _describe(name, distribution)
    declared = _declared_api_version(plugin)
    _check_api_version(declared, who)
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        raise PluginValidationError(_explain_bad_hookimpl(pm, plugin, who, exc)) from exc
    try:
        _check_hooks_known(pm, plugin, who)
    except PluginValidationError:
        pm.unregister(plugin)
        raise
    hooks = sorted(caller.name for caller in pm.get_hookcallers(plugin) or [])
    record = PluginRecord(
        name, LOADED, distribution=distribution, version=version, hook_api_version=declared, hooks=hooks
    )
    pm.records[name] = record
    return record


def _load_entry_point(pm: PluginManager, ep: metadata.EntryPoint) -> None:
    dist, version = _distribution_of(ep)
    plugin = None
    try:
        plugin = ep.load()
        record = register_plugin(pm, plugin, ep.name, dist, version)
    except Exception as exc:  # noqa: BLE001  (a broken plugin must never take the others down with it)
        record = _record(ep, FAILED, error=f"{type(exc).__name__}: {exc}", tb=traceback.format_exc())
        record.hook_api_version = None if plugin is None else _declared_api_version(plugin)
        log.warning("could not load %s: %s", _describe(ep.name, dist), record.error)
        log.debug("%s", record.traceback)
    else:
        record.value = ep.value
    pm.records[ep.name] = record


def _record(ep: metadata.EntryPoint, status: str, error: str | None = None, tb: str | None = None) -> PluginRecord:
    dist, version = _distribution_of(ep)
    return PluginRecord(ep.name, status, ep.value, dist, version, error=error, traceback=tb)


def _distribution_of(ep: metadata.EntryPoint) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    return dist.metadata["Name"], dist.version


def _describe(name: str, distribution: str | None) -> str:
    return f"plugin {name!r} (distribution {distribution or 'unknown'})"


# --- validation ------------------------------------------------------------------------------------


def _declared_api_version(plugin: Any) -> Any:
    declared = getattr(plugin, hookspecs.PLUGIN_VERSION_ATTRIBUTE, None)
    if declared is None and not inspect.ismodule(plugin):
        module = inspect.getmodule(type(plugin))
        declared = getattr(module, hookspecs.PLUGIN_VERSION_ATTRIBUTE, None)
    return declared


def _check_api_version(declared: Any, who: str) -> None:
    expected = hookspecs.HOOK_API_VERSION
    attr = hookspecs.PLUGIN_VERSION_ATTRIBUTE
    if declared is None:
        raise PluginValidationError(f"{who} does not declare {attr}; add `{attr} = {expected}` to the plugin module")
    if declared != expected or isinstance(declared, bool):
        raise PluginValidationError(
            f"{who} declares {attr} = {declared!r}, but this deepinfer implements hook API version {expected}; "
            "install a plugin release built for this deepinfer, or a deepinfer matching the plugin"
        )


def _check_hooks_known(pm: PluginManager, plugin: Any, who: str) -> None:
    """pluggy's ``check_pending``, scoped to one plugin so the error names it."""
    for caller in pm.get_hookcallers(plugin) or []:
        if caller.has_spec():
            continue
        if all(impl.optionalhook for impl in caller.get_hookimpls() if impl.plugin is plugin):
            continue
        known = [spec.__name__ for spec in hookspecs.hook_specs()]
        close = difflib.get_close_matches(caller.name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; known hooks: {', '.join(known)}"
        raise PluginValidationError(f"{who} implements unknown hook {caller.name!r}{hint}")


def _explain_bad_hookimpl(pm: PluginManager, plugin: Any, who: str, exc: Exception) -> str:
    """Rephrase pluggy's registration error so it names the plugin, its distribution and the hook."""
    for attr in dir(plugin):
        opts = pm.parse_hookimpl_opts(plugin, attr)
        hook_name = (opts or {}).get("specname") or attr
        caller = getattr(pm.hook, hook_name, None)
        if opts is None or caller is None or caller.spec is None:
            continue
        spec_args = [*caller.spec.argnames, *caller.spec.kwargnames]
        extra = [arg for arg in _required_args(getattr(plugin, attr)) if arg not in spec_args]
        if extra:
            return (
                f"{who}: hook {hook_name!r} has an invalid signature: argument(s) {', '.join(extra)} not in the "
                f"spec {hook_name}({', '.join(spec_args)}); accept a subset of those names"
            )
    return f"{who} is rejected by pluggy: {exc}"


def _required_args(fn: Any) -> list[str]:
    """Positional parameters without a default: the ones pluggy will pass by name from the spec."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = inspect.signature(fn).parameters.values()
    return [p.name for p in params if p.kind in positional and p.default is p.empty]


# --- using the plugins --------------------------------------------------------------------------------


def claimed_options(pm: pluggy.PluginManager) -> dict[str, list[str]]:
    """Feature option name -> names of the plugins that claim it (``deepinfer_feature_options``)."""
    claims: dict[str, list[str]] = {}
    for impl in pm.hook.deepinfer_feature_options.get_hookimpls():
        if impl.hookwrapper or impl.wrapper:
            continue
        for option in _call_impl(pm, "deepinfer_feature_options", impl, {}) or {}:
            claims.setdefault(option, []).append(impl.plugin_name)
    return claims


def validate_options(pm: pluggy.PluginManager, options: Mapping[str, Any]) -> None:
    """Raise ``UnknownOptionError`` for a feature option that no loaded plugin claims."""
    claims = claimed_options(pm)
    unknown = sorted(set(options) - set(claims))
    if unknown:
        known = ", ".join(sorted(claims)) or "none"
        raise UnknownOptionError(
            f"unknown option(s) {', '.join(unknown)}: no loaded plugin claims them (claimed options: {known}). "
            "Check the spelling, or install and enable the plugin that provides the feature "
            "(`deepinfer plugins` lists what is loaded)"
        )


def check_backend_support(pm: pluggy.PluginManager, backend_name: str, options: Mapping[str, Any]) -> None:
    """Raise ``UnsupportedBackendError`` when an active plugin does not support ``backend_name``."""
    claims = claimed_options(pm)
    for impl in pm.hook.deepinfer_supported_backends.get_hookimpls():
        if impl.hookwrapper or impl.wrapper:
            continue
        supported = _call_impl(pm, "deepinfer_supported_backends", impl, {})
        if supported is None:
            continue
        supported = sorted(supported)
        own_options = sorted(option for option, owners in claims.items() if impl.plugin_name in owners)
        active = not own_options or any(option in options for option in own_options)
        if active and backend_name not in supported:
            because = f" (enabled by option {', '.join(o for o in own_options if o in options)})" if own_options else ""
            raise UnsupportedBackendError(
                f"plugin {impl.plugin_name!r}{because} does not support backend {backend_name!r}; it supports: "
                f"{', '.join(supported) or 'none'}. Choose one of those backends, or disable the plugin "
                f"({ENV_PLUGINS} lists the plugins to load)"
            )


def configure_plugins(
    pm: pluggy.PluginManager,
    config: Mapping[str, str] | None = None,
    options: Mapping[str, Any] | None = None,
    backend_name: str | None = None,
    *,
    context: EngineContext | None = None,
) -> EngineContext:
    """Validate the options, check backend support, then call the historic ``deepinfer_configure``.

    ``context`` is the engine's ``EngineContext``; without one, a bare context of ``backend_name`` (default
    ``"cpu"``) and ``options`` is made (tests). Returns the context, to pass on to ``Backend.make_op_table``.
    """
    if context is None:
        context = EngineContext(backend_name or "cpu", options or {})
    validate_options(pm, context.options)
    check_backend_support(pm, context.backend_name, context.options)
    if config is None and context.model_dir is not None:
        config = {"model": str(context.model_dir)}
    call_historic_hook(pm, "deepinfer_configure", {"config": config, "options": context.options, "context": context})
    return context


def plugin_logits_processors(pm: pluggy.PluginManager, context: EngineContext) -> list[Callable]:
    """The logits processors the plugins contribute for ``context``'s engine (``deepinfer_logits_processors``), in
    the plugins' registration order (entry-point names, sorted)."""
    from deepinfer_core.sampling.logits_processor import check_processors

    processors: list[Callable] = []
    for impl in pm.hook.deepinfer_logits_processors.get_hookimpls():
        if impl.hookwrapper or impl.wrapper:
            continue
        contributed = _call_impl(pm, "deepinfer_logits_processors", impl, {"context": context})
        if contributed:
            who = _describe(impl.plugin_name, _distribution_name(pm, impl.plugin_name))
            processors += check_processors(contributed, f"{who}, hook deepinfer_logits_processors")
    return processors


def check_strict(pm: PluginManager, env: Mapping[str, str] | None = None) -> None:
    """With ``DEEPINFER_STRICT_PLUGINS=1``, raise ``StrictPluginsError`` naming every plugin that failed to load
    or is listed in ``DEEPINFER_PLUGINS`` but missing."""
    if not envs.get(ENV_STRICT, env):
        return
    bad = [record for record in pm.records.values() if record.status in (FAILED, MISSING)]
    if bad:
        listed = "; ".join(f"{_describe(r.name, r.distribution)}: {r.error}" for r in bad)
        raise StrictPluginsError(f"{ENV_STRICT}=1 and {len(bad)} plugin(s) failed: {listed}. Fix or uninstall them, "
                                 f"leave them out with {ENV_PLUGINS}, or unset {ENV_STRICT} "
                                 "(`deepinfer plugins -v` shows the tracebacks)")


def failure_lines(pm: PluginManager) -> list[str]:
    """One line per plugin that failed to load or is missing: who, and the error."""
    return [f"{_describe(r.name, r.distribution)} {'failed to load' if r.status == FAILED else 'is missing'}: "
            f"{r.error}" for r in pm.records.values() if r.status in (FAILED, MISSING)]


# --- calling hooks --------------------------------------------------------------------------------------


def call_hook(pm: pluggy.PluginManager, name: str, **kwargs: Any) -> Any:
    """Call hook ``name`` with ``kwargs`` (pluggy's result); a raising implementation fails it naming its plugin."""
    try:
        return getattr(pm.hook, name)(**kwargs)
    except Exception as exc:
        raise _blamed(pm, name, exc, _culprit(pm, name, exc)) from exc


def call_historic_hook(pm: pluggy.PluginManager, name: str, kwargs: Mapping[str, Any]) -> None:
    """``call_hook`` for a historic hook: also replayed to plugins registered later."""
    try:
        getattr(pm.hook, name).call_historic(kwargs=dict(kwargs))
    except Exception as exc:
        raise _blamed(pm, name, exc, _culprit(pm, name, exc)) from exc


def _call_impl(pm: pluggy.PluginManager, name: str, impl: Any, kwargs: Mapping[str, Any]) -> Any:
    """One implementation of hook ``name``, given the arguments it asks for."""
    try:
        return impl.function(*(kwargs[arg] for arg in impl.argnames))
    except Exception as exc:
        raise _blamed(pm, name, exc, impl) from exc


def _culprit(pm: pluggy.PluginManager, name: str, exc: Exception) -> Any:
    """The hook implementation a traceback passes through (the frame pluggy called), or None."""
    impls = {getattr(impl.function, "__code__", None): impl for impl in getattr(pm.hook, name).get_hookimpls()}
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in impls:
            return impls[tb.tb_frame.f_code]
        tb = tb.tb_next
    return None


def _blamed(pm: pluggy.PluginManager, name: str, exc: Exception, impl: Any) -> Exception:
    """The error to raise for ``exc`` from ``impl`` of hook ``name``: a ``DeepInferError`` the plugin raised on purpose
    keeps its class and gains the plugin and hook in its message; any other becomes a ``PluginHookError``."""
    if impl is None or isinstance(exc, PluginHookError):
        return exc
    who = _describe(impl.plugin_name, _distribution_name(pm, impl.plugin_name))
    if isinstance(exc, DeepInferError):
        message = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
        exc.args = (f"{who}, hook {name}: {message}", *exc.args[1:])
        return exc
    error = PluginHookError(f"{who} failed in hook {name}: {type(exc).__name__}: {exc}")
    error.plugin, error.hook, error.original = impl.plugin_name, name, exc
    return error


def _distribution_name(pm: pluggy.PluginManager, plugin_name: str) -> str | None:
    record = getattr(pm, "records", {}).get(plugin_name)
    return record.distribution if record is not None else None


# --- the process-wide manager -------------------------------------------------------------------------

_manager: PluginManager | None = None
_lock = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process's plugin manager, with every allowed installed plugin loaded (built on first call)."""
    global _manager
    with _lock:
        if _manager is None:
            _manager = load_plugins(new_plugin_manager())
        return _manager


def reset_plugin_manager() -> None:
    """Forget the cached manager (tests; a later ``get_plugin_manager()`` loads again)."""
    global _manager
    with _lock:
        _manager = None

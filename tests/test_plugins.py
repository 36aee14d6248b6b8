"""Plugin loading through real entry points: failures are isolated and named, hooks are validated,
``DEEPINFER_PLUGINS`` filters, and loading happens once per process (again in a spawned worker)."""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest

from deepinfer_core import plugins
from deepinfer_core.backends.cpu import CpuBackend
from deepinfer_core.errors import PluginValidationError, UnknownOptionError, UnsupportedBackendError
from deepinfer_core.ops.table import UnknownOpError
from deepinfer_core.plugins import configure_plugins, load_plugins, new_plugin_manager, register_plugin

HEADER = "from deepinfer_core.hookspecs import hookimpl\nDEEPINFER_HOOK_API_VERSION = 1\n"

GOOD = (
    HEADER
    + """
@hookimpl
def deepinfer_feature_options():
    return {"good_feature": "a feature"}

@hookimpl
def deepinfer_rebuild_sliding_window(request, num_cached_tokens, sliding_window):
    return num_cached_tokens - sliding_window
"""
)

BROKEN_IMPORT = HEADER + "raise RuntimeError('boom at import of broken_plugin')\n"

BAD_SIGNATURE = (
    HEADER
    + """
@hookimpl
def deepinfer_register_ops(op_table, backend_name, device):
    pass
"""
)

MISSPELT_HOOK = HEADER + "def deepinfer_register_opps(op_table):\n    pass\n"


@pytest.fixture(autouse=True)
def _no_plugin_env(monkeypatch):
    monkeypatch.delenv(plugins.ENV_PLUGINS, raising=False)
    plugins.reset_plugin_manager()
    yield
    plugins.reset_plugin_manager()


def only(*names: str) -> dict[str, str]:
    """An environment that allow-lists ``names`` (keeps the real installed plugins out of a test)."""
    return {plugins.ENV_PLUGINS: ",".join(names)}


def plugin_dist(make_distribution, name: str, source: str, version: str = "0.1.0"):
    """One distribution ``deepinfer-<name>`` whose entry point ``<name>`` is module ``<name>_plugin``."""
    return make_distribution(
        f"deepinfer-{name}",
        version,
        entry_points={"deepinfer.plugins": {name: f"{name}_plugin"}},
        modules={f"{name}_plugin": source},
    )


def test_plugin_raising_on_import_is_reported_by_name_while_others_load(make_distribution):
    plugin_dist(make_distribution, "good", GOOD)
    plugin_dist(make_distribution, "broken", BROKEN_IMPORT, version="2.5.0")

    pm = load_plugins(new_plugin_manager())  # every installed plugin, the real ones included

    broken = pm.records["broken"]
    assert broken.status == "failed"
    assert broken.distribution == "deepinfer-broken" and broken.version == "2.5.0"
    assert broken.error == "RuntimeError: boom at import of broken_plugin"
    assert "Traceback" in broken.traceback and "broken_plugin.py" in broken.traceback
    assert pm.get_plugin("broken") is None
    assert pm.records["good"].status == "loaded"
    assert pm.hook.deepinfer_rebuild_sliding_window(request=None, num_cached_tokens=1000, sliding_window=128, hit=None,
                                                   context=None) == 872


def test_failure_is_logged_with_traceback(make_distribution, caplog):
    plugin_dist(make_distribution, "broken", BROKEN_IMPORT)
    with caplog.at_level("WARNING", logger="deepinfer.plugins"):
        load_plugins(new_plugin_manager(), env=only("broken"))
    assert "plugin 'broken' (distribution deepinfer-broken)" in caplog.text
    assert "boom at import of broken_plugin" in caplog.text


def test_hookimpl_with_wrong_signature_is_rejected_naming_plugin_and_hook(make_distribution):
    plugin_dist(make_distribution, "badsig", BAD_SIGNATURE)
    plugin_dist(make_distribution, "good", GOOD)

    pm = load_plugins(new_plugin_manager(), env=only("badsig", "good"))

    record = pm.records["badsig"]
    assert record.status == "failed"
    assert "plugin 'badsig' (distribution deepinfer-badsig)" in record.error
    assert "'deepinfer_register_ops'" in record.error and "device" in record.error
    assert pm.get_plugin("badsig") is None
    assert [impl.plugin_name for impl in pm.hook.deepinfer_register_ops.get_hookimpls()] == []
    assert pm.records["good"].status == "loaded"


def test_unknown_hook_name_is_rejected_with_a_suggestion(make_distribution):
    plugin_dist(make_distribution, "typo", MISSPELT_HOOK)

    pm = load_plugins(new_plugin_manager(), env=only("typo"))

    record = pm.records["typo"]
    assert record.status == "failed"
    assert "plugin 'typo' (distribution deepinfer-typo)" in record.error
    assert "unknown hook 'deepinfer_register_opps'" in record.error
    assert "did you mean 'deepinfer_register_ops'" in record.error
    assert pm.get_plugin("typo") is None
    assert not pm.hook.deepinfer_register_opps.get_hookimpls()


@pytest.mark.parametrize(
    ("declaration", "expected"),
    [("", "does not declare DEEPINFER_HOOK_API_VERSION"), ("DEEPINFER_HOOK_API_VERSION = 2\n", "= 2, but")],
)
def test_wrong_or_missing_hook_api_version_is_rejected(make_distribution, declaration, expected):
    source = "from deepinfer_core.hookspecs import hookimpl\n" + declaration
    plugin_dist(make_distribution, "old", source + "def deepinfer_configure(options):\n    pass\n")

    record = load_plugins(new_plugin_manager(), env=only("old")).records["old"]

    assert record.status == "failed"
    assert expected in record.error and "plugin 'old' (distribution deepinfer-old)" in record.error
    assert record.hook_api_version == (2 if declaration else None)


def test_register_plugin_raises_for_programmatic_registration():
    import types

    module = types.ModuleType("inline_plugin")
    module.DEEPINFER_HOOK_API_VERSION = 1
    module.deepinfer_after_step = lambda engine, scheduler_output, model_output, extra: None
    pm = new_plugin_manager()
    with pytest.raises(PluginValidationError, match=r"'inline'.*'deepinfer_after_step'.*extra"):
        register_plugin(pm, module, "inline")


def test_unmarked_hook_function_is_still_an_implementation(make_distribution):
    plugin_dist(make_distribution, "plain", HEADER + "def deepinfer_feature_options():\n    return {'plain': ''}\n")
    pm = load_plugins(new_plugin_manager(), env=only("plain"))
    assert pm.records["plain"].hooks == ["deepinfer_feature_options"]
    assert plugins.claimed_options(pm) == {"plain": ["plain"]}


def test_allow_list_loads_only_named_plugins_and_never_imports_the_others(make_distribution):
    site = plugin_dist(make_distribution, "good", GOOD)
    marker = site / "imported.txt"
    plugin_dist(make_distribution, "other", HEADER + f"open({str(marker)!r}, 'a').write('x')\n")

    pm = load_plugins(new_plugin_manager(), env={"DEEPINFER_PLUGINS": "good, absent"})

    assert pm.loaded_names() == ["good"]
    assert pm.records["other"].status == "skipped"
    assert not marker.exists()
    assert pm.records["absent"].status == "missing"
    assert "not installed" in pm.records["absent"].error


def test_none_disables_autoload(make_distribution):
    plugin_dist(make_distribution, "good", GOOD)
    pm = load_plugins(new_plugin_manager(), env={"DEEPINFER_PLUGINS": "none"})
    assert pm.loaded_names() == []
    assert pm.records["good"].status == "skipped"


def test_load_plugins_twice_is_harmless(make_distribution):
    plugin_dist(make_distribution, "good", GOOD)
    pm = load_plugins(new_plugin_manager())
    load_plugins(pm)
    assert pm.records["good"].status == "loaded"
    names = [impl.plugin_name for impl in pm.hook.deepinfer_feature_options.get_hookimpls()]
    assert "good" in names and len(names) == len(set(names))  # each plugin's hooks registered once


COUNTED = (
    HEADER
    + """
import os
with open(os.environ["COUNTED_PLUGIN_LOG"], "a") as log:
    log.write(f"{os.getpid()}\\n")

def deepinfer_feature_options():
    return {"counted": "test option"}
"""
)

SPAWN_CHILD = """
import json, os
from deepinfer_core import plugins

def run(out_path):
    first = plugins.get_plugin_manager()
    second = plugins.get_plugin_manager()
    with open(out_path, "w") as f:
        json.dump({"pid": os.getpid(), "same": first is second, "loaded": first.loaded_names()}, f)
"""


def _imports_by_pid(log_path) -> list[int]:
    return [int(line) for line in log_path.read_text().split()]


def test_plugins_load_once_per_process_and_again_in_a_spawned_worker(make_distribution, monkeypatch):
    site = plugin_dist(make_distribution, "counted", COUNTED)
    make_distribution("spawn-helper", modules={"spawn_child": SPAWN_CHILD})
    log_path = site / "imports.log"
    monkeypatch.setenv("COUNTED_PLUGIN_LOG", str(log_path))
    monkeypatch.setenv(plugins.ENV_PLUGINS, "counted")

    first = plugins.get_plugin_manager()
    assert plugins.get_plugin_manager() is first
    assert first.loaded_names() == ["counted"]
    assert _imports_by_pid(log_path) == [os.getpid()]

    import spawn_child

    out_path = site / "child.json"
    child = multiprocessing.get_context("spawn").Process(target=spawn_child.run, args=(str(out_path),))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0

    result = json.loads(out_path.read_text())
    assert result["pid"] != os.getpid()
    assert result == {"pid": result["pid"], "same": True, "loaded": ["counted"]}
    assert _imports_by_pid(log_path) == [os.getpid(), result["pid"]]


# --- options, backend support, configure --------------------------------------------------------------

NVIDIA_ONLY = (
    HEADER
    + """
def deepinfer_feature_options():
    return {"fancy": "needs tensor cores"}

def deepinfer_supported_backends():
    return ["nvidia_sm100"]
"""
)

ALWAYS_ON_ASCEND = HEADER + "def deepinfer_supported_backends():\n    return ['ascend950']\n"

CONFIGURED = (
    HEADER
    + """
seen = []

def deepinfer_feature_options():
    return {"batch_invariant": "bitwise identical logits"}

def deepinfer_configure(config, options):
    seen.append((config, dict(options)))
"""
)


def test_unclaimed_option_is_rejected_with_the_claimed_ones(make_distribution):
    plugin_dist(make_distribution, "good", GOOD)
    pm = load_plugins(new_plugin_manager(), env=only("good"))
    configure_plugins(pm, config=None, options={"good_feature": 1}, backend_name="cpu")
    with pytest.raises(UnknownOptionError, match=r"batch_invariant.*claimed options: .*good_feature"):
        configure_plugins(pm, config=None, options={"batch_invariant": True}, backend_name="cpu")


def test_unsupported_backend_is_rejected_only_when_the_plugin_is_active(make_distribution):
    plugin_dist(make_distribution, "fancy", NVIDIA_ONLY)
    pm = load_plugins(new_plugin_manager(), env=only("fancy"))

    configure_plugins(pm, config=None, options={}, backend_name="cpu")  # installed but not enabled: fine
    with pytest.raises(UnsupportedBackendError, match=r"'fancy' \(enabled by option fancy\).*'cpu'.*nvidia_sm100"):
        configure_plugins(pm, config=None, options={"fancy": True}, backend_name="cpu")
    configure_plugins(pm, config=None, options={"fancy": True}, backend_name="nvidia_sm100")


def test_always_on_plugin_is_checked_against_every_backend(make_distribution):
    plugin_dist(make_distribution, "npu", ALWAYS_ON_ASCEND)
    pm = load_plugins(new_plugin_manager(), env=only("npu"))
    with pytest.raises(UnsupportedBackendError, match="'npu' does not support backend 'cpu'"):
        plugins.check_backend_support(pm, "cpu", {})
    plugins.check_backend_support(pm, "ascend950", {})


def test_configure_is_historic_and_sees_the_feature_options(make_distribution):
    plugin_dist(make_distribution, "configured", CONFIGURED)
    pm = new_plugin_manager()
    configure_plugins(pm, config="cfg", options={}, backend_name="cpu")  # before the plugin exists

    load_plugins(pm, env=only("configured"))
    configure_plugins(pm, config="cfg2", options={"batch_invariant": True}, backend_name="cpu")

    import configured_plugin

    assert configured_plugin.seen == [("cfg", {}), ("cfg2", {"batch_invariant": True})]


# --- registries and selectors ---------------------------------------------------------------------------

OVERRIDES = (
    HEADER
    + """
def double(x, weight, eps):
    return 2 * x

def deepinfer_register_ops(op_table, backend_name):
    if backend_name == "cpu":
        op_table.override("rms_norm", double, source="overrides")
"""
)


def test_register_ops_overrides_through_the_op_table(make_distribution):
    plugin_dist(make_distribution, "overrides", OVERRIDES)
    pm = load_plugins(new_plugin_manager(), env=only("overrides"))
    table = CpuBackend().make_op_table(pm)
    assert table.sources()["rms_norm"] == "overrides"
    assert table.rms_norm(3, None, 0.0) == 6
    assert CpuBackend().make_op_table().sources()["rms_norm"] != "overrides"  # only through the plugin manager


def test_override_of_unknown_op_names_the_plugin(make_distribution):
    source = HEADER + "def deepinfer_register_ops(op_table):\n    op_table.override('no_such_op', len, source='bad')\n"
    plugin_dist(make_distribution, "bad", source)
    pm = load_plugins(new_plugin_manager(), env=only("bad"))
    with pytest.raises(UnknownOpError, match="bad overrides unknown op 'no_such_op'"):
        CpuBackend().make_op_table(pm)


def test_rebuild_sliding_window_defaults_to_none_without_plugins():
    pm = new_plugin_manager()
    assert pm.hook.deepinfer_rebuild_sliding_window(request=None, num_cached_tokens=500, sliding_window=128, hit=None,
                                                   context=None) is None

"""The plugin as users get it: entry point, option, environment variable, per-engine state, backends."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import deepinfer_batch_invariant as bi
import pytest
from deepinfer_batch_invariant import plugin

from deepinfer_core.backends.base import Backend, Capabilities, MemoryInfo
from deepinfer_core.backends.cpu import CpuBackend
from deepinfer_core.engine_context import EngineContext
from deepinfer_core.errors import DeepInferError, UnsupportedBackendError
from deepinfer_core.ops.table import reference_ops
from deepinfer_core.plugins import configure_plugins, load_plugins, new_plugin_manager, register_plugin

SOURCE = "batch_invariant"


@pytest.fixture
def pm():
    return load_plugins(new_plugin_manager(), env={"DEEPINFER_PLUGINS": "batch_invariant"})


def _table(pm, backend=None):
    return (backend or CpuBackend()).make_op_table(pm)


def _all_ours(table) -> bool:
    return set(table.sources().values()) == {SOURCE}


class _OtherBackend(Backend):
    """Stands in for an accelerator backend: the plugin must refuse it."""

    name = "ascend950"
    device_type = "cpu"

    def capabilities(self):
        return Capabilities(dtypes=(), distributed_backend="gloo")

    def memory_info(self):
        return MemoryInfo(0, 0)


def test_entry_point_loads(pm):
    record = pm.records["batch_invariant"]
    assert record.status == "loaded", record.traceback
    assert record.distribution == "deepinfer-batch-invariant"
    assert record.hook_api_version == 1
    assert record.hooks == ["deepinfer_configure", "deepinfer_feature_options", "deepinfer_register_ops",
                            "deepinfer_supported_backends"]


def test_option_pins_every_op(pm):
    configure_plugins(pm, None, {"batch_invariant": True}, "cpu")
    table = _table(pm)
    assert _all_ours(table)
    assert set(table.names()) == set(reference_ops())
    assert bi.state() == bi.State(True, "option", None)


def test_off_by_default_leaves_the_table_alone(pm):
    configure_plugins(pm, None, {}, "cpu")
    assert SOURCE not in _table(pm).sources().values()
    configure_plugins(pm, None, {"batch_invariant": False}, "cpu")
    assert SOURCE not in _table(pm).sources().values()


def test_environment_variable_enables_without_the_option(pm, monkeypatch):
    monkeypatch.setenv(bi.ENV, "1")
    configure_plugins(pm, None, {}, "cpu")
    assert bi.state() == bi.State(True, "env", None)
    assert _all_ours(_table(pm))


def test_explicit_option_wins_over_the_environment(pm, monkeypatch):
    monkeypatch.setenv(bi.ENV, "1")
    configure_plugins(pm, None, {"batch_invariant": False}, "cpu")
    assert not bi.state().enabled
    assert SOURCE not in _table(pm).sources().values()
    monkeypatch.setenv(bi.ENV, "0")
    configure_plugins(pm, None, {"batch_invariant": "true"}, "cpu")  # `--option batch_invariant=true` gives a str
    assert _all_ours(_table(pm))


@pytest.mark.parametrize("options, env", [({"batch_invariant": "maybe"}, None), ({"batch_invariant": 2}, None),
                                          ({}, "2"), ({}, "yes please")])
def test_bad_values_are_refused(pm, monkeypatch, options, env):
    if env is not None:
        monkeypatch.setenv(bi.ENV, env)
    # the option's ValueError becomes a PluginHookError; the variable's EnvironmentVariableError keeps its class
    with pytest.raises(DeepInferError, match="'batch_invariant'.*deepinfer_configure.*must be a boolean"):
        configure_plugins(pm, None, options, "cpu")


def test_state_follows_each_configure_call_and_tables_keep_their_ops(pm):
    """One plugin manager, three engines: the mode never leaks from one engine's table to the next."""
    configure_plugins(pm, None, {"batch_invariant": True}, "cpu")
    first = _table(pm)
    configure_plugins(pm, None, {}, "cpu")
    second = _table(pm)
    configure_plugins(pm, None, {"batch_invariant": True}, "cpu")
    third = _table(pm)
    assert _all_ours(first) and _all_ours(third)
    assert SOURCE not in second.sources().values()


def _configure_call(options):
    return {"config": None, "options": options, "context": EngineContext("cpu", options)}


def test_late_registration_replays_configure_calls_in_order():
    """``deepinfer_configure`` is historic: a plugin registered late decides for every engine configured before,
    each in its own context, and the latest one is the process's default."""
    pm = new_plugin_manager()
    on, off = _configure_call({"batch_invariant": True}), _configure_call({})
    pm.hook.deepinfer_configure.call_historic(kwargs=on)
    pm.hook.deepinfer_configure.call_historic(kwargs=off)
    register_plugin(pm, plugin, "batch_invariant")
    assert bi.state(on["context"]).enabled and not bi.state(off["context"]).enabled
    assert not bi.state().enabled
    pm2 = new_plugin_manager()
    pm2.hook.deepinfer_configure.call_historic(kwargs=_configure_call({}))
    pm2.hook.deepinfer_configure.call_historic(kwargs=_configure_call({"batch_invariant": True}))
    register_plugin(pm2, plugin, "batch_invariant")
    assert bi.state().enabled


def test_each_engine_keeps_its_own_decision(pm):
    """Two engines configured one after the other: each op table follows its own engine's option, whatever was
    configured last."""
    on = configure_plugins(pm, None, {"batch_invariant": True}, "cpu")
    off = configure_plugins(pm, None, {}, "cpu")
    assert _all_ours(CpuBackend().make_op_table(pm, on))
    assert SOURCE not in CpuBackend().make_op_table(pm, off).sources().values()
    assert bi.state(on).enabled and not bi.state(off).enabled


def test_core_refuses_another_backend_when_the_option_is_set(pm):
    with pytest.raises(UnsupportedBackendError, match=r"batch_invariant.*ascend950.*cpu, nvidia_sm100"):
        configure_plugins(pm, None, {"batch_invariant": True}, "ascend950")
    configure_plugins(pm, None, {}, "ascend950")  # off: the plugin does not block other backends
    assert SOURCE not in _table(pm, _OtherBackend()).sources().values()


def test_plugin_refuses_another_backend_when_enabled_by_the_environment(pm, monkeypatch):
    monkeypatch.setenv(bi.ENV, "1")
    configure_plugins(pm, None, {}, "ascend950")  # the core's check only sees options the user passed
    with pytest.raises(UnsupportedBackendError, match=r"DEEPINFER_BATCH_INVARIANT.*ascend950.*cpu, nvidia_sm100"):
        _table(pm, _OtherBackend())


def test_mtp_varlen_flag_is_accepted_and_logged_as_no_op(pm, monkeypatch, caplog):
    monkeypatch.setenv(bi.ENV_MTP_VARLEN, "0")
    with caplog.at_level(logging.INFO, logger="deepinfer.batch_invariant"):
        configure_plugins(pm, None, {"batch_invariant": True}, "cpu")
    assert bi.state().mtp_varlen is False
    assert "DEEPINFER_ENABLE_MTP_VARLEN=0 has no effect" in caplog.text
    monkeypatch.setenv(bi.ENV_MTP_VARLEN, "sometimes")
    with pytest.raises(ValueError, match="DEEPINFER_ENABLE_MTP_VARLEN"):
        configure_plugins(pm, None, {}, "cpu")


def test_llm_instances_get_their_own_mode(tiny_ckpt, monkeypatch):
    """Through ``LLM`` and the process's plugin manager: kwarg, environment, explicit off, default off."""
    from deepinfer_core import LLM

    def sources(**kwargs):
        llm = LLM(str(tiny_ckpt), block_size=8, max_num_seqs=2, **kwargs)
        return llm, set(llm.model.ops.sources().values())

    on, on_sources = sources(batch_invariant=True)
    _, off_sources = sources()
    monkeypatch.setenv(bi.ENV, "1")
    _, env_sources = sources()
    _, explicit_off_sources = sources(batch_invariant=False)
    assert on_sources == env_sources == {SOURCE}
    assert SOURCE not in off_sources and SOURCE not in explicit_off_sources
    assert set(on.model.ops.sources().values()) == {SOURCE}  # the first engine kept its ops


def test_deepinfer_plugins_lists_it():
    script = Path(sys.executable).parent / "deepinfer"
    env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_PLUGINS"}
    out = subprocess.run([str(script), "plugins", "--json"], check=True, capture_output=True, text=True, env=env)
    record = next(p for p in json.loads(out.stdout)["plugins"] if p["name"] == "batch_invariant")
    assert record["status"] == "loaded", record["traceback"]


def test_deepinfer_bench_batch_invariant_runs_the_mode(tmp_path, monkeypatch):
    """``deepinfer bench --batch-invariant`` is the option (the same switch as the variable): every op of the run's
    table is this plugin's; ``--no-batch-invariant`` wins over the variable."""
    pytest.importorskip("transformers")
    from deepinfer_core.cli import main

    common = ["bench", "--preset", "tiny", "--cache-dir", str(tmp_path / "cache"), "--input-len", "8", "--output-len",
              "2", "--num-prompts", "2", "--max-num-seqs", "2", "--warmup", "0", "--json"]
    assert main([*common, str(tmp_path / "on.json"), "--batch-invariant"]) == 0
    assert set(json.loads((tmp_path / "on.json").read_text())["config"]["op_sources"].values()) == {SOURCE}
    monkeypatch.setenv(plugin.ENV, "1")
    assert main([*common, str(tmp_path / "off.json"), "--no-batch-invariant"]) == 0
    assert SOURCE not in json.loads((tmp_path / "off.json").read_text())["config"]["op_sources"].values()

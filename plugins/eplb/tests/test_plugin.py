"""The plugin as users get it: entry point, the ``enable_eplb`` / ``eplb_config`` options, their validation."""

from __future__ import annotations

import pytest
from deepinfer_eplb import EplbConfig, EplbConfigError
from deepinfer_eplb.plugin import engine_config

from deepinfer_core.engine_context import EngineContext
from deepinfer_core.errors import UnknownOptionError
from deepinfer_core.plugins import configure_plugins, load_plugins, new_plugin_manager


@pytest.fixture
def pm():
    return load_plugins(new_plugin_manager(), env={"DEEPINFER_PLUGINS": "eplb"})  # the real entry point


def configure(pm, **options) -> EngineContext:
    return configure_plugins(pm, context=EngineContext("cpu", options))


def test_entry_point_loads(pm):
    record = pm.records["eplb"]
    assert record.status == "loaded", record.traceback
    assert record.distribution == "deepinfer-eplb" and record.hook_api_version == 1
    assert record.hooks == ["deepinfer_configure", "deepinfer_engine_start", "deepinfer_feature_options",
                            "deepinfer_step_boundary"]


def test_options_become_the_engines_config(pm):
    context = configure(pm, enable_eplb=True, eplb_config={"num_redundant_experts": 8, "window_size": 100,
                                                           "step_interval": 1000})
    assert engine_config(context) == EplbConfig(8, 100, 1000)
    assert engine_config(configure(pm, enable_eplb="true")) == EplbConfig()  # --option enable_eplb=true
    cli = configure(pm, enable_eplb=True, eplb_config='{"num_redundant_experts": 4}')  # --option eplb_config=JSON
    assert engine_config(cli) == EplbConfig(num_redundant_experts=4)


def test_off_by_default_and_per_engine(pm):
    on = configure(pm, enable_eplb=True)
    off = configure(pm)
    assert engine_config(off) is None and engine_config(configure(pm, enable_eplb=False)) is None
    assert engine_config(on) == EplbConfig()  # the later engine did not change the earlier one's config


@pytest.mark.parametrize("options, match", [
    ({"eplb_config": {"window_size": 10}}, "eplb_config is set but enable_eplb is not"),
    ({"enable_eplb": "maybe"}, "enable_eplb must be a boolean"),
    ({"enable_eplb": True, "eplb_config": {"window": 10}},
     "unknown key.*'window'.*the keys are num_redundant_experts, window_size, step_interval"),
    ({"enable_eplb": True, "eplb_config": {"num_redundant_experts": -1}},
     r"eplb_config\['num_redundant_experts'\] must be an int >= 0, got -1"),
    ({"enable_eplb": True, "eplb_config": {"window_size": 0}}, r"eplb_config\['window_size'\] must be an int >= 1"),
    ({"enable_eplb": True, "eplb_config": {"step_interval": "10"}},
     r"eplb_config\['step_interval'\] must be an int >= 1, got '10'"),
    ({"enable_eplb": True, "eplb_config": {"step_interval": True}}, r"must be an int >= 1, got True"),
    ({"enable_eplb": True, "eplb_config": "{not json"}, "eplb_config must be a JSON object"),
    ({"enable_eplb": True, "eplb_config": [1, 2]}, "eplb_config must be a mapping .* got list"),
])
def test_bad_options_are_refused_by_name(pm, options, match):
    with pytest.raises(EplbConfigError, match=match):
        configure(pm, **options)


def test_without_the_plugin_the_options_are_unknown():
    pm = load_plugins(new_plugin_manager(), env={"DEEPINFER_PLUGINS": "none"})
    with pytest.raises(UnknownOptionError, match="enable_eplb"):
        configure(pm, enable_eplb=True)

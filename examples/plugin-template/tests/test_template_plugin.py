"""The template plugin, loaded the way users get it: installed, found through its entry point."""

from __future__ import annotations

import deepinfer_plugin_template as template
import pytest
import torch

from deepinfer_core.backends.cpu import CpuBackend
from deepinfer_core.engine_context import EngineContext
from deepinfer_core.errors import UnknownOptionError
from deepinfer_core.ops.table import OpTable
from deepinfer_core.plugins import configure_plugins, load_plugins, new_plugin_manager


@pytest.fixture
def pm(monkeypatch):
    monkeypatch.delenv("DEEPINFER_PLUGINS", raising=False)
    return load_plugins(new_plugin_manager())


def test_entry_point_is_found_and_loads(pm):
    record = pm.records["template"]
    assert record.status == "loaded", record.traceback
    assert record.distribution == "deepinfer-plugin-template"
    assert record.hook_api_version == 1
    assert record.hooks == ["deepinfer_configure", "deepinfer_feature_options", "deepinfer_register_ops"]


def test_option_is_claimed_and_a_typo_is_rejected(pm):
    configure_plugins(pm, context=EngineContext("cpu", {"count_rms_norm": True}))
    with pytest.raises(UnknownOptionError, match="count_rms_nrom"):
        configure_plugins(pm, context=EngineContext("cpu", {"count_rms_nrom": True}))


def test_enabled_wraps_rms_norm_and_counts_calls(pm):
    context = configure_plugins(pm, context=EngineContext("cpu", {"count_rms_norm": True}))
    table = CpuBackend().make_op_table(pm, context)
    assert table.sources()["rms_norm"] == "template"

    x, weight = torch.randn(3, 8), torch.rand(8)
    expected = CpuBackend().make_op_table().rms_norm(x, weight, 1e-6)  # the op the counter wraps
    assert torch.equal(table.rms_norm(x, weight, 1e-6), expected)
    torch.testing.assert_close(expected, OpTable().rms_norm(x, weight, 1e-6))
    table.rms_norm(x, weight, 1e-6)
    assert template.calls(context) == 2


def test_two_engines_count_separately(pm):
    counting = configure_plugins(pm, context=EngineContext("cpu", {"count_rms_norm": True}))
    plain = configure_plugins(pm, context=EngineContext("cpu", {}))  # built after: must not turn the first off
    counted, untouched = CpuBackend().make_op_table(pm, counting), CpuBackend().make_op_table(pm, plain)
    counted.rms_norm(torch.randn(2, 4), torch.ones(4), 1e-6)
    untouched.rms_norm(torch.randn(2, 4), torch.ones(4), 1e-6)
    assert (template.calls(counting), template.calls(plain)) == (1, 0)
    assert untouched.sources() == CpuBackend().make_op_table().sources()  # nothing from the plugin

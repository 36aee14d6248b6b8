"""The plugin's environment variables: declared in ``deepinfer_batch_invariant.envs``, listed under the
``deepinfer.envs`` entry point, parsed by the core's typed parser."""

from __future__ import annotations

import pytest
from deepinfer_batch_invariant import envs, plugin

from deepinfer_core import envs as core_envs
from deepinfer_core.errors import EnvironmentVariableError


def test_the_entry_point_lists_the_plugins_declarations():
    assert any(group is envs.VARIABLES for group in core_envs.declarations())
    assert [v.name for v in envs.VARIABLES] == [plugin.ENV, "DEEPINFER_BATCH_INVARIANT_FUSED_FOLD",
                                                "DEEPINFER_BATCH_INVARIANT_ATTENTION_FEW_PROGRAMS",
                                                "DEEPINFER_BATCH_INVARIANT_GEMM_LAUNCHES", "DEEPINFER_BATCH_INVARIANT_SPLIT_K_PROGRAMS",
                                                "DEEPINFER_BATCH_INVARIANT_MIN_SPLIT_BLOCKS", plugin.ENV_MTP_VARLEN]
    assert envs.VARIABLES.owner == "deepinfer-batch-invariant"


@pytest.mark.parametrize("environ, enabled, varlen", [({}, False, None), ({plugin.ENV: " "}, False, None),
                                                      ({plugin.ENV: "On"}, True, None),
                                                      ({plugin.ENV: "no", plugin.ENV_MTP_VARLEN: "1"}, False, True)])
def test_resolve_reads_the_given_environment(environ, enabled, varlen):
    state = plugin.resolve({}, environ)
    assert (state.enabled, state.source, state.mtp_varlen) == (enabled, "env" if enabled else None, varlen)


def test_the_option_wins_and_a_malformed_variable_is_refused_by_name():
    assert plugin.resolve({"batch_invariant": False}, {plugin.ENV: "1"}).enabled is False
    with pytest.raises(EnvironmentVariableError, match="DEEPINFER_BATCH_INVARIANT must be a boolean.*'maybe'"):
        plugin.resolve({}, {plugin.ENV: "maybe"})


def test_module_attributes_read_the_environment_now(monkeypatch):
    monkeypatch.setenv(plugin.ENV, "true")
    assert envs.DEEPINFER_BATCH_INVARIANT is True
    monkeypatch.setenv(plugin.ENV, "0")
    assert envs.DEEPINFER_BATCH_INVARIANT is False

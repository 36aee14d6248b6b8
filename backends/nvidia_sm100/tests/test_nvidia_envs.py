"""The backend's environment variables: declared in ``deepinfer_nvidia_sm100.envs``, listed under the
``deepinfer.envs`` entry point, read when a switch is asked (so ``monkeypatch.setenv`` counts), malformed values
refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from deepinfer_nvidia_sm100 import envs

from deepinfer_core import envs as core_envs
from deepinfer_core.errors import EnvironmentVariableError


def test_the_entry_point_lists_the_backends_declarations():
    groups = core_envs.declarations()
    assert any(group is envs.VARIABLES for group in groups), [group.owner for group in groups]
    assert envs.VARIABLES.owner == "deepinfer-nvidia-sm100"


def test_every_name_is_the_backends_and_defaults_keep_the_fast_paths_on():
    names = [variable.name for variable in envs.VARIABLES]
    assert all(name.startswith(("DEEPINFER_NVIDIA_", "DEEPINFER_TL_ATTN_", "DEEPINFER_TINY_")) for name in names)
    switches = {v.name: v.default for v in envs.VARIABLES if v.type is bool}
    assert switches.pop("DEEPINFER_NVIDIA_COMPILE_STEP") is False  # opt-in
    assert switches.pop("DEEPINFER_NVIDIA_FP8_SPLITS_MEET") is False  # not yet run on a GPU
    assert switches.pop("DEEPINFER_NVIDIA_ROW_PICKS_APART") is False  # not yet run on a GPU
    assert switches.pop("DEEPINFER_NVIDIA_MXFP4_FP8_DECODE") is False  # not yet run on a GPU
    assert all(switches.values()), switches


def test_switches_follow_the_environment_at_call_time(monkeypatch):
    from deepinfer_nvidia_sm100.kernels import compiled, streams, tl_attention

    for name in ("DEEPINFER_NVIDIA_COMPILE", "DEEPINFER_NVIDIA_COMPILE_STEP", "DEEPINFER_NVIDIA_STREAMS",
                 "DEEPINFER_TL_ATTN_SPLITS"):
        monkeypatch.delenv(name, raising=False)
    assert compiled.enabled() and not compiled.step_enabled() and streams.enabled()
    assert tl_attention.num_splits(64, 2048, 132) == 2
    monkeypatch.setenv("DEEPINFER_NVIDIA_COMPILE_STEP", "yes")
    monkeypatch.setenv("DEEPINFER_NVIDIA_STREAMS", "off")
    monkeypatch.setenv("DEEPINFER_TL_ATTN_SPLITS", "4")
    assert compiled.step_enabled() and not streams.enabled() and tl_attention.num_splits(64, 2048, 132) == 4
    monkeypatch.setenv("DEEPINFER_NVIDIA_COMPILE", "0")
    assert not compiled.enabled() and not compiled.step_enabled()


@pytest.mark.parametrize("name, raw", [("DEEPINFER_NVIDIA_PDL", "2"), ("DEEPINFER_NVIDIA_DECODE_ATTN_MAX_ROWS", "all")])
def test_a_malformed_value_is_refused_by_name(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(EnvironmentVariableError, match=f"{name} must be .*{raw!r}"):
        envs.get(name)


def test_the_test_checkpoint_is_a_path(monkeypatch):
    monkeypatch.setenv("DEEPINFER_TINY_CHECKPOINT", "~/tiny")
    assert envs.DEEPINFER_TINY_CHECKPOINT == Path.home() / "tiny"

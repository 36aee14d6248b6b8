"""Model folder resolution: local path, env var, local HF cache, embedded default, and the errors."""

from __future__ import annotations

import os

import pytest

from deepinfer_core.models import resolve
from deepinfer_core.models.resolve import MODEL_DIR_ENV, ModelNotFoundError, resolve_model


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for var in (MODEL_DIR_ENV, "HF_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # so ~/.cache/huggingface is empty too


def _model_folder(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def _snapshot(cache, hub_id, revision, mtime=None):
    folder = _model_folder(cache / f"models--{hub_id.replace('/', '--')}" / "snapshots" / revision)
    if mtime is not None:
        os.utime(folder, (mtime, mtime))
    return folder


def test_local_folder_path(tmp_path):
    folder = _model_folder(tmp_path / "my-model")
    assert resolve_model(str(folder)) == folder
    assert resolve_model(folder) == folder


def test_folder_without_config_json_is_named(tmp_path):
    folder = tmp_path / "weights-only"
    folder.mkdir()
    with pytest.raises(ModelNotFoundError, match=rf"{folder} has no config\.json"):
        resolve_model(str(folder))


def test_env_var_when_model_is_none(tmp_path, monkeypatch):
    folder = _model_folder(tmp_path / "from-env")
    monkeypatch.setenv(MODEL_DIR_ENV, str(folder))
    assert resolve_model(None) == folder


def test_env_var_pointing_nowhere(tmp_path, monkeypatch):
    monkeypatch.setenv(MODEL_DIR_ENV, str(tmp_path / "gone"))
    with pytest.raises(ModelNotFoundError, match=rf"\${MODEL_DIR_ENV} folder .*gone does not exist"):
        resolve_model(None)


def test_hub_id_uses_refs_main(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    pinned = _snapshot(cache, "deepseek-ai/DeepSeek-V4-Flash", "aaa111", mtime=1_000)
    _snapshot(cache, "deepseek-ai/DeepSeek-V4-Flash", "bbb222", mtime=2_000)  # newer, but not refs/main
    refs = cache / "models--deepseek-ai--DeepSeek-V4-Flash" / "refs"
    refs.mkdir()
    (refs / "main").write_text("aaa111\n")
    assert resolve_model("deepseek-ai/DeepSeek-V4-Flash") == pinned


def test_hub_id_without_refs_takes_newest_snapshot(tmp_path, monkeypatch):
    cache = tmp_path / "hf_home" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    _snapshot(cache, "org/name", "old", mtime=1_000)
    newest = _snapshot(cache, "org/name", "new", mtime=2_000)
    assert resolve_model("org/name") == newest


def test_hub_id_in_default_cache(tmp_path):
    cache = tmp_path / "home" / ".cache" / "huggingface" / "hub"
    snapshot = _snapshot(cache, "org/name", "rev")
    assert resolve_model("org/name") == snapshot


def test_hub_id_not_cached_says_how_to_download(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("deepseek-ai/DeepSeek-V4-Flash")
    message = str(err.value)
    assert "hf download deepseek-ai/DeepSeek-V4-Flash" in message
    assert "huggingface-cli download deepseek-ai/DeepSeek-V4-Flash" in message
    assert MODEL_DIR_ENV in message
    assert "never downloads" in message


def test_missing_relative_path_is_not_a_hub_id(tmp_path):
    with pytest.raises(ModelNotFoundError, match="neither an existing folder nor a hub id"):
        resolve_model(str(tmp_path / "a" / "b" / "c"))


def test_default_model_when_nothing_given(tmp_path, monkeypatch):
    folder = _model_folder(tmp_path / "tiny_v4")
    monkeypatch.setattr(resolve, "default_model_dir", lambda: folder)
    assert resolve_model() == folder


def test_default_model_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(resolve, "default_model_dir", lambda: tmp_path / "tiny_v4")
    with pytest.raises(ModelNotFoundError, match=rf"embedded default model folder .* does not exist.*{MODEL_DIR_ENV}"):
        resolve_model(None)


def test_default_model_dir_is_inside_the_package():
    folder = resolve.default_model_dir()
    assert folder.parts[-3:] == ("deepinfer_core", "assets", "tiny_v4")

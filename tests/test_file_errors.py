"""A checkpoint folder with a truncated or corrupt file: one line that names the file and what is wrong with it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from v4_factory import tiny_checkpoint

from deepinfer_core.checkpoint import CheckpointError, read_headers
from deepinfer_core.cli.main import main
from deepinfer_core.models.deepseek_v4.config import ConfigError, DeepseekV4Config
from deepinfer_core.models.registry import ConfigFileError, read_model_type

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_good")
    tiny_checkpoint(folder)
    return folder


@pytest.fixture
def checkpoint(good_checkpoint, tmp_path) -> Path:
    """A fresh copy of the tiny checkpoint for the test to break."""
    return Path(shutil.copytree(good_checkpoint, tmp_path / "ckpt"))


def _shard(folder: Path) -> Path:
    return next(folder.glob("*.safetensors"))


def _generate_error(folder: Path, capsys) -> str:
    assert main(["generate", "--model", str(folder), "--max-tokens", "1", "w1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_truncated_shard_is_named_with_what_is_wrong(checkpoint, capsys):
    shard = _shard(checkpoint)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # an interrupted download
    with pytest.raises(CheckpointError, match="not fully covered") as caught:
        read_headers(checkpoint)
    assert str(shard) in str(caught.value) and "truncated or corrupt" in str(caught.value)
    err = _generate_error(checkpoint, capsys)
    assert str(shard) in err and f"{len(data) // 2} bytes" in err and "re-download" in err


@pytest.mark.parametrize("content, reason", [
    (b"\x00" * 7, "header too small"),
    ((16).to_bytes(8, "little") + b"{not json here!}", "invalid JSON in header"),
    (b"", "header too small"),
])
def test_corrupt_shard_header_is_named(checkpoint, content, reason):
    shard = _shard(checkpoint)
    shard.write_bytes(content)
    with pytest.raises(CheckpointError, match=reason) as caught:
        read_headers(checkpoint)
    assert str(caught.value).startswith(f"{shard} is not a readable safetensors file")


@pytest.mark.parametrize("content, reason", [
    ('{"model_type": "deepseek_v4",\n}', "Expecting property name"),
    ("[1, 2]", "holds a list, not a JSON object"),
    ("\udcff", "not valid JSON"),  # bytes that are not UTF-8
])
def test_invalid_config_json_is_named(checkpoint, content, reason, capsys):
    config = checkpoint / "config.json"
    config.write_bytes(content.encode("utf-8", "surrogateescape"))
    with pytest.raises(ConfigFileError, match=reason) as caught:
        read_model_type(checkpoint)
    assert str(config) in str(caught.value)
    with pytest.raises(ConfigError, match=reason):
        DeepseekV4Config.from_file(config)
    err = _generate_error(checkpoint, capsys)
    assert str(config) in err and reason in err

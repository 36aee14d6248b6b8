"""``deepinfer generate`` (console script and in-process) and examples/offline_inference.py on a tiny checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from v4_factory import tiny_checkpoint

from deepinfer_core.cli import generate as cli_generate
from deepinfer_core.cli.main import build_parser, main

REPO = Path(__file__).resolve().parents[1]

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_generate")
    tiny_checkpoint(folder)
    return folder


def _env() -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("DEEPINFER_ACCELERATOR", "DEEPINFER_PLUGINS")}
    environ.setdefault("OMP_NUM_THREADS", "1")
    return environ


def _console(*args: str) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "deepinfer"
    if not script.exists():
        pytest.fail(f"console script {script} is missing: install the core into this venv (pip install -e .)")
    return subprocess.run([str(script), *args], check=False, capture_output=True, text=True, env=_env(), timeout=300)


def test_console_script_prints_prompt_and_completion(checkpoint):
    result = _console("generate", "--model", str(checkpoint), "--max-tokens", "4", "--temperature", "0", "w5 w6 w7")
    assert result.returncode == 0, result.stderr
    assert "prompt:\nw5 w6 w7\n--- completion (finish: length, 4 tokens):\n" in result.stdout
    completion = result.stdout.split("tokens):\n", 1)[1].splitlines()[0]
    assert len(completion.split()) == 4 and all(word.startswith("w") for word in completion.split())


def test_bad_temperature_exits_2_with_the_message(checkpoint, capsys):
    assert main(["generate", "--model", str(checkpoint), "--temperature", "-1", "w5"]) == 2
    assert "deepinfer generate: error: temperature must be >= 0, got -1.0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--n", "0"], "n must be >= 1"),
        (["--max-tokens", "0"], "max_tokens must be >= 1"),
        (["--backend", "no-such-backend"], "unknown backend 'no-such-backend'"),
        (["--dtype", "int3"], "unknown dtype 'int3'"),
    ],
)
def test_bad_values_exit_2(checkpoint, capsys, flags, message):
    assert main(["generate", "--model", str(checkpoint), *flags, "w5"]) == 2
    assert message in capsys.readouterr().err


def test_missing_model_exits_2(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nowhere"), "w5"]) == 2
    assert "is neither an existing folder nor a hub id" in capsys.readouterr().err


def test_json_output_parses_like_request_outputs(checkpoint, capsys):
    code = main(["generate", "--model", str(checkpoint), "--json", "--max-tokens", "3", "--n", "2",
                     "--seed", "7", "w5 w6", "w9"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["prompt"] for d in data] == ["w5 w6", "w9"]
    for d in data:
        assert set(d) >= {"request_id", "prompt", "prompt_token_ids", "outputs", "finished", "error"}
        assert d["finished"] and d["error"] is None
        assert [c["index"] for c in d["outputs"]] == [0, 1]
        assert all(len(c["token_ids"]) == 3 and c["finish_reason"] == "length" for c in d["outputs"])


def test_several_prompts_are_ruled_off_and_stop_strings_apply(checkpoint, capsys):
    code = main(["generate", "--model", str(checkpoint), "--temperature", "0", "--max-tokens", "6",
                     "w5 w6", "w7"])
    out = capsys.readouterr().out
    assert code == 0
    assert "prompt 1 of 2:\nw5 w6\n" in out and "prompt 2 of 2:\nw7\n" in out
    first_word = out.split("tokens):\n", 1)[1].split()[0]
    assert main(["generate", "--model", str(checkpoint), "--temperature", "0", "--max-tokens", "6",
                     "--stop", first_word, "w5 w6"]) == 0
    assert "(finish: stop, " in capsys.readouterr().out


def test_chat_applies_the_template(checkpoint, capsys):
    assert main(["generate", "--model", str(checkpoint), "--chat", "--json", "--max-tokens", "2", "w5"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data[0]["prompt_token_ids"] == [2, 5, 3]  # the factory template: "w2 {content} w3"


def test_generation_config_supplies_defaults_and_flags_override(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.9, "top_k": 5}))
    defaults = cli_generate.generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.7, "top_p": 0.9, "top_k": 5}
    args = build_parser().parse_args(["generate", "--top-p", "0.5", "w5"])
    params = cli_generate.sampling_params(args, defaults)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.7, 0.5, 5, 64)
    assert cli_generate.generation_defaults(tmp_path / "absent") == {}


def test_offline_inference_example_runs(checkpoint):
    example = REPO / "examples" / "offline_inference.py"
    result = subprocess.run([sys.executable, str(example), "--model", str(checkpoint)], check=False,
                            capture_output=True, text=True, env=_env(), timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("Prompt:") == 4 and result.stdout.count("Generated:") == 4


def test_without_model_uses_the_model_dir_environment_variable(checkpoint, capsys, monkeypatch):
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(checkpoint))
    assert main(["generate", "--json", "--max-tokens", "2", "--temperature", "0", "w5"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["prompt_token_ids"] == [5]

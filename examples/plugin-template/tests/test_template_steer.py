"""The logits-processor example, on the embedded default model, as a user runs it: bad words banned per request,
one request steered through extra_args while its neighbour keeps its tokens, and the engine-wide option from the
command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from deepinfer_plugin_template import Steer

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine_context import EngineContext
from deepinfer_core.errors import PluginHookError
from deepinfer_core.plugins import configure_plugins, get_plugin_manager
from deepinfer_core.sampling import LogitsRow
from deepinfer_core.sampling.logits_processor import LogitsProcessorError

PROMPT = "def f(x):"
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=4, enforce_eager=True)


def _text(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def test_the_plugin_is_loaded_with_its_processor_hook():
    record = get_plugin_manager().records["template_steer"]
    assert record.status == "loaded", record.traceback
    assert record.hooks == ["deepinfer_configure", "deepinfer_feature_options", "deepinfer_logits_processors"]


def test_bad_words_are_banned_for_one_request_only(llm):
    (alone,) = _text(llm.generate([PROMPT], GREEDY, use_tqdm=False))
    assert "Return" in alone  # what the model writes unprompted
    banned = SamplingParams(temperature=0, max_tokens=8, bad_words=["Return"])
    neighbour, changed = _text(llm.generate([PROMPT, PROMPT], [GREEDY, banned], use_tqdm=False))
    assert neighbour == alone and "Return" not in changed


def test_extra_args_steer_one_request_and_leave_its_neighbour_alone(llm):
    (alone,) = _text(llm.generate([PROMPT], GREEDY, use_tqdm=False))
    steered = SamplingParams(temperature=0, max_tokens=8, extra_args={"steer": {"import": 100.0}})
    neighbour, changed = _text(llm.generate([PROMPT, PROMPT], [GREEDY, steered], use_tqdm=False))
    assert neighbour == alone
    assert changed.startswith("import")


def test_a_bad_steer_request_names_the_processor():
    bad = SamplingParams(temperature=0, max_tokens=2, extra_args={"steer": {"import": "lots"}})
    with pytest.raises(LogitsProcessorError, match="Steer raised ValueError: .*the bias of 'import' must be a finite "
                                                   "number, got 'lots'"):
        LLM(max_num_seqs=1, enforce_eager=True).generate([PROMPT], bad, use_tqdm=False)


def test_the_engine_option_is_checked_when_the_engine_is_configured():
    with pytest.raises(PluginHookError, match="'template_steer'.*deepinfer_configure.*option steer must be a mapping"):
        configure_plugins(get_plugin_manager(), context=EngineContext("cpu", {"steer": 3}))


def test_the_processor_steers_the_rows_it_is_given():
    steer = Steer(lambda word: {"a": [1], "b": [2, 3]}[word], {"a": 1.0})
    rows = [LogitsRow("0-0", SamplingParams(), [5], [], 0),
            LogitsRow("1-0", SamplingParams(extra_args={"steer": {"b": 2.0, "a": -1.0}}), [5], [], 0)]
    out = steer(torch.zeros(2, 4), rows)
    assert out.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, -1.0, 2.0, 0.0]]


def _deepinfer(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("DEEPINFER_PLUGINS", "DEEPINFER_ACCELERATOR")}
    script = Path(sys.executable).parent / "deepinfer"
    return subprocess.run([str(script), *args], capture_output=True, text=True, env=env, timeout=300, check=False)


def test_the_option_comes_from_the_command_line_and_a_typo_is_refused():
    run = _deepinfer("generate", "--temperature", "0", "--max-tokens", "3", "--option", 'steer={"import": 100}',
                     PROMPT)
    assert run.returncode == 0, run.stderr
    assert "--- completion (finish: length, 3 tokens):\nimport" in run.stdout
    typo = _deepinfer("generate", "--max-tokens", "1", "--option", "stear=1", PROMPT)
    assert typo.returncode == 2
    assert "unknown option(s) stear" in typo.stderr

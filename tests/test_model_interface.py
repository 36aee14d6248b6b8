"""The model interface: a second architecture registered by a plugin runs through the engine unchanged, a model
that lacks part of the interface is refused by name, and the engine knows no model package."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deepinfer_core import LLM, SamplingParams, plugins
from deepinfer_core.models.interface import CausalLM, StaticStepModel, missing_members
from deepinfer_core.models.registry import InvalidModelError
from deepinfer_core.models.resolve import default_model_dir

ROOT = Path(__file__).resolve().parents[1]
TOY_SOURCE = (Path(__file__).parent / "plugins_src" / "toy_lm_plugin.py").read_text()
VOCAB, HIDDEN = 4096, 8


@pytest.fixture(autouse=True)
def _fresh_plugins(monkeypatch):
    monkeypatch.setenv(plugins.ENV_PLUGINS, "toy")
    plugins.reset_plugin_manager()
    yield
    plugins.reset_plugin_manager()


@pytest.fixture
def toy_checkpoint(tmp_path, make_distribution) -> Path:
    """The toy plugin installed as a distribution, and a checkpoint folder of its model type."""
    make_distribution("deepinfer-toy", entry_points={"deepinfer.plugins": {"toy": "toy_lm_plugin"}},
                      modules={"toy_lm_plugin": TOY_SOURCE})
    folder = tmp_path / "toy"
    folder.mkdir()
    config = {"model_type": "toy_lm", "vocab_size": VOCAB, "hidden_size": HIDDEN, "max_position_embeddings": 64}
    (folder / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(0)
    save_file({"embed.weight": torch.randn(VOCAB, HIDDEN, generator=generator),
               "head.weight": torch.randn(VOCAB, HIDDEN, generator=generator)}, folder / "model.safetensors")
    shutil.copy(default_model_dir() / "tokenizer.json", folder / "tokenizer.json")
    return folder


def _reference_greedy(folder: Path, prompt: list[int], steps: int) -> list[int]:
    """The toy model's greedy continuation, recomputed from the whole sequence at every step."""
    from safetensors.torch import load_file

    weights = load_file(folder / "model.safetensors")
    embed, head = weights["embed.weight"], weights["head.weight"]
    tokens = list(prompt)
    for _ in range(steps):
        hidden = embed[torch.tensor(tokens)].mean(dim=0)  # [D]
        tokens.append(int(torch.argmax(head @ hidden)))
    return tokens[len(prompt):]


def test_a_plugin_registered_model_runs_through_the_engine(toy_checkpoint):
    llm = LLM(str(toy_checkpoint), max_num_seqs=2, max_num_batched_tokens=8)
    assert isinstance(llm.model, CausalLM) and not isinstance(llm.model, StaticStepModel)
    prompts = [[5, 17, 300, 9, 41, 2, 77, 8, 1000, 3], [5, 17, 300, 9, 41, 2, 77, 8, 1000, 3], [12, 13], [99] * 5]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == _reference_greedy(toy_checkpoint, prompt, 6)
    assert llm.engine.runner.decode_graphs is None  # no static steps: every step eager
    assert llm.engine.scheduler.num_preemptions >= 0 and llm.engine.state_manager.queries >= 1


def test_sampled_completions_of_the_toy_model_are_seeded(toy_checkpoint):
    llm = LLM(str(toy_checkpoint))
    params = SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=5, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for c in first.outputs)


def test_a_model_lacking_part_of_the_interface_is_refused_by_name(toy_checkpoint, make_distribution, monkeypatch):
    source = TOY_SOURCE.replace("    def prefix_replay_span(self) -> int:", "    def _gone(self) -> int:")
    make_distribution("deepinfer-broken-toy", entry_points={"deepinfer.plugins": {"broken": "broken_toy_plugin"}},
                      modules={"broken_toy_plugin": source})
    monkeypatch.setenv(plugins.ENV_PLUGINS, "broken")
    with pytest.raises(InvalidModelError, match=r"'toy_lm'.*\['prefix_replay_span'\]"):
        LLM(str(toy_checkpoint))


def test_missing_members_names_what_a_model_lacks():
    class Partial:
        vocab_size = 3

    missing = missing_members(Partial())
    assert "forward" in missing and "new_state" in missing and "vocab_size" not in missing
    assert "ops" in missing and "device" in missing


def test_the_engine_imports_no_model_package():
    """No module of the engine (nor ``LLM``) imports a model package, and importing them loads none."""
    sources = [*sorted((ROOT / "deepinfer_core" / "engine").glob("*.py")), ROOT / "deepinfer_core" / "llm.py"]
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("deepinfer_core.models.deepseek"), f"{path.name}: {node.module}"
    code = ("import sys, deepinfer_core.engine.engine, deepinfer_core.llm; "
            "print([m for m in sys.modules if m.startswith('deepinfer_core.models.deepseek')])")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


def test_the_toy_model_verifies_draft_tokens_and_rolls_back(toy_checkpoint):
    """Speculative decoding through a second architecture's ``SpeculativeModel`` members: ngram drafts on a
    repetitive prompt, greedy outputs equal to the reference, rejected drafts rolled back in the toy's running sums."""
    llm = LLM(str(toy_checkpoint), speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    prompt = [5, 17, 300, 9] * 4 + [5, 17]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    output = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert output.outputs[0].token_ids == _reference_greedy(toy_checkpoint, prompt, 12)
    metrics = {m.name: m.value for m in llm.get_metrics()}
    assert metrics["deepinfer:spec_decode_num_drafts"] > 0
    assert metrics["deepinfer:spec_decode_num_accepted_tokens"] < metrics["deepinfer:spec_decode_num_verified_tokens"]

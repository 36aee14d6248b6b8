"""The embedded default model: the engine gives HF transformers' greedy tokens, and the CLI runs it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.models.resolve import default_model_dir

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef main():\n", "class Stack:\n    def push(self, item):"]


@pytest.fixture(scope="module")
def llm():
    return LLM()


def test_default_llm_loads_the_shipped_checkpoint(llm):
    assert llm.model_dir == default_model_dir()
    assert llm.model.config.hc_mult == 4


def test_engine_greedy_tokens_equal_hf(llm):
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for ids, output in zip(prompts, outputs):
        with torch.no_grad():
            reference = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                    pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()
        assert output.outputs[0].token_ids == reference


def test_cli_generate_prints_python_in_seconds():
    exe = shutil.which("deepinfer") or sys.executable
    args = [exe] if exe.endswith("deepinfer") else [exe, "-m", "deepinfer_core.cli"]
    env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_HF_MODEL_DIR"}  # the embedded default
    start = time.perf_counter()
    done = subprocess.run([*args, "generate", "--temperature", "0", "--max-tokens", "40", "def fibonacci(n):"],
                          check=False, capture_output=True, text=True, env=env, timeout=300)
    elapsed = time.perf_counter() - start
    assert done.returncode == 0, done.stderr
    completion = done.stdout.split("def fibonacci(n):", 1)[1]
    assert any(word in completion for word in ("return", "self", "if ", "None", '"""', "(")), completion
    print(f"deepinfer generate took {elapsed:.1f} s")

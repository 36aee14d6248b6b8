"""``compiled.compile_step`` on the CPU: the shipped tiny checkpoint's static-shape decode steps compiled by
TorchInductor (its C++ backend), against the same static steps run eagerly.

What CI can check of the compiled decode path (``DEEPINFER_NVIDIA_COMPILE_STEP=1``): Dynamo traces the layout and the
model (the per-op compiled functions and the cached layout constants step aside, ``forward`` leaves inference mode
to the caller), Inductor compiles and the steps replay with the eager results. The GPU-only parts (Triton and
TileLang kernels as opaque ops, CUDA's lowerings, the CUDA graph) run in ``test_model_gpu.py``. One compile of the
4-layer model per captured shape: about a minute on a 2-core machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

pytest.importorskip("triton", reason="the test extra installs triton")
from deepinfer_nvidia_sm100.kernels import compiled

from deepinfer_core.llm import LLM
from deepinfer_core.sampling.params import SamplingParams

ASSET = Path(__file__).resolve().parents[3] / "deepinfer_core" / "assets" / "tiny_v4"
PROMPTS = [[1, 5, 9, 13, 2], list(range(3, 40)), [7] * 11 + list(range(20, 60, 3))]
STEPS = 6


def _generate(capture) -> tuple[list, int]:
    """Greedy tokens and their logprobs per prompt, decode steps at the static shape of 4 sequences through
    ``capture`` (the decode graphs' capture function); also the number of replays."""
    llm = LLM(str(ASSET), backend="cpu", max_model_len=128, max_num_seqs=4, cuda_graph_sizes=[4])  # CPU even beside a GPU
    for name, op in compiled.compiled_ops().items():  # the NVIDIA backend's per-op compiled functions
        llm.model.ops.override(name, op, "nvidia_sm100 compiled ops")
    graphs = llm.engine.runner.decode_graphs
    graphs.capture = capture
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    steps = [[(t, lp[t].logprob) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
             for o in outs]
    return steps, graphs.num_replays


def _eager(fn, example_inputs):
    return fn


def _compiled(fn, example_inputs):
    def traced_step():
        STEP_TRACED.append(torch.compiler.is_compiling())  # True in every call of a compiled step
        return fn()

    step = compiled.compile_step(traced_step)
    before = counters["stats"]["unique_graphs"]
    step()  # compile outside the timed steps, as the CUDA graph runner's warm-up does
    STEP_GRAPHS.append(counters["stats"]["unique_graphs"] - before)
    return step


STEP_TRACED: list[bool] = []
STEP_GRAPHS: list[int] = []  # graphs TorchDynamo made of each captured step: 1 unless the step graph-breaks


@pytest.mark.skipif(not ASSET.is_dir(), reason="the tiny checkpoint ships with the source tree only")
def test_compiled_static_decode_steps_match_eager(monkeypatch):
    monkeypatch.setenv("DEEPINFER_NVIDIA_COMPILE", "1")
    eager, eager_replays = _generate(_eager)
    torch._dynamo.reset()
    got, replays = _generate(_compiled)
    assert len(STEP_TRACED) > replays and all(STEP_TRACED)  # every replayed step ran compiled
    assert STEP_GRAPHS == [1], f"a graph break split the compiled step into {STEP_GRAPHS} graphs (TORCH_LOGS=graph_breaks)"
    assert replays == eager_replays >= STEPS - 1
    for p, (want_steps, got_steps) in enumerate(zip(eager, got, strict=True)):
        assert [t for t, _ in got_steps] == [t for t, _ in want_steps], f"prompt {p}"
        for step, ((_, want_lp), (_, got_lp)) in enumerate(zip(want_steps, got_steps, strict=True)):
            assert abs(got_lp - want_lp) < 1e-4, f"prompt {p} step {step}: logprob {got_lp} vs {want_lp}"

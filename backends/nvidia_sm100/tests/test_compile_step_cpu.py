"""``compiled.compile_step`` on the CPU: the shipped tiny checkpoint's static-shape decode steps compiled whole,
against the same static steps run eagerly.

What CI can check of the compiled decode path (``DEEPINFER_NVIDIA_COMPILE_STEP=1``): Dynamo traces the layout and the
model in one graph (the per-op compiled functions and the cached layout constants step aside, ``forward`` leaves
inference mode to the caller), AOTAutograd functionalizes it (the kernel wrappers' custom ops with their fake shapes
and mutated arguments) and the steps replay with the eager results. Every test file runs this with the
``aot_eager`` backend: all of that, and no code generation. TorchInductor's own part (its C++ backend lowering the
graph, with ``compile_step``'s replaced ``cat`` lowering) adds close to 2 minutes of compiling on a 2-core machine
and none of the project's logic besides that lowering, so it is marked ``slow`` and runs in ``tox -e nvidia-slow``
(nightly) and wherever ``-m slow`` selects it. The 4 layers are the smallest model with every layer type (sliding,
CSA, HCA) and both MoE kinds (hash, routed). The GPU-only parts (Triton and TileLang kernels as opaque ops, CUDA's
lowerings, the CUDA graph) run in ``test_model_gpu.py``.
"""

from __future__ import annotations

from collections.abc import Callable
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

pytestmark = pytest.mark.skipif(not ASSET.is_dir(), reason="the tiny checkpoint ships with the source tree only")


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


def _compiling(backend: str, traced: list[bool], graphs: list[int]) -> Callable:
    """A capture function that compiles each step with ``backend``: ``traced`` gets ``is_compiling()`` of every
    call of a compiled step (True when it ran compiled), ``graphs`` the number of graphs TorchDynamo made of each
    captured step (1 unless the step graph-breaks)."""

    def capture(fn, example_inputs):
        def traced_step():
            traced.append(torch.compiler.is_compiling())
            return fn()

        step = compiled.compile_step(traced_step, backend)
        before = counters["stats"]["unique_graphs"]
        step()  # compile outside the timed steps, as the CUDA graph runner's warm-up does
        graphs.append(counters["stats"]["unique_graphs"] - before)
        return step

    return capture


@pytest.fixture(scope="module")
def compile_on():
    """``DEEPINFER_NVIDIA_COMPILE=1`` for the module (the per-op compiled functions in the op table)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEEPINFER_NVIDIA_COMPILE", "1")
        yield


@pytest.fixture(scope="module")
def eager_steps(compile_on) -> tuple[list, int]:
    """The eager run's steps and replays, shared by the backends' tests."""
    return _generate(_eager)


def _check_compiled_steps_match_eager(backend: str, eager_steps: tuple[list, int]) -> None:
    """Every replayed step ran compiled, in one graph, with the eager run's tokens and logprobs (within 1e-4)."""
    eager, eager_replays = eager_steps
    torch._dynamo.reset()
    traced, graphs = [], []
    got, replays = _generate(_compiling(backend, traced, graphs))
    assert len(traced) > replays and all(traced)  # every replayed step ran compiled
    assert graphs == [1], f"a graph break split the compiled step into {graphs} graphs (TORCH_LOGS=graph_breaks)"
    assert replays == eager_replays >= STEPS - 1
    for p, (want_steps, got_steps) in enumerate(zip(eager, got, strict=True)):
        assert [t for t, _ in got_steps] == [t for t, _ in want_steps], f"prompt {p}"
        for step, ((_, want_lp), (_, got_lp)) in enumerate(zip(want_steps, got_steps, strict=True)):
            assert abs(got_lp - want_lp) < 1e-4, f"prompt {p} step {step}: logprob {got_lp} vs {want_lp}"


def test_traced_static_decode_steps_match_eager(eager_steps):
    """Dynamo and AOTAutograd (``aot_eager``): one graph per step, functionalized, replaying the eager results."""
    _check_compiled_steps_match_eager("aot_eager", eager_steps)


@pytest.mark.slow
def test_compiled_static_decode_steps_match_eager(eager_steps):
    """The same through TorchInductor (``compile_step``'s default backend): its C++ code for the whole step."""
    _check_compiled_steps_match_eager("inductor", eager_steps)

"""Experiment (not a product path): decode steps of the `tiny` preset at batch 16 on CPU, three ways.

    python tools/cpu_compiled_decode_experiment.py dynamic|static|compile

dynamic: the default eager step; static: the decode-graph path's static-shape step, run eagerly
(``cuda_graph_sizes=[16]``); compile: that static step under ``torch.compile`` (inductor, C++ kernels), with
``model.forward`` run under ``no_grad`` instead of ``inference_mode`` (inductor refused the inference tensors).
Prints the compile time and the mean decode step over 20 steps (after a prefill and 3 warm steps).
docs/performance.md 2.2 records one run; the compile is ~2 minutes per static shape on 2 cores.
"""

from __future__ import annotations

import sys
import time

import torch

from deepinfer_core.bench import presets
from deepinfer_core.bench.runner import random_prompts
from deepinfer_core.llm import LLM
from deepinfer_core.models.deepseek_v4.model import DeepseekV4Model
from deepinfer_core.sampling.params import SamplingParams


def compile_capture(fn, example_inputs):
    """A stand-in for ``Backend.capture_graph``: compile the static step and run it once."""
    del example_inputs
    compiled = torch.compile(fn, dynamic=False)
    start = time.time()
    compiled()
    print(f"compile + first step: {time.time() - start:.1f} s", flush=True)
    return compiled


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "dynamic"
    folder = presets.ensure_preset("tiny")
    if mode == "compile":
        DeepseekV4Model.forward = torch.no_grad()(DeepseekV4Model.forward.__wrapped__)
    llm = LLM(folder, max_model_len=256, max_num_seqs=16, **({} if mode == "dynamic" else {"cuda_graph_sizes": [16]}))
    if mode == "compile":
        llm.engine.runner.decode_graphs.capture = compile_capture
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i, ids in enumerate(random_prompts(16, 128, llm.model.config.vocab_size, 0)):
        engine.add_request(f"r{i}", None, ids, params)
    for _ in range(4):  # prefill, then warm decode steps
        engine.step()
    start, steps = time.perf_counter(), 20
    for _ in range(steps):
        engine.step()
    print(f"{mode}: decode step {(time.perf_counter() - start) / steps * 1e3:.1f} ms")


if __name__ == "__main__":
    main()

"""Steady-state decode step time at batch 1 with and without asynchronous scheduling, and where the host's time
goes (cProfile, by own time). Run from the repository root on the GPU machine:

    python backends/nvidia_sm100/benchmarks/step_time_async.py

Writes nothing; prints ``async=False: X ms/step`` / ``async=True: Y ms/step`` and a profile after each.
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

from deepinfer_core.bench import presets
from deepinfer_core.bench.runner import random_prompts
from deepinfer_core.llm import LLM
from deepinfer_core.sampling.params import SamplingParams


def main() -> None:
    folder = presets.ensure_preset("v4-flash-8l64e")
    for overlap in (False, True):
        llm = LLM(folder, backend="nvidia_sm100", dtype="bfloat16", max_model_len=1200, max_num_seqs=1,
                  async_scheduling=overlap)
        engine = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        engine.add_request("w", None, random_prompts(1, 1024, llm.model.config.vocab_size, 1)[0], params)
        for _ in range(30):  # prefill, graph capture, warm steps
            engine.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            engine.step()
        torch.cuda.synchronize()
        print(f"async={overlap}: {1e3 * (time.perf_counter() - start) / 20:.2f} ms/step", flush=True)
        host = cProfile.Profile()
        host.enable()
        for _ in range(20):
            engine.step()
        torch.cuda.synchronize()
        host.disable()
        pstats.Stats(host).sort_stats("tottime").print_stats(14)
        while engine.has_unfinished():
            engine.step()
        del llm, engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

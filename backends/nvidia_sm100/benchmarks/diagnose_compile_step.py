"""Why a compiled decode step (``DEEPINFER_NVIDIA_COMPILE_STEP=1``) fails: compiles the tiny checkpoint's decode
steps and, on failure, names the FX node TorchInductor lowered last (op, shapes, the model's source line; the output
node when the failure came after lowering) beside the warning's full traceback (the step is then captured uncompiled,
``compiled.StepCompiler``). ``--variant`` re-runs with one Inductor setting changed, to test a diagnosis. GPU only.

    python backends/nvidia_sm100/benchmarks/diagnose_compile_step.py [--model tiny|preset] [--variant VARIANT]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]


def watch_lowering(trail: list) -> None:
    """Record every FX node TorchInductor lowers (the last one is where a lowering error happened)."""
    from torch._inductor.graph import GraphLowering

    original = GraphLowering.run_node

    def run_node(self, n):
        trail.append(n)
        return original(self, n)

    GraphLowering.run_node = run_node


def describe(node) -> str:
    def shape(a):
        val = getattr(a, "meta", {}).get("val") if hasattr(a, "meta") else None
        return f"{tuple(val.shape)} {val.dtype}" if isinstance(val, torch.Tensor) else repr(a)[:60]

    args = ", ".join(shape(a) for a in node.args if not isinstance(a, (list, tuple))) or repr(node.args)[:300]
    trace = node.meta.get("stack_trace", "") or "(no stack trace)"
    return f"{node.op} {node.target} ({args})\n{trace[-1500:]}"


def apply_variant(name: str) -> None:
    import torch._inductor.config as inductor_config

    if name == "pointwise-cat":  # undo compile_step's fix: Inductor's own cat lowering
        from deepinfer_nvidia_sm100.kernels import compiled

        compiled._concatenations_copied = contextlib.nullcontext
    elif name == "no-split":
        inductor_config.split_reductions = False


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", default="default", choices=["default", "pointwise-cat", "no-split"])
    parser.add_argument("--model", default="tiny", choices=["tiny", "preset"],
                        help="the shipped tiny checkpoint, or the bench preset v4-flash-8l64e (1K-token prompt)")
    args = parser.parse_args()
    os.environ["DEEPINFER_NVIDIA_COMPILE_STEP"] = "1"
    logging.basicConfig(level=logging.WARNING)
    trail: list = []
    watch_lowering(trail)
    apply_variant(args.variant)
    from deepinfer_core.bench import presets
    from deepinfer_core.llm import LLM
    from deepinfer_core.sampling.params import SamplingParams

    folder = presets.ensure_preset("v4-flash-8l64e") if args.model == "preset" else REPO / "deepinfer_core/assets/tiny_v4"
    prompt = list(range(1, 1025)) if args.model == "preset" else [1, 5, 9, 13, 2]
    llm = LLM(model=str(folder), backend="nvidia_sm100", dtype="bfloat16",
              max_model_len=len(prompt) + 64, max_num_seqs=4)
    graphs = llm.engine.runner.decode_graphs
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    failure = llm.backend._step_compiler.failure  # the warning above has its traceback
    if failure and trail:
        print("=== last FX node lowered:\n" + describe(trail[-1]))
    print(f"=== variant {args.variant}: compile {'failed: ' + failure if failure else 'succeeded'}; "
          f"replays {graphs.num_replays}, graphs disabled: {graphs.disabled_reason}")
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())

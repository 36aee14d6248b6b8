"""What quantized activations cost a quantized model: the backend's default (fp8 linears of ``FP8_TC_MIN_ROWS`` rows
and more on fp8 tensor cores, activations quantized per token and 128 inputs; prefill steps' MXFP4 experts on fp8
tensor cores from ``DEEPINFER_NVIDIA_MXFP4_FP8_MIN_PER_EXPERT`` assignments per expert) against the same run with
every path that quantizes activations switched off (``REFERENCE_SWITCHES``: the exact weights times the activations
as they are, the reference op's math), on the same prompts in one process.

    python backends/nvidia_sm100/benchmarks/quant_accuracy.py                      # v4-flash-8l64e-fp4, H200
    python backends/nvidia_sm100/benchmarks/quant_accuracy.py --model DIR --backend cpu --num-prompts 4

Two measures, each with the reference run (``FP8_TC=0``) as the baseline:

* greedy agreement: both runs generate ``--output-len`` greedy tokens from ``--num-prompts`` random prompts in one
  batch (decode rows take the tensor cores from 16 sequences); per prompt, the tokens equal before the first
  difference, and whether the reference's top-2 gap there was a near-tie (below ``--tie-gap``);
* teacher-forced logprobs: the reference's prompts plus completions are scored by both runs (``prompt_logprobs``:
  prefill rows, in steps of at most ``--max-num-batched-tokens`` tokens: 512 by default, the decode batches' fp8
  tensor-core kernel; 8,192 takes the prefill paths, cuBLAS's blockwise fp8 GEMM for the linears and
  ``moe_mxfp4_prefill`` for the experts); the largest and median absolute difference of the completion tokens'
  logprobs.

The last line is a Markdown row for docs/quantization.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

FP8_TC_VARIABLE = "DEEPINFER_NVIDIA_FP8_TC"
REFERENCE_SWITCHES = {FP8_TC_VARIABLE: "0", "DEEPINFER_NVIDIA_FP8_SCALED_MM": "0",
                      "DEEPINFER_NVIDIA_MXFP4_FP8_MIN_PER_EXPERT": "0"}  # the reference run: no path quantizes


@dataclass(frozen=True)
class Agreement:
    """Greedy agreement of one run against a reference run."""

    prompts: int
    tokens: int  # generated tokens per prompt
    matched: int  # tokens equal before each prompt's first difference, summed over prompts
    identical: int  # prompts whose completions are equal throughout
    near_ties: int  # first differences where the reference's top-2 gap was below the tie gap

    @property
    def fraction(self) -> float:
        return self.matched / (self.prompts * self.tokens)


def greedy_agreement(reference: list[list[tuple[int, float]]], other: list[list[int]], tie_gap: float) -> Agreement:
    """``reference``: per prompt, (token, top-2 logprob gap) per generated step; ``other``: per prompt, the tokens."""
    matched = identical = near_ties = 0
    for want, got in zip(reference, other, strict=True):
        same = next((i for i, ((w, _), g) in enumerate(zip(want, got, strict=True)) if w != g), len(want))
        matched += same
        identical += same == len(want)
        near_ties += same < len(want) and want[same][1] < tie_gap
    return Agreement(len(reference), len(reference[0]) if reference else 0, matched, identical, near_ties)


def logprob_differences(reference: list[list[float]], other: list[list[float]]) -> list[float]:
    """Absolute differences of two runs' logprobs of the same tokens, every position of every sequence."""
    return [abs(a - b) for want, got in zip(reference, other, strict=True) for a, b in zip(want, got, strict=True)]


def _top2_gap(logprobs) -> float:
    ranked = sorted((lp.logprob for lp in logprobs.values()), reverse=True)
    return ranked[0] - ranked[1] if len(ranked) > 1 else float("inf")


def _switch(quantized: bool, before: dict[str, str | None]) -> None:
    """``REFERENCE_SWITCHES`` as they were when the tool started (``quantized``) or off; read when the engine's steps
    run and are captured."""
    for name, off in REFERENCE_SWITCHES.items():
        value = before[name] if quantized else off
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _run(args, prompts: list[list[int]], quantized: bool, sequences: list[list[int]] | None = None):
    """One engine with the quantizing paths on or off (``_switch``): its greedy completions ((token, top-2 gap) per
    step), and its logprobs of each completion token of ``sequences`` (default: the prompts plus its own
    completions) run as prompts."""
    import torch

    from deepinfer_core.llm import LLM
    from deepinfer_core.sampling.params import SamplingParams

    _switch(quantized, args.switches)
    llm = LLM(model=str(args.folder), backend=args.backend, dtype=args.dtype, max_num_seqs=len(prompts),
              max_model_len=args.input_len + args.output_len + 1,
              max_num_batched_tokens=args.max_num_batched_tokens)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    steps = [[(t, _top2_gap(lps)) for t, lps in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
             for o in outs]
    if sequences is None:
        sequences = [p + [t for t, _ in s] for p, s in zip(prompts, steps, strict=True)]
    forced = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    scored = llm.generate([{"prompt_token_ids": s} for s in sequences], forced, use_tqdm=False)
    scores = [[lps[t].logprob for t, lps in zip(s[args.input_len:], o.prompt_logprobs[args.input_len:], strict=True)]
              for s, o in zip(sequences, scored, strict=True)]
    llm.engine.shutdown()
    del llm, outs, scored
    gc.collect()  # one engine at a time: the preset fills much of the GPU
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return steps, scores, sequences


def measure(args) -> tuple[Agreement, list[float]]:
    """Both runs on the same prompts: (greedy agreement, teacher-forced logprob differences of the reference's
    completions)."""
    from deepinfer_core.bench.runner import random_prompts

    vocab = int(json.loads((Path(args.folder) / "config.json").read_text())["vocab_size"])
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, seed=0)
    args.switches = {name: os.environ.get(name) for name in REFERENCE_SWITCHES}
    try:
        ref_steps, ref_scores, sequences = _run(args, prompts, quantized=False)
        steps, scores, _ = _run(args, prompts, quantized=True, sequences=sequences)
    finally:
        _switch(True, args.switches)
    agreement = greedy_agreement(ref_steps, [[t for t, _ in s] for s in steps], args.tie_gap)
    return agreement, logprob_differences(ref_scores, scores)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="v4-flash-8l64e-fp4", help="a bench preset (written when missing)")
    parser.add_argument("--model", default=None, help="a checkpoint folder instead of the preset")
    parser.add_argument("--backend", default="nvidia_sm100")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64, help="prompts, run as one batch")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="tokens a step (512: the decode batches' fp8 kernels; 8192: the prefill paths)")
    parser.add_argument("--tie-gap", type=float, default=0.05,
                        help="a first difference where the reference's top-2 logprob gap is below this is a near-tie")
    args = parser.parse_args(argv)
    if args.model is None:
        from deepinfer_core.bench import presets

        args.folder = presets.ensure_preset(args.preset)
    else:
        args.folder = args.model
    agreement, diffs = measure(args)
    worst, median = max(diffs), statistics.median(diffs)
    name = args.model or args.preset
    print(f"{name}, {args.backend}, {args.dtype}: {args.num_prompts} prompts of {args.input_len} tokens, "
          f"{args.output_len} greedy tokens each, {args.max_num_batched_tokens} tokens a step; default vs "
          + " ".join(f"{name}={off}" for name, off in REFERENCE_SWITCHES.items()))
    print(f"greedy agreement {agreement.fraction:.3f} ({agreement.matched} of {agreement.prompts * agreement.tokens} "
          f"tokens before each prompt's first difference), {agreement.identical} of {agreement.prompts} completions "
          f"identical, {agreement.near_ties} of {agreement.prompts - agreement.identical} first differences at a "
          f"near-tie (top-2 gap < {args.tie_gap})")
    print(f"teacher-forced completion logprobs: largest |difference| {worst:.4f}, median {median:.2e} "
          f"({len(diffs)} tokens)")
    print(f"| {name} | {args.dtype}, {args.num_prompts} x {args.input_len} in / {args.output_len} out | "
          f"{agreement.fraction:.3f} | {agreement.identical} / {agreement.prompts} | {worst:.4f} | {median:.2e} |")
    return 0


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)
    raise SystemExit(main())

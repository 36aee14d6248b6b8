#!/usr/bin/env python
"""Measure mtp and dspark in the engine on the embedded tiny model over held-out code.

The prompts are ``tools/train_tiny_mtp.py``'s held-out set (16 prompts of 96 tokens from the files the tiny model
never trained on); each request decodes 128 tokens greedily, all 16 in one batch. For each method the script
reports the engine's own counters (``LLM.get_metrics``): draft rounds, drafted / verified / accepted tokens, the
acceptance length ``1 + accepted / drafts`` (rounds that verified a draft), the tokens each sequence gained per step
that ran it, engine steps and wall time, and checks that the greedy tokens equal those without speculation.

    python plugins/dspark/measure_acceptance.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

METHODS = {
    "none": None,
    "mtp": {"method": "mtp", "num_speculative_tokens": 5},
    "dspark 0.7": {"method": "dspark", "num_speculative_tokens": 5, "verify_fraction": 0.7},
    "dspark 0.8": {"method": "dspark", "num_speculative_tokens": 5, "verify_fraction": 0.8},
}


def held_out_prompts() -> list[list[int]]:
    import train_tiny_mtp as tool

    _, _, held = tool.token_splits()
    return tool.prompts(held, tool.HELDOUT_PROMPTS, tool.SEED + 4).tolist()


def run(config, prompts, params) -> tuple[list[list[int]], dict]:
    from deepinfer_core.llm import LLM

    llm = LLM(speculative_config=config, max_num_seqs=len(prompts))
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    metrics = {m.name.removeprefix("deepinfer:spec_decode_"): m.value for m in llm.get_metrics()
               if m.name.startswith("deepinfer:spec_decode_")}
    tokens = [o.outputs[0].token_ids for o in outputs]
    report = {"seconds": round(seconds, 2), "steps": llm.engine.num_steps, **metrics}
    if config is not None:
        drafts = metrics["num_drafts"]
        report["acceptance_length"] = 1 + metrics["num_accepted_tokens"] / max(drafts, 1)
        report["verified_per_draft"] = metrics["num_verified_tokens"] / max(drafts, 1)
    return tokens, report


def main() -> int:
    from deepinfer_core.sampling.params import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="also write the reports here")
    args = ap.parse_args()
    prompts = held_out_prompts()
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    reports, base = {}, None
    for name, config in METHODS.items():
        tokens, report = run(config, prompts, params)
        base = base or tokens
        report["same_tokens_as_none"] = sum(t == b for t, b in zip(tokens, base, strict=True))
        reports[name] = report
        print(name, json.dumps(report), flush=True)
    print("| method | steps | draft rounds | verified / round | acceptance length | same greedy tokens | s |")
    print("|---|---|---|---|---|---|---|")
    for name, r in reports.items():
        if "acceptance_length" in r:
            row = f"{r['num_drafts']:.0f} | {r['verified_per_draft']:.2f} | {r['acceptance_length']:.3f}"
        else:
            row = "- | - | -"
        print(f"| {name} | {r['steps']} | {row} | {r['same_tokens_as_none']}/{len(prompts)} | {r['seconds']} |")
    if args.json:
        args.json.write_text(json.dumps(reports, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""ngram speculative decoding on the embedded tiny model, against none: greedy, the first 600 characters of the first
16 Python files of deepinfer_core/engine (sorted by name; not in the model's training corpus) as prompts, max_tokens
64, k = 3 and 5; fp32, eager, one batch.

Run from the repository root: ``python tools/measure_ngram.py``; docs/speculative.md has the figures."""

from __future__ import annotations

import pathlib
import time

from deepinfer_core import LLM, SamplingParams

CONFIGS = (None, {"method": "ngram", "num_speculative_tokens": 3}, {"method": "ngram", "num_speculative_tokens": 5})


def main() -> None:
    files = sorted(pathlib.Path("deepinfer_core/engine").glob("*.py"))[:16]
    prompts = [f.read_text()[:600] for f in files]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outputs = []
    print("| k | steps | tokens/s | acceptance length | verified per draft | accepted per position |")
    print("|---|---|---|---|---|---|")
    for config in CONFIGS:
        llm = LLM(enforce_eager=True, speculative_config=config, max_num_seqs=len(prompts))
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        first_step = llm.engine.num_steps
        start = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        metrics = {m.name: m.value for m in llm.get_metrics()}
        drafts = metrics.get("deepinfer:spec_decode_num_drafts", 0)
        accepted = metrics.get("deepinfer:spec_decode_num_accepted_tokens", 0)
        verified = metrics.get("deepinfer:spec_decode_num_verified_tokens", 0)
        tokens = sum(len(o.outputs[0].token_ids) for o in out)
        print(f"| {config['num_speculative_tokens'] if config else '-'} | {llm.engine.num_steps - first_step} "
              f"| {tokens / wall:.0f} | {1 + accepted / drafts if drafts else 1:.2f} "
              f"| {verified / drafts if drafts else 0:.2f} "
              f"| {metrics.get('deepinfer:spec_decode_num_accepted_tokens_per_pos', '-')} |")
        outputs.append([o.outputs[0].token_ids for o in out])
    same = [sum(a == b for a, b in zip(outputs[0], other)) for other in outputs[1:]]
    print(f"outputs equal to no speculation: {same} of {len(prompts)}")


if __name__ == "__main__":
    main()

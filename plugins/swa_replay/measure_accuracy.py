"""Bounded replay against exact reuse on the embedded tiny model over held-out text (the README's table).

    python plugins/swa_replay/measure_accuracy.py [--max-tokens 16] [--top-k 20]

The text is the tiny model's held-out split (Python standard library files with ``crc32(path) % 100 < 2``, the rule
of ``tools/train_tiny.py``). For each adopted hit length ``A`` and distance ``d`` from the hit to the first sampled
position, each file's first ``A + d`` tokens are one prompt; the prompt is sent twice to an exact engine and to a
bounded-replay engine (fp32, CPU), and the second outputs are compared (``deepinfer_swa_replay.measure``). The exact
engine's outputs after a hit are checked against a cold engine's on the way.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

from deepinfer_swa_replay import measure
from deepinfer_swa_replay.accuracy import after_hit, greedy_params

from deepinfer_core import LLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import train_tiny

HITS = (256, 384, 512, 640)
DISTANCES = (134, 261)  # the nearest the sampled position gets to an adopted hit, and the farthest in its block


def heldout_token_ids(llm: LLM, min_tokens: int) -> list[list[int]]:
    """Token ids of every held-out file with at least ``min_tokens`` tokens."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rels = [rel for rel in train_tiny.corpus_files(stdlib) if train_tiny.is_heldout(rel)]
    _, texts = train_tiny.read_texts(stdlib, rels)
    encoded = [llm.get_tokenizer().encode(text) for text in texts]
    return [ids for ids in encoded if len(ids) >= min_tokens]


def exact_against_cold(exact: LLM, cold: LLM, prompts: list[list[int]], params) -> tuple[bool, float]:
    """(every completion the same, largest |logprob difference|) of ``exact`` after a hit against ``cold``."""
    after = [after_hit(exact, p, params) for p in prompts]
    fresh = cold.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    same = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(after, fresh))
    diff = max(abs(x[t].logprob - y[t].logprob) for a, b in zip(after, fresh)
               for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs) for t in x if t in y)
    return same, diff


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=20)
    args = parser.parse_args()
    exact, replay = LLM(dtype="float32"), LLM(dtype="float32", enable_swa_replay=True, enable_prefix_state_cache=False)
    cold = LLM(dtype="float32", enable_prefix_caching=False)
    texts = heldout_token_ids(exact, max(HITS) + max(DISTANCES))
    print(f"{len(texts)} held-out files; greedy {args.max_tokens} tokens, top-{args.top_k} logprobs\n")
    print("| adopted hit | distance to hit | prompts | max Δ first token (top-k) | mean Δ first token "
          "| max Δ chosen token | greedy agreement | identical completions |")
    print("|---|---|---|---|---|---|---|---|")
    for hit in HITS:
        for distance in DISTANCES:
            prompts = [ids[: hit + distance] for ids in texts]
            r = measure(exact, replay, prompts, args.max_tokens, args.top_k)
            print(f"| {hit} | {distance} | {r.samples} | {r.max_first_token_diff:.4f} | {r.mean_first_token_diff:.4f} "
                  f"| {r.max_chosen_diff:.4f} | {r.greedy_agreement:.3f} | {r.identical:.2f} |")
    prompts = [ids[: max(HITS) + max(DISTANCES)] for ids in texts]
    same, diff = exact_against_cold(exact, cold, prompts, greedy_params(args.max_tokens, args.top_k))
    print(f"\nexact reuse after a hit against a cold run: same tokens {same}, largest logprob difference {diff:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

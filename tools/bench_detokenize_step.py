"""Host time of detokenizing one batch-64 decode step: token by token vs deferred.

Deferred (what the engine does): the step's critical path keeps only the token-level stop rules, and
``catch_up`` decodes the text while the device computes the next step. Tokenizer: the shipped ``tiny_v4``;
1024-token prompts, 128 random output tokens per sequence; the best of 5 runs.

    OMP_NUM_THREADS=1 python tools/bench_detokenize_step.py
"""

from __future__ import annotations

import random
import time

from deepinfer_core.engine.detokenizer import SequenceDetokenizer
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.tokenizer import Tokenizer

ASSET = "deepinfer_core/assets/tiny_v4"
SEQUENCES, PROMPT, OUTPUT = 64, 1024, 128


def run(tokenizer: Tokenizer, streams: list[tuple[list[int], list[int]]], defer: bool) -> tuple[float, float]:
    """(critical-path ms per step, overlapped ms per step)."""
    params = SamplingParams(max_tokens=OUTPUT, ignore_eos=True)
    seqs = [SequenceDetokenizer(tokenizer, params, prompt) for prompt, _ in streams]
    critical = overlapped = 0.0
    for step in range(OUTPUT - 1):
        start = time.perf_counter()
        for seq, (_, out) in zip(seqs, streams, strict=True):
            seq.append(out[step], defer_text=defer)
        critical += time.perf_counter() - start
        if defer:
            start = time.perf_counter()
            for seq in seqs:
                seq.catch_up()
            overlapped += time.perf_counter() - start
    return critical / (OUTPUT - 1) * 1e3, overlapped / (OUTPUT - 1) * 1e3


def main() -> None:
    tokenizer = Tokenizer.from_folder(ASSET)
    vocab = tokenizer.vocab_size
    rng = random.Random(0)
    streams = [([rng.randrange(vocab) for _ in range(PROMPT)], [rng.randrange(vocab) for _ in range(OUTPUT)])
               for _ in range(SEQUENCES)]
    for defer in (False, True):
        critical, overlapped = min((run(tokenizer, streams, defer) for _ in range(5)), key=lambda r: r[0])
        print(f"defer_text={defer}: critical path {critical:.3f} ms/step, overlapped {overlapped:.3f} ms/step "
              f"({SEQUENCES} sequences)")


if __name__ == "__main__":
    main()

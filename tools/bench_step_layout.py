"""Host time to build one step's index layout on the CPU: the inputs a decode graph replay uploads
(``DecodeInputs``), the ``DecodeLayout`` computed from them (on the GPU that runs inside the graph), and the
host-built ``StepLayout`` of an eager step.

    python tools/bench_step_layout.py [--seqs 64] [--context 1100]
    python tools/bench_step_layout.py --prefill 8 1024     (one prefill step of 8 prompts of 1024 tokens)

V4-Flash geometry: window 128, compression ratios 4 (CSA, carry span 8) and 128 (HCA), block 128, context
bucket 2048. Prints the median over 5 rounds of 20 builds each. ``inputs`` is the host work the GPU waits for
around every decode graph replay.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.models.deepseek_v4.layout import DecodeInputs, DecodeLayout, StaticBuffers, StaticShape, StepLayout

WINDOW, BLOCK, BUCKET = 128, 128, 2048


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=1100)
    parser.add_argument("--prefill", type=int, nargs=2, metavar=("PROMPTS", "LENGTH"),
                        help="time the host work of a prefill step's layout instead (device target: meta tensors, "
                             "so what would run on the GPU is not timed)")
    args = parser.parse_args()
    if args.prefill:
        return time_prefill(*args.prefill)
    S, ctx = args.seqs, args.context
    shape = StaticShape(S, WINDOW, BUCKET, spare_slot=S, spare_block=S * 20, windows=((4, 8), (128, 128)),
                        entry_ratios=(4, 128))
    batch = ForwardBatch(
        input_ids=torch.zeros(S, dtype=torch.long), positions=torch.tensor([ctx + s for s in range(S)]),
        query_start=list(range(S + 1)), context_lens=[ctx + s for s in range(S)], slots=list(range(S)),
        block_tables=[[s * 20 + i for i in range(BUCKET // BLOCK)] for s in range(S)],
        logits_rows=torch.arange(S), compressed_write_start=[0] * S, sliding_floor=[0] * S)
    buffers = StaticBuffers(torch.device("cpu"))
    DecodeInputs.from_batch(batch, shape, BLOCK).place(buffers)
    buffers.seal()

    def inputs() -> DecodeInputs:
        buffers.rewind()
        return DecodeInputs.from_batch(batch, shape, BLOCK).place(buffers)

    placed = inputs()

    def decode_layout() -> None:
        DecodeLayout(placed, WINDOW, BLOCK, shape)

    def dynamic() -> None:
        layout = StepLayout(batch, WINDOW, BLOCK, "cpu")
        for ratio, span in shape.windows:
            layout.entries(ratio)
            layout.windows(ratio, span)

    for name, build in (("inputs", inputs), ("decode", decode_layout), ("dynamic", dynamic)):
        print(f"{name:8} {S} sequences, context {ctx}: {median_ms(build):.2f} ms per layout")


def time_prefill(prompts: int, length: int) -> None:
    batch = ForwardBatch.build([[1] * length for _ in range(prompts)], [0] * prompts, list(range(prompts)),
                               [[s * 100 + i for i in range(length // BLOCK + 1)] for s in range(prompts)])

    def build() -> None:  # as the model builds it: every compressor plan with the layout, one upload
        StepLayout(batch, WINDOW, BLOCK, torch.device("meta"), windows=((4, 8), (128, 128)), entry_ratios=(4, 128))

    print(f"prefill {prompts} x {length}: {median_ms(build, repeats=2):.1f} ms of host work per layout")


def median_ms(build, repeats: int = 20) -> float:
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            build()
        rounds.append((time.perf_counter() - start) / repeats)
    return statistics.median(rounds) * 1e3


if __name__ == "__main__":
    main()

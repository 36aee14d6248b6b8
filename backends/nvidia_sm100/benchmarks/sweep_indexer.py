"""The lightning indexer's query-tile kernel (``kernels/indexer.py``, ``_indexer_scores_kernel``) over a grid of
tile sizes and launch configurations, at the prefill shapes one CSA layer sees at long context (64 heads x 128,
bf16), to pick ``indexer.BLOCK_T``, ``TILE_E`` and ``STAGES``.

    python backends/nvidia_sm100/benchmarks/sweep_indexer.py      # on a GPU; prints one table, the default marked

Each configuration's scores are checked against the reference op on a few query rows (the reference materialises
every head's products, so all rows of a long shape would not fit), then timed (CUDA events, median of repeats,
after warmup). TFLOP/s counts every head's product over the whole ``queries x entries`` tile; the fraction is of
the H200's 799 TFLOP/s bf16 peak (docs/performance.md).
"""

from __future__ import annotations

from functools import partial

import torch
from cuda_timing import cuda_time

from deepinfer_core.ops import reference as ref

H, D, PEAK, CHECKED_ROWS = 64, 128, 799e12, 16
SHAPES = (  # (queries, entries, what)
    (8192, 2048, "8K prompt"),
    (16384, 32768, "16K chunk at 128K"),
    (1024, 262144, "1M: one slice"),
)
CONFIGS = [  # (BLOCK_T, TILE_E, warps, stages)
    (64, 64, 4, 2), (64, 128, 4, 2), (64, 128, 4, 3), (64, 128, 4, 4), (64, 256, 8, 3), (128, 128, 8, 3),
]


def main() -> None:
    from deepinfer_nvidia_sm100.kernels import indexer

    torch.manual_seed(0)
    print("\nindexer_scores query-tile kernel, 64 heads x 128, bf16 (H200); * = the default")
    print("| shape | queries x entries | BLOCK_T x TILE_E, warps, stages | time | TFLOP/s | % of bf16 peak |")
    print("|---|---|---|---|---|---|")
    for Lq, E, what in SHAPES:
        q = torch.randn(1, Lq, H, D, device="cuda").bfloat16()
        keys = torch.randn(1, E, D, device="cuda").bfloat16()
        weights = torch.randn(1, Lq, H, device="cuda") * 0.125
        rows = torch.linspace(0, Lq - 1, CHECKED_ROWS, device="cuda").long()  # [CHECKED_ROWS]
        want = ref.indexer_scores(q[:, rows], keys, weights[:, rows], D**-0.5)  # [1, CHECKED_ROWS, E]
        out, *operands, strides = indexer._prepare(q, keys, weights)  # out [1, Lq, E]; q, keys, weights as read
        flops = 2 * Lq * E * H * D
        for config in CONFIGS:
            run = partial(indexer.query_tiles, *operands, out, D**-0.5, strides, config)
            run()
            torch.testing.assert_close(out[:, rows], want, atol=1e-4, rtol=1e-4, msg=lambda m, c=config: f"{c}: {m}")
            seconds = cuda_time(run, reps=10)
            mark = "*" if config == indexer.QUERY_TILES else ""
            print(f"| {what} | {Lq} x {E} | {config[0]} x {config[1]}, {config[2]}, {config[3]}{mark} | "
                  f"{seconds * 1e3:.3f} ms | {flops / seconds / 1e12:.0f} | {100 * flops / seconds / PEAK:.0f}% |")


if __name__ == "__main__":
    main()

"""Lightning-indexer scores (``indexer_scores``) on the bench preset's indexer (64 heads x 128, bf16): the reference
op against the Triton kernel (``kernels/indexer.py``), at one 8K-token prompt's prefill and at decode rows.

    python backends/nvidia_sm100/benchmarks/bench_indexer.py      # on a GPU; prints one table

Checks the kernel against the reference op first (max relative error), then times both (CUDA events, median of
repeats, after warmup). Floor = max(FLOPs / 799 TFLOP/s, bytes of q, keys, weights and scores / 4.25 TB/s)
(the H200's ceilings, docs/performance.md).
"""

from __future__ import annotations

import torch
from cuda_timing import cuda_time

from deepinfer_core.ops import reference as ref

H, D, BW, FLOPS = 64, 128, 4.25e12, 799e12


def main() -> None:
    from deepinfer_nvidia_sm100.kernels.indexer import indexer_scores

    torch.manual_seed(0)
    rows = []
    for S, Lq, E in ((1, 8192, 2048), (8, 1024, 256), (64, 1, 1024), (256, 1, 1024)):
        q = torch.randn(S, Lq, H, D, device="cuda").to(torch.bfloat16)
        keys = torch.randn(S, E, D, device="cuda").to(torch.bfloat16)
        weights = torch.randn(S, Lq, H, device="cuda") * 0.125
        args = (q, keys, weights, D**-0.5)
        want = ref.indexer_scores(*args)
        err = ((indexer_scores(*args) - want).abs().max() / want.abs().max()).item()
        flops = 2 * S * Lq * H * E * D
        bytes_ = q.numel() * 2 + keys.numel() * 2 + weights.numel() * 4 + S * Lq * E * 4
        floor = max(flops / FLOPS, bytes_ / BW)
        t_ref = cuda_time(lambda a=args: ref.indexer_scores(*a), reps=5)
        t_kernel = cuda_time(lambda a=args: indexer_scores(*a), reps=20)
        rows.append((S, Lq, E, err, floor, t_ref, t_kernel))
    print("\nindexer_scores, 64 heads x 128, bf16 (H200)")
    print("| sequences x queries x entries | max rel err | floor | reference | Triton | % floor | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for S, Lq, E, err, floor, a, b in rows:
        print(f"| {S} x {Lq} x {E} | {err:.1e} | {floor * 1e3:.3f} ms | {a * 1e3:.3f} ms | {b * 1e3:.3f} ms | "
              f"{100 * floor / b:.0f}% | {a / b:.1f}x |")


if __name__ == "__main__":
    main()

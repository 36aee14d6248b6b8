"""The ``hc_pre_normed`` finishing kernel's warps at decode sizes (bench preset: bf16, D 4096, hc 4, 20 Sinkhorn
iterations): one program per token runs the Sinkhorn loop, whose reductions cross warps (shared memory and a barrier
each) unless the program is one warp.

    python backends/nvidia_sm100/benchmarks/bench_hc_finish.py      # on a GPU; prints one table

Checks every launch against the default's outputs first (the weights bit for bit; the normed row differs by the order
of its sum of squares where the row is taken block by block), then times ``CALLS``
back-to-back calls (mixing partials + finish, as in a decode step) replayed from one CUDA graph: CUDA events, median
of repeats, per call.
"""

from __future__ import annotations

import os

import torch
from cuda_timing import cuda_time, graphed

HC, D, ITERS, CALLS = 4, 4096, 20, 32


def case(tokens: int):
    mix = (2 + HC) * HC
    streams = torch.randn(tokens, HC, D, device="cuda").to(torch.bfloat16)
    fn, base = torch.randn(mix, HC * D, device="cuda") * 0.05, torch.randn(mix, device="cuda")
    scale, weight = torch.rand(3, device="cuda") + 1, torch.rand(D, device="cuda") + 0.5
    return streams, fn, base, scale, ITERS, 1e-6, 1e-6, weight


def main() -> None:
    from deepinfer_nvidia_sm100.kernels import hc

    torch.manual_seed(0)
    print(f"\nhc_pre_normed (mixing partials + finish) per call, {CALLS} calls in one CUDA graph (H200)")
    print("| tokens | warps | BLOCK_D | us per call | weights equal the default's | normed row: max abs diff |")
    print("|---|---|---|---|---|---|")
    for tokens in (1, 16):
        args = case(tokens)
        os.environ.pop(hc.DECODE_WARPS_ENV, None)
        want = hc.hc_pre_normed(*args)
        for warps in (4, 2, 1):
            os.environ[hc.DECODE_WARPS_ENV] = str(warps)
            got = hc.hc_pre_normed(*args)
            same = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            diff = (got[2].float() - want[2].float()).abs().max().item()
            replay = graphed(lambda a=args: [hc.hc_pre_normed(*a) for _ in range(CALLS)])
            seconds = cuda_time(replay) / CALLS
            print(f"| {tokens} | {warps} | {hc.finish_launch(tokens, D)[1]} | {seconds * 1e6:.2f} | {same} | "
                  f"{diff:.3g} |")
    os.environ.pop(hc.DECODE_WARPS_ENV, None)


if __name__ == "__main__":
    main()

"""Tile sweep of the Triton ``moe_experts`` on the bench preset's MoE shape (E=64, top-6, D=4096, I=2048, bf16).

    python backends/nvidia_sm100/benchmarks/sweep_moe_configs.py [--tokens 1 16 64 256 1024]

For each token count: every (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) candidate is checked against the reference
op, then timed replayed from a CUDA graph (CUDA events, median of 20 after warmup). Prints, per token count,
the current default (``moe._config``), the best candidate and the % of the weight-read floor (docs/performance.md:
unique experts' bytes / 4.25 TB/s); the full table goes to --out.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from cuda_timing import cuda_time, graphed

from deepinfer_core.ops import reference as ref

E, K, D, I = 64, 6, 4096, 2048
BW = 4.25e12


def candidates(tokens: int):
    if tokens <= 64:  # a few tokens per expert: GEMV-like, one BLOCK_M tile per expert
        yield from itertools.product((16,), (32, 64, 128), (64, 128, 256), (4, 8))
    else:
        yield from itertools.product((32, 64), (64, 128), (64, 128), (4, 8))


def main() -> None:
    from deepinfer_nvidia_sm100.kernels import moe

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    parser.add_argument("--out", default="moe_sweep.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    dt = torch.bfloat16
    w1 = (torch.randn(E, I, D, device="cuda") * 0.02).to(dt)
    w2 = (torch.randn(E, D, I, device="cuda") * 0.02).to(dt)
    w3 = (torch.randn(E, I, D, device="cuda") * 0.02).to(dt)
    table, summary = [], []
    for T in args.tokens:
        x = torch.randn(T, D, device="cuda").to(dt)
        ids = torch.rand(T, E, device="cuda").topk(K, dim=-1).indices
        weights = torch.rand(T, K, device="cuda")
        want = ref.moe_experts(x, ids, weights, w1, w2, w3, 10.0).float()
        floor = ids.unique().numel() * 3 * I * D * 2 / BW
        default = moe._config(T * K, E)
        results = {}
        for cfg in dict.fromkeys([default, *candidates(T)]):
            try:
                got = moe.moe_experts(x, ids, weights, w1, w2, w3, 10.0, config=cfg).float()
                err = ((got - want).abs().max() / want.abs().max()).item()
                if err > 2e-2:
                    raise AssertionError(f"max rel err {err:.2e}")
                args_ = (x, ids, weights, w1, w2, w3, 10.0)
                t = cuda_time(graphed(lambda c=cfg, a=args_: moe.moe_experts(*a, config=c)))
            except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is skipped
                table.append({"tokens": T, "config": cfg, "error": str(exc)[:200]})
                continue
            results[cfg] = t
            table.append({"tokens": T, "config": cfg, "seconds": t, "floor_fraction": floor / t})
        best = min(results, key=results.get)
        summary.append((T, default, results.get(default), best, results[best], floor))
    with open(args.out, "w") as f:
        json.dump(table, f, indent=1)
    print("| tokens | default config | time | % floor | best config | time | % floor |")
    print("|---|---|---|---|---|---|---|")
    for T, d, td, b, tb, floor in summary:
        td_s = f"{td * 1e3:.3f} ms | {100 * floor / td:.0f}%" if td else "failed | -"
        print(f"| {T} | {d} | {td_s} | {b} | {tb * 1e3:.3f} ms | {100 * floor / tb:.0f}% |")


if __name__ == "__main__":
    main()

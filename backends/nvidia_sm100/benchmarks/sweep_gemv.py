"""One-row decode projections of the bench preset (bf16): cuBLAS against the one-row Triton kernel of
``kernels/gemv.py`` over a grid of launch configurations, to pick ``gemv.row_config`` per shape.

    python backends/nvidia_sm100/benchmarks/sweep_gemv.py      # on a GPU; prints a table per shape, then a summary

Each candidate is checked against ``F.linear`` first; the default launch (``gemv.row_config``) is timed too (PDL
launches unless ``DEEPINFER_NVIDIA_PDL=0``). Timing: one
CUDA graph replays the projection over enough copies of the weight that the copies exceed the L2 cache (each call
reads its weight from HBM, as in a decode step, where every weight is read once), CUDA events, median of repeats,
seconds per call. Floor = weight bytes / 4.25 TB/s (the H200's copy bandwidth, docs/performance.md).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from cuda_timing import cuda_time, graphed

BW = 4.25e12
L2_MARGIN_BYTES = 320 * 2**20  # well past the H200's 50 MB L2
SHAPES = {  # name -> (output columns per group, input width, groups): the preset's one-row projections
    "w_input (CSA)": (4160, 4096, 1),
    "w_input (HCA)": (2560, 4096, 1),
    "w_input (sliding)": (1536, 4096, 1),
    "wq_b": (32768, 1024, 1),
    "indexer wq_b": (8192, 1024, 1),
    "wo_a (8 groups)": (1024, 4096, 8),
    "wo_b": (4096, 8192, 1),
    "shared w1+w3": (4096, 4096, 1),
    "shared w2": (4096, 2048, 1),
}
BLOCK_N = (2, 4, 8, 16, 32)
BLOCK_K = (128, 256, 512, 1024)
WARPS = (2, 4, 8)
STAGES = (1, 2, 4)


def configs():
    from deepinfer_nvidia_sm100.kernels.gemv import RowConfig

    for bn, bk, warps, stages in itertools.product(BLOCK_N, BLOCK_K, WARPS, STAGES):
        elements_per_thread = bn * bk / (32 * warps)
        if 4 <= elements_per_thread <= 64:
            yield RowConfig(bn, bk, warps, stages)


def time_per_call(call_on, copies: int) -> float:
    """Seconds per call of ``call_on(i)`` over ``copies`` weights, replayed from one CUDA graph."""
    replay = graphed(lambda: [call_on(i) for i in range(copies)])
    return cuda_time(replay, reps=15) / copies


def sweep_shape(name: str, n: int, k: int, groups: int, candidates: list) -> dict:
    from deepinfer_nvidia_sm100.kernels import gemv

    size = groups * n * k * 2
    copies = max(4, math.ceil(L2_MARGIN_BYTES / size))
    weights = [(torch.randn(groups * n, k, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(copies)]
    x = torch.randn(groups, k, device="cuda").to(torch.bfloat16)  # [groups, K]
    out = torch.empty(groups, n, device="cuda", dtype=torch.bfloat16)  # [groups, N]
    want = torch.einsum("gk,gnk->gn", x.float(), weights[0].float().view(groups, n, k))

    def cublas(i):
        if groups == 1:
            return F.linear(x, weights[i])
        return torch.einsum("gk,gnk->gn", x, weights[i].view(groups, n, k))

    timings = {"cublas": time_per_call(cublas, copies)}
    for config in candidates:
        gemv.launch_row(x, weights[0], out, groups, config)
        err = ((out.float() - want).abs().max() / want.abs().max()).item()
        assert err < 2e-2, f"{name} {config}: max relative error {err:.1e}"
        timings[config] = time_per_call(lambda i, c=config: gemv.launch_row(x, weights[i], out, groups, c), copies)
    timings["default"] = time_per_call(lambda i: gemv.launch_row(x, weights[i], out, groups), copies)
    weights.clear()
    torch.cuda.empty_cache()
    return {"floor": size / BW, "timings": timings}


def main() -> None:
    torch.manual_seed(0)
    candidates = list(configs())
    print(f"{len(candidates)} launch configurations per shape")
    results = {name: sweep_shape(name, *shape, candidates) for name, shape in SHAPES.items()}
    print("\n| projection | floor | cuBLAS | row kernel, default config | best config | best | best / floor |")
    print("|---|---|---|---|---|---|---|")
    for name, result in results.items():
        t = result["timings"]
        best = min(candidates, key=t.__getitem__)
        print(f"| {name} | {result['floor'] * 1e6:.2f} us | {t['cublas'] * 1e6:.2f} us | {t['default'] * 1e6:.2f} us "
              f"| {best} | {t[best] * 1e6:.2f} us | {result['floor'] / t[best]:.0%} |")
        top = sorted(candidates, key=t.__getitem__)[:5]
        print("|  top 5 | " + "; ".join(f"{c.block_n}x{c.block_k} w{c.warps} s{c.stages} {t[c] * 1e6:.2f}" for c in top)
              + " | | | | | |")
    totals = {c: sum(r["timings"][c] for r in results.values()) for c in candidates}
    best_one = min(candidates, key=totals.__getitem__)
    cublas = sum(r["timings"]["cublas"] for r in results.values())
    best_each = sum(min(r["timings"][c] for c in candidates) for r in results.values())
    default = sum(r["timings"]["default"] for r in results.values())
    floor = sum(r["floor"] for r in results.values())
    print(f"\nsummary (one of each shape): floor {floor * 1e6:.1f} us, cuBLAS {cublas * 1e6:.1f} us, row kernel "
          f"default {default * 1e6:.1f} us, best single config {best_one} "
          f"{totals[best_one] * 1e6:.1f} us, best per shape {best_each * 1e6:.1f} us")


if __name__ == "__main__":
    main()

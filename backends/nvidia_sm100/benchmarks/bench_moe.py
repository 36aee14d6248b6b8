"""Routed-expert op on the bench preset's MoE shape (E=64, top-6, D=4096, I=2048, bf16): Triton vs reference.

    python backends/nvidia_sm100/benchmarks/bench_moe.py      # on a GPU; prints one table

Checks the Triton op against the reference op first, then times (CUDA events, median of repeats, after
warmup; weights normal(0, 0.02), never zeros) the reference op (eager), the Triton op (eager) and the
Triton op replayed from a CUDA graph. Floor = max(unique experts' weight bytes / 4.25 TB/s,
FLOPs / 799 TFLOP/s) (BENCHMARKS.md ceilings).
"""

from __future__ import annotations

import torch
from cuda_timing import cuda_time, graphed

from deepinfer_core.ops import reference as ref

E, K, D, I = 64, 6, 4096, 2048
BW, FLOPS = 4.25e12, 799e12


def main() -> None:
    from deepinfer_nvidia_sm100.kernels.moe import moe_experts

    torch.manual_seed(0)
    dt = torch.bfloat16
    w1 = (torch.randn(E, I, D, device="cuda") * 0.02).to(dt)
    w2 = (torch.randn(E, D, I, device="cuda") * 0.02).to(dt)
    w3 = (torch.randn(E, I, D, device="cuda") * 0.02).to(dt)
    rows = []
    for T in (1, 16, 64, 256, 1024, 4096):
        x = torch.randn(T, D, device="cuda").to(dt)
        ids = torch.rand(T, E, device="cuda").topk(K, dim=-1).indices
        weights = torch.rand(T, K, device="cuda")
        got = moe_experts(x, ids, weights, w1, w2, w3, 10.0)
        want = ref.moe_experts(x, ids, weights, w1, w2, w3, 10.0)
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        unique = ids.unique().numel()
        floor = max(unique * 3 * I * D * 2 / BW, T * K * 3 * 2 * D * I / FLOPS)
        args = (x, ids, weights, w1, w2, w3, 10.0)
        t_ref = cuda_time(lambda a=args: ref.moe_experts(*a), reps=5 if T > 256 else 20)
        t_tri = cuda_time(lambda a=args: moe_experts(*a))
        t_graph = None
        if T <= 256:
            t_graph = cuda_time(graphed(lambda a=args: moe_experts(*a)))
        rows.append((T, unique, err, floor, t_ref, t_tri, t_graph))
    print("\nmoe_experts, E=64 top-6 D=4096 I=2048 bf16, one layer (H200)")
    print("| tokens | experts touched | max rel err vs ref | floor | reference | triton | % floor | triton+graph | % floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for T, u, err, floor, a, b, c in rows:
        pct_c = f"{100 * floor / c:.0f}%" if c is not None else "-"
        tc = f"{c * 1e3:.3f} ms" if c is not None else "-"
        print(f"| {T} | {u} | {err:.1e} | {floor * 1e3:.3f} ms | {a * 1e3:.3f} ms | {b * 1e3:.3f} ms | "
              f"{100 * floor / b:.0f}% | {tc} | {pct_c} |")


if __name__ == "__main__":
    main()

"""Routed-expert op on the bench preset's MoE shape (E=64, top-6, D=4096, I=2048, bf16): Triton vs reference.

    python backends/nvidia_sm100/benchmarks/bench_moe.py      # on a GPU; prints one table

Checks the Triton kernels and the grouped-GEMM path (``torch._grouped_mm``, expert runs padded to 16 rows or
unpadded) against the reference op first, then times (CUDA events, median of repeats, after warmup; weights
normal(0, 0.02), never zeros) the reference op (eager), the op as the backend runs it, the Triton kernels, the
grouped-GEMM path, the batch-invariant mode's op (``invariant.moe_experts``) and its 64-row tile at every size
(``invariant/64``), and the op replayed from a CUDA graph; then lists which variants give the mode's op's bits (the
mode takes the CUTLASS grouped GEMM for prefill and the 16-row decode tile for one or two tokens because they do).
Floor = max(unique experts' weight bytes / 4.25 TB/s, FLOPs / 799 TFLOP/s) (the H200's ceilings,
docs/performance.md).
"""

from __future__ import annotations

import torch
from cuda_timing import cuda_time, graphed

from deepinfer_core.ops import reference as ref

E, K, D, I = 64, 6, 4096, 2048
BW, FLOPS = 4.25e12, 799e12


def main() -> None:
    from deepinfer_nvidia_sm100.kernels import invariant, moe

    torch.manual_seed(0)
    dt = torch.bfloat16
    w1 = (torch.randn(E, I, D, device="cuda") * 0.02).to(dt)
    w2 = (torch.randn(E, D, I, device="cuda") * 0.02).to(dt)
    w3 = (torch.randn(E, I, D, device="cuda") * 0.02).to(dt)
    variants = {
        "op": lambda *a: moe.moe_experts(*a),
        "triton": lambda *a: moe._moe_experts(*a, moe._config(a[1].numel(), E)),
        "grouped/16": lambda *a: moe.moe_experts_grouped(*a, group_align=16),
        "grouped/1": lambda *a: moe.moe_experts_grouped(*a, group_align=1),
        "invariant": lambda *a: invariant.moe_experts(*a),
        "invariant/64": lambda *a: moe.moe_experts(*a, config=invariant.MOE_TILE),
    }
    rows, same = [], {}
    for T in (1, 16, 64, 256, 1024, 2048, 4096, 8192):
        x = torch.randn(T, D, device="cuda").to(dt)
        ids = torch.rand(T, E, device="cuda").topk(K, dim=-1).indices
        weights = torch.rand(T, K, device="cuda")
        args = (x, ids, weights, w1, w2, w3, 10.0)
        want = ref.moe_experts(*args).float()
        outs = {name: fn(*args) for name, fn in variants.items()}
        errs = {name: ((out.float() - want).abs().max() / want.abs().max()).item() for name, out in outs.items()}
        same[T] = [name for name in ("triton", "grouped/16", "grouped/1", "invariant/64")
                   if torch.equal(outs[name], outs["invariant"])]
        unique = ids.unique().numel()
        floor = max(unique * 3 * I * D * 2 / BW, T * K * 3 * 2 * D * I / FLOPS)
        times = {"reference": cuda_time(lambda a=args: ref.moe_experts(*a), reps=5 if T > 256 else 20)}
        times.update({name: cuda_time(lambda a=args, f=fn: f(*a), reps=10 if T > 1024 else 20)
                      for name, fn in variants.items()})
        times["op+graph"] = cuda_time(graphed(lambda a=args: moe.moe_experts(*a))) if T <= 256 else None
        rows.append((T, unique, errs, floor, times))
    names = ["reference", *variants, "op+graph"]
    print("\nmoe_experts, E=64 top-6 D=4096 I=2048 bf16, one layer (H200); time (% of floor); max rel err vs reference")
    print("| tokens | experts | floor | " + " | ".join(names) + " | " + " | ".join(f"err {n}" for n in variants) + " |")
    print("|" + "---|" * (3 + len(names) + len(variants)))
    for T, unique, errs, floor, times in rows:
        cells = [f"{times[n] * 1e3:.3f} ms ({100 * floor / times[n]:.0f}%)" if times[n] else "-" for n in names]
        print(f"| {T} | {unique} | {floor * 1e3:.3f} ms | " + " | ".join(cells) + " | "
              + " | ".join(f"{errs[n]:.1e}" for n in variants) + " |")
    print("\nSummary (best variant per size):")
    for T, _, _, floor, times in rows:
        best = min(variants, key=lambda n: times[n])
        print(f"  {T:5d} tokens: {best} {times[best] * 1e3:.3f} ms = {100 * floor / times[best]:.0f}% of floor")
    print("\nBitwise equal to the batch-invariant mode's tiles (invariant.moe_tile), per size:")
    for T, names_equal in same.items():
        print(f"  {T:5d} tokens: {', '.join(names_equal) or 'none'}")


if __name__ == "__main__":
    main()

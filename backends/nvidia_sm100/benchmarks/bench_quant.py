"""Quantized-weight kernels on the ``v4-flash-8l64e-fp4`` preset's shapes: routed experts (bf16 vs MXFP4 vs fp8
blocks) and fp8 block linears (bf16 vs weight-only fp8 vs fp8 tensor cores), bf16 activations.

    python backends/nvidia_sm100/benchmarks/bench_quant.py      # on a GPU; prints two tables and the crossover
    KERNELS=bench_quant KERNEL_TIMEOUT=550 bash backends/nvidia_sm100/benchmarks/h200_session.sh kernels

Every variant is first checked against its reference op (``reference.moe_experts_mxfp4``, ``linear_fp8_block``,
...; weights normal(0, 0.02) written through ``deepinfer_core.quant``), then timed replayed from a CUDA graph
up to 256 rows (which also shows it captures: no host synchronisation) and eagerly beyond, CUDA events, median of
repeats. Floor = max(bytes read /
4.25 TB/s, FLOPs / peak), bytes counted as stored (bf16 2 B, fp8 1 B, MXFP4 0.5 B per weight, plus scales; the
experts each routed token reaches, once), peak 799 TFLOP/s for bf16 products (the weight-only kernels multiply in
bf16) and 1,415 TFLOP/s for the fp8 tensor-core kernel (fp8 ``torch._scaled_mm`` on 8192^3): the H200's ceilings
(docs/performance.md). % = floor / time. The fp8 tensor-core rows also report their error against the reference
op: they quantize activations (per token per 128 inputs). Last, launch sweeps of the MXFP4 expert kernels and
the fp8 linear kernels for tuning ``moe_quant.TILES`` / ``ROW_TILES`` / ``ONE_TOKEN_ROW_KERNELS`` /
``SWAP_AB_MAX_ROWS`` and ``fp8_linear``'s tiles / ``SWAP_AB_MAX_ROWS``, with the kernels before the rewrite
(``DEEPINFER_NVIDIA_MXFP4_DOT_SCALED=0``) as a reference point.
"""

from __future__ import annotations

import sys
from functools import partial

import torch
from cuda_timing import cuda_time, graphed

from deepinfer_core.ops import reference as ref
from deepinfer_core.quant import fp8_block, mxfp4

E, TOP_K, D, I = 64, 6, 4096, 2048  # v4-flash-8l64e(-fp4) routed experts
BLOCK = (128, 128)  # the preset's fp8 blocks (ue8m0 scales)
BW, BF16_FLOPS, FP8_FLOPS = 4.25e12, 799e12, 1415e12
MOE_TOKENS = (1, 16, 64, 1024, 8192)
LINEAR_ROWS = (1, 16, 64, 256, 1024, 8192)
LINEARS = {  # name -> (out per group, in, groups): the preset's projections
    "wq_a+wkv": (1536, 4096, 1), "wq_b": (32768, 1024, 1), "wo_a": (1024, 4096, 8), "wo_b": (4096, 8192, 1),
    "shared w1||w3": (4096, 4096, 1)}
DEVICE = "cuda"
GRAPH_MAX_ROWS = 256  # larger sizes are timed eagerly (launch overhead is negligible there)
WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0 + 1 / (BLOCK[0] * BLOCK[1]), "mxfp4": 0.5 + 1 / mxfp4.GROUP}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.float()
    return ((got.float() - want).abs().max() / want.abs().max()).item()


def timed(fn, rows: int) -> float | None:
    """Median seconds of ``fn``, replayed from a CUDA graph up to ``GRAPH_MAX_ROWS`` rows; None when the capture
    fails (printed)."""
    if rows > GRAPH_MAX_ROWS:
        return cuda_time(fn, reps=10)
    replay = graphed(fn, strict=False)
    return cuda_time(replay, reps=10) if replay is not None else None


def micros(seconds: float | None) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds else "capture failed"


def cell(seconds: float | None, floor: float) -> str:
    return f"{seconds * 1e6:.1f} us ({100 * floor / seconds:.0f}%)" if seconds else "capture failed"


def expert_weights():
    """bf16, MXFP4 and fp8-block copies of the same random experts: ``{format: (w1, s1, w2, s2, w3, s3)}``."""
    torch.manual_seed(0)
    dense = [(torch.randn(E, *shape, device=DEVICE) * 0.02).to(torch.bfloat16) for shape in ((I, D), (D, I), (I, D))]
    packed = [mxfp4.quantize(w) for w in dense]
    blocks = [fp8_block.quantize(w, BLOCK, ue8m0=True) for w in dense]
    return {"bf16": (dense[0], None, dense[1], None, dense[2], None),
            "mxfp4": tuple(t for pair in packed for t in pair), "fp8": tuple(t for pair in blocks for t in pair)}


def bench_moe() -> None:
    from deepinfer_nvidia_sm100.kernels import moe, moe_quant

    weights = expert_weights()
    limit = 10.0
    ops = {
        "bf16": (lambda x, i, w, a: moe.moe_experts(x, i, w, a[0], a[2], a[4], limit),
                 lambda x, i, w, a: ref.moe_experts(x, i, w, a[0], a[2], a[4], limit)),
        "mxfp4": (lambda x, i, w, a: moe_quant.moe_experts_mxfp4(x, i, w, *a, limit),
                  lambda x, i, w, a: ref.moe_experts_mxfp4(x, i, w, *a, limit)),
        "fp8": (lambda x, i, w, a: moe_quant.moe_experts_fp8_block(x, i, w, *a, BLOCK, limit),
                lambda x, i, w, a: ref.moe_experts_fp8_block(x, i, w, *a, BLOCK, limit)),
    }
    print(f"\nrouted experts, E={E} top-{TOP_K} D={D} I={I}, bf16 activations, one layer; time (% of floor), "
          "max relative error vs the format's reference op")
    print("| tokens | experts | " + " | ".join(f"{n} floor | {n}" for n in ops) + " | errors |")
    print("|---|---|" + "---|---|" * len(ops) + "---|")
    for T in MOE_TOKENS:
        x = torch.randn(T, D, device=DEVICE).to(torch.bfloat16)
        ids = torch.rand(T, E, device=DEVICE).topk(TOP_K, dim=-1).indices
        routing = torch.rand(T, TOP_K, device=DEVICE)
        unique = ids.unique().numel()
        cells, errors = [], []
        for name, (fast, reference) in ops.items():
            args = weights[name]
            err = relative_error(fast(x, ids, routing, args), reference(x, ids, routing, args))
            assert err < 2e-2, f"{name} at {T} tokens: max relative error {err:.1e}"
            floor = max(unique * 3 * I * D * WEIGHT_BYTES[name] / BW, T * TOP_K * 6 * D * I / BF16_FLOPS)
            cells += [f"{floor * 1e6:.1f} us", cell(timed(partial(fast, x, ids, routing, args), T), floor)]
            errors.append(f"{name} {err:.1e}")
        print(f"| {T} | {unique} | " + " | ".join(cells) + " | " + ", ".join(errors) + " |")


def linear_variants(x: torch.Tensor, dense: torch.Tensor, w: torch.Tensor, s: torch.Tensor, groups: int) -> dict:
    """The products timed per (weight, rows): bf16 as the backend runs it, the fp8 kernels forced, the op."""
    from deepinfer_nvidia_sm100.kernels import fp8_linear, gemv

    weight_only = fp8_linear.ROW if x.shape[0] == 1 else fp8_linear.WEIGHT_ONLY
    return {
        "bf16": lambda: (gemv.grouped_linear(x, dense, groups) if groups > 1
                         else gemv.linear(x[:, 0], dense).unsqueeze(1)),
        "weight-only": lambda: fp8_linear.matmul(x, w, s, BLOCK, groups, weight_only),
        "tensor cores": lambda: fp8_linear.matmul(x, w, s, BLOCK, groups, fp8_linear.FP8_TC),
        "op": lambda: fp8_linear.grouped_linear_fp8_block(x, w, s, BLOCK, groups),
    }


def bench_linear() -> None:
    from deepinfer_nvidia_sm100.kernels import fp8_linear

    print(f"\nfp8 block linears ({BLOCK[0]} x {BLOCK[1]} ue8m0), bf16 activations; time (% of floor); "
          f"the op picks weight-only below FP8_TC_MIN_ROWS = {fp8_linear.FP8_TC_MIN_ROWS} rows")
    print("| weight | rows | bf16 | fp8 weight-only | fp8 tensor cores | op | tensor-core error |")
    print("|---|---|---|---|---|---|---|")
    wins = {}
    for name, (n, k, groups) in LINEARS.items():
        torch.manual_seed(1)
        dense = (torch.randn(groups * n, k, device=DEVICE) * 0.02).to(torch.bfloat16)
        w, s = fp8_block.quantize(dense, BLOCK, ue8m0=True)
        for rows in LINEAR_ROWS:
            x = torch.randn(rows, groups, k, device=DEVICE).to(torch.bfloat16)
            want = ref.grouped_linear_fp8_block(x, w, s, BLOCK, groups)
            variants = linear_variants(x, dense, w, s, groups)
            errors = {v: relative_error(fn(), want) for v, fn in variants.items()}
            assert errors["weight-only"] < 2e-2 and errors["op"] < 0.1, f"{name} at {rows} rows: {errors}"
            assert errors["tensor cores"] < 0.1, f"{name} at {rows} rows: tensor cores {errors['tensor cores']:.1e}"
            flops = 2 * rows * groups * n * k
            act = rows * groups * (k + n) * 2
            floors = {"bf16": max((dense.numel() * 2 + act) / BW, flops / BF16_FLOPS),
                      "weight-only": max((dense.numel() * WEIGHT_BYTES["fp8"] + act) / BW, flops / BF16_FLOPS),
                      "tensor cores": max((dense.numel() * WEIGHT_BYTES["fp8"] + act) / BW, flops / FP8_FLOPS)}
            floors["op"] = floors["tensor cores" if fp8_linear.linear_path(rows, x.dtype, BLOCK) == fp8_linear.FP8_TC
                                  else "weight-only"]
            times = {v: timed(fn, rows) for v, fn in variants.items()}
            wins[name, rows] = (times["weight-only"] or float("inf")) > (times["tensor cores"] or float("inf"))
            print(f"| {name} | {rows} | " + " | ".join(cell(times[v], floors[v]) for v in variants)
                  + f" | {errors['tensor cores']:.1e} |")
    print("\nfp8 tensor cores faster than weight-only at (weight: rows):")
    for name in LINEARS:
        faster = [rows for rows in LINEAR_ROWS if wins[name, rows]]
        print(f"  {name}: {faster}")
    crossover = next((r for r in LINEAR_ROWS if all(wins[name, q] for name in LINEARS for q in LINEAR_ROWS if q >= r)),
                     None)
    print(f"crossover (the smallest measured row count from which tensor cores win on every weight): {crossover}; "
          f"fp8_linear.FP8_TC_MIN_ROWS = {fp8_linear.FP8_TC_MIN_ROWS}")


MOE_SWEEP = {  # tokens -> (path, launch) tried for the MXFP4 experts, the default first. Paths: "rows" (the one-token
    # row kernels, ROW_TILES' form), "grouped" (align + the grouped kernels, _tiles' form; tl.dot_scaled at bf16),
    # "old" (the grouped kernels with DEEPINFER_NVIDIA_MXFP4_DOT_SCALED=0: float32 decode, even / odd products),
    # "unswapped" (16-row tiles with the activations as dot_scaled's left operand: SWAP_AB_MAX_ROWS = 0)
    1: (("rows", (8, 512, 4, 3)), ("rows", (4, 1024, 4, 3)), ("rows", (16, 512, 8, 3)),
        ("grouped", (16, 64, 128, 4)), ("grouped", (16, 128, 128, 4))),
    16: (("grouped", (16, 64, 128, 4)), ("grouped", (16, 128, 128, 4)), ("grouped", (16, 64, 256, 4)),
         ("unswapped", (16, 64, 128, 4))),
    64: (("grouped", (16, 64, 128, 4)), ("grouped", (16, 128, 128, 4)), ("grouped", (16, 64, 256, 4)),
         ("old", (16, 64, 128, 4))),
    8192: (("grouped", (128, 128, 64, 8)), ("grouped", (128, 128, 128, 8)), ("grouped", (64, 128, 64, 8)),
           ("old", (128, 128, 64, 8))),
}
LINEAR_SWEEP = {  # rows -> (path, launch) tried on wo_b (4096 x 8192), the default first; "unswapped": weight-only
    # 16-row tiles with the activations as the left operand (fp8_linear.SWAP_AB_MAX_ROWS = 0)
    1: (("row", (16, 512, 4, 3)), ("row", (16, 128, 4, 4)), ("row", (16, 1024, 8, 3)),
        ("weight_only", (16, 64, 4, 4))),
    16: (("weight_only", (16, 16, 4, 4)), ("weight_only", (16, 64, 4, 4)), ("unswapped", (16, 16, 4, 4))),
    64: (("weight_only", (64, 16, 4, 3)), ("weight_only", (64, 64, 4, 3)), ("weight_only", (16, 16, 4, 4))),
    8192: (("fp8_tc", (128, 128, 8, 3)), ("fp8_tc", (128, 256, 8, 3)), ("fp8_tc", (128, 128, 8, 4)),
           ("fp8_tc", (256, 128, 8, 3))),
}


def linear_sweep_run(path: str, tile: tuple[int, int, int, int], x, w, s):
    """The fp8 linear at one sweep point: a function of no arguments."""
    from deepinfer_nvidia_sm100.kernels import fp8_linear

    def run():
        if path != "unswapped":
            return fp8_linear.matmul(x, w, s, BLOCK, 1, path, tile)
        swap, fp8_linear.SWAP_AB_MAX_ROWS = fp8_linear.SWAP_AB_MAX_ROWS, 0
        try:
            return fp8_linear.matmul(x, w, s, BLOCK, 1, fp8_linear.WEIGHT_ONLY, tile)
        finally:
            fp8_linear.SWAP_AB_MAX_ROWS = swap

    return run


def moe_sweep_run(path: str, tile: tuple[int, int, int, int], x, ids, routing, stored):
    """The MXFP4 experts at one sweep point: a function of no arguments."""
    import os

    from deepinfer_nvidia_sm100.kernels import moe_quant

    def run():
        if path == "unswapped":
            swap, moe_quant.SWAP_AB_MAX_ROWS = moe_quant.SWAP_AB_MAX_ROWS, 0
            try:
                return moe_quant._run(moe_quant.MXFP4, x, ids, routing, *stored, moe_quant.MXFP4_BLOCK, 10.0, tile,
                                      row_kernels=False)
            finally:
                moe_quant.SWAP_AB_MAX_ROWS = swap
        if path != "old":
            return moe_quant._run(moe_quant.MXFP4, x, ids, routing, *stored, moe_quant.MXFP4_BLOCK, 10.0, tile,
                                  row_kernels=path == "rows")
        os.environ["DEEPINFER_NVIDIA_MXFP4_DOT_SCALED"] = "0"  # read at each call, also while a graph is captured
        try:
            return moe_quant._run(moe_quant.MXFP4, x, ids, routing, *stored, moe_quant.MXFP4_BLOCK, 10.0, tile,
                                  row_kernels=False)
        finally:
            del os.environ["DEEPINFER_NVIDIA_MXFP4_DOT_SCALED"]

    return run


def sweep() -> None:
    """Launch sweeps for tuning (after the tables: a run cut short keeps those): MXFP4 experts by tokens, the fp8
    linear kernels by rows; each launch checked against the reference op, then timed."""

    print("\nsweep: MXFP4 experts (tokens: path launch -> time; the default first)")
    stored = expert_weights()["mxfp4"]
    for T, points in MOE_SWEEP.items():
        x = torch.randn(T, D, device=DEVICE).to(torch.bfloat16)
        ids = torch.rand(T, E, device=DEVICE).topk(TOP_K, dim=-1).indices
        routing = torch.rand(T, TOP_K, device=DEVICE)
        want = ref.moe_experts_mxfp4(x, ids, routing, *stored, 10.0)
        cells = []
        for path, tile in points:
            run = moe_sweep_run(path, tile, x, ids, routing, stored)
            err = relative_error(run(), want)
            cells.append(f"{path} {tile}: {micros(timed(run, T))}" + (f" (error {err:.1e})" if err > 2e-2 else ""))
        print(f"  {T}: " + "; ".join(cells))
    print("\nsweep: fp8 linear wo_b 4096 x 8192 (rows: path launch -> time; the default first)")
    torch.manual_seed(2)
    w, s = fp8_block.quantize(torch.randn(4096, 8192, device=DEVICE) * 0.02, BLOCK, ue8m0=True)
    for rows, points in LINEAR_SWEEP.items():
        x = torch.randn(rows, 1, 8192, device=DEVICE).to(torch.bfloat16)
        want = ref.linear_fp8_block(x, w, s, BLOCK)
        cells = []
        for path, tile in points:
            run = linear_sweep_run(path, tile, x, w, s)
            err = relative_error(run(), want)
            cells.append(f"{path} {tile}: {micros(timed(run, rows))}" + (f" (error {err:.1e})" if err > 0.1 else ""))
        print(f"  {rows}: " + "; ".join(cells))


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)  # rows reach the log as they finish, even if the run is cut short
    print(torch.cuda.get_device_name())
    bench_moe()
    bench_linear()
    sweep()


if __name__ == "__main__":
    main()

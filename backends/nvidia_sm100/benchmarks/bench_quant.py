"""Quantized-weight kernels on the ``v4-flash-8l64e-fp4`` preset's shapes: routed experts (bf16 vs MXFP4 vs fp8
blocks) and fp8 block linears (bf16 vs weight-only fp8 vs fp8 tensor cores), bf16 activations.

    python backends/nvidia_sm100/benchmarks/bench_quant.py      # on a GPU: every section
    python backends/nvidia_sm100/benchmarks/bench_quant.py fp8  # the fp8 linears only: A/B table, sweep, summary
    python backends/nvidia_sm100/benchmarks/bench_quant.py mxfp4  # MXFP4 experts at decode sizes (bench_mxfp4_decode)
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

The fp8 linear table (section ``fp8``) times per weight and row count bf16 (the backend's GEMV at 1 row, cuBLAS
beyond), the fp8 op as main c407f82 ran it (``old``), the op now (``new``, its path named), and each fp8 path
forced (``split-K``, ``fp8 TC``, ``dequant``, cuBLAS blockwise ``scaled_mm`` where torch has it: the reason
printed where not); a summary of new / bf16 and new / old per row count comes last.
"""

from __future__ import annotations

import sys
from functools import partial

import torch
from bench_mxfp4_decode import ROW_TILES_ONE_TOKEN
from cuda_timing import BACK_TO_BACK, cuda_time, graphed, module_settings

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
    """Median seconds of ``fn`` (``BACK_TO_BACK`` calls an event pair), replayed from a CUDA graph up to
    ``GRAPH_MAX_ROWS`` rows; None when the capture fails (printed)."""
    if rows > GRAPH_MAX_ROWS:
        return cuda_time(fn, reps=10, inner=BACK_TO_BACK)
    replay = graphed(fn, strict=False)
    return cuda_time(replay, reps=10, inner=BACK_TO_BACK) if replay is not None else None


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


FP8_AB_LINEARS = {  # name -> (out per group, in, groups, block): the A/B table's weights (V4.1's 32 x 32 blocks last)
    **{name: (*shape, BLOCK) for name, shape in LINEARS.items()}, "wo_b 32x32": (4096, 8192, 1, (32, 32))}


def old_fp8_linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, block, groups: int) -> torch.Tensor:
    """The fp8 linear as main c407f82 ran it: the row kernel at 1 row, the weight-only kernel below 128 rows, the
    tensor-core kernel with its tiles and no K split from there."""
    from deepinfer_nvidia_sm100.kernels import fp8_linear

    rows = x.shape[0]
    if rows == 1:
        return fp8_linear.matmul(x, w, s, block, groups, fp8_linear.ROW)
    if rows < 128:
        return fp8_linear.matmul(x, w, s, block, groups, fp8_linear.WEIGHT_ONLY)
    return fp8_linear.matmul(x, w, s, block, groups, fp8_linear.FP8_TC, (*fp8_linear._tile(fp8_linear.FP8_TC_TILES,
                                                                                          rows), 1))


def scaled_mm_blockwise(w: torch.Tensor, s: torch.Tensor):
    """``torch._scaled_mm`` with DeepSeek's scaling (activations per 1 x 128, weights per 128 x 128, float32 scales;
    cuBLAS on SM90 from CUDA 12.9): a function of ``x [M, 1, K]``, or the reason it cannot run."""
    from deepinfer_nvidia_sm100.kernels import fp8_linear

    scale_t = torch.exp2(s.view(torch.uint8).float() - 127).t()  # [K / 128, N / 128] ue8m0 as float32, once

    def run(x: torch.Tensor) -> torch.Tensor:
        xq, xs = fp8_linear.quantize_activations(x, 128)  # [M, 1, K] e4m3, [M, 1, K / 128]
        a_scale = xs[:, 0].t().contiguous().t()  # [M, K / 128], outer-dim-major as cuBLAS reads it
        return torch._scaled_mm(xq[:, 0], w.t(), scale_a=a_scale, scale_b=scale_t, out_dtype=x.dtype)[:, None]

    return run


def fp8_ab_variants(x, dense, w, s, block, groups: int) -> dict:
    """The products timed per (weight, rows): bf16 as the backend runs it, the fp8 op before this change
    (``old``), the op now (``new``), and its paths forced: ``split-K`` (weight-only, decode batches), ``fp8 TC``
    (tensor cores, K split where the grid is small), ``dequant`` (the weight decoded to bf16, then cuBLAS; the
    decode counted: bytes floor as fp8), cuBLAS blockwise ``scaled_mm`` (128 x 128, one group)."""
    from deepinfer_nvidia_sm100.kernels import fp8_linear, gemv

    rows = x.shape[0]
    variants = {
        "bf16": lambda: (gemv.grouped_linear(x, dense, groups) if groups > 1
                         else gemv.linear(x[:, 0], dense).unsqueeze(1)),
        "old": lambda: old_fp8_linear(x, w, s, block, groups),
        "new": lambda: fp8_linear.grouped_linear_fp8_block(x, w, s, block, groups),
    }
    if rows < 1024:  # beyond, bf16 products of decoded weights are far behind (compute bound)
        variants["split-K"] = lambda: fp8_linear.matmul(x, w, s, block, groups, fp8_linear.SPLIT_K)
    if rows > 1:
        variants["fp8 TC"] = lambda: fp8_linear.matmul(x, w, s, block, groups, fp8_linear.FP8_TC)
    if rows >= 256:
        variants["dequant"] = lambda: fp8_linear.matmul(x, w, s, block, groups, fp8_linear.DEQUANT)
    if groups == 1 and block == (128, 128):
        run = scaled_mm_blockwise(w, s)
        variants["scaled_mm"] = lambda: run(x)
    return variants


AB_QUANTIZED = ("fp8 TC", "scaled_mm")  # variants that quantize activations (checked to fp8's error)


def bench_fp8_linear_ab() -> list[tuple]:
    """bf16 vs the fp8 block linear before and after (and each fp8 path) per weight and row count: each variant
    checked against the reference op, then timed. Returns ``(weight, rows, {variant: seconds}, {variant: floor})``
    rows for ``fp8_summary``."""
    from deepinfer_nvidia_sm100.kernels import fp8_linear

    print("\nfp8 block linears, old (main c407f82) vs new, bf16 activations; time (% of floor: fp8 bytes / 4.25 TB/s "
          "or FLOPs / peak); max relative error vs the reference op")
    names = ("bf16", "old", "new", "split-K", "fp8 TC", "dequant", "scaled_mm")
    print("| weight | rows | new path | " + " | ".join(names) + " | errors |")
    print("|---|---|---|" + "---|" * len(names) + "---|")
    results = []
    for name, (n, k, groups, block) in FP8_AB_LINEARS.items():
        torch.manual_seed(1)
        dense = (torch.randn(groups * n, k, device=DEVICE) * 0.02).to(torch.bfloat16)
        w, s = fp8_block.quantize(dense, block, ue8m0=True)
        fp8_bytes = w.numel() + s.numel()
        for rows in LINEAR_ROWS:
            x = torch.randn(rows, groups, k, device=DEVICE).to(torch.bfloat16)
            want = ref.grouped_linear_fp8_block(x, w, s, block, groups)
            times, floors, errors = {}, {}, {}
            for variant, fn in fp8_ab_variants(x, dense, w, s, block, groups).items():
                try:
                    errors[variant] = relative_error(fn(), want)
                except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:  # scaled_mm's
                    # blockwise scaling needs cuBLAS >= 12.9 on SM90
                    errors[variant] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
                    continue
                quantizes = variant in AB_QUANTIZED or (variant == "old" and rows >= 128) or (
                    variant == "new" and fp8_linear.picked_path(x, n, block) in (fp8_linear.FP8_TC,
                                                                                 fp8_linear.SCALED_MM))
                limit = 0.1 if quantizes else 2e-2
                assert variant == "bf16" or errors[variant] < limit, (  # bf16: the quantization's own error
                    f"{name} at {rows} rows: {variant} error {errors[variant]:.1e}")
                flops = 2 * rows * groups * n * k
                act = rows * groups * (k + n) * 2
                stored = dense.numel() * 2 if variant == "bf16" else fp8_bytes
                peak = FP8_FLOPS if variant in AB_QUANTIZED else BF16_FLOPS
                floors[variant] = max((stored + act) / BW, flops / peak)
                times[variant] = timed(fn, rows)
            cells = [cell(times.get(v), floors[v]) if v in floors else "-" for v in names]
            bad = {v: e for v, e in errors.items() if isinstance(e, str)}
            text = ", ".join(f"{v} {e:.1e}" for v, e in errors.items() if not isinstance(e, str))
            text += "".join(f"; {v}: {e}" for v, e in bad.items())
            path = fp8_linear.linear_path(rows, x.dtype, block)
            print(f"| {name} | {rows} | {path} | " + " | ".join(cells) + f" | {text} |")
            results.append((name, rows, times, floors))
    return results


def fp8_summary(results: list[tuple]) -> None:
    """The A/B table in a few lines: per row count, new / bf16 and new / old (geometric means over the weights and
    the worst weight), new's % of the floor, and how often each fp8 variant was the fastest ("new" where the
    path the op picks is)."""
    print("\nsummary: fp8 block linears, new vs bf16 and vs old (time ratios < 1: new faster); fastest fp8 path")
    for rows in LINEAR_ROWS:
        points = [(name, t, f) for name, r, t, f in results if r == rows and t.get("new") and t.get("bf16")]
        vs_bf16 = [(t["new"] / t["bf16"], name) for name, t, _ in points]
        vs_old = [t["new"] / t["old"] for _, t, _ in points if t.get("old")]
        floor_pct = [100 * f["new"] / t["new"] for _, t, f in points]
        fastest = {}
        for name, t, _ in points:
            fp8 = {v: s for v, s in t.items() if v not in ("bf16", "old") and s}
            if fp8:
                best = min(fp8, key=fp8.get)
                fastest[best] = fastest.get(best, 0) + 1
        worst = max(vs_bf16)
        print(f"  {rows:>5} rows: new/bf16 {_geomean([r for r, _ in vs_bf16]):.2f} (worst {worst[0]:.2f} {worst[1]}), "
              f"new/old {_geomean(vs_old):.2f}, new {min(floor_pct):.0f}-{max(floor_pct):.0f}% of floor; "
              f"fastest fp8 path: " + ", ".join(f"{v} x{c}" for v, c in fastest.items()))
    slower = [(name, rows) for name, rows, t, _ in results if t.get("new") and t.get("bf16") and t["new"] > t["bf16"]]
    print(f"  new slower than bf16 at {len(slower)} of {len(results)} points" + (f": {slower}" if slower else ""))


def _geomean(values: list[float]) -> float:
    return float(torch.tensor(values).log().mean().exp()) if values else float("nan")


MOE_SWEEP = {  # tokens -> (path, launch) tried for the MXFP4 experts, the default first. Paths: "rows" (the one-token
    # row kernels, ROW_TILES' form), "grouped" (align + the grouped kernels, _tiles' form; tl.dot_scaled at bf16),
    # "old" (the grouped kernels with DEEPINFER_NVIDIA_MXFP4_DOT_SCALED=0: float32 decode, even / odd products),
    # "unswapped" (16-row tiles with the activations as dot_scaled's left operand: SWAP_AB_MAX_ROWS = 0)
    # one token: the default row tile, then tiles whose slice spans 32 groups a warp, so that each thread holds
    # several rows of one group and their inputs once (sass_census: ~5.0 / 6.0 instructions a weight, up / down)
    1: (("rows", (4, 1024, 4, 3)), *(("rows", tile) for tile in ROW_TILES_ONE_TOKEN), ("rows", (8, 512, 4, 3)),
        ("grouped", (16, 64, 128, 4))),
    16: (("grouped", (16, 64, 128, 4)), ("grouped", (16, 128, 128, 4)), ("grouped", (16, 64, 256, 4)),
         ("unswapped", (16, 64, 128, 4))),
    64: (("grouped", (16, 64, 128, 4)), ("grouped", (16, 128, 128, 4)), ("grouped", (16, 64, 256, 4)),
         ("old", (16, 64, 128, 4))),
    8192: (("grouped", (128, 128, 64, 8)), ("grouped", (128, 128, 128, 8)), ("grouped", (64, 128, 64, 8)),
           ("old", (128, 128, 64, 8))),
}
LINEAR_SWEEP = {  # rows -> (path, launch) tried on wo_b (4096 x 8192), the default first. split_k: (BM, BN, BK,
    # warps, stages[, K splits]); "split_k_unswapped": the activations as the left operand (SPLIT_K_SWAP = False);
    # "split_k_bf16": bf16 products (SPLIT_K_F16 = False); weight_only / fp8_tc: (BM, BN, warps, stages[, K splits]);
    # "..._meet": the K splits added in the kernel (fp8_linear.SPLITS_MEET) instead of by _sum_splits_kernel;
    # row: (BN, BK, warps, stages[, K splits])
    1: (("row", (8, 2048, 8, 3)), ("row", (16, 1024, 8, 3)), ("row", (8, 2048, 8, 4)), ("row", (8, 2048, 4, 3)),
        ("row", (16, 2048, 8, 3)), ("row", (4, 4096, 8, 3)), ("row", (8, 1024, 4, 3, 2)),
        ("split_k", (16, 256, 128, 8, 4))),
    16: (("split_k", (16, 256, 128, 8, 4)), ("split_k_meet", (16, 256, 128, 8, 4)), ("split_k", (16, 256, 128, 8, 4, 4)),
         ("split_k", (16, 128, 128, 4, 4)),
         ("split_k", (16, 64, 128, 4, 4)), ("split_k", (16, 256, 256, 8, 3)), ("split_k_bf16", (16, 256, 128, 8, 4)),
         ("split_k_unswapped", (16, 128, 128, 4, 4)), ("weight_only", (16, 16, 4, 4))),
    64: (("split_k", (64, 256, 128, 8, 3)), ("split_k", (64, 256, 128, 8, 3, 4)), ("split_k", (64, 128, 128, 8, 3)),
         ("split_k", (64, 64, 128, 4, 3)), ("split_k_bf16", (64, 256, 128, 8, 3)), ("fp8_tc", (64, 128, 4, 3)),
         ("fp8_tc_meet", (64, 128, 4, 3)), ("fp8_tc", (64, 128, 4, 3, 4)), ("fp8_tc_meet", (64, 128, 4, 3, 4)),
         ("fp8_tc", (64, 64, 4, 3)), ("fp8_tc_meet", (64, 64, 4, 3)), ("weight_only", (64, 16, 4, 3))),
    256: (("fp8_tc", (64, 128, 4, 3)), ("fp8_tc", (64, 128, 4, 3, 1)), ("fp8_tc", (128, 128, 8, 3)),
          ("fp8_tc", (64, 64, 4, 4)), ("split_k", (64, 256, 128, 8, 3)), ("split_k_bf16", (64, 256, 128, 8, 3)),
          ("dequant", None)),
    8192: (("dequant", None), ("fp8_tc", (128, 128, 8, 3)), ("fp8_tc", (128, 256, 8, 3)), ("fp8_tc", (128, 128, 8, 4)),
           ("fp8_tc", (256, 128, 8, 3))),
}


SWEEP_VARIANTS = {  # sweep path -> (the fp8_linear path, fp8_linear settings while it runs)
    "split_k_unswapped": ("split_k", {"SPLIT_K_SWAP": False}),
    "split_k_bf16": ("split_k", {"SPLIT_K_F16": False}),
    "split_k_meet": ("split_k", {"SPLITS_MEET": True}),
    "fp8_tc_meet": ("fp8_tc", {"SPLITS_MEET": True}),
}


def linear_sweep_run(path: str, tile: tuple[int, ...], x, w, s):
    """The fp8 linear at one sweep point: a function of no arguments."""
    from deepinfer_nvidia_sm100.kernels import fp8_linear

    kernel_path, settings = SWEEP_VARIANTS.get(path, (path, {}))

    def run():
        with module_settings(fp8_linear, **settings):
            return fp8_linear.matmul(x, w, s, BLOCK, 1, kernel_path, tile)

    return run


def moe_sweep_run(path: str, tile: tuple[int, int, int, int], x, ids, routing, stored):
    """The MXFP4 experts at one sweep point: a function of no arguments."""
    import os

    from deepinfer_nvidia_sm100.kernels import moe_quant

    def run():
        if path == "unswapped":
            with module_settings(moe_quant, SWAP_AB_MAX_ROWS=0):
                return moe_quant._run(moe_quant.MXFP4, x, ids, routing, *stored, moe_quant.MXFP4_BLOCK, 10.0, tile,
                                      row_kernels=False)
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


LINEAR_SWEEP_WEIGHTS = {"wo_b": (LINEARS["wo_b"][:2], LINEAR_SWEEP),
                        "wq_a+wkv": (LINEARS["wq_a+wkv"][:2], {1: LINEAR_SWEEP[1]}),  # narrow: 96 row blocks
                        "wq_b": (LINEARS["wq_b"][:2], {1: (("row", None), *LINEAR_SWEEP[1])})}  # K 1,024


def sweep_linear() -> None:
    """Launch sweeps of the fp8 linear kernels on ``wo_b`` by rows (and on the narrow ``wq_a+wkv`` at one row); each
    checked against the reference op, then timed."""
    for name, ((out_features, in_features), sweep_points) in LINEAR_SWEEP_WEIGHTS.items():
        print(f"\nsweep: fp8 linear {name} {out_features} x {in_features} (rows: path launch -> time; the default "
              "first)")
        torch.manual_seed(2)
        w, s = fp8_block.quantize(torch.randn(out_features, in_features, device=DEVICE) * 0.02, BLOCK, ue8m0=True)
        for rows, points in sweep_points.items():
            x = torch.randn(rows, 1, in_features, device=DEVICE).to(torch.bfloat16)
            want = ref.linear_fp8_block(x, w, s, BLOCK)
            cells = []
            for path, tile in points:
                run = linear_sweep_run(path, tile, x, w, s)
                err = relative_error(run(), want)
                cells.append(f"{path} {tile}: {micros(timed(run, rows))}"
                             + (f" (error {err:.1e})" if err > 0.1 else ""))
            print(f"  {rows}: " + "; ".join(cells))


SHARED_ONE_TOKEN = (((16, 512, 4, 3), 0), ((16, 512, 4, 3), 3), ((16, 512, 4, 4), 4), ((8, 1024, 4, 3), 3),
                    ((8, 2048, 8, 3), 0), ((8, 2048, 8, 3), 3), ((4, 1024, 4, 3), 3))  # (moe_quant.ROW_TILES'
# fp8 tile, ROW_PIPELINE) timed


def bench_shared_expert_one_token() -> None:
    """The preset's shared expert (D 4,096, I 2,048, fp8 128 x 128 blocks) for one token, as a batch-1 decode step
    runs it (``fp8_linear.swiglu_mlp_fp8_block``: ``moe_quant``'s row kernels as a one-expert MoE, 128 programs up
    at ``ROW_TILES``), at each ``SHARED_ONE_TOKEN`` setting, checked against the reference op; bf16's SwiGLU MLP
    beside it."""
    from deepinfer_nvidia_sm100.kernels import fp8_linear, moe, moe_quant

    torch.manual_seed(3)
    dense = [(torch.randn(*shape, device=DEVICE) * 0.02).to(torch.bfloat16) for shape in ((I, D), (D, I), (I, D))]
    stored = [t for w in dense for t in fp8_block.quantize(w, BLOCK, ue8m0=True)]
    x = torch.randn(1, D, device=DEVICE).to(torch.bfloat16)
    want = ref.swiglu_mlp_fp8_block(x, *stored, BLOCK, 10.0)
    floor = sum(t.numel() * t.element_size() for t in stored) / BW
    cells = [f"bf16 {micros(timed(lambda: moe.swiglu_mlp(x, *dense, 10.0), 1))}"]
    for tile, stages in SHARED_ONE_TOKEN:
        def run(tile=tile, stages=stages):
            tiles = moe_quant.ROW_TILES | {moe_quant.FP8: tile}
            with module_settings(moe_quant, ROW_TILES=tiles, ROW_PIPELINE=stages):
                return fp8_linear.swiglu_mlp_fp8_block(x, *stored, BLOCK, 10.0)

        err = relative_error(run(), want)
        assert err < 2e-2, f"shared expert, tile {tile}, pipeline {stages}: error {err:.1e}"
        cells.append(f"{tile} pipeline {stages}: {cell(timed(run, 1), floor)}")
    print(f"\nshared expert, one token (floor {floor * 1e6:.1f} us): " + "; ".join(cells))


def main() -> None:
    """Sections by name on the command line (``moe``, ``fp8``: the fp8 linear A/B table, its sweep and summary;
    ``mxfp4``: ``bench_mxfp4_decode``); all of them without."""
    sys.stdout.reconfigure(line_buffering=True)  # rows reach the log as they finish, even if the run is cut short
    sections = set(sys.argv[1:]) or {"moe", "fp8", "mxfp4"}
    print(torch.cuda.get_device_name())
    if "moe" in sections:
        bench_moe()
    results = bench_fp8_linear_ab() if "fp8" in sections else []
    if "moe" in sections:
        sweep()
    if "fp8" in sections:
        sweep_linear()
        bench_shared_expert_one_token()
        fp8_summary(results)
    if "mxfp4" in sections:  # MXFP4 experts at decode sizes, old vs moe_mxfp4_decode, its summary last
        from bench_mxfp4_decode import bench_mxfp4_decode

        bench_mxfp4_decode()


if __name__ == "__main__":
    main()

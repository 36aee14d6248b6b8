"""The batch-invariant GEMM's launches against cuBLAS on the bench preset's projections (GPU only).

    python plugins/batch_invariant/bench_gemm.py [--rows 1 64 256 2048 16384]
    python plugins/batch_invariant/bench_gemm.py --rows 256 16384 --tiles 128,128,64,8,3 128,256,64,8,3
    python plugins/batch_invariant/bench_gemm.py --cold --rows 1 16 --tiles 16,64,128,4,4 --tile-launches split_swap

For every projection of a ``v4-flash-8l64e`` layer (bf16; the grouped ``wo_a`` as 8 groups) and row count: the time of
``F.linear`` (cuBLAS; the grouped one as a batched matmul), of the plain path's op (``nvidia_sm100``'s ``linear`` /
``grouped_linear`` from its op table: the GEMV kernel at one row), of ``triton_kernels.matmul_nt`` as the mode runs it
(``launch_for``'s launch for the row count and the weight), of every launch in ``triton_kernels.LAUNCHES`` and of
the split-K launch with the fold kernel, each checked to give the same bits as the mode's. CUDA events, median of
repeats after warm-up, each call replayed from a CUDA graph (as a decode step runs). Prints one table (time per call,
the mode's time over the plain op's), the fastest launch per row count summed over the projections, and a
``DEEPINFER_BATCH_INVARIANT_GEMM_LAUNCHES`` value from those (``suggest``).
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics

import torch
import torch.nn.functional as F

# (name, N, K, groups) of one v4-flash-8l64e layer: the CSA layer's fused input run, wq_b, wo_a (8 groups), wo_b,
# the shared expert's w1 || w3 and w2, and the vocabulary head
SHAPES = [("input run (CSA)", 4160, 4096, 1), ("wq_b", 32768, 1024, 1), ("wo_a", 1024, 4096, 8),
          ("wo_b", 4096, 8192, 1), ("shared w1||w3", 4096, 4096, 1), ("shared w2", 4096, 2048, 1),
          ("head", 129280, 4096, 1)]


def _time(fn, reps: int = 20) -> float:
    """Median seconds of one replay of ``fn`` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _cublas(x: torch.Tensor, w: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return F.linear(x[:, 0], w)
    return torch.bmm(x.transpose(0, 1), w.view(groups, -1, w.shape[1]).transpose(1, 2))  # [G, M, N]


def _cases(rows: list[int], cold: bool = False):
    """(projection, rows, x ``[rows, groups, K]``, weights, groups) for every projection of ``SHAPES`` and row count
    (the head at most 256 rows: it runs on a step's last rows only), drawn from one seeded generator. ``weights`` is
    one weight, or with ``cold`` as many copies as make twice the L2 cache (a timed call cycles through them, so each
    weight comes from HBM as in a decode step)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for name, n, k, groups in SHAPES:
        w = (torch.randn(groups * n, k, device="cuda", generator=gen) * 0.02).bfloat16()
        copies = max(1, math.ceil(2 * l2 / (w.numel() * w.element_size()))) if cold else 1
        weights = (w, *(w.clone() for _ in range(copies - 1)))
        for m in rows:
            if name != "head" or m <= 256:
                yield name, m, torch.randn(m, groups, k, device="cuda", generator=gen).bfloat16(), weights, groups


def _time_each(fn, x: torch.Tensor, weights: tuple[torch.Tensor, ...], groups: int) -> float:
    """Median seconds of ``fn(x, w, groups)`` per weight, the calls over every copy in ``weights`` replayed together."""
    return _time(lambda: [fn(x, w, groups) for w in weights]) / len(weights)


def _plain_op(backend: str = "nvidia_sm100"):
    """The plain path's product as ``_cublas`` is called: the backend's ``linear`` / ``grouped_linear`` op."""
    from deepinfer_core.backends.registry import select_backend

    ops = select_backend(backend).op_overrides()

    def product(x: torch.Tensor, w: torch.Tensor, groups: int) -> torch.Tensor:
        return ops["linear"](x[:, 0], w) if groups == 1 else ops["grouped_linear"](x, w, groups)

    return product


def main(argv: list[str] | None = None) -> int:
    from deepinfer_batch_invariant import triton_kernels as tk

    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128, 256, 512, 2048, 16384])
    parser.add_argument("--split-targets", nargs="+", metavar="PROGRAMS:MIN_BLOCKS",
                        help="instead: the split-K launch at each K-split target (``split_k``'s programs per row tile "
                             "and fewest K blocks a split), summed over the projections but the head")
    parser.add_argument("--tiles", nargs="+", metavar="BM,BN,BK,WARPS,STAGES",
                        help="instead: the --tile-launches at each tile, every projection and row count")
    parser.add_argument("--tile-launches", nargs="+", default=["wide", "split_wide"],
                        help="the launches --tiles times (names in triton_kernels.LAUNCHES)")
    parser.add_argument("--cold", action="store_true",
                        help="weights read from HBM: each call on another copy of the weight (twice the L2 in all)")
    args = parser.parse_args(argv)
    if args.split_targets:
        return sweep_split_targets(args.rows, args.split_targets, args.cold)
    if args.tiles:
        return sweep_tiles(args.rows, [tuple(int(v) for v in t.split(",")) for t in args.tiles], args.tile_launches,
                           args.cold)
    launches = list(tk.LAUNCHES)
    plain = _plain_op()
    print("| projection | rows | cuBLAS | plain op | mode | mode / plain | " + " | ".join(launches)
          + " | split, fold kernel |")
    print("|---|---|---|---|---|---|" + "---|" * (len(launches) + 1))
    totals: dict[int, dict[str, float]] = {}  # rows -> launch -> seconds summed over the projections
    mode_totals: dict[int, float] = {}  # rows -> the mode's launches (by projection) summed
    plain_totals: dict[int, float] = {}  # rows -> the plain op summed
    variants = {launch: {"launch": launch} for launch in launches}
    variants["split, fold kernel"] = {"launch": "split", "fused_fold": False}
    for name, m, x, ws, groups in _cases(args.rows, args.cold):
        mode = tk._grouped_matmul(x, ws[0], groups)
        for variant, kwargs in variants.items():
            if not torch.equal(tk._grouped_matmul(x, ws[0], groups, **kwargs), mode):
                raise AssertionError(f"{name} at {m} rows: the {variant} launch changes the bits")
        base = _time_each(_cublas, x, ws, groups)
        fast = _time_each(plain, x, ws, groups)
        ours = _time_each(tk._grouped_matmul, x, ws, groups)
        cells = {variant: _time_each(functools.partial(tk._grouped_matmul, **kw), x, ws, groups)
                 for variant, kw in variants.items()}
        if name != "head":
            for launch in launches:
                totals.setdefault(m, {}).setdefault(launch, 0.0)
                totals[m][launch] += cells[launch]
            mode_totals[m] = mode_totals.get(m, 0.0) + ours
            plain_totals[m] = plain_totals.get(m, 0.0) + fast
        print(f"| {name} | {m} | {base * 1e6:.1f} us | {fast * 1e6:.1f} us | {ours * 1e6:.1f} us | "
              f"{ours / fast:.2f}x | " + " | ".join(f"{cells[v] * 1e6:.1f} us" for v in variants) + " |")
    print("\nsummed over the projections but the head, per row count: " + ", ".join(
        f"{m}: {min(t, key=t.get)} ({1e6 * min(t.values()):.0f} us; mode's {1e6 * mode_totals[m]:.0f}, plain "
        f"{1e6 * plain_totals[m]:.0f})"
        for m, t in totals.items()))
    print(f"DEEPINFER_BATCH_INVARIANT_GEMM_LAUNCHES={suggest(totals)}")
    return 0


def sweep_split_targets(rows: list[int], targets: list[str], cold: bool = False) -> int:
    """The mode's launch's time per call summed over the projections (not the head: too wide to split) at each
    target and row count, each checked against its launch with the fold kernel; the last line names the target
    fastest over all ``rows`` together as the two variables' values."""
    import os

    from deepinfer_batch_invariant import triton_kernels as tk

    cases = [case for case in _cases(rows, cold) if case[0] != "head"]
    totals = {}
    print("| programs:min blocks | " + " | ".join(f"{m} rows" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for target in targets:
        programs, _, min_blocks = target.partition(":")
        os.environ["DEEPINFER_BATCH_INVARIANT_SPLIT_K_PROGRAMS"] = programs
        os.environ["DEEPINFER_BATCH_INVARIANT_MIN_SPLIT_BLOCKS"] = min_blocks
        cells = dict.fromkeys(rows, 0.0)
        for name, m, x, ws, g in cases:
            if not torch.equal(tk._grouped_matmul(x, ws[0], g), tk._grouped_matmul(x, ws[0], g, fused_fold=False)):
                raise AssertionError(f"{name}, {target} at {m} rows: the fused fold changes the bits")
            cells[m] += _time_each(tk._grouped_matmul, x, ws, g)
        totals[target] = sum(cells.values())
        print(f"| {target} | " + " | ".join(f"{1e6 * c:.0f} us" for c in cells.values()) + " |")
    best = min(totals, key=totals.get)
    programs, _, min_blocks = best.partition(":")
    print(f"DEEPINFER_BATCH_INVARIANT_SPLIT_K_PROGRAMS={programs} DEEPINFER_BATCH_INVARIANT_MIN_SPLIT_BLOCKS={min_blocks}")
    return 0


def sweep_tiles(rows: list[int], tiles: list[tuple[int, ...]], launches: list[str], cold: bool = False) -> int:
    """Each tile in each of ``launches`` (``_grouped_matmul``'s ``tile``), per projection and row count, each checked
    to give the mode's bits (a tile that does not is reported, not timed); the last lines sum each variant over the
    projections but the head, per row count."""
    from deepinfer_batch_invariant import triton_kernels as tk

    variants = {f"{launch} {'x'.join(map(str, tile))}": {"launch": launch, "tile": tile}
                for tile in tiles for launch in launches}
    print("| projection | rows | cuBLAS | mode | " + " | ".join(variants) + " |")
    print("|---|---|---|---|" + "---|" * len(variants))
    totals: dict[int, dict[str, float]] = {}
    for name, m, x, ws, groups in _cases(rows, cold):
        mode = tk._grouped_matmul(x, ws[0], groups)
        cells = {"cuBLAS": _time_each(_cublas, x, ws, groups), "mode": _time_each(tk._grouped_matmul, x, ws, groups)}
        for variant, kw in variants.items():
            same = torch.equal(tk._grouped_matmul(x, ws[0], groups, **kw), mode)
            cells[variant] = _time_each(functools.partial(tk._grouped_matmul, **kw), x, ws, groups) \
                if same else float("nan")
        if name != "head":
            for variant, seconds in cells.items():
                totals.setdefault(m, {}).setdefault(variant, 0.0)
                totals[m][variant] += seconds
        print(f"| {name} | {m} | " + " | ".join(
            "other bits" if math.isnan(v) else f"{v * 1e6:.1f} us" for v in cells.values()) + " |")
    for m, t in totals.items():
        print(f"{m} rows, summed but the head: " + ", ".join(f"{v} {1e6 * s:.0f} us" for v, s in t.items()))
    return 0


def suggest(totals: dict[int, dict[str, float]]) -> str:
    """``rows:launch`` pairs from the fastest launch (summed over the projections) at each measured row count: each
    launch from the first row count where it is fastest, the first from 0."""
    pairs: list[tuple[int, str]] = []
    for m in sorted(totals):
        best = min(totals[m], key=totals[m].get)
        if not pairs or pairs[-1][1] != best:
            pairs.append((0 if not pairs else m, best))
    return ",".join(f"{rows}:{launch}" for rows, launch in pairs)


if __name__ == "__main__":
    raise SystemExit(main())

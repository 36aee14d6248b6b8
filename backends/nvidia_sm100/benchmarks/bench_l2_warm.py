"""Does a weight already in L2 shorten the one-row GEMV that reads it? (The question under any L2 prefetch.)

    python backends/nvidia_sm100/benchmarks/bench_l2_warm.py      # on a GPU; prints one table

For two batch-1 projection shapes of the bench preset (64 MB each): the L2 emptied (a 256 MB buffer read), then
the first X MB of the weight read by a plain kernel (``sum`` of the slice: ordinary loads, so the lines are in L2
unless the hardware declines them), 20 us idle (``torch.cuda._sleep``), then the GEMV (``kernels/gemv.py``) between
CUDA events; median of 15. X = 0 is the cold GEMV. The last column reads the whole weight with the GEMV itself
first (the second GEMV finds up to the L2's size of it cached).
"""

from __future__ import annotations

import statistics

import torch

BW = 4.25e12
SHAPES = {"wq_b [32768, 1024]": (32768, 1024), "wo_b [4096, 8192]": (4096, 8192)}
WARM_MB = (0, 8, 16, 32, 48)


def cycles_per_us() -> float:
    """The ``_sleep`` kernel's cycles per microsecond, measured."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    return 1_000_000 / (start.elapsed_time(end) * 1e3)


def gemv_after(warm, gemv, flush, idle: int) -> float:
    """Median GEMV microseconds after emptying the L2, then ``warm()``, then ``idle`` cycles."""
    times = []
    for _ in range(15):
        flush.sum()
        warm()
        torch.cuda._sleep(idle)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        gemv()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    torch.manual_seed(0)
    idle = int(20 * cycles_per_us())
    flush = torch.randn(128 * 2**20, device="cuda", dtype=torch.bfloat16)  # 256 MB
    print(f"L2 {torch.cuda.get_device_properties(0).L2_cache_size / 2**20:.0f} MB; GEMV us after the first X MB of "
          f"its weight were read (X = 0: cold)")
    print("| weight | floor | " + " | ".join(f"X = {mb} MB" for mb in WARM_MB) + " | after the GEMV itself |")
    print("|---|---|" + "---|" * (len(WARM_MB) + 1))
    for name, (n, k) in SHAPES.items():
        cells, floor = row(n, k, flush, idle)
        print(f"| {name} | {floor:.1f} us | " + " | ".join(f"{c:.1f}" for c in cells) + " |")


def row(n: int, k: int, flush: torch.Tensor, idle: int) -> tuple[list[float], float]:
    """GEMV microseconds of one ``[n, k]`` weight by warm-up, and its floor."""
    from deepinfer_nvidia_sm100.kernels import gemv

    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    flat = weight.view(-1)

    def run():
        gemv.launch_row(x, weight, out, 1)

    cells = [gemv_after(lambda mb=mb: flat[:mb * 2**19].sum() if mb else None, run, flush, idle) for mb in WARM_MB]
    cells.append(gemv_after(run, run, flush, idle))
    return cells, weight.numel() * 2 / BW * 1e6


if __name__ == "__main__":
    main()

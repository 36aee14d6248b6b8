"""Does a bulk L2 prefetch during an idle gap shorten the GEMV after it? (``kernels/prefetch.py``)

    python backends/nvidia_sm100/benchmarks/bench_prefetch.py      # on a GPU; prints one table per weight

For each batch-1 projection shape of the bench preset (64 MB each): the L2 emptied (a 256 MB buffer read), then
50 us idle, ``prefetch`` of X MB of the weight (chunks of 4-32 KB a lane, one program per SM at most), a GPU-side
wait of ``gap`` us (``torch.cuda._sleep``: the short kernels of a
decode step), then the one-row GEMV. CUDA events around the gap and the GEMV; median of 15. First the GEMV's output
with the prefetch is checked equal to the one without (a prefetch must change no result).
"""

from __future__ import annotations

import statistics

import torch

BW = 4.25e12
SHAPES = {"wq_b [32768, 1024]": (32768, 1024), "wo_b [4096, 8192]": (4096, 8192)}
PREFETCH_MB = (0, 8, 16, 24, 32, 40)
GAPS_US = (0, 5, 10, 20, 40)
CHUNKS_KB = (4, 8, 32)


def cycles_per_us() -> float:
    """The ``_sleep`` kernel's cycles per microsecond, measured."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    return 1_000_000 / (start.elapsed_time(end) * 1e3)


def timed(weight, x, out, flush, mb: int, gap_cycles: int, chunk_kb: int, settle: int) -> tuple[float, float]:
    """Median (GEMV us, gap + GEMV us) over repeats, the L2 emptied before each (then ``settle`` cycles idle)."""
    from deepinfer_nvidia_sm100.kernels import gemv, prefetch

    gemv_us, total_us = [], []
    for _ in range(15):
        flush.sum()
        torch.cuda._sleep(settle)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        events[0].record()
        if mb:
            prefetch.launch(prefetch.plan((weight,), mb * 2**20), chunk=chunk_kb * 1024)
        if gap_cycles:
            torch.cuda._sleep(gap_cycles)
        events[1].record()
        gemv.launch_row(x, weight, out, 1)
        events[2].record()
        events[2].synchronize()
        gemv_us.append(events[1].elapsed_time(events[2]) * 1e3)
        total_us.append(events[0].elapsed_time(events[2]) * 1e3)
    return statistics.median(gemv_us), statistics.median(total_us)


def main() -> None:
    from deepinfer_nvidia_sm100.kernels import gemv, prefetch

    torch.manual_seed(0)
    rate = cycles_per_us()
    flush = torch.randn(128 * 2**20, device="cuda", dtype=torch.bfloat16)  # 256 MB
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"L2 {l2 / 2**20:.0f} MB, sleep {rate:.0f} cycles/us, default budget "
          f"{prefetch.budget_bytes(torch.device('cuda')) / 2**20:.0f} MB")
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        out, want = torch.empty(1, n, device="cuda", dtype=torch.bfloat16), torch.empty(1, n, device="cuda",
                                                                                      dtype=torch.bfloat16)
        gemv.launch_row(x, weight, want, 1)
        prefetch.launch(prefetch.plan((weight,), 32 * 2**20))
        gemv.launch_row(x, weight, out, 1)
        assert torch.equal(out, want), "the GEMV after a prefetch differs"
        floor = weight.numel() * 2 / BW * 1e6
        print(f"\n{name}: floor {floor:.1f} us; GEMV us (gap + GEMV us) by prefetched MB, chunk and gap")
        print("| MB | chunk | " + " | ".join(f"gap {g} us" for g in GAPS_US) + " |")
        print("|---|---|" + "---|" * len(GAPS_US))
        for mb in PREFETCH_MB:
            for chunk_kb in CHUNKS_KB if mb else CHUNKS_KB[:1]:
                cells = [timed(weight, x, out, flush, mb, int(g * rate), chunk_kb, int(50 * rate)) for g in GAPS_US]
                print(f"| {mb} | {chunk_kb} KB | " + " | ".join(f"{a:.1f} ({b:.1f})" for a, b in cells) + " |")


if __name__ == "__main__":
    main()

"""mHC mixing logits (``hc_mix_logits``) on the bench preset's shape (hc 4, D 4096: rows of 16,384, 24 outputs):
the compiled reference, the split-row kernels and the tensor-core kernel, by batch.

    python backends/nvidia_sm100/benchmarks/bench_hc_mix.py      # on a GPU; prints one table

Checks each variant against the reference op first (fp32 results, max relative error), then times each in a CUDA
graph (CUDA events, median of repeats, after warmup). Floor = bf16 stream bytes / 4.25 TB/s (the H200's
copy bandwidth; the 24 x 16,384 fp32 weight is read once more per program). Sets ``MIX_KERNEL_MAX_TOKENS``.
"""

from __future__ import annotations

import torch
from cuda_timing import cuda_time, graphed

from deepinfer_core.ops import reference as ref

HC, D, BW = 4, 4096, 4.25e12


def main() -> None:
    from deepinfer_nvidia_sm100.kernels import hc

    torch.manual_seed(0)
    fn = torch.randn((2 + HC) * HC, HC * D, device="cuda") * 0.02
    variants = {
        "compiled": lambda s: hc.maybe_compile(ref.hc_mix_logits)(s, fn, 1e-6),
        "split": lambda s: hc.hc_mix_logits(s, fn, 1e-6, kernel="split"),
        "tensor cores": lambda s: hc.hc_mix_logits(s, fn, 1e-6, kernel="dot"),
    }
    rows = []
    for T in (1, 4, 16, 64, 256, 1024, 8192):
        streams = torch.randn(T, HC, D, device="cuda").to(torch.bfloat16)
        want = ref.hc_mix_logits(streams, fn, 1e-6)
        floor = streams.numel() * 2 / BW
        row = [T, floor]
        for name, run in variants.items():
            if name == "split" and T > 64:  # one program per 4 tokens re-reads the weight: too slow to matter
                row.append(None)
                continue
            err = ((run(streams) - want).abs().max() / want.abs().max()).item()
            assert err < 1e-4, f"{name} at {T} tokens: max relative error {err:.1e}"
            row.append(cuda_time(graphed(lambda r=run, s=streams: r(s)), reps=20))
        rows.append(row)
    print(f"\nhc_mix_logits, hc {HC}, D {D} (rows of {HC * D}), bf16 streams, fp32 fn; CUDA graph replays (H200)")
    print("| tokens | floor | compiled reference | split rows | tensor cores | best |")
    print("|---|---|---|---|---|---|")
    for T, floor, *times in rows:
        cells = [f"{t * 1e6:.1f} us ({100 * floor / t:.0f}%)" if t is not None else "-" for t in times]
        best = min((t, name) for t, name in zip(times, variants, strict=True) if t is not None)[1]
        print(f"| {T} | {floor * 1e6:.1f} us | " + " | ".join(cells) + f" | {best} |")


if __name__ == "__main__":
    main()

"""The fused norm ops against their parts on the bench preset's shapes (bf16, D 4096, hc 4):
``hc_pre_normed`` (one finishing kernel that also norms) against ``hc_pre`` then ``rms_norm``, and ``rms_norm_rope``
(one pass) against the norm then ``apply_rope_``, at decode (1, 256 tokens) and prefill (8192) sizes.

    python backends/nvidia_sm100/benchmarks/bench_hc_norm.py      # on a GPU; prints one table

Checks each fused op against its parts first, then times both in CUDA graphs (CUDA events, median of repeats).
Floor = the bytes read and written once / 4.25 TB/s.
"""

from __future__ import annotations

import torch
from cuda_timing import ab_row, print_ab_table

BW = 4.25e12
HC, D, HEADS, HEAD_DIM, HALF = 4, 4096, 64, 512, 32


def hc_rows(tokens: int):
    from deepinfer_nvidia_sm100.kernels import hc, norm

    mix = (2 + HC) * HC
    streams = torch.randn(tokens, HC, D, device="cuda").to(torch.bfloat16)
    fn, base, scale = torch.randn(mix, HC * D, device="cuda") * 0.05, torch.randn(mix, device="cuda"), \
        torch.rand(3, device="cuda") + 1
    weight = torch.rand(D, device="cuda") + 0.5
    args = (streams, fn, base, scale, 20, 1e-6, 1e-6)
    floor = (streams.numel() * 2 + tokens * D * 2) / BW

    def parts():
        return norm.rms_norm(hc.hc_pre(*args)[2], weight, 1e-6)

    return ab_row("hc_pre_normed", tokens, floor, parts, lambda: hc.hc_pre_normed(*args, weight)[2])


def rope_rows(tokens: int):
    from deepinfer_nvidia_sm100.kernels import norm, rope

    q = torch.randn(tokens, HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    angles = torch.randn(tokens, HALF, device="cuda")
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    floor = 2 * q.numel() * 2 / BW

    def parts():
        return rope.apply_rope_(norm.unweighted_rms_norm(q, 1e-6), cos, sin)

    return ab_row("rms_norm_rope (query heads)", tokens, floor, parts,
                  lambda: norm.rms_norm_rope(q, None, 1e-6, cos, sin))


def main() -> None:
    from deepinfer_nvidia_sm100.kernels import hc

    torch.manual_seed(0)
    rows = []
    default = hc.NORM_WARPS
    for warps in (4, 8, 16):  # the fused hc kernel's warps (one program per token)
        hc.NORM_WARPS = warps
        rows += [(f"{name}, {warps} warps", *rest) for name, *rest in (hc_rows(tokens) for tokens in (1, 256, 8192))]
    hc.NORM_WARPS = default
    rows += [rope_rows(tokens) for tokens in (1, 256, 8192)]
    print_ab_table("fused norms, bf16, CUDA graph replays (H200)", ("op", "tokens", "parts", "fused"), rows)


if __name__ == "__main__":
    main()

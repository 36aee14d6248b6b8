"""Where the time of one ``hc_pre_normed`` call goes at decode sizes (bf16, D 4096, hc 4): the mixing partials
alone, then the whole op with 20 Sinkhorn iterations (the preset's) and with 1, so the Sinkhorn's share of the
finishing kernel shows; also ``hc_pre`` (no norm, the collapse over several programs).

    python backends/nvidia_sm100/benchmarks/bench_hc_finish.py      # on a GPU; prints one table

Each row: 20 back-to-back calls captured in one CUDA graph (launched as in a decode step, with PDL where the backend
uses it), median of replays over 20, per call.
"""

from __future__ import annotations

import torch
from cuda_timing import cuda_time, graphed

HC, D, CALLS = 4, 4096, 20


def rows(tokens: int) -> list[tuple[str, int, float]]:
    from deepinfer_nvidia_sm100.kernels import hc

    mix = (2 + HC) * HC
    streams = torch.randn(tokens, HC, D, device="cuda").to(torch.bfloat16)
    fn, base, scale = torch.randn(mix, HC * D, device="cuda") * 0.05, torch.randn(mix, device="cuda"), \
        torch.rand(3, device="cuda") + 1
    weight = torch.rand(D, device="cuda") + 0.5
    variants = {
        "mixing partials only": lambda: hc.hc_mix_logits(streams, fn, 1e-6, partials=True),
        "hc_pre_normed, 20 iterations": lambda: hc.hc_pre_normed(streams, fn, base, scale, 20, 1e-6, 1e-6, weight),
        "hc_pre_normed, 1 iteration": lambda: hc.hc_pre_normed(streams, fn, base, scale, 1, 1e-6, 1e-6, weight),
        "hc_pre, 20 iterations": lambda: hc.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6),
    }
    return [(name, tokens, cuda_time(graphed(lambda f=f: [f() for _ in range(CALLS)])) / CALLS)
            for name, f in variants.items()]


def main() -> None:
    torch.manual_seed(0)
    table = [row for tokens in (1, 64) for row in rows(tokens)]
    print("| hc op (bf16, H200, per call in a graph of 20) | tokens | us |")
    print("|---|---|---|")
    for name, tokens, seconds in table:
        print(f"| {name} | {tokens} | {seconds * 1e6:.2f} |")


if __name__ == "__main__":
    main()

"""Decode projections of the bench preset (bf16, D 4096): cuBLAS (``F.linear`` / the reference grouped einsum)
against the candidate Triton kernel of ``kernels/gemv.py``, at 1, 4 and 16 rows.

    python backends/nvidia_sm100/benchmarks/bench_gemv.py      # on a GPU; prints one table

Checks the kernel against the reference op first, then times both in CUDA graphs (CUDA events, median of repeats,
after warmup). Floor = weight bytes / 4.25 TB/s (BENCHMARKS.md ceilings). Decides whether
``DEEPINFER_NVIDIA_GEMV=1`` (the kernel in the op table) becomes the default, and for which shapes.
"""

from __future__ import annotations

from functools import partial

import torch
from cuda_timing import ab_row, print_ab_table

from deepinfer_core.ops import reference as ref

BW = 4.25e12
SHAPES = {  # name -> (output columns, input width, groups): the preset's per-layer projections
    "w_input (CSA layer)": (4160, 4096, 1),
    "w_input (HCA layer)": (2560, 4096, 1),
    "wq_b": (32768, 1024, 1),
    "indexer wq_b": (8192, 1024, 1),
    "wo_a (grouped)": (8 * 1024, 4096, 8),
    "wo_b": (4096, 8192, 1),
}


def main() -> None:
    from deepinfer_nvidia_sm100.kernels import gemv

    torch.manual_seed(0)
    rows = []
    for name, (n, k, groups) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        floor = w.numel() * 2 / BW
        for m in (1, 4, 16):
            shape = (m, k) if groups == 1 else (m, groups, k)
            x = torch.randn(*shape, device="cuda").to(torch.bfloat16)
            if groups == 1:
                cublas, triton_op = partial(ref.linear, x, w), partial(gemv.linear, x, w)
            else:
                cublas, triton_op = partial(ref.grouped_linear, x, w, groups), partial(gemv.grouped_linear, x, w, groups)
            rows.append(ab_row(name, m, floor, cublas, triton_op))
    print_ab_table("Decode projections, bf16, CUDA graph replays (H200)", ("projection", "rows", "cuBLAS", "Triton gemv"),
                   rows)


if __name__ == "__main__":
    main()

"""RMS norms on the bench preset's decode shapes (bf16): the compiled reference against the Triton kernel
of ``kernels/norm.py`` (in the op table by default; ``DEEPINFER_NVIDIA_NORM=0`` takes the compiled reference).

    python backends/nvidia_sm100/benchmarks/bench_norm.py      # on a GPU; prints one table

Checks the kernel against the reference op first, then times both in CUDA graphs (CUDA events, median of repeats,
after warmup). Floor = bytes read and written / 4.25 TB/s (the H200's copy bandwidth,
docs/performance.md).
"""

from __future__ import annotations

from functools import partial

import torch
from cuda_timing import ab_row, print_ab_table

from deepinfer_core.ops import reference as ref

BW = 4.25e12
SHAPES = {  # name -> (row shape, weighted): a decode step's norms per token
    "attn / ffn norm (D 4096)": ((4096,), True),
    "q_norm (q_lora 1024)": ((1024,), True),
    "kv norm (head_dim 512)": ((512,), True),
    "per-head q norm (64 x 512)": ((64, 512), False),
}


def main() -> None:
    from deepinfer_nvidia_sm100.kernels import compiled, norm

    torch.manual_seed(0)
    rows = []
    for name, (row, weighted) in SHAPES.items():
        weight = torch.randn(row[-1], device="cuda")
        for tokens in (1, 64, 256, 8192):
            x = torch.randn(tokens, *row, device="cuda").to(torch.bfloat16)
            if weighted:
                reference = partial(compiled.maybe_compile(ref.rms_norm), x, weight, 1e-6)
                kernel = partial(norm.rms_norm, x, weight, 1e-6)
            else:
                reference = partial(compiled.maybe_compile(ref.unweighted_rms_norm), x, 1e-6)
                kernel = partial(norm.unweighted_rms_norm, x, 1e-6)
            rows.append(ab_row(name, tokens, 2 * x.numel() * 2 / BW, reference, kernel))
    print_ab_table("RMS norms, bf16, CUDA graph replays (H200)", ("norm", "tokens", "compiled", "Triton"), rows)


if __name__ == "__main__":
    main()

"""RoPE on the bench preset's shapes (bf16): ``apply_rope`` (a new tensor: every channel read and written) against
``apply_rope_`` (in place: only the 64 rotary channels of each 512-channel row), both ``kernels/rope.py``.

    python backends/nvidia_sm100/benchmarks/bench_rope.py      # on a GPU; prints one table

Checks the in-place result against the copying kernel first, then times both in CUDA graphs (CUDA events, median
of repeats, after warmup). Floor = the in-place kernel's bytes (rotary channels read and written) / 4.25 TB/s.
"""

from __future__ import annotations

import torch
from cuda_timing import ab_row, print_ab_table

BW = 4.25e12
ROPE_DIM = 64
SHAPES = {"q / attention output (64 x 512)": (64, 512), "kv (512)": (1, 512)}


def main() -> None:
    from deepinfer_nvidia_sm100.kernels import rope

    torch.manual_seed(0)
    rows = []
    for name, (heads, dim) in SHAPES.items():
        for tokens in (1, 256, 8192):
            x = torch.randn(tokens, heads, dim, device="cuda").to(torch.bfloat16)
            angles = torch.rand(tokens, ROPE_DIM // 2, device="cuda") * 6
            cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
            work = x.clone()

            def in_place(work=work, x=x, cos=cos, sin=sin):
                if not torch.cuda.is_current_stream_capturing():  # the check's call starts from x; replays rotate on
                    work.copy_(x)
                return rope.apply_rope_(work, cos, sin)

            floor = 2 * tokens * heads * ROPE_DIM * 2 / BW
            rows.append(ab_row(name, tokens, floor, lambda x=x, cos=cos, sin=sin: rope.apply_rope(x, cos, sin),
                               in_place))
    print_ab_table("RoPE, bf16, CUDA graph replays (H200)", ("tensor", "tokens", "apply_rope (copy)",
                                                             "apply_rope_ (in place)"), rows)


if __name__ == "__main__":
    main()

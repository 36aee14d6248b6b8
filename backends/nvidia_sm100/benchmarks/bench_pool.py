"""The compressor's pooled windows (``compressor_entries``, ``kernels/compressor.py``) against the reference op, for
the windows a static decode step pools: all real (every slot valid) or all dummies (a sequence that completes no
window pools its last slot only, ``DecodeLayout``), at batch 1 and 256, the bench preset's HCA and CSA shapes (bf16).

    python backends/nvidia_sm100/benchmarks/bench_pool.py      # on a GPU; prints one table

Checks the kernel against the reference op first, then times both in CUDA graphs (CUDA events, median of repeats).
Floor = the valid slots' kv and gate rows read plus the pooled rows written, / 4.25 TB/s.
"""

from __future__ import annotations

import torch
from cuda_timing import ab_row, print_ab_table

from deepinfer_core.ops import reference as ref

BW = 4.25e12
SHAPES = {"HCA (ratio 128, 128 slots)": (128, False), "CSA (ratio 4, 8 overlapping slots)": (4, True)}
D = 512


def case(windows: int, ratio: int, overlap: bool, dummies: bool) -> tuple:
    """Arguments of ``compressor_entries`` for ``windows`` windows whose slots all come from the carry."""
    width, span, slots = (2 * D if overlap else D), (2 * ratio if overlap else ratio), windows + 1
    raw = torch.randn(windows, 2 * width, device="cuda").to(torch.bfloat16)
    carry_kv, carry_gate = (torch.randn(slots, span, width, device="cuda").to(torch.bfloat16) for _ in range(2))
    seq = torch.arange(windows, device="cuda")[:, None].expand(-1, span)
    offsets = torch.arange(span, device="cuda")[None, :].expand(windows, -1)
    valid = offsets >= (span - 1 if dummies else 0)
    ape, weight = torch.randn(ratio, width, device="cuda"), torch.rand(D, device="cuda") + 0.5
    return (raw[:, :width], raw[:, width:], carry_kv, carry_gate, torch.zeros_like(valid), seq.contiguous(),
            seq.contiguous(), offsets.contiguous(), valid, ape, weight, 1e-6, ratio, overlap)


def main() -> None:
    from deepinfer_nvidia_sm100.kernels import compressor

    torch.manual_seed(0)
    rows = []
    for name, (ratio, overlap) in SHAPES.items():
        for windows in (1, 256):
            for dummies in (False, True):
                args = case(windows, ratio, overlap, dummies)
                span = args[4].shape[1]
                read = windows * (1 if dummies else span) * 2 * D * 2
                rows.append(ab_row(f"{name}, {'dummy' if dummies else 'real'} windows", windows,
                                   (read + windows * D * 2) / BW, lambda a=args: ref.compressor_entries(*a),
                                   lambda a=args: compressor.compressor_entries(*a)))
    print_ab_table("compressor_entries, bf16, CUDA graph replays (H200)",
                   ("windows", "count", "reference op", "kernel"), rows)


if __name__ == "__main__":
    main()

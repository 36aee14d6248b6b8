"""MXFP4 routed experts at decode sizes, old kernels vs ``moe_mxfp4_decode``, on the ``v4-flash-8l64e-fp4`` preset's
experts (E=64, top-6, D=4096, I=2048, bf16 activations, one layer): section ``mxfp4`` of bench_quant.py.

    python backends/nvidia_sm100/benchmarks/bench_quant.py mxfp4        # this section alone (~30 s)
    python backends/nvidia_sm100/benchmarks/bench_mxfp4_decode.py       # the same

Per token count (1, 16, 64, 256, 1,024, 8,192: prefill) every variant is first checked against ``reference.moe_experts_mxfp4``
(``bf16`` against ``reference.moe_experts`` on its bf16 weights; max error relative to the largest output < 2e-2),
then timed: replayed from a CUDA graph up to 256 tokens, eagerly beyond (CUDA events around
``cuda_timing.BACK_TO_BACK`` calls, median). Rows of the sweep, ``tokens: variant -> time``:

* ``bf16``: ``moe.moe_experts`` on the same experts in bf16 (the preset the fp4 one is measured against);
* ``old``: the MXFP4 kernels before ``moe_mxfp4_decode``, as the op ran them (one token: the two row kernels,
  ``moe_quant.ROW_TILES``, float32 decode; more: the grouped kernels with ``tl.dot_scaled``, ``moe_quant._tiles``'
  launch); ``rows ptx`` (one token): the row kernels with ``moe_quant.ROW_DECODE_PTX`` (``mxfp4_row_sums``), at
  ``ROW_TILES``, and ``rows ptx picks apart`` with the down products by pick on programs of their own
  (``moe_quant.PICKS_APART``);
* ``op``: ``moe_quant.moe_experts_mxfp4`` as it runs now (``moe_mxfp4_decode.used`` picks the path);
* ``new (BLOCK_M, BLOCK_K, stages[, subtiles[, splits]])``: ``moe_mxfp4_decode.run`` with that launch (the first is ``tile``'s
  default; ``maxnreg 168``: held to 168 registers a thread, three programs an SM), ``portable``: its bf16 decode
  without inline PTX;
* ``fp8`` (from 1,024 tokens): ``moe_mxfp4_prefill.run``, the experts converted to e4m3 rows and the activations
  quantized, on fp8 tensor cores (its error against the reference op is fp8's: checked to 0.1, printed);
* ``fp8 decode`` (up to 256 tokens): ``moe_mxfp4_fp8_decode.run``, the codes expanded in registers to e4m3 and the
  activations quantized per 128 inputs, on fp8 tensor cores (the op's path with
  ``DEEPINFER_NVIDIA_MXFP4_FP8_DECODE=1``; checked to 0.1 as ``fp8``), and ``fp8 decode (BLOCK_M, stages, half)``
  with half its weight rows a program (twice the programs: one token's 6 experts give 192 at the default) and with
  twice (sm_90a: 3.0 instructions a weight, 8 warps an SM).

Floor = bytes of the touched experts' packed weights and scales / 4.25 TB/s (the H200's HBM roofline), % = floor /
time. The summary last: per token count the floor, bf16, old, the best new launch and op, and op's speed-up over old
and over bf16.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import BACK_TO_BACK, cuda_time, graphed, module_settings

from deepinfer_core.ops import reference as ref
from deepinfer_core.quant import mxfp4

E, TOP_K, D, I = 64, 6, 4096, 2048
BW = 4.25e12
TOKENS = (1, 16, 64, 256, 1024, 2048, 4096, 8192)
FP8_MIN_TOKENS = 1024  # token counts from which the fp8 prefill path is timed too
FP8_DECODE_MAX_TOKENS = 256  # token counts up to which moe_mxfp4_fp8_decode is timed too
QUANTIZED = 0.1  # error bound of the variants that quantize activations (fp8's), else 2e-2
GRAPH_MAX_TOKENS = 256
LIMIT = 10.0
LAUNCHES = {  # tokens -> moe_mxfp4_decode launches tried beside its default, (BLOCK_M, BLOCK_K, stages[, subtiles]);
    # few distinct ones (each compiles once): the section stays near 30 s
    1: ((16, 256, 3, 1),),
    16: ((16, 512, 2), (16, 256, 3, 2)),
    64: ((16, 256, 3, 2), (16, 256, 2, 2)),
    256: ((64, 128, 3), (32, 256, 3, 2)),
    1024: ((64, 128, 3, 2), (128, 128, 2, 2)),
    2048: (),
    4096: (),
    8192: ((128, 128, 2, 2), (128, 128, 3, 2)),
}


ROW_TILES_ONE_TOKEN = ((8, 2048, 2, 1), (4, 2048, 2, 1), (2, 4096, 4, 1), (4, 2048, 4, 3), (2, 2048, 4, 3))  # one
# token's row kernels besides ROW_TILES' (BLOCK_N, BLOCK_K, warps, stages): slices of 32 groups a warp, several rows
# a thread; slices of 2,048 inputs, two 16-byte loads a thread and matrix (4 rows) or twice the programs (2 rows)
MAX_REGISTERS_TOKENS = (16, 64)  # token counts where the default launch is also timed held to 168 registers a thread


def _seconds(fn, tokens: int) -> float | None:
    if tokens > GRAPH_MAX_TOKENS:
        return cuda_time(fn, reps=10, inner=BACK_TO_BACK)
    replay = graphed(fn, strict=False)
    return cuda_time(replay, reps=10, inner=BACK_TO_BACK) if replay is not None else None


def _cell(seconds: float | None, floor: float) -> str:
    return f"{seconds * 1e6:.1f} us ({100 * floor / seconds:.0f}%)" if seconds else "failed"


def _variants(T: int, x, ids, routing, dense, stored) -> dict:
    """Name -> function of no arguments, for ``T`` tokens."""
    from deepinfer_nvidia_sm100.kernels import moe, moe_mxfp4_decode, moe_mxfp4_fp8_decode, moe_mxfp4_prefill, moe_quant

    raw = [t.view(torch.uint8) for t in stored]
    def rows(ptx: bool, apart: bool = False):
        def run():
            with module_settings(moe_quant, ROW_DECODE_PTX=ptx, PICKS_APART=apart):
                return moe_quant._run(moe_quant.MXFP4, x, ids, routing, *stored, moe_quant.MXFP4_BLOCK, LIMIT,
                                      row_kernels=True)

        return run

    if T == 1:
        old = rows(False)
    else:
        old_tile = moe_quant._tiles(moe_quant.MXFP4, T * TOP_K, E, moe_quant.MXFP4_BLOCK)
        old = lambda: moe_quant._run(moe_quant.MXFP4, x, ids, routing, *stored, moe_quant.MXFP4_BLOCK, LIMIT,
                                     old_tile, row_kernels=False)
    default = moe_mxfp4_decode.tile(T * TOP_K, E)
    variants = {
        "bf16": lambda: moe.moe_experts(x, ids, routing, dense[0], dense[1], dense[2], LIMIT),
        "old": old,
        "op": lambda: moe_quant.moe_experts_mxfp4(x, ids, routing, *stored, LIMIT),
    }
    if T == 1:
        variants["rows ptx"] = rows(True)
        variants["rows ptx picks apart"] = rows(True, apart=True)
    for launch in (default, *LAUNCHES[T]):
        variants[f"new {launch}"] = lambda launch=launch: moe_mxfp4_decode.run(x, ids, routing, *raw, LIMIT, launch)
    if T in MAX_REGISTERS_TOKENS:
        variants[f"new {default} maxnreg 168"] = lambda: moe_mxfp4_decode.run(x, ids, routing, *raw, LIMIT, default,
                                                                             max_registers=168)
    if T >= FP8_MIN_TOKENS:
        variants["fp8"] = lambda: moe_mxfp4_prefill.run(x, ids, routing, *stored, LIMIT)
    if T <= FP8_DECODE_MAX_TOKENS:
        variants["fp8 decode"] = lambda: moe_mxfp4_fp8_decode.run(x, ids, routing, *raw, LIMIT)
        for scale in (0.5, 2):  # half / twice the weight rows a program
            launch = (*moe_mxfp4_fp8_decode.tile(T * TOP_K, E), int(moe_mxfp4_fp8_decode.HALF * scale))
            variants[f"fp8 decode {launch}"] = lambda launch=launch: moe_mxfp4_fp8_decode.run(
                x, ids, routing, *raw, LIMIT, launch)
    if T == 64:
        variants["new portable"] = lambda: moe_mxfp4_decode.run(x, ids, routing, *raw, LIMIT, default,
                                                                moe_mxfp4_decode.PORTABLE)
    return variants


def bench_mxfp4_decode() -> None:
    """The sweep, then the summary (see the module docstring)."""
    from deepinfer_nvidia_sm100.kernels import moe_mxfp4_decode, moe_mxfp4_fp8_decode, moe_mxfp4_prefill

    torch.manual_seed(0)
    dense = [(torch.randn(E, r, c, device="cuda") * 0.02).to(torch.bfloat16) for r, c in ((I, D), (D, I), (I, D))]
    stored = [t for w in dense for t in mxfp4.quantize(w)]
    print(f"\nMXFP4 experts at decode sizes (E={E} top-{TOP_K} D={D} I={I}, one layer): old kernels vs "
          f"moe_mxfp4_decode (MAX_PER_EXPERT={moe_mxfp4_decode.MAX_PER_EXPERT}, DEEPINFER_NVIDIA_MXFP4_DECODE_MAX_PER_EXPERT="
          f"{moe_mxfp4_decode.envs.DEEPINFER_NVIDIA_MXFP4_DECODE_MAX_PER_EXPERT}, "
          f"BF16_DECODE={moe_mxfp4_decode.BF16_DECODE}); time (% of the HBM floor)")
    summary = []
    for T in TOKENS:
        x = torch.randn(T, D, device="cuda").to(torch.bfloat16)
        ids = torch.rand(T, E, device="cuda").topk(TOP_K, dim=-1).indices
        routing = torch.rand(T, TOP_K, device="cuda")
        touched = ids.unique().numel()
        floor = touched * 3 * I * D * (0.5 + 1 / mxfp4.GROUP) / BW
        want = {"bf16": ref.moe_experts(x, ids, routing, *dense, LIMIT).float(),  # bf16 weights: their own reference
                "mxfp4": ref.moe_experts_mxfp4(x, ids, routing, *stored, LIMIT).float()}
        times, cells = {}, []
        for name, fn in _variants(T, x, ids, routing, dense, stored).items():
            expected = want["bf16" if name == "bf16" else "mxfp4"]
            err = ((fn().float() - expected).abs().max() / expected.abs().max()).item()
            quantized = name.startswith("fp8") or (name == "op" and (
                moe_mxfp4_prefill.used(T * TOP_K, x, stored[0], stored[2])
                or moe_mxfp4_fp8_decode.used(T * TOP_K, x, stored[0], stored[2])))
            if not err < (QUANTIZED if quantized else 2e-2):  # NaN too
                cells.append(f"{name}: WRONG (error {err:.1e})")
                continue
            times[name] = _seconds(fn, T)
            cells.append(f"{name}: {_cell(times[name], floor)}" + (f" (error {err:.1e})" if quantized else ""))
        print(f"  {T} tokens ({touched} experts, floor {floor * 1e6:.1f} us): " + "; ".join(cells))
        summary.append((T, floor, times))
    print("\nsummary: MXFP4 experts per layer, time (% of floor); op / old and op / bf16 as speed-ups")
    print("| tokens | floor | bf16 | old | best new (launch) | fp8 decode | fp8 | op | op vs old | op vs bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for T, floor, times in summary:
        new = {k: v for k, v in times.items() if k.startswith("new") and v}
        best = min(new, key=new.get) if new else None
        op, old, bf16 = times.get("op"), times.get("old"), times.get("bf16")
        ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"
        print(f"| {T} | {floor * 1e6:.1f} us | {_cell(bf16, floor)} | {_cell(old, floor)} | "
              f"{_cell(new[best], floor) + ' ' + best[4:] if best else '-'} | "
              f"{_cell(times['fp8 decode'], floor) if times.get('fp8 decode') else '-'} | "
              f"{_cell(times['fp8'], floor) if times.get('fp8') else '-'} | {_cell(op, floor)} | "
              f"{ratio(old, op)} | {ratio(bf16, op)} |")


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)
    print(torch.cuda.get_device_name())
    bench_mxfp4_decode()

"""Static instruction counts of kernels' main loops, compiled for sm_90a on any machine (no GPU): what an expanded
MXFP4 weight costs in issued instructions (the bound of weight expansion at decode sizes), and what the sparse
attention's key reads compile to.

    python backends/nvidia_sm100/benchmarks/sass_census.py             # both sections
    python backends/nvidia_sm100/benchmarks/sass_census.py mxfp4       # moe_quant's kernels, moe_mxfp4_decode, fp8 decode
    python backends/nvidia_sm100/benchmarks/sass_census.py sparse      # _sparse_split_kernel by heads and key read
    python backends/nvidia_sm100/benchmarks/sass_census.py fp8         # the fp8 block linears' kernels

Each kernel is compiled ahead of time as Triton's JIT sees the preset (pointers, strides and widths divisible by 16)
with the installed Triton and its bundled ``nvdisasm``; the longest loop of the SASS (the K loop) is counted per
opcode. ``per weight`` = the loop's instructions x threads / weights expanded per iteration (one program): the H200
issues 4 warp instructions per SM and clock, ~33 T thread instructions a second, so at N instructions a weight a
layer of the ``v4-flash-8l64e-fp4`` preset (64 experts x 3 x 4,096 x 2,048 weights) takes at least N x 48 us when
every expert is touched. ``local`` counts spill loads and stores (``LDL`` / ``STL``) in the whole kernel;
``registers`` a thread's (``cuobjdump -res-usage``), ``warps a SM`` the kernel's warps an SM holds at once by
registers, shared memory and the 64-warp limit (``aot.resident_warps``): with few, loads and the expansion's
dependent instructions wait uncovered. The sparse section: per (key, head) of a loop step, at V4's head width (512,
bf16), each ``STORE`` read (contiguous keys, the key rows' one gather, the block and row tables). The fp8 section:
the one-row and split-K kernels per weight, the tensor-core kernel per 128-input K step of its tile as issue clocks of an SM (4 warp instructions a clock) beside
the fp8 MMA's clocks (~7,570 FLOP a clock and SM at the H200's dense fp8 peak).
"""

from __future__ import annotations

import sys

import triton
import triton.language as tl
from deepinfer_nvidia_sm100.kernels import (
    aot,
    fp8_linear,
    moe,
    moe_mxfp4_decode,
    moe_mxfp4_fp8_decode,
    moe_quant,
    sparse_attention,
)

TYPES = {"w1_ptr": "*u8", "w2_ptr": "*u8", "w3_ptr": "*u8", "s1_ptr": "*u8", "s2_ptr": "*u8", "s3_ptr": "*u8",
         "assign_ptr": "*i64", "block_expert_ptr": "*i64", "weights_ptr": "*fp32", "limit": "fp32"}
WORDS = {f"w{i}_ptr": "*i32" for i in "123"}  # moe_mxfp4_decode reads the packed bytes as int32 words


FP8_TYPES = {"w_ptr": "*fp8e4nv", "s_ptr": "*u8", "xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "x_ptr": "*bf16"}
FP8_FLOP_PER_CLOCK = 7570  # dense fp8 tensor-core FLOP per clock and SM on the H200 (~1,979 TFLOP/s, 132 SMs, 1.98 GHz)


def sparse_cases() -> dict[str, tuple]:
    """Name -> (kernel, types, constants, warps, stages, (key, head) pairs per loop iteration, widths)."""
    types = {**{name: "*bf16" for name in ("q_ptr", "kv_ptr", "store_ptr", "out_ptr")}, "index_ptr": "*i32",
             "blocks_ptr": "*i64", "rows_ptr": "*i64", "sinks_ptr": "*fp32", "opart_ptr": "*fp32",
             "mpart_ptr": "*fp32", "lpart_ptr": "*fp32", "scale_log2": "fp32"}
    out = {}
    for heads in (16, 32, 64):
        for read in ("NO_STORE", "KEY_ROWS", "TABLES"):
            store = getattr(sparse_attention, read).value
            block_n, stages = sparse_attention.tile(heads, store == sparse_attention.TABLES.value)
            constants = {"D": 512, "BLOCK_H": heads, "BLOCK_N": block_n, "WHOLE": True, "STORE": store,
                         "PRECISION": "tf32", "PDL": True, "splits": 1}
            out[f"_sparse_split_kernel {heads} heads {read} (BLOCK_N {block_n}, {stages} stages)"] = (
                sparse_attention._sparse_split_kernel, types, constants, 4 if heads <= 16 else 8, stages,
                block_n * heads, aot.SPARSE_WIDTHS)
    return out


def fp8_cases() -> dict[str, tuple]:
    """Name -> (kernel, types, constants, warps, stages, weights per loop iteration): the row and split-K kernels."""
    bn, bk, warps, stages = fp8_linear.ROW_TILE
    out = {f"_row_kernel {fp8_linear.ROW_TILE}": (fp8_linear._row_kernel, FP8_TYPES, {
        "BLOCK_N": bn, "BLOCK_K": bk, "B0": 128, "B1": 128, "UE8M0": True}, warps, stages, bn * bk)}
    for rows in (16, 32, 64):
        bm, bn, bk, warps, stages = fp8_linear._tile(fp8_linear.SPLIT_K_TILES, rows)
        constants = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "B0": 128, "B1": 128, "UE8M0": True,
                     "PRECISION": "tf32", "SWAP": fp8_linear.SPLIT_K_SWAP, "F16": fp8_linear.SPLIT_K_F16}
        out[f"_split_k_kernel {rows} rows {(bm, bn, bk, warps, stages)}"] = (
            fp8_linear._split_k_kernel, FP8_TYPES | {"out_ptr": "*fp32"}, constants, warps, stages, bn * bk)
    return out


def fp8_tc_table() -> None:
    """The tensor-core kernel at each ``FP8_TC_TILES`` tile, 128 x 128 ue8m0 blocks, per K step."""
    print("\nfp8 tensor-core kernel, 128 x 128 ue8m0 blocks: a K step (128 inputs) of one tile, SM clocks")
    print("| tile | loop instructions a warp | issue clocks | fp8 MMA clocks | local |\n|---|---|---|---|---|")
    for _, bm, bn, warps, stages in fp8_linear.FP8_TC_TILES:
        constants = {"BLOCK_M": bm, "BLOCK_N": bn, "B0": 128, "B1": 128, "UE8M0": True,
                     "GROUP_M": fp8_linear.FP8_TC_GROUP_M, "ONE_SCALE": 128 % bn == 0, "EVEN_K": True}
        compiled = aot.compile_divisible(fp8_linear._fp8_tc_kernel, FP8_TYPES | {"out_ptr": "*bf16"}, constants, 90,
                                         warps, stages)
        counts, spills = aot.loop_census(aot.disassemble(compiled.asm["cubin"]))
        total = sum(counts.values())
        print(f"| {(bm, bn, warps, stages)} | {total} | {total * warps / 4:.0f} | "
              f"{2 * bm * bn * 128 / FP8_FLOP_PER_CLOCK:.0f} | {spills} |")


def cases() -> dict[str, tuple]:
    """Name -> (kernel, types, constants, warps, stages, weights expanded per loop iteration)."""
    out = {}
    for name, (_, (bm, bn, bk, warps)) in moe_quant.TILES.items():
        if name == "large":
            continue
        constants = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "FMT": moe_quant.MXFP4, "B0": 1, "B1": 32,
                     "UE8M0": True, "PRECISION": "tf32", "SCALED": True, "SWAP": False,
                     "GROUP_M": moe_quant.TILE_GROUP_M if bm >= moe_quant.TILE_GROUP_MIN_ROWS else 1}
        for kernel, matrices in (("_up_kernel", 2), ("_down_kernel", 1)):
            out[f"moe_quant.{kernel} {name} {(bm, bn, bk, warps)}"] = (
                getattr(moe_quant, kernel), TYPES, constants, warps, 3, bn * bk * matrices)
    bn, bk, warps, stages = moe_quant.ROW_TILES[moe_quant.MXFP4]
    for kernel, matrices in (("_up_row_kernel", 2), ("_down_row_kernel", 1), ("_down_pick_kernel", 1)):
        constants = {"BLOCK_N": bn, "BLOCK_K": bk, "FMT": moe_quant.MXFP4, "B0": 1, "B1": 32, "UE8M0": True,
                     "PTX": moe_quant.ROW_DECODE_PTX} | ({"K_P2": 8} if kernel.startswith("_down") else {})
        types = TYPES | {"ids_ptr": "*i64", "part_ptr": "*fp32", "counter_ptr": "*i32"}
        out[f"moe_quant.{kernel} one token {(bn, bk, warps, stages)}"] = (
            getattr(moe_quant, kernel), types, constants, warps, stages, bn * bk * matrices)
    launches = [(name, (bm, bk, stages, subtiles)) for name, (_, (bm, bk, stages, *_)) in
                moe_mxfp4_decode.TILES.items() for subtiles in (1, 2)]  # 64-row weight tiles a program
    for name, (bm, bk, stages, subtiles) in launches:
        constants = {"BLOCK_M": bm, "BLOCK_K": bk, "DECODE": moe_mxfp4_decode.PTX, "PRECISION": "tf32",
                     "SUBTILES": subtiles}
        for kernel in ("_up_kernel", "_down_kernel"):
            out[f"moe_mxfp4_decode.{kernel} {name} {(bm, bk, stages, subtiles)}"] = (
                getattr(moe_mxfp4_decode, kernel), TYPES | WORDS, constants,
                moe_mxfp4_decode.WARPS, stages, moe_mxfp4_decode.TILE_ROWS * subtiles * bk)
    fp8 = {"xq_ptr": "*fp8e4nv", "hq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "hs_ptr": "*fp32"}
    for _, bm, stages in moe_mxfp4_fp8_decode.TILES:
        half = moe_mxfp4_fp8_decode.HALF
        for kernel in ("_up_kernel", "_down_kernel"):
            out[f"moe_mxfp4_fp8_decode.{kernel} ({bm} rows, {2 * half} weight rows)"] = (
                getattr(moe_mxfp4_fp8_decode, kernel), TYPES | fp8,
                {"BLOCK_M": bm, "HALF": half, "PTX": True} | ({"DT": tl.bfloat16} if kernel == "_up_kernel" else {}),
                moe_mxfp4_fp8_decode.WARPS, stages, 2 * half * moe_mxfp4_fp8_decode.STEP)
    return out


def table(title: str, unit: str, rows: dict[str, tuple]) -> None:
    """Each case compiled and its loop counted: one Markdown row per case."""
    print(f"\n{title}\n| kernel | loop instructions | per {unit} | local | registers | warps a SM | top opcodes |"
          "\n|---|---|---|---|---|---|---|")
    for name, (fn, types, constants, warps, stages, work, *widths) in rows.items():
        compiled = aot.compile_divisible(fn, types, constants, 90, warps, stages, *widths)
        counts, spills = aot.loop_census(aot.disassemble(compiled.asm["cubin"]))
        regs = aot.registers(compiled.asm["cubin"])
        resident = aot.resident_warps(regs, warps, compiled.metadata.shared)
        total = sum(counts.values())
        top = ", ".join(f"{op} {n}" for op, n in counts.most_common(6))
        print(f"| {name} | {total} | {total * warps * 32 / work:.2f} | {spills} | {regs} | {resident} | {top} |")


def main(sections: list[str]) -> None:
    print(f"Triton {triton.__version__}, sm_90a")
    if "mxfp4" in sections:
        table(f"MXFP4 experts (moe.TILES decode {moe.TILES['decode']}): thread instructions per expanded weight",
              "weight", cases())
    if "sparse" in sections:
        table("sparse attention, d 512 bf16: thread instructions per (key, head)", "key x head", sparse_cases())
    if "fp8" in sections:
        table("fp8 block linears (128 x 128 ue8m0), bf16 activations: thread instructions per weight", "weight",
              fp8_cases())
        fp8_tc_table()


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)
    main(sys.argv[1:] or ["mxfp4", "sparse", "fp8"])

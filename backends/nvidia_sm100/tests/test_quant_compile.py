"""The quantized-weight kernels (``moe_quant.py``, ``fp8_linear.py``, ``dequant.py``) compile for sm_90a and sm_100a
on a machine without a GPU, as test_triton_compile.py checks the others: MoE tiles of 64 rows and the fp8 linear
tiles from 64 rows reach the architecture's tensor cores (wgmma / tcgen05), the fp8 tensor-core kernel with e4m3
operands; 16-row decode tiles use mma.sync. Results are checked elsewhere (test_quant_kernels.py on the CPU
interpreter, test_kernels_gpu.py on the GPU)."""

from __future__ import annotations

import re

import pytest
import torch

triton = pytest.importorskip("triton", reason="the test extra installs triton")
from deepinfer_nvidia_sm100.kernels import aot, dequant, fp8_linear, moe_mxfp4_prefill, moe_quant
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ARCHS = {90: ("sm_90a", "wgmma"), 100: ("sm_100a", "tcgen05.mma")}
FP8_MMA = {90: r"wgmma\.mma_async\S*e4m3\.e4m3", 100: r"tcgen05\.mma\S*kind::f8f6f4"}


def _compile(fn, types: dict[str, str], constants: dict, capability: int, warps: int = 4, stages: int = 3):
    """``fn`` compiled for ``capability``: pointers ``*bf16`` and other scalars ``i32`` unless ``types`` says;
    constexpr arguments left out of ``constants`` take their defaults."""
    constants = aot.with_defaults(fn, constants)
    signature = {}
    for i, arg in enumerate(fn.arg_names):
        if i in fn.constexprs:
            signature[arg] = "constexpr"
        else:
            signature[arg] = types.get(arg, "*bf16" if arg.endswith("_ptr") else "i32")
    source = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": warps, "num_stages": stages})
    ptx = compiled.asm["ptx"]
    assert re.search(r"^\.target (\S+)", ptx, re.MULTILINE).group(1) == ARCHS[capability][0]
    assert len(compiled.asm["cubin"]) > 0
    return ptx


def _weights(fmt: int, names: tuple[str, ...]) -> dict[str, str]:
    """Argument types of the stored weights (MXFP4 bytes or e4m3) and their scales (ue8m0 bytes)."""
    weight = "*u8" if fmt == moe_quant.MXFP4 else "*fp8e4nv"
    types = {f"w{i}_ptr": weight for i in names} | {f"s{i}_ptr": "*u8" for i in names}
    return types | {"assign_ptr": "*i64", "block_expert_ptr": "*i64", "ids_ptr": "*i64", "weights_ptr": "*fp32",
                    "limit": "fp32"}


def _expect_tensor_cores(ptx: str, rows: int, capability: int, name: str) -> None:
    tensor_core = ARCHS[capability][1]
    if rows >= 64:
        assert tensor_core in ptx and "mma.sync" not in ptx, f"{name} on {ARCHS[capability][0]}: no {tensor_core}"
    else:
        assert "mma.sync" in ptx and "wgmma" not in ptx and "tcgen05.mma" not in ptx, name


@pytest.mark.parametrize("capability", sorted(ARCHS))
@pytest.mark.parametrize("tile_name", ["decode", "prefill", "large"])  # 16, 64 and 128 rows ("mid": "prefill"'s MMA)
@pytest.mark.parametrize("fmt", [moe_quant.MXFP4, moe_quant.FP8])
@pytest.mark.parametrize("kernel", ["_up_kernel", "_down_kernel"])
def test_quantized_moe_kernels_reach_the_tensor_cores(kernel, fmt, tile_name, capability):
    """Each tile ``_tiles`` picks compiles to the architecture's MMA without spilling registers (MXFP4 with bf16
    activations: ``tl.dot_scaled``, whose expanded tiles reach wgmma / tcgen05 at every height; 16-row tiles, MXFP4
    and fp8, put the weights on the left, so SM90 runs m64n16 wgmma with them in registers)."""
    block = moe_quant.MXFP4_BLOCK if fmt == moe_quant.MXFP4 else (128, 128)
    per_expert = {"decode": 16, "prefill": 256, "large": 768}[tile_name]
    block_m, block_n, block_k, warps = moe_quant._tiles(fmt, 64 * per_expert, 64, block)
    assert (block_m, block_n, block_k, warps) == moe_quant.TILES[tile_name][1]
    fn = getattr(moe_quant, kernel)
    constants = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "FMT": fmt, "B0": block[0],
                 "B1": block[1], "UE8M0": True, "PRECISION": "tf32", "SCALED": moe_quant.scaled_dot(fmt, torch.bfloat16)}
    constants["SWAP"] = (constants["SCALED"] or fmt == moe_quant.FP8) and block_m <= moe_quant.SWAP_AB_MAX_ROWS
    constants["GROUP_M"] = moe_quant.TILE_GROUP_M if block_m >= moe_quant.TILE_GROUP_MIN_ROWS else 1
    ptx = _compile(fn, _weights(fmt, ("1", "2", "3")), constants, capability, warps)
    mma_rows = block_n if constants["SWAP"] else 64 if constants["SCALED"] else block_m
    _expect_tensor_cores(ptx, mma_rows, capability, f"{kernel} fmt {fmt} {tile_name}")
    assert "ld.local" not in ptx and "st.local" not in ptx, f"{kernel} fmt {fmt} {tile_name}: registers spill"
    if constants["SWAP"] and capability == 90:
        assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n16k16\.f32\.bf16\.bf16 \{[^}]*\}, \{%r", ptx), kernel


@pytest.mark.parametrize("capability", sorted(ARCHS))
@pytest.mark.parametrize("fmt, pipeline", [(moe_quant.MXFP4, 0), (moe_quant.FP8, 0), (moe_quant.FP8, 3)])
@pytest.mark.parametrize("kernel", ["_up_row_kernel", "_down_row_kernel"])
def test_quantized_moe_row_kernels_compile(kernel, fmt, pipeline, capability):
    """The one-token row kernels at their launches (MXFP4 never pipelined: ``row_pipeline``), without spills; with
    ``PIPELINE`` their weight slices are copied ahead into shared memory (``cp.async``), without it loaded straight
    into registers. (Triton 3.9's pipeliner leaves the fp8 up kernel's loop, two weights' slices a step,
    unpipelined at every tile tried: there ``PIPELINE`` changes nothing.)"""
    assert moe_quant.row_pipeline(moe_quant.MXFP4) == 0
    block_n, block_k, warps, stages = moe_quant.ROW_TILES[fmt]
    block = moe_quant.MXFP4_BLOCK if fmt == moe_quant.MXFP4 else (128, 128)
    constants = {"BLOCK_N": block_n, "BLOCK_K": block_k, "FMT": fmt, "B0": block[0], "B1": block[1], "UE8M0": True,
                 "PIPELINE": pipeline}
    if kernel == "_down_row_kernel":
        constants["K_P2"] = 8
    ptx = _compile(getattr(moe_quant, kernel), _weights(fmt, ("1", "2", "3")), constants, capability, warps, stages)
    pipelined = pipeline > 1 and not (kernel == "_up_row_kernel" and fmt == moe_quant.FP8)
    assert ("cp.async" in ptx) == pipelined, f"{kernel} fmt {fmt} pipeline {pipeline}"
    assert "ld.local" not in ptx and "st.local" not in ptx, f"{kernel} fmt {fmt} pipeline {pipeline}: registers spill"


@pytest.mark.parametrize("capability", sorted(ARCHS))
@pytest.mark.parametrize("fmt", [moe_quant.MXFP4, moe_quant.FP8])
def test_down_pick_kernel_compiles_and_meets_by_an_atomic_count(fmt, capability):
    """``_down_pick_kernel`` (``PICKS_APART``) at the one-token tile (MXFP4 through the PTX row sums): its column
    block's programs meet by an acquire-release count at GPU scope, the last reads the others' sums through L2, no
    spills."""
    block_n, block_k, warps, stages = moe_quant.ROW_TILES[fmt]
    block = moe_quant.MXFP4_BLOCK if fmt == moe_quant.MXFP4 else (128, 128)
    constants = {"BLOCK_N": block_n, "BLOCK_K": block_k, "FMT": fmt, "B0": block[0], "B1": block[1], "UE8M0": True,
                 "K_P2": 8, "PTX": fmt == moe_quant.MXFP4}
    types = _weights(fmt, ("2",)) | {"part_ptr": "*fp32", "counter_ptr": "*i32"}
    ptx = _compile(moe_quant._down_pick_kernel, types, constants, capability, warps, stages)
    assert re.search(r"atom\.global\.(acq_rel\.gpu|gpu\.acq_rel)\.add", ptx) and "ld.global.cg" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx, f"fmt {fmt}: registers spill"


LINEAR_TYPES = {"w_ptr": "*fp8e4nv", "s_ptr": "*u8", "xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32"}


@pytest.mark.parametrize("capability", sorted(ARCHS))
@pytest.mark.parametrize("rows, columns", [(16, 4096), (16, 32768), (64, 4096), (64, 32768)])  # wo_b; wq_b
def test_fp8_weight_only_kernel_tiles(rows, columns, capability):
    """16-row tiles multiply with the weights on the left: m64n16 wgmma from registers on SM90 (as narrow as the
    column tile allows: 16 columns stay on mma.sync)."""
    block_m, block_n, warps, stages = fp8_linear._weight_only_tile(rows, columns, 1)
    swap = block_m <= fp8_linear.SWAP_AB_MAX_ROWS
    constants = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": 128, "B0": 128, "B1": 128, "UE8M0": True,
                 "PRECISION": "tf32", "SWAP": swap}
    ptx = _compile(fp8_linear._weight_only_kernel, LINEAR_TYPES, constants, capability, warps, stages)
    _expect_tensor_cores(ptx, block_n if swap else block_m, capability, f"weight-only {block_m} rows")
    assert "ld.local" not in ptx, f"weight-only {block_m} rows: registers spill"


@pytest.mark.parametrize("capability", sorted(ARCHS))
@pytest.mark.parametrize("rows, block, ue8m0", [(256, (128, 128), True), (8192, (128, 128), False),
                                              (256, (32, 32), True)])
def test_fp8_tensor_core_kernel_multiplies_e4m3_operands(rows, block, ue8m0, capability):
    """The prefill kernel's products are fp8 tensor-core instructions (e4m3 x e4m3 with fp32 accumulate), for
    V4-Flash's 128 x 128 blocks (ue8m0 scales; float32 as V4-Flash-Base) and V4.1-Flash's 32 x 32."""
    block_m, block_n, warps, stages = fp8_linear._tile(fp8_linear.FP8_TC_TILES, rows)
    one_scale = block[0] % block_n == 0  # as _launch_fp8_tc sets it for one group
    constants = {"BLOCK_M": block_m, "BLOCK_N": block_n, "B0": block[0], "B1": block[1], "UE8M0": ue8m0,
                 "GROUP_M": fp8_linear.FP8_TC_GROUP_M, "ONE_SCALE": one_scale, "EVEN_K": True}
    types = LINEAR_TYPES | {"s_ptr": "*u8" if ue8m0 else "*fp32"}
    ptx = _compile(fp8_linear._fp8_tc_kernel, types, constants, capability, warps, stages)
    assert re.search(FP8_MMA[capability], ptx), f"fp8 tensor cores {block_m} rows {block}: no e4m3 MMA"
    assert one_scale == (block == (128, 128))  # V4-Flash's blocks take one weight scale a K step


@pytest.mark.parametrize("capability", sorted(ARCHS))
@pytest.mark.parametrize("name, fn, types, constants", [
    ("row", fp8_linear._row_kernel, LINEAR_TYPES, {"BLOCK_N": 16, "BLOCK_K": 128, "B0": 128, "B1": 128,
                                                   "UE8M0": True}),
    ("row f32 scales", fp8_linear._row_kernel, LINEAR_TYPES | {"s_ptr": "*fp32"},
     {"BLOCK_N": 8, "BLOCK_K": 32, "B0": 32, "B1": 32, "UE8M0": False}),
    ("quantize rows", fp8_linear._quantize_rows_kernel, {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
     {"B1": 128, "BLOCKS": 16}),
    ("mxfp4 rows to e4m3 (moe_mxfp4_prefill)", moe_mxfp4_prefill._e4m3_rows_kernel,
     {"w_ptr": "*u8", "s_ptr": "*u8", "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32"},
     {"GROUPS_P2": 128, "BLOCK_R": moe_mxfp4_prefill.CONVERT_ROWS, "BLOCK_G": moe_mxfp4_prefill.CONVERT_GROUPS,
      "ROUND": False}),
    ("swiglu quantized (moe_mxfp4_prefill)", moe_mxfp4_prefill._swiglu_quantize_kernel,
     {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "limit": "fp32"}, {"BLOCK": 2048}),
    ("dequantize mxfp4", dequant._mxfp4_kernel, {"packed_ptr": "*u8", "scale_ptr": "*u8", "out_ptr": "*fp32"},
     {"BLOCK": 1024}),
    ("dequantize fp8", dequant._fp8_block_kernel, {"w_ptr": "*fp8e4nv", "scale_ptr": "*u8", "out_ptr": "*fp32"},
     {"B0": 128, "B1": 128, "UE8M0": True, "BLOCK_R": 32, "BLOCK_C": 64}),
    ("dequantize fp8 to bf16 (fp8_linear.DEQUANT)", dequant._fp8_block_kernel,
     {"w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "out_ptr": "*bf16"},
     {"B0": 128, "B1": 128, "UE8M0": False, "BLOCK_R": fp8_linear.DEQUANT_TILE[0],
      "BLOCK_C": fp8_linear.DEQUANT_TILE[1]}),
])
def test_small_quant_kernels_compile(name, fn, types, constants, capability):
    _compile(fn, types, constants, capability)


@pytest.mark.parametrize("capability", sorted(ARCHS))
@pytest.mark.parametrize("name", ["mxfp4", "fp8", "fp8 pipelined", "linear", "linear K split"])
def test_row_kernels_read_the_weights_in_16_byte_vectors(name, capability):
    """The one-row kernels are bound by reading the stored weights: every weight load (the ``evict_first`` ones) is a
    16-byte vector (MXFP4: 16 bytes of one scale group; fp8: 16 of a row's block), also with K split (float32
    partials out); the fp8 expert rows pipelined (``row_pipeline``: the down kernel's), the weights are copied into
    shared memory by ``cp.async.cg``, which copies 16 bytes only."""
    if name.startswith("linear"):
        block_n, block_k, warps, stages = fp8_linear.ROW_TILE[:4]
        split = name.endswith("split")
        fn, types = fp8_linear._row_kernel, LINEAR_TYPES | ({"out_ptr": "*fp32"} if split else {})
        constants = {"BLOCK_N": block_n, "BLOCK_K": block_k, "B0": 128, "B1": 128, "UE8M0": True,
                     "SPLITS": 2 if split else 1}
    else:
        fmt = moe_quant.MXFP4 if name == "mxfp4" else moe_quant.FP8
        block_n, block_k, warps, stages = moe_quant.ROW_TILES[fmt]
        block = moe_quant.MXFP4_BLOCK if fmt == moe_quant.MXFP4 else (128, 128)
        fn, types = moe_quant._up_row_kernel, _weights(fmt, ("1", "2", "3"))
        constants = {"BLOCK_N": block_n, "BLOCK_K": block_k, "FMT": fmt, "B0": block[0], "B1": block[1],
                     "UE8M0": True, "PIPELINE": 0}
        if name.endswith("pipelined"):
            fn, types = moe_quant._down_row_kernel, _weights(fmt, ("2",))
            constants |= {"PIPELINE": 3, "K_P2": 8}
            ptx = aot.compile_divisible(fn, types, constants, capability, warps, stages).asm["ptx"]
            assert "cp.async.cg.shared.global" in ptx and "ld.global.L1::evict_first" not in ptx
            assert "ld.local" not in ptx, "registers spill"
            return
    ptx = aot.compile_divisible(fn, types, constants, capability, warps, stages).asm["ptx"]
    loads = re.findall(r"ld\.global\.L1::evict_first\S*", ptx)
    assert loads and all(load.endswith(".v4.b32") for load in loads), loads


@pytest.mark.parametrize("capability", sorted(ARCHS))
@pytest.mark.parametrize("rows, block, f16", [(16, (128, 128), True), (64, (128, 128), True), (16, (32, 32), True),
                                           (16, (128, 128), False)])
def test_fp8_split_k_kernel_streams_weights_into_the_tensor_cores(rows, block, f16, capability):
    """The decode-batch kernel: 256 weight rows a program on the left (wgmma / tcgen05 whatever the batch), the
    e4m3 weights read in 16-byte vectors (``k_per_split`` a multiple of 16, as the JIT specializes it), no spills;
    with ``F16`` fp16 products, the weights converted two at a time (e4m3x2 to f16x2) and never to bf16."""
    tile = fp8_linear._tile(fp8_linear.SPLIT_K_TILES, rows)
    block_m, block_n, block_k, warps, stages = tile
    constants = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "B0": block[0], "B1": block[1],
                 "UE8M0": True, "PRECISION": "tf32", "SWAP": fp8_linear.SPLIT_K_SWAP, "F16": f16}
    ptx = aot.compile_divisible(fp8_linear._split_k_kernel, LINEAR_TYPES, constants, capability, warps,
                                stages).asm["ptx"]
    _expect_tensor_cores(ptx, block_n if fp8_linear.SPLIT_K_SWAP else block_m, capability, f"split-K {rows} rows")
    assert "ld.local" not in ptx, f"split-K {rows} rows: registers spill"
    assert not re.search(r"ld\.global\S*evict_first\S*\.b8", ptx), "split-K: e4m3 weights read a byte at a time"
    if f16:
        assert "cvt.rn.f16x2.e4m3x2" in ptx and "cvt.bf16.f16" not in ptx


@pytest.mark.parametrize("capability", sorted(ARCHS))
@pytest.mark.parametrize("kernel, rows", [("_split_k_kernel", 16), ("_fp8_tc_kernel", 64)])
def test_fp8_split_launches_meet_in_the_kernel(kernel, rows, capability):
    """Split 8 ways, the decode-batch kernels add their partials in the kernel (``k_splits.store_split``): an
    acquire-release arrival count at GPU scope, the other splits' partials read through L2 (``.cg``: another SM
    wrote them), the counter set back; no spills."""
    if kernel == "_split_k_kernel":
        block_m, block_n, block_k, warps, stages = fp8_linear._tile(fp8_linear.SPLIT_K_TILES, rows)
        constants = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "PRECISION": "tf32",
                     "SWAP": fp8_linear.SPLIT_K_SWAP, "F16": True}
    else:
        block_m, block_n, warps, stages = fp8_linear._tile(fp8_linear.FP8_TC_TILES, rows)
        constants = {"BLOCK_M": block_m, "BLOCK_N": block_n, "GROUP_M": fp8_linear.FP8_TC_GROUP_M,
                     "ONE_SCALE": True, "EVEN_K": True}
    constants |= {"B0": 128, "B1": 128, "UE8M0": True, "SPLITS": 8, "MEET": True}
    types = LINEAR_TYPES | {"part_ptr": "*fp32", "counter_ptr": "*i32"}
    ptx = aot.compile_divisible(getattr(fp8_linear, kernel), types, constants, capability, warps, stages).asm["ptx"]
    assert re.search(r"atom\.global\.(acq_rel\.gpu|gpu\.acq_rel)\.add\.(u32|s32)", ptx), kernel
    assert "ld.global.cg" in ptx and "atom.global" in ptx.split("ld.global.cg")[0], kernel
    assert re.search(r"atom\.global\S*\.exch\.b32", ptx), kernel
    assert "ld.local" not in ptx, f"{kernel}: registers spill"


@pytest.mark.parametrize("capability", sorted(ARCHS))
def test_sum_splits_kernel_compiles(capability):
    _compile(fp8_linear._sum_splits_kernel, {"part_ptr": "*fp32"}, {"SPLITS": 4, "BLOCK": fp8_linear.SUM_BLOCK},
             capability)


@pytest.mark.parametrize("rows", [256, 8192])
def test_fp8_tensor_core_k_step_issues_in_fewer_clocks_than_its_mma(rows):
    """Static count on sm_90a (``benchmarks/sass_census.py fp8``): with V4-Flash's 128 x 128 ue8m0 blocks a K step of
    the tile issues fewer instruction clocks (4 warp instructions a clock and SM) than its fp8 MMA takes at the
    H200's peak (~7,570 FLOP a clock and SM), so the scaling around the products need not set the pace (before
    ``ONE_SCALE`` / ``EVEN_K``: 682 issue clocks against 554 at 128 x 128)."""
    block_m, block_n, warps, stages = fp8_linear._tile(fp8_linear.FP8_TC_TILES, rows)
    constants = {"BLOCK_M": block_m, "BLOCK_N": block_n, "B0": 128, "B1": 128, "UE8M0": True,
                 "GROUP_M": fp8_linear.FP8_TC_GROUP_M, "ONE_SCALE": 128 % block_n == 0, "EVEN_K": True}
    compiled = aot.compile_divisible(fp8_linear._fp8_tc_kernel, LINEAR_TYPES, constants, 90, warps, stages)
    counts, spills = aot.loop_census(aot.disassemble(compiled.asm["cubin"]))
    issue_clocks = sum(counts.values()) * warps / 4
    assert issue_clocks < 2 * block_m * block_n * 128 / 7570 and spills == 0, (issue_clocks, spills)

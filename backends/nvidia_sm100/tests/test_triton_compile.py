"""Every Triton kernel of the backend compiles for sm_90a and sm_100a on a machine without a GPU (CI).

Triton compiles ahead of time for a named target (``GPUTarget("cuda", 90 | 100, 32)``) with its own ptxas, so
this runs on the CPU CI machine. Each MoE tile the backend can pick is compiled in bf16 and the PTX is checked
for the tensor-core path: 64-row tiles use wgmma on sm_90a and tcgen05 on sm_100a; the 16-row decode tile uses
mma.sync on both (wgmma and tcgen05 need at least 64 rows, and decode reads weights, it barely multiplies).
Only compilation is checked here; the kernels' results are checked on the GPU (test_kernels_gpu.py,
test_triton_kernels.py). The kernels without a matrix multiply (mHC weights, MoE align, SwiGLU and combine) are checked
to compile for both targets.
"""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton", reason="the test extra installs triton")
from deepinfer_nvidia_sm100.kernels import hc, indexer, moe
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ARCHS = {90: ("sm_90a", "wgmma"), 100: ("sm_100a", "tcgen05.mma")}
INDEX_POINTERS = {"assign_ptr", "block_expert_ptr"}


def _signature(fn) -> dict[str, str]:
    """Argument types of a MoE kernel for bf16 activations and weights."""
    types = {}
    for i, name in enumerate(fn.arg_names):
        if i in fn.constexprs:
            types[name] = "constexpr"
        elif name in INDEX_POINTERS:
            types[name] = "*i64"
        elif name == "weights_ptr":
            types[name] = "*fp32"
        elif name.endswith("_ptr"):
            types[name] = "*bf16"
        else:
            types[name] = "fp32" if name == "limit" else "i32"
    return types


def _compile(fn, tile, capability):
    block_m, block_n, block_k, warps, *grouping = tile
    constants = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "PRECISION": "tf32"}
    if grouping:
        constants["GROUP_M"] = grouping[0]
    source = ASTSource(fn, _signature(fn), constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": warps, "num_stages": 3})


def _moe_tiles() -> dict[str, tuple[int, ...]]:
    """The fast path's tiles and the batch-invariant mode's (its prefill tile walks row blocks grouped)."""
    from deepinfer_nvidia_sm100.kernels import invariant

    return {**moe.TILES, "invariant": invariant.MOE_TILE, "invariant prefill": invariant.MOE_PREFILL_TILE}


@pytest.mark.parametrize("capability", sorted(ARCHS))
@pytest.mark.parametrize("tile_name", sorted(_moe_tiles()))
@pytest.mark.parametrize("kernel", ["_up_kernel", "_down_kernel"])
def test_moe_kernel_compiles_to_the_architectures_tensor_core_path(kernel, tile_name, capability):
    tile = _moe_tiles()[tile_name]
    compiled = _compile(getattr(moe, kernel), tile, capability)
    arch, tensor_core = ARCHS[capability]
    ptx = compiled.asm["ptx"]
    assert re.search(r"^\.target (\S+)", ptx, re.MULTILINE).group(1) == arch
    assert len(compiled.asm["cubin"]) > 0
    if tile[0] >= 64:
        assert tensor_core in ptx, f"{kernel} {tile} on {arch}: no {tensor_core}"
        assert "mma.sync" not in ptx
    else:
        assert "mma.sync" in ptx and "wgmma" not in ptx and "tcgen05.mma" not in ptx


SMALL_KERNELS = {  # kernel -> (argument types where not the default, constexprs) as the ops launch them
    # defaults: pointers (*_ptr) *fp32, *eps fp32, other scalars i32
    "hc._hc_weights_kernel": ({}, {"HC": 4, "HC_P2": 4}),
    "hc._hc_mix_partial_kernel": ({"x_ptr": "*bf16"}, {"BLOCK_T": 1, "BLOCK_K": 128, "N_P2": 32,
                                                       "TENSOR_CORES": False}),
    "hc._hc_mix_finish_kernel": ({}, {"N_P2": 32, "SPLITS_P2": 64}),
    "indexer._indexer_scores_kernel": ({"q_ptr": "*bf16", "k_ptr": "*bf16", "scale": "fp32"},
                                       {"D": 128, "BLOCK_T": indexer.BLOCK_T, "BLOCK_E": indexer.TILE_E,
                                        "PRECISION": "tf32"}),
    "indexer._indexer_scores_rows_kernel": ({"q_ptr": "*bf16", "k_ptr": "*bf16", "scale": "fp32"},
                                            {"D": 128, "H_P2": 64, "BLOCK_E": 64, "PRECISION": "tf32"}),
    "hc._hc_mix_partial_kernel:tensor_cores": ({"x_ptr": "*bf16"}, {"BLOCK_T": hc.MIX_DOT_BLOCK_T,
                                                                    "BLOCK_K": hc.MIX_DOT_BLOCK_K, "N_P2": 32,
                                                                    "TENSOR_CORES": True}),
    "hc._hc_finish_weights_collapse_kernel": ({"streams_ptr": "*bf16", "out_ptr": "*bf16", "norm_w_ptr": "*bf16"},
                                              {"HC": 4, "HC_P2": 4, "N_P2": 32, "SPLITS_P2": 128, "BLOCK_D": 1024,
                                               "NORM": False}),
    "hc._hc_finish_weights_collapse_kernel:normed": ({"streams_ptr": "*bf16", "out_ptr": "*bf16",
                                                      "norm_w_ptr": "*fp32"},
                                                     {"HC": 4, "HC_P2": 4, "N_P2": 32, "SPLITS_P2": 128,
                                                      "BLOCK_D": 1024, "NORM": True}),
    "hc._hc_finish_weights_collapse_kernel:deferred": ({"streams_ptr": "*bf16", "out_ptr": "*bf16",
                                                        "norm_w_ptr": "*fp32"},
                                                       {"HC": 4, "HC_P2": 4, "N_P2": 32, "SPLITS_P2": 128,
                                                        "BLOCK_D": 4096, "NORM": True, "WEIGHTS": False}),
    "hc._hc_mix_weights_kernel": ({}, {"HC": 4, "HC_P2": 4, "N_P2": 32, "SPLITS_P2": 128}),
    "greedy._partials_kernel": ({"ids_ptr": "*i32", "counts_ptr": "*i32"}, {"BLOCK": 4096}),
    "greedy._finish_kernel": ({"ids_ptr": "*i32", "counts_ptr": "*i32", "token_ptr": "*i64", "rank_ptr": "*i64"},
                              {"CHUNKS_P2": 32}),
    "moe._up_row_kernel": ({"x_ptr": "*bf16", "w1_ptr": "*bf16", "w3_ptr": "*bf16", "h_ptr": "*bf16",
                            "ids_ptr": "*i64", "limit": "fp32"}, {"BLOCK_N": 2, "BLOCK_K": 1024, "EVEN": True}),
    "moe._down_row_kernel": ({"h_ptr": "*bf16", "w2_ptr": "*bf16", "out_ptr": "*bf16", "ids_ptr": "*i64"},
                             {"BLOCK_N": 2, "BLOCK_K": 512, "EVEN": True, "K_P2": 8}),
    "decode_attention._split_kernel": ({"q_ptr": "*bf16", "kv_ptr": "*bf16", "vis_ptr": "*u8", "blocks_ptr": "*i32",
                                        "counts_ptr": "*i32", "out_ptr": "*bf16", "scale_log2": "fp32"},
                                       {"D": 512, "BLOCK_H": 16, "BLOCK_N": 64, "WHOLE": False}),
    "decode_attention._split_kernel:whole": ({"q_ptr": "*bf16", "kv_ptr": "*bf16", "vis_ptr": "*u8",
                                              "blocks_ptr": "*i32", "counts_ptr": "*i32", "out_ptr": "*bf16",
                                              "opart_ptr": "*bf16", "mpart_ptr": "*bf16", "lpart_ptr": "*bf16",
                                              "scale_log2": "fp32"},
                                             {"D": 512, "BLOCK_H": 16, "BLOCK_N": 64, "WHOLE": True}),
    "decode_attention._combine_kernel": ({"out_ptr": "*bf16"}, {"D": 512, "BLOCK_H": 16, "SPLITS_P2": 4}),
    "hc._hc_collapse_kernel": ({"streams_ptr": "*bf16", "out_ptr": "*bf16"}, {"HC": 4, "HC_P2": 4, "BLOCK_D": 1024}),
    "hc._hc_post_kernel": ({"streams_ptr": "*bf16", "block_ptr": "*bf16", "extra_ptr": "*bf16", "out_ptr": "*bf16"},
                           {"HC": 4, "HC_P2": 4, "BLOCK_D": 512, "ADD": False}),
    "hc._hc_post_kernel:sum": ({"streams_ptr": "*bf16", "block_ptr": "*bf16", "extra_ptr": "*bf16",
                                "out_ptr": "*bf16"}, {"HC": 4, "HC_P2": 4, "BLOCK_D": 512, "ADD": True}),
    "rope._rope_kernel": ({"x_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "out_ptr": "*bf16", "sign": "fp32"},
                          {"BLOCK_R": 4, "NOPE_P2": 512, "HALF_P2": 32, "COPY": True}),
    "rope._rope_kernel:in_place": ({"x_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "out_ptr": "*bf16",
                                    "sign": "fp32"}, {"BLOCK_R": 16, "NOPE_P2": 1, "HALF_P2": 32, "COPY": False}),
    "gemv._gemv_row_kernel": ({"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16"},
                              {"BLOCK_N": 8, "BLOCK_K": 512, "EVEN": True}),
    "gemv._gemv_row_kernel:masked": ({"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16"},
                                     {"BLOCK_N": 2, "BLOCK_K": 128, "EVEN": False}),
    "norm._rms_norm_kernel": ({"x_ptr": "*bf16", "out_ptr": "*bf16"},
                              {"ROWS": 1, "BLOCK_D": 4096, "WEIGHTED": True, "ROPE": False}),
    "norm._rms_norm_kernel:unweighted": ({"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16"},
                                         {"ROWS": 4, "BLOCK_D": 512, "WEIGHTED": False, "ROPE": False}),
    "norm._rms_norm_kernel:rope": ({"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*bf16", "cos_ptr": "*bf16",
                                    "sin_ptr": "*bf16"}, {"ROWS": 4, "BLOCK_D": 512, "WEIGHTED": True, "ROPE": True}),
    "norm._rms_norm_kernel:unweighted_rope": ({"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
                                              "cos_ptr": "*bf16", "sin_ptr": "*bf16"},
                                             {"ROWS": 4, "BLOCK_D": 512, "WEIGHTED": False, "ROPE": True}),
    "keys._gather_keys_kernel": ({"ring_ptr": "*bf16", "ring_slots_ptr": "*i64", "ring_index_ptr": "*i64",
                                  "new_ptr": "*bf16", "new_rows_ptr": "*i64", "from_new_ptr": "*u8", "store_ptr": "*bf16",
                                  "blocks_ptr": "*i64", "rows_ptr": "*i64", "out_ptr": "*bf16"},
                                 {"HAS_STORE": True, "BLOCK_K": 8, "BLOCK_D": 512}),
    "key_blocks._visible_blocks_kernel": ({"vis_ptr": "*u8", "blocks_ptr": "*i32", "counts_ptr": "*i32"},
                                          {"BLOCK_N": 64, "CHUNK": 64}),
    "moe._align_kernel": ({"ids_ptr": "*i64", "sorted_assign_ptr": "*i64", "block_expert_ptr": "*i64",
                           "dest_ptr": "*i64"}, {"BLOCK_M": 16, "E_P2": 64, "CHUNK": 64}),
    "moe._align_count_kernel": ({"ids_ptr": "*i64", "counts_ptr": "*i32", "sorted_assign_ptr": "*i64"},
                                {"CHUNK": 64, "E_P2": 64, "FILL_P2": 128}),
    "moe._align_scan_kernel": ({"counts_ptr": "*i32", "pad_start_ptr": "*i32", "block_expert_ptr": "*i64"},
                               {"BLOCK_M": 16, "E_P2": 64, "GROUP": 64}),
    "moe._align_place_kernel": ({"ids_ptr": "*i64", "base_ptr": "*i32", "pad_start_ptr": "*i32",
                                 "sorted_assign_ptr": "*i64", "dest_ptr": "*i64"}, {"CHUNK": 64, "E_P2": 64}),
    "moe._combine_kernel": ({"y_ptr": "*bf16", "out_ptr": "*bf16", "ids_ptr": "*i64", "dest_ptr": "*i64"},
                            {"K_P2": 8, "BLOCK_D": 1024, "WEIGHTED": False}),
    "moe._combine_kernel:weighted": ({"y_ptr": "*bf16", "out_ptr": "*bf16", "ids_ptr": "*i64", "dest_ptr": "*i64"},
                                     {"K_P2": 8, "BLOCK_D": 1024, "WEIGHTED": True}),
    "moe._swiglu_kernel": ({"gate_ptr": "*bf16", "up_ptr": "*bf16", "h_ptr": "*bf16", "limit": "fp32"}, {"BLOCK": 2048}),
    "compressor._pool_windows_kernel": ({"raw_kv_ptr": "*bf16", "raw_gate_ptr": "*bf16", "carry_kv_ptr": "*bf16",
                                         "carry_gate_ptr": "*bf16", "from_new_ptr": "*u8", "new_rows_ptr": "*i64",
                                         "carry_slots_ptr": "*i64", "carry_index_ptr": "*i64", "valid_ptr": "*u8",
                                         "out_ptr": "*bf16"},
                                        {"OVERLAP": True, "BLOCK_S": 8, "BLOCK_D": 128, "SPAN_P2": 8}),
    "cache_writes._write_rows_kernel": ({"dst_ptr": "*bf16", "slots_ptr": "*i64", "index_ptr": "*i64",
                                         "src_ptr": "*fp32", "rows_ptr": "*i64"},
                                        {"HAS_ROWS": True, "BLOCK_M": 4, "BLOCK_W": 512}),
    "route._route_kernel": ({"logits_ptr": "*bf16", "table_ptr": "*i64", "token_ptr": "*i64", "weights_ptr": "*bf16",
                             "ids_ptr": "*i64", "scaling": "fp32"},
                            {"SCORING": 0, "HASH": False, "E_P2": 64, "K_P2": 8}),
    "route._route_kernel:hash": ({"logits_ptr": "*bf16", "table_ptr": "*i64", "token_ptr": "*i64",
                                  "weights_ptr": "*bf16", "ids_ptr": "*i64", "scaling": "fp32"},
                                 {"SCORING": 0, "HASH": True, "E_P2": 256, "K_P2": 8}),
}


TENSOR_CORE_KERNELS = {  # their tl.dot tiles must compile to the architecture's MMA
    "hc._hc_mix_partial_kernel:tensor_cores", "indexer._indexer_scores_kernel", "indexer._indexer_scores_rows_kernel"}


@pytest.mark.parametrize("capability", sorted(ARCHS))
@pytest.mark.parametrize("name", sorted(SMALL_KERNELS))
def test_small_kernels_compile(name, capability):
    from deepinfer_nvidia_sm100.kernels import (
        cache_writes,
        compressor,
        decode_attention,
        gemv,
        greedy,
        indexer,
        key_blocks,
        keys,
        norm,
        rope,
        route,
    )

    module, kernel = name.split(":")[0].split(".")
    fn = getattr({"gemv": gemv, "greedy": greedy, "hc": hc, "indexer": indexer, "key_blocks": key_blocks, "keys": keys, "moe": moe,
                   "norm": norm, "rope": rope, "route": route, "compressor": compressor,
                   "cache_writes": cache_writes, "decode_attention": decode_attention}[module], kernel)
    types, constants = SMALL_KERNELS[name]
    signature = {}
    for i, arg in enumerate(fn.arg_names):
        if i in fn.constexprs:
            signature[arg] = "constexpr"
        else:
            signature[arg] = types.get(arg, "*fp32" if arg.endswith("_ptr") else "fp32" if arg.endswith("eps") else "i32")
    source = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": 4})
    ptx = compiled.asm["ptx"]
    assert re.search(r"^\.target (\S+)", ptx, re.MULTILINE).group(1) == ARCHS[capability][0]
    assert len(compiled.asm["cubin"]) > 0
    if name.startswith("decode_attention._split"):  # 16-head tiles: mma rows
        assert "mma.sync" in ptx, f"{name} on {ARCHS[capability][0]}: no mma"
    if name in TENSOR_CORE_KERNELS:
        assert ARCHS[capability][1] in ptx, f"{name} on {ARCHS[capability][0]}: no {ARCHS[capability][1]}"


def _bf16_source(fn, constants: dict, divisible, floats: tuple[str, ...] = ()) -> ASTSource:
    """``fn`` with bf16 pointers, fp32 ``floats``, i32 other scalars and ``constants``; the arguments ``divisible``
    accepts marked divisible by 16, as Triton's JIT marks them on the preset's shapes."""
    signature, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if i in fn.constexprs:
            signature[arg] = "constexpr"
            continue
        signature[arg] = "*bf16" if arg.endswith("_ptr") else "fp32" if arg in floats else "i32"
        if divisible(arg):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()},
                     attrs=attrs)


@pytest.mark.parametrize("capability", sorted(ARCHS))
def test_rope_in_place_moves_the_rotary_channels_as_16_byte_vectors(capability):
    """``apply_rope_`` reads and writes each row's 64 rotary channels as contiguous runs, split into even / odd
    lanes in registers: 16-byte vector accesses, never two-byte scalars (even and odd channels loaded with
    stride 2 run far below the copy bandwidth). Divisibility as the
    JIT sees the preset's shapes (pointers, the row width and the pass-through width multiples of 16)."""
    from deepinfer_nvidia_sm100.kernels import rope

    source = _bf16_source(rope._rope_kernel, {"BLOCK_R": 16, "NOPE_P2": 1, "HALF_P2": 32, "COPY": False},
                          divisible=lambda arg: arg.endswith("_ptr") or arg in ("DIM", "NOPE", "HALF"),
                          floats=("sign",))
    ptx = triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": 4}).asm["ptx"]
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx
    assert "ld.global.b16" not in ptx and "st.global.b16" not in ptx


@pytest.mark.parametrize("capability", sorted(ARCHS))
def test_gemv_row_kernel_reads_the_weight_in_16_byte_vectors(capability):
    """The one-row GEMV (``kernels/gemv.py``) is bound by reading the weight: with the 16-byte divisibility Triton's
    JIT sees on the preset's shapes, every global load is a 16-byte vector, never a scalar or 2-byte load."""
    from deepinfer_nvidia_sm100.kernels import gemv

    config = gemv.row_config(4160, 4096)
    constants = {"BLOCK_N": config.block_n, "BLOCK_K": config.block_k, "EVEN": True}
    source = _bf16_source(gemv._gemv_row_kernel, constants, divisible=lambda arg: True)
    ptx = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                         options={"num_warps": config.warps, "num_stages": config.stages}).asm["ptx"]
    loads = re.findall(r"ld\.global\S*", ptx)
    assert loads and all(".v4.b32" in load for load in loads), loads


@pytest.mark.parametrize("capability", sorted(ARCHS))
def test_pdl_kernels_wait_for_their_predecessor_before_any_load(capability):
    """``PDL=True`` (``kernels/pdl.py``): the kernel waits on its predecessor (``griddepcontrol.wait``) before its
    first global load and lets its successor launch; ``PDL=False`` emits neither."""
    from deepinfer_nvidia_sm100.kernels import norm

    for on in (False, True):
        constants = {"ROWS": 1, "BLOCK_D": 4096, "WEIGHTED": True, "ROPE": False, "PDL": on}
        ptx = triton.compile(_bf16_source(norm._rms_norm_kernel, constants, divisible=lambda arg: True),
                             target=GPUTarget("cuda", capability, 32), options={"num_warps": 4}).asm["ptx"]
        if not on:
            assert "griddepcontrol" not in ptx
            continue
        assert "griddepcontrol.launch_dependents" in ptx
        assert 0 <= ptx.index("griddepcontrol.wait") < ptx.index("ld.global")

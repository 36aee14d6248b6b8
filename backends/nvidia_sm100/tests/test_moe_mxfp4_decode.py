"""The MXFP4 decode-size expert kernels (``kernels/moe_mxfp4_decode.py``) and their word decode
(``dequant.mxfp4_word_codes``) against the reference op and ``deepinfer_core.quant.mxfp4``: on the GPU where there is
one (every ``DECODE``, bf16), without one in a child pytest under Triton's interpreter (the float32 decode with
float32 / fp16 activations: the fragment order, the row order and the epilogues); and compiled for sm_90a / sm_100a
with the inline PTX (ptxas checks it), reaching the tensor cores with the weights in registers and without
spilling."""

from __future__ import annotations

import re

import pytest
import torch

triton = pytest.importorskip("triton", reason="the test extra installs triton")
import triton.language as tl
from deepinfer_nvidia_sm100.kernels import dequant, moe_mxfp4_decode, moe_quant
from interpreted import DEVICE, kernel_runs_here, run_under_interpreter, starts_the_interpreter

from deepinfer_core.ops import reference as ref
from deepinfer_core.quant import mxfp4

EXTREME_SCALES = (0, 1, 100, 126, 127, 128, 129, 253, 254, 255)  # ue8m0 bytes: 2^-127 (subnormal) ... 2^127, NaN
DECODES = [moe_mxfp4_decode.FLOAT32] + ([moe_mxfp4_decode.PORTABLE, moe_mxfp4_decode.PTX] if DEVICE == "cuda" else [])
DTYPES = [torch.float32, torch.bfloat16 if DEVICE == "cuda" else torch.float16]


@starts_the_interpreter
def test_kernels_under_triton_interpreter():
    run_under_interpreter(__file__, also_deselect="bf16_decode or inline_ptx or fewer_instructions or compile or "
                                                  "issue_fewer")


@triton.jit
def _decode_kernel(words_ptr, scale_ptr, out_ptr, PTX: tl.constexpr):
    """Row ``program_id`` of ``[rows, 64]`` int32 words with one scale byte per row -> its ``[rows, 64, 8]`` bf16
    weights (code ``i`` of word ``w`` at ``[w, i]``)."""
    row = tl.program_id(0)
    w = tl.arange(0, 64)
    words = tl.load(words_ptr + row * 64 + w)
    scale = dequant.ue8m0(tl.load(scale_ptr + row + w * 0)).to(tl.bfloat16)
    if PTX:
        codes = dequant.mxfp4_word_codes(words, scale)
    else:
        codes = dequant.mxfp4_word_values(words, scale)
    for i in tl.static_range(8):
        tl.store(out_ptr + row * 512 + w * 8 + i, codes[i])


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 bit casts need a GPU (Triton's interpreter has no bf16)")
@pytest.mark.parametrize("ptx", [False, True])
def test_mxfp4_bf16_decode_is_exact_on_every_code_and_scale_byte(ptx):
    """All 256 bytes (16 x 16 code pairs) under extreme scale bytes decode to ``mxfp4.dequantize``'s weights rounded
    to bf16 (exact: a code times a power of two fits bf16; 2 x 2^127 and up overflow to inf, byte 255 is NaN)."""
    scales = torch.tensor(EXTREME_SCALES, dtype=torch.uint8, device=DEVICE)
    packed = torch.arange(256, dtype=torch.uint8, device=DEVICE).repeat(len(scales), 1)  # [rows, 256]
    got = torch.empty(len(scales), 512, dtype=torch.bfloat16, device=DEVICE)
    _decode_kernel[(len(scales),)](packed.view(torch.int32), scales, got, PTX=ptx)
    want = mxfp4.dequantize(packed, scales[:, None].repeat(1, 512 // mxfp4.GROUP).view(torch.float8_e8m0fnu))
    want = want.to(torch.bfloat16)  # [rows, 512]
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite]) and torch.equal(got.signbit()[finite], want.signbit()[finite])


def _experts(E: int, D: int, I: int, gen: torch.Generator):
    stored = []
    for rows, cols in ((I, D), (D, I), (I, D)):
        stored += mxfp4.quantize(torch.randn(E, rows, cols, device=DEVICE, generator=gen) * cols**-0.5)
    return stored


def _case(T: int, E: int, top_k: int, D: int, I: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(T, D, device=DEVICE, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, device=DEVICE, generator=gen)[:top_k] for _ in range(T)])
    if T > 1:
        ids[1, -1] = ids[1, 0]  # one token picks an expert twice (hash routing can)
    return x, ids, torch.rand(T, top_k, device=DEVICE, generator=gen), _experts(E, D, I, gen)


def _tol(dtype: torch.dtype) -> dict:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@kernel_runs_here
@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, E, top_k, D, I, launch", [
    (1, 4, 3, 128, 128, (16, 128, 2)),  # one token, one step over each width
    (5, 4, 2, 256, 384, (16, 256, 2)),  # 256 inputs a step over D, 128 over I (384 is not a multiple of 256)
    (40, 4, 2, 128, 256, (64, 128, 2)),  # 20 assignments per expert in 64-row tiles
    (3, 4, 3, 256, 128, (16, 128, 2)),  # two steps over D
    (90, 2, 2, 128, 128, (128, 128, 2)),  # a prefill tile: 90 assignments per expert in 128-row tiles
    (5, 4, 2, 256, 384, (16, 256, 2, 2)),  # two weight tiles a program: 64 columns of I, 128 of D
    (90, 2, 2, 128, 128, (128, 128, 2, 2)),  # the same at a prefill tile
])
def test_decode_kernels_match_reference(T, E, top_k, D, I, launch, dtype, decode):
    if decode != moe_mxfp4_decode.FLOAT32 and dtype != torch.bfloat16:
        pytest.skip("the bf16 decodes take bf16 activations")
    x, ids, weights, stored = _case(T, E, top_k, D, I, dtype, seed=T + D)
    raw = [t.view(torch.uint8) for t in stored]
    got = moe_mxfp4_decode.run(x, ids, weights, *raw, 0.7, launch=launch, decode=decode)
    want = ref.moe_experts_mxfp4(x, ids, weights, *stored, 0.7)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, **_tol(dtype))


@kernel_runs_here
def test_decode_kernels_held_to_fewer_registers_match_reference():
    """``max_registers`` (``maxnreg``) changes how the kernels are compiled, not what they compute."""
    dtype = DTYPES[-1]
    x, ids, weights, stored = _case(5, 4, 2, 256, 384, dtype, seed=3)
    got = moe_mxfp4_decode.run(x, ids, weights, *(t.view(torch.uint8) for t in stored), 0.7, (16, 128, 2, 2),
                               max_registers=168)
    torch.testing.assert_close(got, ref.moe_experts_mxfp4(x, ids, weights, *stored, 0.7), **_tol(dtype))


def test_up_decode_kernel_compiles_to_three_programs_an_sm_at_168_registers():
    """Static, sm_90a: the up kernel's decode launch (two subtiles) held to 168 registers compiles without spilling,
    so an SM holds three of its programs instead of two (``MAX_REGISTERS``' candidate; sm_100a spills there)."""
    import triton
    from deepinfer_nvidia_sm100.kernels import aot
    from test_quant_compile import _weights

    block_m, block_k, stages, subtiles = moe_mxfp4_decode.TILES["decode"][1]
    constants = {"BLOCK_M": block_m, "BLOCK_K": block_k, "DECODE": moe_mxfp4_decode.PTX, "PRECISION": "tf32",
                 "SUBTILES": subtiles}
    types = _weights(moe_quant.MXFP4, ("1", "2", "3")) | {f"w{i}_ptr": "*i32" for i in "123"}
    compiled = triton.compile(aot.divisible_source(moe_mxfp4_decode._up_kernel, types, constants),
                              target=aot.GPUTarget("cuda", 90, 32),
                              options={"num_warps": moe_mxfp4_decode.WARPS, "num_stages": stages, "maxnreg": 168})
    cubin = compiled.asm["cubin"]
    assert aot.registers(cubin) <= 168 and "ld.local" not in compiled.asm["ptx"]
    assert aot.loop_census(aot.disassemble(cubin))[1] == 0  # no spill loads / stores
    assert aot.resident_warps(aot.registers(cubin), moe_mxfp4_decode.WARPS) >= 12


@kernel_runs_here
@pytest.mark.parametrize("T", [1, 6, 40])
def test_mxfp4_op_takes_the_decode_kernels_up_to_the_bound(T, monkeypatch):
    """``moe_experts_mxfp4`` runs these kernels from two tokens up to ``MAX_PER_EXPERT`` assignments per expert, else
    ``moe_quant``'s (one token: its row kernels): either way the reference's result."""
    monkeypatch.setattr(moe_mxfp4_decode, "MAX_PER_EXPERT", 16)
    dtype = DTYPES[-1]
    x, ids, weights, stored = _case(T, 4, 2, 128, 128, dtype, seed=T)
    w1, w2, w3 = stored[0], stored[2], stored[4]
    assert moe_mxfp4_decode.used(T, T * 2, x, w1, w2, w3) == (1 < T and T * 2 <= 16 * 4)
    assert not moe_mxfp4_decode.used(T, T * 2, x[:, :96], w1[:, :, :48], w2[:, :96], w3[:, :, :48])  # D = 96
    shifted = torch.empty(w1.numel() + 1, dtype=w1.dtype, device=DEVICE)[1:].view(w1.shape)  # storage offset 1
    assert not moe_mxfp4_decode.used(T, T * 2, x, shifted.copy_(w1), w2, w3)  # not readable as int32 words
    got = moe_quant.moe_experts_mxfp4(x, ids, weights, *stored, 0.7)
    torch.testing.assert_close(got, ref.moe_experts_mxfp4(x, ids, weights, *stored, 0.7), **_tol(dtype))


def test_fragment_order_places_each_input():
    """``fragment_order`` puts input ``32 q + 16 h + 8 e + s`` of every 128 at column ``16 s + 8 h + 2 q + e`` (the
    next test: ``fragment_column``, the up kernel's ``h`` columns, is its inverse)."""
    t = torch.arange(256).reshape(1, 256)
    got = moe_mxfp4_decode.fragment_order(t)[0]
    for p in (0, 1, 7, 8, 16, 31, 32, 100, 127, 128, 255):
        q, h, e, s = p % 128 // 32, p // 16 % 2, p // 8 % 2, p % 8
        assert got[p // 128 * 128 + 16 * s + 8 * h + 2 * q + e] == p
    assert sorted(got.tolist()) == list(range(256))
    assert moe_mxfp4_decode.tile(64 * 6, 64) == moe_mxfp4_decode.TILES["decode"][1]


@kernel_runs_here
def test_fragment_column_is_the_inverse_of_fragment_order():
    cols = torch.empty(256, dtype=torch.int32, device=DEVICE)
    _columns_kernel[(1,)](cols)
    assert moe_mxfp4_decode.fragment_order(torch.arange(256, device=DEVICE).reshape(1, 256))[0][cols.long()].tolist() \
        == list(range(256))


@triton.jit
def _columns_kernel(out_ptr):
    n = tl.arange(0, 256)
    tl.store(out_ptr + n, moe_mxfp4_decode.fragment_column(n))


@pytest.mark.parametrize("capability", [90, 100])
@pytest.mark.parametrize("subtiles", [1, 2])
@pytest.mark.parametrize("tile_name", sorted(moe_mxfp4_decode.TILES))
@pytest.mark.parametrize("kernel", ["_up_kernel", "_down_kernel"])
def test_decode_kernels_compile_with_the_inline_ptx(kernel, tile_name, subtiles, capability):
    """Each ``TILES`` launch, with one and two weight tiles a program,
    compiles for sm_90a / sm_100a with the PTX decode (ptxas accepts the inline assembly), multiplies on the tensor
    cores and keeps its registers (no local-memory spills)."""
    from deepinfer_nvidia_sm100.kernels import aot
    from test_quant_compile import _weights

    block_m, block_k, stages, *_ = moe_mxfp4_decode.TILES[tile_name][1]
    constants = {"BLOCK_M": block_m, "BLOCK_K": block_k, "DECODE": moe_mxfp4_decode.PTX, "PRECISION": "tf32",
                 "SUBTILES": subtiles}
    types = _weights(moe_quant.MXFP4, ("1", "2", "3")) | {f"w{i}_ptr": "*i32" for i in "123"}
    ptx = aot.compile_divisible(getattr(moe_mxfp4_decode, kernel), types, constants, capability,
                                moe_mxfp4_decode.WARPS, stages).asm["ptx"]  # as the JIT sees the preset
    assert "mul.rn.bf16x2" in ptx, f"{kernel} {tile_name}: no bf16x2 decode"
    assert "ld.local" not in ptx and "st.local" not in ptx, f"{kernel} {tile_name}: registers spill"
    if capability == 90:  # the expanded weights feed wgmma from registers: none goes through shared memory
        assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16 \{[^}]*\}, \{%r", ptx), kernel
        assert "ldmatrix" not in ptx, f"{kernel} {tile_name}: weights through shared memory"  # (stmatrix: epilogue)


@pytest.mark.parametrize("capability", [90, 100])
@pytest.mark.parametrize("tile", [moe_quant.ROW_TILES[moe_quant.MXFP4], (8, 2048, 2, 1)])  # (8, ...): rows a thread
@pytest.mark.parametrize("kernel", ["_up_row_kernel", "_down_row_kernel"])
def test_one_token_row_kernels_compile_with_the_inline_ptx(kernel, tile, capability):
    """``moe_quant``'s one-token MXFP4 row kernels with ``PTX`` (``moe_quant.ROW_DECODE_PTX``: the codes decoded and
    multiplied by ``dequant.mxfp4_row_sums``) compile for sm_90a / sm_100a without spilling, at the default tile and
    at one whose slice gives each thread several rows of one scale group."""
    from test_quant_compile import _compile, _weights

    block_n, block_k, warps, stages = tile
    constants = {"BLOCK_N": block_n, "BLOCK_K": block_k, "FMT": moe_quant.MXFP4, "B0": 1, "B1": 32, "UE8M0": True,
                 "PTX": True} | ({"K_P2": 8} if kernel == "_down_row_kernel" else {})
    ptx = _compile(getattr(moe_quant, kernel), _weights(moe_quant.MXFP4, ("1", "2", "3")), constants, capability,
                   warps, stages)
    assert "prmt.b32 t" in ptx and "ld.local" not in ptx, f"{kernel}: no PTX decode, or registers spill"


def _loop_instructions_per_weight(fn, constants: dict, warps: int, stages: int, weights: int) -> tuple[float, int]:
    """(instructions of ``fn``'s K loop per expanded weight on sm_90a, spill loads / stores): ``aot.loop_census``."""
    from deepinfer_nvidia_sm100.kernels import aot
    from test_quant_compile import _weights

    types = _weights(moe_quant.MXFP4, ("1", "2", "3"))
    if fn in (moe_mxfp4_decode._up_kernel, moe_mxfp4_decode._down_kernel):
        types |= {f"w{i}_ptr": "*i32" for i in "123"}
    compiled = aot.compile_divisible(fn, types, constants, 90, warps, stages)
    counts, spills = aot.loop_census(aot.disassemble(compiled.asm["cubin"]))
    return sum(counts.values()) * warps * 32 / weights, spills


@pytest.mark.parametrize("kernel, matrices", [("_up_kernel", 2), ("_down_kernel", 1)])
def test_decode_tile_expands_a_weight_in_fewer_instructions_than_the_grouped_kernels(kernel, matrices):
    """Static count on sm_90a (``benchmarks/sass_census.py``): the decode tile's K loop issues under 5 instructions
    per expanded weight, under four fifths of ``moe_quant``'s ``tl.dot_scaled`` decode tile (Triton 3.6: 4.2 /
    4.1 against 8.6 / 9.6; 3.9: 4.5 / 3.8 against 6.4 / 7.1), without spilling: the expansion, which bounds MXFP4
    experts at decode sizes, costs about half of what it did."""
    block_m, block_k, stages, *_ = moe_mxfp4_decode.TILES["decode"][1]
    new, spills = _loop_instructions_per_weight(
        getattr(moe_mxfp4_decode, kernel), {"BLOCK_M": block_m, "BLOCK_K": block_k, "DECODE": moe_mxfp4_decode.PTX,
                                            "PRECISION": "tf32"}, moe_mxfp4_decode.WARPS, stages,
        moe_mxfp4_decode.TILE_ROWS * block_k)
    bm, bn, bk, warps = moe_quant.TILES["decode"][1]
    old, _ = _loop_instructions_per_weight(
        getattr(moe_quant, kernel), {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "FMT": moe_quant.MXFP4, "B0": 1,
                                     "B1": 32, "UE8M0": True, "PRECISION": "tf32", "SCALED": True, "SWAP": False,
                                     "GROUP_M": 1}, warps, 3, bn * bk * matrices)
    assert new < 5 and new < 0.8 * old and spills == 0, (new, old, spills)


@pytest.mark.parametrize("kernel", ["_up_kernel", "_down_kernel"])
def test_two_subtiles_expand_a_weight_in_fewer_instructions(kernel):
    """Static count on sm_90a: two 64-row weight tiles a program share each K step's fixed instructions (activation
    tile, addresses, barriers), so at the decode tile their loop issues fewer instructions per weight than one
    tile's (up / down, Triton 3.6: 3.95 / 3.95 against 4.41 / 4.33; 3.9: 4.27 / 3.90 against 4.56 / 4.10), without
    spilling. (At the 128-row prefill tile Triton 3.9 spills the up kernel's two epilogues; 3.6 does not.)"""
    block_m, block_k, stages, *_ = moe_mxfp4_decode.TILES["decode"][1]
    per_weight = {}
    for subtiles in (1, 2):
        constants = {"BLOCK_M": block_m, "BLOCK_K": block_k, "DECODE": moe_mxfp4_decode.PTX, "PRECISION": "tf32",
                     "SUBTILES": subtiles}
        per_weight[subtiles], spills = _loop_instructions_per_weight(
            getattr(moe_mxfp4_decode, kernel), constants, moe_mxfp4_decode.WARPS, stages,
            moe_mxfp4_decode.TILE_ROWS * subtiles * block_k)
        assert spills == 0, (subtiles, spills)
    assert per_weight[2] < per_weight[1], per_weight


@pytest.mark.parametrize("kernel, matrices", [("_up_row_kernel", 2), ("_down_row_kernel", 1)])
def test_row_kernels_with_rows_a_thread_issue_fewer_instructions_a_weight(kernel, matrices):
    """Static count on sm_90a of the one-token row kernels (``mxfp4_row_sums``): a slice that gives each thread
    several rows of one scale group (8, 2048, 2, 1) shares the inputs' loads and conversion between the rows, so
    its loop issues fewer instructions a weight than the default tile's (Triton 3.9: 5.04 / 5.97 against 5.83 /
    8.69 up / down; the codes-PTX kernels before: 7.12 / 9.94 at the default tile), without spilling."""
    per_weight = {}
    for tile in (moe_quant.ROW_TILES[moe_quant.MXFP4], (8, 2048, 2, 1)):
        block_n, block_k, warps, stages = tile
        constants = {"BLOCK_N": block_n, "BLOCK_K": block_k, "FMT": moe_quant.MXFP4, "B0": 1, "B1": 32,
                     "UE8M0": True, "PTX": True} | ({"K_P2": 8} if kernel == "_down_row_kernel" else {})
        per_weight[tile], spills = _loop_instructions_per_weight(getattr(moe_quant, kernel), constants,
                                                                 warps, stages, block_n * block_k * matrices)
        assert spills == 0, (tile, spills)
    default, rows_a_thread = per_weight.values()
    assert rows_a_thread < default, per_weight


def test_run_refuses_launches_it_cannot_take():
    """Subtiles other than one or two, or a fifth element (the K splits this op no longer has), name the launch."""
    x, ids, weights, stored = _case(2, 4, 2, 128, 128, torch.float32, seed=0)
    raw = [t.view(torch.uint8) for t in stored]
    for launch in ((16, 128, 2, 3), (16, 128, 2, 1, 4)):
        with pytest.raises(ValueError, match=re.escape(f"subtiles 1 or 2]), got {launch}")):
            moe_mxfp4_decode.run(x, ids, weights, *raw, 0.7, launch=launch)

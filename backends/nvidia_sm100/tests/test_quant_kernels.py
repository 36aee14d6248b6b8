"""The quantized-weight kernels (``kernels/dequant.py``, ``moe_quant.py``, ``fp8_linear.py``) against the reference
ops and ``deepinfer_core.quant``'s exact dequantization. On the GPU where there is one; without, in a child pytest
process under Triton's interpreter (as test_triton_kernels.py: ``TRITON_INTERPRET=1`` must be set before Triton is
imported). Tiny shapes with partial tiles and partial scale blocks; fp32 runs compare to 1e-5 (the decode is
exact, only fp32 sums differ), 16-bit ones to the reference's own rounding. The interpreter multiplies bf16
``tl.dot`` tiles wrongly (numpy has no bf16), so dot kernels run fp16 there and bf16 on the GPU."""

from __future__ import annotations

from functools import partial

import pytest
import torch

pytest.importorskip("triton", reason="the test extra installs triton")
from deepinfer_nvidia_sm100.kernels import dequant, fp8_linear, k_splits, moe, moe_mxfp4_prefill, moe_quant
from interpreted import DEVICE, kernel_runs_here, run_under_interpreter, starts_the_interpreter

from deepinfer_core.ops import reference as ref
from deepinfer_core.quant import fp8_block, mxfp4

DOT_DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16
# bf16 runs too for MXFP4 on the interpreter: its grouped kernels take tl.dot_scaled there (which the interpreter
# multiplies right: it widens bf16 itself) and its one-token kernels have no dot; the interpreter rounds float32 to
# bf16 toward zero, so its bf16 results sit ~1e-2 from the reference's, inside the 16-bit tolerance
MXFP4_DTYPES = list(dict.fromkeys([torch.float32, DOT_DTYPE, torch.bfloat16]))
EXTREME_SCALES = (0, 1, 126, 127, 128, 253, 254, 255)  # ue8m0 bytes: 2^-127 (subnormal) ... 2^127, NaN


@starts_the_interpreter
def test_kernels_under_triton_interpreter():
    run_under_interpreter(__file__)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _tol(dtype: torch.dtype) -> dict:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@kernel_runs_here
def test_mxfp4_decode_is_exact_on_every_code_and_scale_byte():
    """Every byte value (all 16 x 16 pairs of e2m1 codes, low nibble first) under every extreme ue8m0 byte, decoded
    by the helpers the GEMM kernels use, equals ``mxfp4.dequantize`` bit for bit: signed zeros, 2^-127 (byte 0),
    2^127 (byte 254; 2 x 2^127 and up overflow to inf as in float32), NaN (byte 255)."""
    packed = torch.arange(256, dtype=torch.uint8, device=DEVICE).repeat(len(EXTREME_SCALES), 1)  # [8, 256]
    scale = torch.tensor(EXTREME_SCALES, dtype=torch.uint8, device=DEVICE)[:, None].repeat(1, 512 // mxfp4.GROUP)
    got = dequant.dequantize_mxfp4(packed.view(torch.int8), scale.view(torch.float8_e8m0fnu))
    want = mxfp4.dequantize(packed, scale.view(torch.float8_e8m0fnu))
    assert got.shape == want.shape == (len(EXTREME_SCALES), 512) and got.dtype == torch.float32
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite]) and torch.equal(got.signbit()[finite], want.signbit()[finite])
    codes = torch.arange(16, device=DEVICE)
    one = dequant.dequantize_mxfp4(codes.to(torch.uint8)[None, :] | (codes.to(torch.uint8)[None, :] << 4),
                                   torch.full((1, 1), 127, dtype=torch.uint8, device=DEVICE).view(torch.float8_e8m0fnu))
    magnitudes = torch.tensor(mxfp4.E2M1_MAGNITUDES, device=DEVICE)
    assert torch.equal(one[0, 0::2], torch.cat([magnitudes, -magnitudes]))  # the e2m1 table, code by code


@kernel_runs_here
@pytest.mark.parametrize("block, ue8m0", [((32, 64), True), ((16, 16), False), ((128, 128), True)])
def test_fp8_block_decode_is_exact(block, ue8m0):
    """e4m3 weights with partial edge blocks times ue8m0 (the extreme bytes among them) or float32 scales."""
    gen = _gen(block[0])
    weight, scale = fp8_block.quantize(torch.randn(2, 70, 200, device=DEVICE, generator=gen), block, ue8m0)
    if ue8m0:
        extremes = torch.tensor(EXTREME_SCALES[:-1], dtype=torch.uint8, device=DEVICE)
        flat = scale.view(torch.uint8).reshape(-1)
        flat[: extremes.numel()] = extremes[: flat.numel()]
    got = dequant.dequantize_fp8_block(weight, scale, block)
    want = fp8_block.dequantize(weight, scale, block)
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got[want.isfinite()], want[want.isfinite()])


def _experts(fmt: int, E: int, D: int, I: int, gen: torch.Generator, block=(32, 32), ue8m0=True):
    """Random experts quantized as ``fmt``: ``(w1, s1, w2, s2, w3, s3)``."""
    dense = [torch.randn(E, *shape, device=DEVICE, generator=gen) * shape[1] ** -0.5 for shape in ((I, D), (D, I),
                                                                                                    (I, D))]
    pairs = [mxfp4.quantize(w) if fmt == moe_quant.MXFP4 else fp8_block.quantize(w, block, ue8m0) for w in dense]
    return tuple(t for pair in pairs for t in pair)


def _route(T: int, E: int, top_k: int, gen: torch.Generator, repeat: bool = False):
    ids = torch.stack([torch.randperm(E, device=DEVICE, generator=gen)[:top_k] for _ in range(T)])
    if repeat:
        ids[0, -1] = ids[0, 0]  # one token picks an expert twice (hash routing can)
    return ids, torch.rand(T, top_k, device=DEVICE, generator=gen)


@kernel_runs_here
@pytest.mark.parametrize("dtype", MXFP4_DTYPES)
@pytest.mark.parametrize("T, E, top_k, D, I", [
    (1, 8, 3, 96, 64),  # one token: the row kernels, a K slice past D and past I
    (5, 4, 2, 160, 64),  # the 16-row tiles, a K tile past D
    (40, 4, 2, 64, 96),  # 20 assignments per expert: the 64-row tiles, a column tile past I
    (300, 2, 2, 64, 32)])  # 300 per expert: the 128-row tiles
def test_moe_experts_mxfp4_matches_reference(T, E, top_k, D, I, dtype, monkeypatch):
    monkeypatch.setenv("DEEPINFER_NVIDIA_MXFP4_FP8_MIN_PER_EXPERT", "0")  # the fp8 prefill path: test_quant_prefill.py
    gen = _gen(T + D)
    x = torch.randn(T, D, device=DEVICE, generator=gen).to(dtype)
    ids, weights = _route(T, E, top_k, gen, repeat=True)
    stored = _experts(moe_quant.MXFP4, E, D, I, gen)
    got = moe_quant.moe_experts_mxfp4(x, ids, weights, *stored, 0.7)
    want = ref.moe_experts_mxfp4(x, ids, weights, *stored, 0.7)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, **_tol(dtype))


@kernel_runs_here
@pytest.mark.parametrize("fmt, dtype", [(moe_quant.MXFP4, dtype) for dtype in MXFP4_DTYPES]
                         + [(moe_quant.FP8, torch.float32), (moe_quant.FP8, DOT_DTYPE)])
def test_one_token_through_the_grouped_kernels_matches_reference(fmt, dtype):
    """``ONE_TOKEN_ROW_KERNELS = False``'s path: one token aligned into a 16-row tile (the weights on the left)."""
    gen = _gen(11)
    E, top_k, D, I = 4, 3, 96, 64
    x = torch.randn(1, D, device=DEVICE, generator=gen).to(dtype)
    ids, weights = _route(1, E, top_k, gen)
    block = moe_quant.MXFP4_BLOCK if fmt == moe_quant.MXFP4 else (32, 32)
    stored = _experts(fmt, E, D, I, gen)
    got = moe_quant._run(fmt, x, ids, weights, *stored, block, 0.7, row_kernels=False)
    reference = ref.moe_experts_mxfp4 if fmt == moe_quant.MXFP4 else partial(ref.moe_experts_fp8_block, block=block)
    torch.testing.assert_close(got, reference(x, ids, weights, *stored, limit=0.7), **_tol(dtype))


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.float32, DOT_DTYPE])
@pytest.mark.parametrize("T, block, ue8m0", [(1, (32, 32), True), (1, (16, 64), False), (7, (32, 32), False),
                                              (40, (16, 64), True)])
def test_moe_experts_fp8_block_matches_reference(T, block, ue8m0, dtype):
    """fp8 experts with ue8m0 and float32 scales, widths that leave partial scale blocks (100, 70)."""
    gen = _gen(T)
    E, top_k, D, I = 4, 2, 100, 70
    x = torch.randn(T, D, device=DEVICE, generator=gen).to(dtype)
    ids, weights = _route(T, E, top_k, gen)
    stored = _experts(moe_quant.FP8, E, D, I, gen, block, ue8m0)
    got = moe_quant.moe_experts_fp8_block(x, ids, weights, *stored, block, 0.7)
    want = ref.moe_experts_fp8_block(x, ids, weights, *stored, block, 0.7)
    torch.testing.assert_close(got, want, **_tol(dtype))


@kernel_runs_here
@pytest.mark.parametrize("T", [1, 6])
def test_moe_experts_mxfp4_decodes_extreme_scales_inside_the_gemm(T):
    """Input group 0 of every expert row scaled by 2^-127 (byte 0) and group 1 by 2^127 (byte 254, codes of
    magnitude <= 1.5), the inputs of those groups 2^124 and 2^-124 so that the products stay finite: the grouped
    and the one-token kernels (fp32) decode them as the reference does."""
    gen = _gen(T)
    E, top_k, D, I = 4, 2, 96, 64
    ids, weights = _route(T, E, top_k, gen)
    w1, s1, w2, s2, w3, s3 = _experts(moe_quant.MXFP4, E, D, I, gen)
    for packed, scale in ((w1, s1), (w3, s3)):
        scale.view(torch.uint8)[..., 0] = 0
        scale.view(torch.uint8)[..., 1] = 254
        group = packed.view(torch.uint8)[..., 16:32]
        group &= 0xBB  # codes 0-3 and 8-11: magnitudes <= 1.5 (6 x 2^127 would overflow)
    x = torch.randn(T, D, device=DEVICE, generator=gen)
    x[:, :32] *= 2.0**124
    x[:, 32:64] *= 2.0**-124
    got = moe_quant.moe_experts_mxfp4(x, ids, weights, w1, s1, w2, s2, w3, s3, 20.0)
    want = ref.moe_experts_mxfp4(x, ids, weights, w1, s1, w2, s2, w3, s3, 20.0)
    assert want.isfinite().all() and want.abs().max() > 1e-3
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # fp32 sums of terms up to ~40 (a decode error: x2)


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.float32, DOT_DTYPE])
@pytest.mark.parametrize("rows, n, k, block, ue8m0", [
    (1, 70, 256, (32, 64), True),  # the row kernel: a column block past N
    (5, 96, 200, (32, 32), False),  # weight-only: K not a multiple of the block
    (3, 64, 96, (16, 16), True),  # 16-wide blocks (no tensor-core kernel for them)
])
def test_fp8_linear_weight_only_matches_reference(rows, n, k, block, ue8m0, dtype):
    gen = _gen(rows + n)
    x = torch.randn(2, rows, k, device=DEVICE, generator=gen).to(dtype)  # leading dims kept
    weight, scale = fp8_block.quantize(torch.randn(n, k, device=DEVICE, generator=gen) * k**-0.5, block, ue8m0)
    assert fp8_linear.linear_path(2 * rows, dtype, block) == fp8_linear.SPLIT_K
    one_row = fp8_linear.ROW if fp8_linear.ROW_MAX_ROWS else fp8_linear.SPLIT_K
    assert fp8_linear.linear_path(1, dtype, block) == one_row
    want = ref.linear_fp8_block(x, weight, scale, block)
    got = fp8_linear.linear_fp8_block(x, weight, scale, block)
    assert got.shape == want.shape == (2, rows, n) and got.dtype == dtype
    torch.testing.assert_close(got, want, **_tol(dtype))
    flat = x.reshape(2 * rows, 1, k)
    weight_only = fp8_linear.matmul(flat, weight, scale, block, path=fp8_linear.WEIGHT_ONLY)
    torch.testing.assert_close(weight_only.view(2, rows, n), want, **_tol(dtype))
    one = fp8_linear.linear_fp8_block(x[:1, :1], weight, scale, block)  # one row: the row kernel
    torch.testing.assert_close(one, ref.linear_fp8_block(x[:1, :1], weight, scale, block), **_tol(dtype))


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.float32, DOT_DTYPE])
@pytest.mark.parametrize("n, k, groups, tile, splits", [
    (70, 1000, 1, (16, 128, 4, 2, 3), 3),  # 3 K splits of 384 inputs (3 slices), the last partial
    (3, 1000, 2, (1, 512, 4, 2, 2), 2),  # one row a program, K split in two
])
def test_fp8_row_kernel_split_matches_reference(n, k, groups, tile, splits, dtype):
    """The one-row kernel with K split (the tile's fifth element), each split's float32 sums added in split order by
    ``_sum_splits_kernel``: the reference op's result up to fp32 sums."""
    gen = _gen(n + k)
    block = (16, 128)
    x = torch.randn(1, groups, k, device=DEVICE, generator=gen).to(dtype)
    weight, scale = fp8_block.quantize(torch.randn(groups * n, k, device=DEVICE, generator=gen) * k**-0.5, block,
                                       True)
    launch, got_splits, per_split = fp8_linear._row_launch(n, k, groups, tile)
    assert launch == tile[:4] and got_splits == splits and (splits - 1) * per_split < k <= splits * per_split
    got = fp8_linear.matmul(x, weight, scale, block, groups, fp8_linear.ROW, tile)
    dense = fp8_block.dequantize(weight, scale, block).view(groups, n, k)  # the weights exactly
    want = torch.einsum("tgk,gnk->tgn", x.float(), dense)
    torch.testing.assert_close(got.float(), want, **_tol(dtype))


def test_row_launch_trades_inputs_for_rows_on_short_k():
    """``ROW_TILE``'s slice halves (its rows double) while it would span twice K: at wq_b's 1,024 inputs 16 rows of
    1,024, at the preset's 4,096 and 8,192 the tile as set, one split; never more rows than the output has."""
    block_n, block_k, warps, stages = fp8_linear.ROW_TILE
    assert block_k >= 1024
    assert fp8_linear._row_launch(32768, 1024, 1, None)[:2] == ((block_n * block_k // 1024, 1024, warps, stages), 1)
    for k in (4096, 8192):
        assert fp8_linear._row_launch(4096, k, 8, None)[:2] == (fp8_linear.ROW_TILE, 1)
    assert fp8_linear._row_launch(16, 64, 2, None)[0][0] == 16


@kernel_runs_here
@pytest.mark.parametrize("tile", [(4, 64, 4, 1), (4, 128, 4, 1), (8, 64, 4, 1), (16, 32, 4, 1), (4, 1024, 4, 3)])
def test_one_token_mxfp4_rows_at_any_tile_match_reference(tile):
    """bf16 MXFP4 rows at tiles that give each thread 1-2 packed bytes of a slice (Triton decodes them: the PTX
    row sums need ``PTX_MIN_BYTES_A_THREAD``) and at the default (16 bytes: the PTX on a GPU): the reference's
    result, slices past ``D`` and ``I`` included."""
    gen = _gen(29)
    E, top_k, D, I = 8, 3, 96, 128
    x = torch.randn(1, D, device=DEVICE, generator=gen).to(torch.bfloat16)
    ids, weights = _route(1, E, top_k, gen, repeat=True)
    stored = _experts(moe_quant.MXFP4, E, D, I, gen)
    block_n, block_k, warps, _ = tile
    assert moe_quant.row_sums_ptx(x, block_n, block_k, warps) == (DEVICE == "cuda" and block_k == 1024)
    got = moe_quant._run(moe_quant.MXFP4, x, ids, weights, *stored, moe_quant.MXFP4_BLOCK, 0.7, tile)
    want = ref.moe_experts_mxfp4(x, ids, weights, *stored, 0.7)
    torch.testing.assert_close(got, want, **_tol(torch.bfloat16))


@kernel_runs_here
@pytest.mark.parametrize("fmt, dtype", [(moe_quant.MXFP4, dtype) for dtype in MXFP4_DTYPES]
                         + [(moe_quant.FP8, torch.float32), (moe_quant.FP8, DOT_DTYPE)])
def test_one_token_down_picks_apart_give_the_same_bits(fmt, dtype, monkeypatch):
    """``PICKS_APART``: one token's down products by pick on programs of their own, added by each column block's
    last program (an expert picked twice, a column block past ``D``): the same bits as one program taking the
    picks in turn, the counters back at zero, the reference op's result."""
    gen = _gen(31)
    E, top_k, D, I = 8, 6, 96, 128
    x = torch.randn(1, D, device=DEVICE, generator=gen).to(dtype)
    ids, weights = _route(1, E, top_k, gen, repeat=True)
    block = moe_quant.MXFP4_BLOCK if fmt == moe_quant.MXFP4 else (32, 32)
    stored = _experts(fmt, E, D, I, gen)
    tile = (16, 64, 4, 1)  # 6 column blocks of D (the last partial), 2 slices of I
    runs = {}
    for apart in (False, True, True):
        monkeypatch.setattr(moe_quant, "PICKS_APART", apart)
        runs.setdefault(apart, []).append(moe_quant._run(fmt, x, ids, weights, *stored, block, 0.7, tile))
    assert all(torch.equal(run, runs[False][0]) for run in runs[True])
    assert not k_splits.arrival_counters(torch.device(DEVICE), 1).any()
    reference = ref.moe_experts_mxfp4 if fmt == moe_quant.MXFP4 else partial(ref.moe_experts_fp8_block, block=block)
    torch.testing.assert_close(runs[True][0], reference(x, ids, weights, *stored, limit=0.7), **_tol(dtype))


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.float32, DOT_DTYPE])
def test_fp8_expert_rows_pipelined_give_the_same_sums(dtype, monkeypatch):
    """``ROW_PIPELINE`` 3 on fp8 experts: the up kernel's K loop pipelined, the down kernel's (pick, slice) steps in
    one pipelined loop crossing from one pick to the next (an expert picked twice, a slice past ``D``): the same bits
    as the unpipelined loops, and the reference op's result."""
    gen = _gen(17)
    E, top_k, D, I = 8, 3, 96, 128
    x = torch.randn(1, D, device=DEVICE, generator=gen).to(dtype)
    ids, weights = _route(1, E, top_k, gen, repeat=True)
    block = (32, 32)
    stored = _experts(moe_quant.FP8, E, D, I, gen)
    tile = (4, 64, 4, 1)  # 2 slices of D (the last partial), 2 of I
    runs = {}
    for stages in (0, 3):
        monkeypatch.setattr(moe_quant, "ROW_PIPELINE", stages)
        assert moe_quant.row_pipeline(moe_quant.FP8) == stages and moe_quant.row_pipeline(moe_quant.MXFP4) == 0
        runs[stages] = moe_quant._run(moe_quant.FP8, x, ids, weights, *stored, block, 0.7, tile)
    assert torch.equal(runs[3], runs[0])
    want = ref.moe_experts_fp8_block(x, ids, weights, *stored, block=block, limit=0.7)
    torch.testing.assert_close(runs[3], want, **_tol(dtype))


SPLIT_K_CASES = [
    (3, 70, 1000, 1, (128, 128), True, (16, 32, 128, 4, 2, 3)),  # 3 K splits, the last one partial; N past a tile
    (5, 96, 200, 1, (32, 32), False, (16, 32, 64, 4, 2, 2)),  # float32 scales, slices of two 32-wide blocks
    (18, 40, 512, 3, (32, 32), True, (16, 16, 32, 4, 2)),  # two row blocks, groups, splits picked (4: few tiles)
    (4, 64, 96, 1, (16, 16), True, (16, 64, 32, 4, 2, 1)),  # 16-wide blocks, one split (the output directly)
    (2, 48, 512, 2, (64, 64), True, (16, 16, 32, 4, 2, 4)),  # a slice inside a block: the scale after the product
]


@kernel_runs_here
@pytest.mark.parametrize("rows, n, k, groups, block, ue8m0, tile, dtype", [
    (*case, dtype) for case in SPLIT_K_CASES for dtype in dict.fromkeys([torch.float32, DOT_DTYPE, torch.bfloat16])
    if DEVICE == "cuda" or dtype != torch.bfloat16 or case[5]])  # the interpreter's bf16 products are wrong
def test_fp8_split_k_kernel_matches_reference(rows, n, k, groups, block, ue8m0, tile, dtype):
    """The split-K kernel: each split's float32 partial summed in split order, by ``_sum_splits_kernel`` or by the
    tile's last split to finish (``SPLITS_MEET``: the same bits; the output written directly for one split); weights decoded to the reference op's own (the product is the
    reference's up to fp32 sums). bf16 rows with ue8m0 blocks multiply as fp16 times a power of two per row (the
    interpreter runs those fp16 products right): rows of very different magnitudes, and an all-zero row, keep
    their own precision."""
    gen = _gen(rows * k)
    x = torch.randn(k, rows, groups, device=DEVICE, generator=gen).permute(1, 2, 0)  # strided rows
    small, large = (1e-3, 1e2) if dtype == torch.float16 else (1e-20, 1e15)  # in the dtype's range
    x[0] *= small
    x[1] *= large
    x[-1] = 0
    x = x.to(dtype)
    weight, scale = fp8_block.quantize(torch.randn(groups * n, k, device=DEVICE, generator=gen) * k**-0.5, block,
                                       ue8m0)
    want = ref.grouped_linear_fp8_block(x, weight, scale, block, groups)
    got = fp8_linear.matmul(x, weight, scale, block, groups, fp8_linear.SPLIT_K, tile)
    assert got.shape == (rows, groups, n) and got.dtype == dtype
    for meet, slots in ((True, k_splits.COUNTERS.slots), (True, 0), (False, k_splits.COUNTERS.slots)):
        with pytest.MonkeyPatch.context() as patch:  # the splits met in the kernel or added by _sum_splits_kernel
            patch.setattr(fp8_linear, "SPLITS_MEET", meet)
            patch.setattr(k_splits.COUNTERS, "slots", slots)  # 0: no counters, the second kernel
            assert torch.equal(fp8_linear.matmul(x, weight, scale, block, groups, fp8_linear.SPLIT_K, tile), got)
    for row in range(rows):  # each row to its own scale
        scale = want[row].float().abs().max().clamp_min(1e-30)
        torch.testing.assert_close(got[row].float() / scale, want[row].float() / scale, **_tol(dtype))
    assert not got[-1].any()
    if len(tile) == 5:
        assert fp8_linear._split_k_launch(rows, n, k, groups, block[1], tile)[1] == 4


def test_fp8_split_k_splits_fill_the_gpu():
    """K is split (powers of two) until the launch has ``MIN_PROGRAMS`` programs, never into parts of fewer than
    ``MIN_SPLIT_STEPS`` slices; each part a whole number of slices."""
    assert fp8_linear._splits(fp8_linear.MIN_PROGRAMS, 8192, 128) == 1
    assert fp8_linear._splits(64, 8192, 128) == 8  # wo_b at 16 rows: 64 column tiles of 64
    assert fp8_linear._splits(1, 1024, 128) == 2  # 8 slices: two parts of 4
    assert fp8_linear._splits(1, 384, 128) == 1
    tile, splits, per_split = fp8_linear._split_k_launch(16, 4096, 8192, 1, 128, None)
    assert splits * per_split >= 8192 > (splits - 1) * per_split and per_split % tile[2] == 0


@kernel_runs_here
def test_fp8_tensor_core_kernel_splits_k():
    """The tensor-core kernel with ``K`` split (forced, and picked for a grid of few tiles) equals its one-split
    result up to the order of fp32 sums, and itself bit for bit however its splits race."""
    gen = _gen(7)
    M, n, k, block = 40, 48, 512, (64, 64)
    x = torch.randn(M, 1, k, device=DEVICE, generator=gen)
    weight, scale = fp8_block.quantize(torch.randn(n, k, device=DEVICE, generator=gen) * k**-0.5, block, True)
    whole = fp8_linear.matmul(x, weight, scale, block, 1, fp8_linear.FP8_TC, (16, 32, 4, 1, 1))
    for tile in ((16, 32, 4, 1, 3), (16, 32, 4, 1)):
        split = fp8_linear.matmul(x, weight, scale, block, 1, fp8_linear.FP8_TC, tile)
        torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)
        for meet in (True, True, True, False):  # met in the kernel (splits racing), or added by a second one
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(fp8_linear, "SPLITS_MEET", meet)
                assert torch.equal(fp8_linear.matmul(x, weight, scale, block, 1, fp8_linear.FP8_TC, tile), split)
    q, s = fp8_block.quantize(x.reshape(M, k), (1, block[1]), ue8m0=False)
    torch.testing.assert_close(whole[:, 0], ref.linear_fp8_block(fp8_block.dequantize(q, s, (1, block[1])), weight,
                                                                 scale, block), atol=1e-4, rtol=1e-4)


@kernel_runs_here
@pytest.mark.parametrize("block, ue8m0, groups, dtype", [
    (block, ue8m0, groups, dtype) for block, ue8m0, groups in (((128, 128), True, 1), ((32, 32), False, 3),
                                                               ((16, 64), True, 2))
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
    if DEVICE == "cuda" or dtype != torch.bfloat16 or ue8m0])  # the interpreter rounds float32 to bf16 toward zero
def test_fp8_dequant_path_decodes_the_reference_weights(block, ue8m0, groups, dtype):
    """Prefill sizes (``DEQUANT_MIN_ROWS`` rows on): the weight decoded once to the activations' dtype is the
    reference op's own, bit for bit (partial blocks at both edges), then one batched product per group."""
    gen = _gen(groups)
    weight, scale = fp8_block.quantize(torch.randn(groups * 70, 200, device=DEVICE, generator=gen) * 0.02, block,
                                       ue8m0)
    dense = fp8_linear.dequantized(weight, scale, block, dtype)
    assert torch.equal(dense, fp8_block.dequantize(weight, scale, block).to(dtype))
    x = torch.randn(5, groups, 200, device=DEVICE, generator=gen).to(dtype)
    got = fp8_linear.matmul(x, weight, scale, block, groups, fp8_linear.DEQUANT)
    torch.testing.assert_close(got, ref.grouped_linear_fp8_block(x, weight, scale, block, groups), **_tol(dtype))


@kernel_runs_here
def test_fp8_linear_decodes_extreme_scales_exactly():
    """One-hot input rows pick single weight columns out of blocks scaled by 2^-127, 1, 2^127 (values below 2 in
    the last: 448 x 2^127 overflows): the row, weight-only and split-K kernels return the exactly dequantized
    weights."""
    block = (16, 32)
    gen = _gen(3)
    weight, scale = fp8_block.quantize(torch.randn(48, 96, device=DEVICE, generator=gen), block, True)
    scale.view(torch.uint8)[:, 0] = 0
    scale.view(torch.uint8)[:, 1] = 254
    weight[:, 32:64] = (weight[:, 32:64].float().clamp(-1.875, 1.875)).to(torch.float8_e4m3fn)
    dense = fp8_block.dequantize(weight, scale, block)  # [48, 96]
    assert dense.isfinite().all() and (dense[:, :32].abs() < 1e-30).all() and dense[:, 32:64].abs().max() > 1e30
    for column in (0, 5, 33, 70):
        x = torch.zeros(1, 96, device=DEVICE)
        x[0, column] = 1.0
        assert torch.equal(fp8_linear.matmul(x[:, None], weight, scale, block, path=fp8_linear.ROW)[0, 0],
                           dense[:, column])
    eye = torch.eye(96, device=DEVICE)[:, None]  # [96, 1, 96]: every column, 96 rows
    for path in (fp8_linear.WEIGHT_ONLY, fp8_linear.SPLIT_K):
        got = fp8_linear.matmul(eye, weight, scale, block, path=path)[:, 0]
        assert torch.equal(got, dense.T), path


@kernel_runs_here
@pytest.mark.parametrize("block", [(64, 64), (32, 32)])
def test_fp8_activation_quantization_rounds_as_torch(block):
    """``quantize_activations``: per row and block of ``B1`` inputs, scale amax / 448 and e4m3 values rounded to
    nearest, ties to even: exactly ``fp8_block.quantize`` with (1, B1) float32 blocks, including an all-zero block
    (scale 1), values that round up across a power of two (125.07 -> 128) and e4m3 subnormals."""
    gen = _gen(block[1])
    M, G, K = 9, 3, 200
    x = torch.randn(M, G, K, device=DEVICE, generator=gen)
    x[0, 0, :6] = torch.tensor([1e-6, -3e-5, 0.0, 2e-4, 125.07, -448.0])
    x[1, 1, : block[1]] = 0
    q, s = fp8_linear.quantize_activations(x, block[1])
    want_q, want_s = fp8_block.quantize(x.reshape(M * G, K), (1, block[1]), ue8m0=False)
    assert torch.equal(q.view(torch.uint8).reshape(M * G, K), want_q.view(torch.uint8))
    assert torch.equal(s.reshape(M * G, -1), want_s)


@kernel_runs_here
@pytest.mark.parametrize("M, n, k, groups, block", [(130, 64, 200, 1, (64, 64)), (9, 40, 128, 3, (32, 32)),
                                                    (130, 128, 256, 2, (128, 128))])  # one scale a K step
def test_fp8_tensor_core_kernel_is_the_reference_on_quantized_activations(M, n, k, groups, block):
    """The fp8 tensor-core kernel equals the reference op run on activations quantized as ``quantize_activations``
    does, up to the sums: Hopper's fp8 MMA keeps about 14 bits while it accumulates one K block (DeepSeek-V3's report,
    section 3.3.2; the kernel adds each block's product into a float32 accumulator), so outputs of about 1 differ by a
    few 1e-4 (1.3e-4 seen on an H200); its error against the reference on the activations themselves is fp8's (a few
    %)."""
    gen = _gen(M)
    x = torch.randn(M, groups, k, device=DEVICE, generator=gen)
    weight, scale = fp8_block.quantize(torch.randn(groups * n, k, device=DEVICE, generator=gen) * k**-0.5, block,
                                       True)
    q, s = fp8_block.quantize(x.reshape(M * groups, k), (1, block[1]), ue8m0=False)
    x_quantized = fp8_block.dequantize(q, s, (1, block[1])).view(M, groups, k)
    got = fp8_linear.matmul(x, weight, scale, block, groups, path=fp8_linear.FP8_TC)
    torch.testing.assert_close(got, ref.grouped_linear_fp8_block(x_quantized, weight, scale, block, groups),
                               atol=1e-3, rtol=1e-3)
    exact = ref.grouped_linear_fp8_block(x, weight, scale, block, groups)
    assert 0 < (got - exact).abs().max() / exact.abs().max() < 0.1


@kernel_runs_here
def test_fp8_linear_picks_tensor_cores_from_the_crossover(monkeypatch):
    block = (128, 128)
    rows = fp8_linear.FP8_TC_MIN_ROWS
    assert fp8_linear.linear_path(rows - 1, torch.bfloat16, block) == fp8_linear.SPLIT_K
    assert fp8_linear.linear_path(rows, torch.bfloat16, block) == fp8_linear.FP8_TC
    assert fp8_linear.linear_path(fp8_linear.DEQUANT_MIN_ROWS, torch.bfloat16, block) == fp8_linear.DEQUANT
    assert fp8_linear.linear_path(rows, torch.float32, block) == fp8_linear.SPLIT_K  # fp32 runs stay exact
    assert fp8_linear.linear_path(rows, torch.bfloat16, (16, 16)) == fp8_linear.SPLIT_K  # fp8 MMA takes K >= 32
    assert fp8_linear.linear_path(rows, torch.bfloat16, (24, 24)) is None  # not a power of two: the reference op
    monkeypatch.setenv("DEEPINFER_NVIDIA_FP8_TC", "0")
    assert fp8_linear.linear_path(rows, torch.bfloat16, block) == fp8_linear.SPLIT_K


@kernel_runs_here
def test_fp8_linear_takes_the_reference_for_blocks_it_cannot_tile():
    gen = _gen(0)
    x = torch.randn(3, 48, device=DEVICE, generator=gen)
    weight, scale = fp8_block.quantize(torch.randn(40, 48, device=DEVICE, generator=gen), (24, 24), True)
    assert torch.equal(fp8_linear.linear_fp8_block(x, weight, scale, (24, 24)),
                       ref.linear_fp8_block(x, weight, scale, (24, 24)))


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.float32, DOT_DTYPE])
@pytest.mark.parametrize("tokens", [1, 3])
def test_fp8_grouped_linear_matches_reference(tokens, dtype):
    """Groups on the grid's last axis, a strided input (``x [T, groups, in]`` a transposed view)."""
    gen = _gen(tokens)
    groups, per_group, k, block = 4, 40, 64, (32, 32)
    x = torch.randn(tokens, k, groups, device=DEVICE, generator=gen).to(dtype).transpose(1, 2)
    weight, scale = fp8_block.quantize(torch.randn(groups * per_group, k, device=DEVICE, generator=gen) * 0.1, block,
                                       True)
    got = fp8_linear.grouped_linear_fp8_block(x, weight, scale, block, groups)
    want = ref.grouped_linear_fp8_block(x, weight, scale, block, groups)
    assert got.shape == (tokens, groups, per_group)
    torch.testing.assert_close(got, want, **_tol(dtype))


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.float32, DOT_DTYPE])
@pytest.mark.parametrize("tokens, adjacent", [(1, True), (4, True), (4, False)])
def test_fp8_shared_expert_matches_reference(tokens, adjacent, dtype):
    """One token as a one-expert MoE (row kernels); more as products: one for ``w1`` and ``w3`` where they and
    their scales lie one after the other (the model's fused allocation), two otherwise."""
    gen = _gen(tokens)
    inter, dim, block = 64, 96, (32, 32)
    both, both_scale = fp8_block.quantize(torch.randn(2 * inter, dim, device=DEVICE, generator=gen) * 0.1, block,
                                          True)
    w1, s1, w3, s3 = both[:inter], both_scale[:2], both[inter:], both_scale[2:]
    if not adjacent:
        w1, s1, w3, s3 = w1.clone(), s1.clone(), w3.clone(), s3.clone()
    w2, s2 = fp8_block.quantize(torch.randn(dim, inter, device=DEVICE, generator=gen) * 0.1, block, True)
    x = torch.randn(tokens, dim, device=DEVICE, generator=gen).to(dtype)
    args = (x, w1, s1, w2, s2, w3, s3, block, 0.7)
    torch.testing.assert_close(fp8_linear.swiglu_mlp_fp8_block(*args), ref.swiglu_mlp_fp8_block(*args),
                               **_tol(dtype))


def _opaque_cases():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=gen).to(torch.bfloat16)
    weight, scale = fp8_block.quantize(torch.randn(64, 256, generator=gen), (128, 128), True)
    grouped, grouped_scale = fp8_block.quantize(torch.randn(64, 128, generator=gen), (32, 128), True)
    w1, s1 = fp8_block.quantize(torch.randn(4, 64, 256, generator=gen), (128, 128), True)
    w2, s2 = fp8_block.quantize(torch.randn(4, 256, 64, generator=gen), (128, 128), True)
    p1, q1 = mxfp4.quantize(torch.randn(4, 64, 256, generator=gen))
    p2, q2 = mxfp4.quantize(torch.randn(4, 256, 64, generator=gen))
    ids, weights = torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.rand(3, 2, generator=gen)
    return {
        "linear_fp8_block": (fp8_linear.linear_fp8_block, ref.linear_fp8_block,
                             (x.view(3, 1, 256), weight, scale, (128, 128))),
        "grouped_linear_fp8_block": (fp8_linear.grouped_linear_fp8_block, ref.grouped_linear_fp8_block,
                                     (x.view(3, 2, 128), grouped, grouped_scale, (32, 128), 2)),
        "swiglu_mlp_fp8_block": (fp8_linear.swiglu_mlp_fp8_block, ref.swiglu_mlp_fp8_block,
                                 (x, w1[0], s1[0], w2[0], s2[0], w1[1], s1[1], (128, 128), 7.0)),
        "moe_experts_fp8_block": (moe_quant.moe_experts_fp8_block, ref.moe_experts_fp8_block,
                                  (x, ids, weights, w1, s1, w2, s2, w1, s1, (128, 128), 7.0)),
        "moe_experts_mxfp4": (moe_quant.moe_experts_mxfp4, ref.moe_experts_mxfp4,
                              (x, ids, weights, p1, q1, p2, q2, p1, q1, 7.0)),
    }


class _NotRun(Exception):
    pass


@pytest.mark.parametrize("name", sorted(_opaque_cases()))
def test_quantized_op_is_one_custom_op_under_compile_with_the_reference_shape(name):
    """A decode step compiled whole (``DEEPINFER_NVIDIA_COMPILE_STEP=1``) sees each quantized op as the one opaque
    node ``deepinfer_nvidia::<op>`` whose fake output has the reference op's shape and dtype (traced on the CPU with
    ``fullgraph=True`` into a backend that records the graph and never runs it)."""
    wrapper, reference, args = _opaque_cases()[name]
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)

        def never(*_):
            raise _NotRun

        return never

    torch._dynamo.reset()
    with pytest.raises(_NotRun):
        torch.compile(wrapper, backend=record, fullgraph=True)(*args)
    (gm,) = graphs
    ops = [n for n in gm.graph.nodes if n.op == "call_function" and "deepinfer_nvidia" in str(n.target)]
    assert [str(n.target) for n in ops] == [f"deepinfer_nvidia.{name}.default"]
    fake, want = ops[0].meta["example_value"], reference(*args)
    assert (tuple(fake.shape), fake.dtype) == (tuple(want.shape), want.dtype)


@kernel_runs_here
def test_mxfp4_rows_to_e4m3_are_exact_within_14_binades():
    """``moe_mxfp4_prefill.to_e4m3_rows``: two packed parts stacked along the rows, each row as e4m3 codes times one
    float32 scale (its largest ue8m0 byte less 133). Rows whose bytes lie within 14 of their largest give the
    dequantized weights exactly (all 256 byte values among the codes; bytes 0, 1 and 250 among the scales); every
    row, the wide ones too, holds each weight over its row scale rounded to nearest e4m3, ties to even (torch's
    cast)."""
    gen = _gen(14)
    E, K = 2, 96  # three scale groups a row: not a power of two
    packed = [torch.randint(0, 256, (E, n, K // 2), dtype=torch.uint8, device=DEVICE, generator=gen) for n in (5, 4)]
    packed[0][0, 0, :] = torch.arange(48, dtype=torch.uint8, device=DEVICE) * 5  # every code among the rows
    scales = [torch.randint(110, 125, (E, n, K // 32), dtype=torch.uint8, device=DEVICE, generator=gen)
              for n in (5, 4)]
    scales[1][0] = torch.tensor([[0, 0, 0], [1, 0, 14], [250, 236, 240], [200, 170, 185]], dtype=torch.uint8,
                                device=DEVICE)  # subnormal scales, a spread of 14, large ones, a spread of 30
    parts = [(w.view(torch.int8), s.view(torch.float8_e8m0fnu)) for w, s in zip(packed, scales)]
    q, qs = moe_mxfp4_prefill.to_e4m3_rows(*parts)
    assert q.shape == (E, 9, K) and q.dtype == torch.float8_e4m3fn and qs.shape == (E, 9)
    dense = torch.cat([mxfp4.dequantize(w, s) for w, s in parts], dim=1)  # [E, 9, K]
    exact = moe_mxfp4_prefill.exact_rows(torch.cat(scales, dim=1))
    assert exact.sum() == E * 9 - 1  # all but the spread of 30
    assert torch.equal(q.float()[exact] * qs[exact][:, None], dense[exact])
    want = (dense / qs[..., None]).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))


@kernel_runs_here
def test_swiglu_rows_quantize_as_torch():
    """``moe_mxfp4_prefill.swiglu_quantized``: ``moe.swiglu`` of the gate and up halves (the reference op's
    rounding: silu in the activations' dtype, then the product), then each row as e4m3 with scale amax / 448:
    exactly ``fp8_block.quantize`` with one block a row; an all-zero row takes scale 1."""
    gen = _gen(48)
    P, inter, limit = 5, 48, 0.7  # a row width that is not a power of two
    gate_up = torch.randn(P, 2 * inter, device=DEVICE, generator=gen).to(DOT_DTYPE)
    gate_up[3] = 0
    q, s = moe_mxfp4_prefill.swiglu_quantized(gate_up, limit)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    h = moe.swiglu(gate, up, limit)  # [P, I]
    torch.testing.assert_close(h, torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit))
    want_q, want_s = fp8_block.quantize(h.float(), (1, inter), ue8m0=False)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s, want_s.view(-1)) and s[3] == 1

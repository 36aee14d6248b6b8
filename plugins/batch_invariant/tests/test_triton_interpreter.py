"""The CUDA variants' Triton kernels run on CPU tensors under Triton's interpreter (no GPU needed).

What this checks: the kernels' logic (indexing, masks, the compaction of each query's keys, chunk loops,
fold orders, the launchers' shapes and strides) gives a needle the same bits alone and inside random
batches, and agrees with the reference ops. What it cannot check: that ``tl.dot`` on the GPU computes a
row independently of the rest of its tile. Under the interpreter ``_dot`` is an explicit multiply-and-sum
(``triton_kernels`` says why); the GPU property is tested by ``test_cuda.py`` (marker ``nvidia``). The
backend's MoE kernels call ``tl.dot`` directly, so ``moe_experts`` is only compared with the reference here.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="the test extra installs triton")
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton's interpreter is for machines without a GPU (conftest sets TRITON_INTERPRET=1 there)",
                allow_module_level=True)

from bi_harness import (
    attention_batch,
    attention_tiles_agree,
    check_attention,
    check_empty_attention_row,
    check_indexer_close,
    check_indexer_scores,
    check_rows,
    close,
    row_cases,
)
from deepinfer_batch_invariant import cuda_ops, triton_kernels
from deepinfer_batch_invariant.ops import implementations

from deepinfer_core.ops.table import reference_ops

REF = reference_ops()
BI = implementations("nvidia_sm100")
SIZES = (0, 1, 7, 17, 64, 100)  # 64 + 3 needle rows cross a 64-row tile
CASES = {case.name: case for case in row_cases()}
BF16_CASES = {case.name: case for case in row_cases(torch.bfloat16)}
TILED = sorted(name for name, case in CASES.items() if case.op != "moe_experts")


def test_kernels_run_interpreted():
    assert triton_kernels.INTERPRET
    assert type(triton_kernels._matmul_nt_kernel).__name__ == "InterpretedFunction"


def test_every_op_is_classified_and_installed():
    assert set(cuda_ops.VARIANTS) | set(cuda_ops.REFERENCE_KEPT) == set(REF)
    assert not set(cuda_ops.VARIANTS) & set(cuda_ops.REFERENCE_KEPT)
    for name, fn in BI.items():
        assert fn is cuda_ops.VARIANTS.get(name, REF[name])


@pytest.mark.parametrize("name", TILED)
def test_row_op_is_bitwise_invariant(name):
    case = CASES[name]
    assert check_rows(case, BI[case.op], sizes=SIZES) == []


@pytest.mark.parametrize("name", sorted(CASES))
def test_row_op_matches_reference(name):
    case = CASES[name]
    inputs = case.rows(37, torch.Generator().manual_seed(7))
    close(case.call(BI[case.op], inputs), case.call(REF[case.op], inputs), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", ["linear 256->96", "logits", "grouped_linear", "swiglu_mlp", "compressor_pool",
                                  "rms_norm", "unweighted_rms_norm"])
def test_bf16_row_op_invariant_and_close(name):
    case = BF16_CASES[name]
    assert check_rows(case, BI[case.op], sizes=(0, 1, 17, 64)) == []
    inputs = case.rows(21, torch.Generator().manual_seed(3))
    close(case.call(BI[case.op], inputs), case.call(REF[case.op], inputs), atol=3e-2, rtol=3e-2)


def test_sink_attention_invariant_to_padding_batch_and_chunking():
    assert triton_kernels.KV_CHUNK < 150  # the random sequences have up to 150 keys: several chunks
    assert check_attention(BI["sink_attention"], trials=8) == []


def test_sink_attention_bf16_invariant():
    assert check_attention(BI["sink_attention"], trials=4, seed=1, dtype=torch.bfloat16) == []


def test_sink_attention_matches_reference():
    for seed in range(2):
        args = attention_batch(torch.Generator().manual_seed(seed))
        # the extra queries see junk keys of magnitude ~100: outputs up to ~1e2, online-softmax rounding
        close(BI["sink_attention"](*args), REF["sink_attention"](*args), atol=3e-3, rtol=1e-4)


def test_sink_attention_row_without_visible_keys_is_zero():
    check_empty_attention_row(BI["sink_attention"], REF["sink_attention"])


def test_sink_attention_16_and_64_heads_a_program_agree_bitwise(monkeypatch):
    """bf16: the few-queries tile (16 heads a program) gives the 64-head tile's bits (every key sum a product along
    the keys), and the reference's values."""
    assert triton_kernels.attention_block_h(1, 64, torch.bfloat16) == 16
    assert triton_kernels.attention_block_h(131, 64, torch.bfloat16) == 16  # fewer programs than an H200's SMs
    assert triton_kernels.attention_block_h(132, 64, torch.bfloat16) == 64
    assert triton_kernels.attention_block_h(1024, 64, torch.bfloat16) == 64
    assert triton_kernels.attention_block_h(1024, 64, torch.float32) == 16
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT_ATTENTION_FEW_PROGRAMS", "0")
    assert triton_kernels.attention_block_h(1, 64, torch.bfloat16) == 64
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT_ATTENTION_FEW_PROGRAMS")
    attention_tiles_agree(BI["sink_attention"], REF["sink_attention"],
                          lambda few: monkeypatch.setattr(triton_kernels, "ATTN_FEW_PROGRAMS", few))


def test_compact_visible_lists_each_querys_keys_in_order():
    visible = torch.rand(2, 3, 40, generator=torch.Generator().manual_seed(0)) < 0.4
    idx, counts = triton_kernels.compact_visible(visible)
    for row, vis in enumerate(visible.reshape(6, 40)):
        expected = vis.nonzero().flatten().to(torch.int32)
        assert int(counts[row]) == expected.numel()
        assert torch.equal(idx[row, : expected.numel()], expected)


def test_indexer_scores_invariant_and_matches_reference():
    assert check_indexer_scores(BI["indexer_scores"], trials=8) == []
    check_indexer_close(BI["indexer_scores"], REF["indexer_scores"])


def test_cuda_hc_weights_match_the_cpu_form():
    """The CUDA kit's mHC weights (the backend's kernel) against the CPU kit's torch form."""
    from deepinfer_batch_invariant import cpu_ops

    gen = torch.Generator().manual_seed(2)
    mixed, base, scale = torch.randn(9, 24, generator=gen) * 3, torch.randn(24, generator=gen), torch.rand(3) + 0.5
    got = cuda_ops.CUDA_KIT.hc_weights(mixed, base, scale, 4, 20, 1e-6)
    want = cpu_ops.CPU_KIT.hc_weights(mixed, base, scale, 4, 20, 1e-6)
    for g, w in zip(got, want, strict=True):
        close(g, w, atol=1e-6, rtol=1e-5)


def test_split_k_depends_on_the_weight_only_and_keeps_rows_invariant():
    """A decode-sized GEMM is split along K by the weight's shape (never the row count); the split partial sums
    fold in a fixed order, so a row keeps its bits among any number of other rows, close to an unsplit GEMM."""
    assert triton_kernels.split_k(1024, 4096, 64, 64) == 8  # 16 N tiles x 8 splits (8 K blocks each)
    assert triton_kernels.split_k(1024, 4096, 64, 64, groups=8) == 2  # 8 groups x 16 N tiles x 2 splits
    assert triton_kernels.split_k(32768, 1024, 64, 64) == 1  # wide weights fill the GPU without splitting
    assert triton_kernels.split_k(24, 64, 32, 32) == 1  # too short to split
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(40, 512, generator=gen)  # fp32 tiles (16, 32, 32): 2 N tiles, 2 K splits
    assert triton_kernels.split_k(40, 512, 32, 32) == 2
    x = torch.randn(70, 512, generator=gen)
    alone = triton_kernels.matmul_nt(x[:1], w)
    for rows in (2, 17, 70):
        assert torch.equal(triton_kernels.matmul_nt(x[:rows], w)[:1], alone)
    torch.testing.assert_close(triton_kernels.matmul_nt(x, w), x @ w.T, atol=1e-4, rtol=1e-4)


def test_split_k_targets_from_the_variables(monkeypatch):
    """``DEEPINFER_BATCH_INVARIANT_SPLIT_K_PROGRAMS`` / ``_MIN_SPLIT_BLOCKS`` replace the split target and the
    shortest split (still a function of the weight's shape only)."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT_SPLIT_K_PROGRAMS", "1024")
    assert triton_kernels.split_k(4096, 8192, 64, 64) == 16  # 64 N tiles x 16 splits of 8 K blocks
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT_MIN_SPLIT_BLOCKS", "4")
    assert triton_kernels.split_k(4096, 2048, 64, 64) == 8  # 64 N tiles x 8 splits of 4 K blocks
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT_SPLIT_K_PROGRAMS")
    assert triton_kernels.split_k(4096, 2048, 64, 64) == 4  # 256 programs


def test_wide_gemm_launch_gives_the_split_launch_bits(monkeypatch):
    """The prefill tile (``MM_WIDE_CONFIGS``: each program sums its tile's K splits one after the other) computes the
    split-K launch's splits in its order, at the same BLOCK_K: the same bits for every row, plain and grouped, and a
    row alone (split-K launch) keeps them among enough rows to take the wide one."""
    bf16 = torch.bfloat16
    assert triton_kernels.MM_WIDE_CONFIGS[bf16][2] == triton_kernels.MM_CONFIGS[bf16][2]  # one BLOCK_K
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(200, 1100, generator=gen) * 0.05).to(bf16)  # 4 N tiles, 2 splits of 576 (the last 524)
    x = torch.randn(150, 1, 1100, generator=gen).to(bf16)
    assert triton_kernels._k_splits(200, 1100, bf16, 1) == (576, 2)
    split = triton_kernels._grouped_matmul(x, w, 1, launch="split")
    assert torch.equal(triton_kernels._grouped_matmul(x, w, 1, launch="wide"), split)
    close(split.float(), (x.float() @ w.float().T), atol=2e-2, rtol=1e-2)
    wg = (torch.randn(2 * 40, 1024, generator=gen) * 0.05).to(bf16)  # 2 groups x 1 N tile, 2 splits each
    xg = torch.randn(70, 2, 1024, generator=gen).to(bf16)
    assert triton_kernels._k_splits(40, 1024, bf16, 2)[1] == 2
    assert torch.equal(triton_kernels._grouped_matmul(xg, wg, 2, launch="wide"),
                       triton_kernels._grouped_matmul(xg, wg, 2, launch="split"))
    monkeypatch.setattr(triton_kernels, "ROW_LAUNCHES", ((100, "wide"), (0, "split")))
    alone = triton_kernels.matmul_nt(x[:2, 0], w)
    assert torch.equal(triton_kernels.matmul_nt(x[:, 0], w)[:2], alone)
    xs, ws = torch.randn(1200, 1, 64, generator=gen).to(bf16), torch.randn(300, 64, generator=gen).to(bf16)
    assert torch.equal(triton_kernels._grouped_matmul(xs, ws, 1, launch="wide"),  # 10 row tiles: two groups of 8 and 2
                       triton_kernels._grouped_matmul(xs, ws, 1, launch="split"))


def test_every_gemm_launch_gives_the_split_launch_bits():
    """Every launch (the split-K tile in 128 x 128, with the operands swapped, the serial tiles) computes the same
    splits at the same BLOCK_K as the 64 x 64 split-K one: the same bits for every row, plain and grouped (the
    interpreter checks indexing, masks and fold order; the tensor cores' bits: test_cuda.py)."""
    bf16 = torch.bfloat16
    gen = torch.Generator().manual_seed(6)
    w = (torch.randn(200, 1100, generator=gen) * 0.05).to(bf16)  # 2 splits
    x = torch.randn(150, 1, 1100, generator=gen).to(bf16)
    wg = (torch.randn(2 * 40, 1024, generator=gen) * 0.05).to(bf16)
    xg = torch.randn(70, 2, 1024, generator=gen).to(bf16)
    for launch, spec in triton_kernels.LAUNCHES.items():
        assert spec.configs[bf16][2] == triton_kernels.MM_CONFIGS[bf16][2], launch  # one BLOCK_K
        assert torch.equal(triton_kernels._grouped_matmul(x, w, 1, launch=launch),
                           triton_kernels._grouped_matmul(x, w, 1, launch="split")), launch
        assert torch.equal(triton_kernels._grouped_matmul(xg, wg, 2, launch=launch),
                           triton_kernels._grouped_matmul(xg, wg, 2, launch="split")), launch


def test_gemm_launches_by_row_count_from_the_variable(monkeypatch):
    """``DEEPINFER_BATCH_INVARIANT_GEMM_LAUNCHES`` replaces ``ROW_LAUNCHES``; fp32 keeps the split-K launch; a
    malformed value names itself and the launches."""
    bf16 = torch.bfloat16
    assert triton_kernels.launch_for(1, bf16, 4096) == "split_swap"
    assert triton_kernels.launch_for(16, bf16, 4096) == "split_swap"
    assert triton_kernels.launch_for(17, bf16, 4096) == "split"
    assert triton_kernels.launch_for(128, bf16, 4096) == "split_wide"
    wide = triton_kernels.WIDE_MIN_ROWS
    assert triton_kernels.launch_for(wide, bf16, 32768) == "wide"  # 512 programs of 128 x 128
    assert triton_kernels.launch_for(wide, bf16, 4096) == "wide_short"  # 64: too few for the GPU
    assert triton_kernels.launch_for(wide, bf16, 1024, groups=8) == "wide_short"
    assert triton_kernels.launch_for(16384, bf16, 4096) == "wide"
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT_GEMM_LAUNCHES", "256:split_wide, 0:split,1024:wide")
    got = [triton_kernels.launch_for(m, bf16, 32768) for m in (1, 255, 256, 1023, 1024)]
    assert got == ["split", "split", "split_wide", "split_wide", "wide"]
    assert triton_kernels.launch_for(4096, torch.float32, 4096) == "split"
    for bad in ("64:split_wide", "0:split,x:wide", "0:tall"):
        monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT_GEMM_LAUNCHES", bad)
        with pytest.raises(ValueError, match="DEEPINFER_BATCH_INVARIANT_GEMM_LAUNCHES"):
            triton_kernels.launch_for(8, bf16, 4096)


def test_split_k_partials_folded_by_each_tiles_last_program(monkeypatch):
    """The split-K launch's fused fold (the tile's last program, found by a count per tile, adds the partials in split
    order) gives the fold kernel's bits, fp32 and bf16, plain and grouped, and leaves every count at zero for the next
    launch; ``DEEPINFER_BATCH_INVARIANT_FUSED_FOLD=0`` takes the fold kernel."""
    gen = torch.Generator().manual_seed(8)
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(200, 1100, generator=gen) * 0.05).to(dtype)
        x = torch.randn(150, 1, 1100, generator=gen).to(dtype)
        assert triton_kernels._k_splits(200, 1100, dtype, 1)[1] >= 2
        kernel = triton_kernels._grouped_matmul(x, w, 1, launch="split", fused_fold=False)
        assert torch.equal(triton_kernels._grouped_matmul(x, w, 1, launch="split"), kernel)
        wg = (torch.randn(2 * 40, 1024, generator=gen) * 0.05).to(dtype)
        xg = torch.randn(9, 2, 1024, generator=gen).to(dtype)
        assert torch.equal(triton_kernels._grouped_matmul(xg, wg, 2, launch="split"),
                           triton_kernels._grouped_matmul(xg, wg, 2, launch="split", fused_fold=False))
    assert not any(counts.any() for counts in triton_kernels.FOLD_COUNTS.buffers())
    assert triton_kernels._fold_counts(torch.device("cpu"), triton_kernels.FOLD_COUNTS.slots + 1) is None
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT_FUSED_FOLD", "0")
    assert triton_kernels._fold_counts(torch.device("cpu"), 4) is None


def test_bench_gemm_suggests_each_launch_from_where_it_is_fastest():
    """``bench_gemm.suggest``: the fastest launch per measured row count, as a ``rows:launch`` table from 0."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import bench_gemm

    totals = {1: {"split": 1.0, "wide": 2.0}, 16: {"split": 1.0, "split_wide": 0.5},
              64: {"split_wide": 1.0, "split": 2.0}, 512: {"wide": 1.0, "split": 2.0}}
    assert bench_gemm.suggest(totals) == "0:split,16:split_wide,512:wide"


def test_rope_cos_sin_matches_reference_and_is_elementwise():
    """One launch for both tables: the reference's values (angles up to a 1M context, where an approximate sine would
    be far off) in fp32 and bf16, and a position's row the same bits alone and among others."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))  # [32]
    positions = torch.tensor([[0, 1, 7], [4095, 65537, 1_000_000]])  # [2, 3]
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = triton_kernels.rope_cos_sin(positions, inv_freq, 0.5, dtype)
        want_cos, want_sin = REF["rope_cos_sin"](positions, inv_freq, 0.5, dtype)
        assert cos.shape == want_cos.shape == (2, 3, 32) and cos.dtype == sin.dtype == dtype
        tol = 2e-6 if dtype == torch.float32 else 4e-3
        torch.testing.assert_close(cos.float(), want_cos.float(), atol=tol, rtol=0)
        torch.testing.assert_close(sin.float(), want_sin.float(), atol=tol, rtol=0)
        alone_cos, alone_sin = triton_kernels.rope_cos_sin(positions[1, 2:], inv_freq, 0.5, dtype)
        assert torch.equal(alone_cos[0], cos[1, 2]) and torch.equal(alone_sin[0], sin[1, 2])
    assert BI["rope_cos_sin"] is triton_kernels.rope_cos_sin

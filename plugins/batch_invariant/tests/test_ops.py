"""Each batch-invariant op: close to the reference op, and bitwise equal to itself across batches.

The "inverse" tests record where the plain reference ops are *not* invariant on this CPU (so the
variants are needed), and guard the ops whose reference is kept as already invariant.
"""

from __future__ import annotations

import pytest
import torch
from bi_harness import (
    attention_batch,
    check_attention,
    check_empty_attention_row,
    check_indexer_close,
    check_indexer_scores,
    check_indexer_topk,
    check_rows,
    close,
    row_cases,
)
from deepinfer_batch_invariant import primitives
from deepinfer_batch_invariant.cpu_ops import REFERENCE_KEPT, VARIANTS
from deepinfer_batch_invariant.ops import implementations

from deepinfer_core.ops.table import reference_ops

REF = reference_ops()
BI = implementations("cpu")
CASES = {case.name: case for case in row_cases()}
BF16_CASES = {case.name: case for case in row_cases(torch.bfloat16)}


def test_every_op_is_classified_and_installed():
    assert set(VARIANTS) | set(REFERENCE_KEPT) == set(REF)
    assert not set(VARIANTS) & set(REFERENCE_KEPT)
    assert set(BI) == set(REF)
    for name, fn in BI.items():
        assert fn is (VARIANTS[name] if name in VARIANTS else REF[name])


@pytest.mark.parametrize("name", sorted(CASES))
def test_row_op_is_bitwise_invariant(name):
    case = CASES[name]
    assert check_rows(case, BI[case.op]) == []


@pytest.mark.parametrize("name", sorted(CASES))
def test_row_op_matches_reference(name):
    case = CASES[name]
    gen = torch.Generator().manual_seed(7)
    inputs = case.rows(37, gen)
    close(case.call(BI[case.op], inputs), case.call(REF[case.op], inputs), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", ["linear 256->96", "logits", "grouped_linear", "swiglu_mlp", "moe_experts",
                                  "compressor_pool"])
def test_bf16_variants_invariant_and_close(name):
    case = BF16_CASES[name]
    assert check_rows(case, BI[case.op], sizes=(0, 1, 5, 17, 40)) == []
    inputs = case.rows(21, torch.Generator().manual_seed(3))
    close(case.call(BI[case.op], inputs), case.call(REF[case.op], inputs), atol=3e-2, rtol=3e-2)


def test_sink_attention_invariant_to_padding_batch_and_chunking():
    assert check_attention(BI["sink_attention"]) == []


def test_sink_attention_invariant_with_more_keys_than_one_chunk_and_bf16():
    assert primitives.KV_CHUNK < 150  # the random sequences have up to 150 keys: several chunks
    assert check_attention(BI["sink_attention"], trials=8, seed=1, dtype=torch.bfloat16) == []


def test_sink_attention_matches_reference():
    for seed in range(3):
        args = attention_batch(torch.Generator().manual_seed(seed))
        close(BI["sink_attention"](*args), REF["sink_attention"](*args), atol=1e-5, rtol=1e-5)


def test_sink_attention_row_without_visible_keys_is_zero():
    check_empty_attention_row(BI["sink_attention"], REF["sink_attention"])


def test_indexer_scores_invariant_and_matches_reference():
    assert check_indexer_scores(BI["indexer_scores"]) == []
    assert check_indexer_scores(BI["indexer_scores"], trials=8, Hi=64, di=128, seed=1) == []
    check_indexer_close(BI["indexer_scores"], REF["indexer_scores"])


def test_indexer_scores_without_entries():
    out = BI["indexer_scores"](torch.randn(2, 3, 2, 16), torch.randn(2, 0, 16), torch.randn(2, 3, 2), 0.25)
    assert out.shape == (2, 3, 0)


def test_indexer_topk_reference_is_invariant_with_ties():
    assert check_indexer_topk(BI["indexer_topk"]) == []


def test_matmul_nt_shapes_and_layouts():
    w = torch.randn(24, 40)
    x = torch.randn(3, 7, 80)[..., ::2]  # non-contiguous, 3-D
    torch.testing.assert_close(primitives.matmul_nt(x, w), x @ w.T, atol=1e-5, rtol=1e-5)
    assert primitives.matmul_nt(torch.randn(0, 40), w).shape == (0, 24)
    row = torch.randn(40)
    alone = primitives.matmul_nt(row[None], w)[0]
    for m in (2, 16, 17, 100):
        x = torch.randn(m, 40)
        x[m // 2] = row
        assert torch.equal(primitives.matmul_nt(x, w)[m // 2], alone)


def test_activations_are_position_independent_and_close():
    x = torch.randn(5000) * 8
    for ours, theirs in ((primitives.sigmoid, torch.sigmoid), (primitives.silu, torch.nn.functional.silu),
                         (primitives.softplus, torch.nn.functional.softplus)):
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=1e-6)
        whole = ours(x)
        singles = torch.cat([ours(x[i:i + 1]) for i in range(0, 5000, 37)])
        assert torch.equal(whole[::37], singles)


# ----------------------------------------------------------------------------- the plain path (inverse)
NOT_INVARIANT_PLAIN = ["linear 48->40", "linear 256->96", "grouped_linear", "logits", "hc_pre", "swiglu_mlp",
                       "moe_experts"]


@pytest.mark.parametrize("name", NOT_INVARIANT_PLAIN)
def test_plain_reference_op_is_not_batch_invariant(name):
    """The plain GEMM-based ops change a row's bits with the batch: a request's row alone (batch 1: MKL's gemv) and
    the same row among others (a gemm) differ. Among several rows the bits may or may not move with the row count,
    depending on the CPU's MKL kernels, so the needle is one row."""
    case = CASES[name]
    assert check_rows(case, REF[case.op], needle_rows=1) != []


def test_plain_reference_attention_and_indexer_depend_on_padding():
    assert check_attention(REF["sink_attention"]) != []
    # At V4's indexer size (64 heads x 128); at 2 x 16 it depends on padding only with 2+ threads.
    assert check_indexer_scores(REF["indexer_scores"], trials=8, Hi=64, di=128) != []


def test_plain_linear_single_row_differs_from_batched_row():
    """The smallest demonstration: F.linear of one row (gemv) vs the same row among others (gemm)."""
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(64, 64, generator=gen), torch.randn(8, 64, generator=gen)
    assert not torch.equal(REF["linear"](x[:1], w)[0], REF["linear"](x, w)[0])
    assert torch.equal(BI["linear"](x[:1], w)[0], BI["linear"](x, w)[0])


def test_plain_sigmoid_tail_differs():
    """Why the variants rebuild sigmoid / SiLU / softplus: torch's scalar tail disagrees with its SIMD body."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 4
    singles = torch.cat([torch.sigmoid(x[i:i + 1]) for i in range(4096)])
    assert not torch.equal(torch.sigmoid(x), singles)


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c.op in REFERENCE_KEPT))
def test_kept_reference_ops_are_invariant(name):
    """The ops whose reference stays in batch-invariant mode (see ``REFERENCE_KEPT``), at more sizes."""
    case = CASES[name]
    for seed in range(3):
        assert check_rows(case, REF[case.op], sizes=(0, 1, 5, 16, 17, 100, 1000), seed=seed) == []


def test_quantized_weight_ops_are_batch_invariant_and_match_the_reference():
    """``linear_fp8_block`` and ``moe_experts_mxfp4``: a row alone equals the same row inside a batch, bit for bit."""
    from deepinfer_core.quant import fp8_block, mxfp4

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(37, 64, generator=gen)
    weight, scale = fp8_block.quantize(torch.randn(48, 64, generator=gen), (32, 32), True)
    assert torch.equal(VARIANTS["linear_fp8_block"](x[:1], weight, scale, (32, 32))[0],
                       VARIANTS["linear_fp8_block"](x, weight, scale, (32, 32))[0])
    torch.testing.assert_close(VARIANTS["linear_fp8_block"](x, weight, scale, (32, 32)),
                               REF["linear_fp8_block"](x, weight, scale, (32, 32)))
    w13 = [mxfp4.quantize(torch.randn(4, 32, 64, generator=gen)) for _ in range(2)]
    w2 = mxfp4.quantize(torch.randn(4, 64, 32, generator=gen))
    args = (w13[0][0].view(torch.uint8), w13[0][1], w2[0].view(torch.uint8), w2[1], w13[1][0].view(torch.uint8),
            w13[1][1], 10.0)
    ids = torch.randint(0, 4, (37, 2), generator=gen)
    weights = torch.rand(37, 2, generator=gen)
    batch = VARIANTS["moe_experts_mxfp4"](x, ids, weights, *args)
    assert torch.equal(VARIANTS["moe_experts_mxfp4"](x[:1], ids[:1], weights[:1], *args)[0], batch[0])
    torch.testing.assert_close(batch, REF["moe_experts_mxfp4"](x, ids, weights, *args))

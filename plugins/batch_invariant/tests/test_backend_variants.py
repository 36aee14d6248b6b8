"""The backend's own batch-invariant kernels (``Backend.op_variants("batch_invariant")``) as the mode installs them.

Without a GPU the NVIDIA backend's Triton kernels run on CPU tensors under Triton's interpreter (conftest sets
``TRITON_INTERPRET=1``): a needle's rows alone vs among 0 to 61 random rows (batches of 3 to 64 rows) give the same
bits for every offered op whose kernels reduce without ``tl.dot`` (the interpreter's ``tl.dot`` is NumPy's BLAS,
whose row result follows the row's place in the tile: ``moe_experts`` and the 16-bit mHC mixing are checked on
the GPU by ``test_cuda.py``). The kernels are the backend's, taken through its ``op_variants`` contract
(``kernels/invariant.py``; the ``NvidiaBackend`` object itself needs a GPU). Also: how ``ops.install`` merges them
(the ops made of parts rebuilt over the backend's fused kernels, sources named), and that the plugin never imports
a backend package.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="the test extra installs triton")
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton's interpreter is for machines without a GPU (conftest sets TRITON_INTERPRET=1 there)",
                allow_module_level=True)
invariant = pytest.importorskip("deepinfer_nvidia_sm100.kernels.invariant", reason="needs the nvidia_sm100 backend")

from bi_harness import check_indexer_topk, check_rows, close, fused_cases, row_cases
from deepinfer_batch_invariant import ops as bi_ops
from deepinfer_batch_invariant.plugin import SOURCE

from deepinfer_core.errors import UnsupportedBackendError
from deepinfer_core.ops.table import DERIVED, OpTable, reference_ops

REF = reference_ops()
OFFERED = invariant.batch_invariant_ops()
SIZES = (0, 1, 2, 7, 17, 61)  # with the 3 needle rows: batches of 3 to 64 rows
WITHOUT_DOT = ("rms_norm", "unweighted_rms_norm", "apply_rope", "apply_rope inverse", "moe_route_topk sqrtsoftplus",
               "moe_route_topk sigmoid", "moe_route_topk softmax", "moe_route_hash", "hc_pre", "hc_post")
CASES = {case.name: case for case in row_cases()}


def test_the_backend_offers_its_fast_kernels_for_the_mode():
    assert {"rms_norm", "rms_norm_rope", "hc_pre_normed", "hc_post_sum", "moe_experts", "compressor_entries_rope",
            "moe_route_topk"} <= set(OFFERED)
    assert not {"linear", "logits", "grouped_linear", "swiglu_mlp", "sink_attention"} & set(OFFERED)


def test_moe_tile_follows_the_assignment_count_and_dtype():
    """The mode's MoE takes its tile from a shape-known count (assignments per expert) and the dtype; the 64-row tiles
    have the same rows and BLOCK_K, and all are tiles of the fast path, which the backend's compile tests build for
    sm_90a / sm_100a (``test_cuda.py`` checks that their bits agree on the GPU)."""
    from deepinfer_nvidia_sm100.kernels import moe

    small, wide, decode = invariant.MOE_TILE, invariant.MOE_PREFILL_TILE, invariant.MOE_DECODE_TILE
    assert (small[0], small[2]) == (wide[0], wide[2]) and wide[1] > small[1]
    assert {small, wide[:4], decode} <= set(moe.TILES.values())
    bf16 = torch.bfloat16
    assert invariant.moe_tile(64 * 64, 64, bf16) == small and invariant.moe_tile(64 * 64 + 1, 64, bf16) == wide
    assert invariant.moe_tile(16, 64, bf16) == decode and invariant.moe_tile(17, 64, bf16) == small  # batch 2 / 3
    assert invariant.moe_tile(6, 64, torch.float32) == small and invariant.moe_tile(16384 * 6, 64, bf16) == wide


@pytest.mark.parametrize("name", WITHOUT_DOT)
def test_offered_kernel_keeps_a_rows_bits_in_any_batch(name):
    case = CASES[name]
    assert case.op in OFFERED
    assert check_rows(case, OFFERED[case.op], sizes=SIZES) == []
    inputs = case.rows(21, torch.Generator().manual_seed(5))
    close(case.call(OFFERED[case.op], inputs), case.call(REF[case.op], inputs), atol=3e-5, rtol=3e-5)


def test_offered_fused_ops_keep_a_rows_bits_in_any_batch():
    """``hc_pre_normed``, ``hc_post_sum`` and ``rms_norm_rope`` (the fused kernels the model calls)."""
    gen = torch.Generator().manual_seed(3)
    hc, dim = 4, 64
    fn, base, scale = torch.randn(24, hc * dim, generator=gen) * 0.05, torch.randn(24, generator=gen), torch.rand(3)
    norm_w = torch.rand(dim, generator=gen) + 0.5
    cos, sin = torch.rand(1, 8, generator=gen), torch.rand(1, 8, generator=gen)
    needle = torch.randn(3, hc, dim, generator=gen)
    block_a, block_b = torch.randn(3, dim, generator=gen), torch.randn(3, dim, generator=gen)
    post, comb = torch.rand(3, hc, generator=gen), torch.rand(3, hc, hc, generator=gen)

    def run(streams, a, b, p, c):
        pre = OFFERED["hc_pre_normed"](streams, fn, base, scale, 20, 1e-6, 1e-6, norm_w)
        summed = OFFERED["hc_post_sum"](streams, a, b, p, c)
        roped = OFFERED["rms_norm_rope"](a, None, 1e-6, cos.expand(a.shape[0], 8), sin.expand(a.shape[0], 8))
        return (*pre, summed, roped)

    alone = run(needle, block_a, block_b, post, comb)
    want = (*REF["hc_pre_normed"](needle, fn, base, scale, 20, 1e-6, 1e-6, norm_w),
            REF["hc_post_sum"](needle, block_a, block_b, post, comb),
            REF["rms_norm_rope"](block_a, None, 1e-6, cos.expand(3, 8), sin.expand(3, 8)))
    close(alone, want, atol=3e-5, rtol=3e-5)
    for others in (1, 13, 61):
        at = torch.randperm(others + 3, generator=gen)[:3]
        streams = torch.randn(others + 3, hc, dim, generator=gen)
        a, b = torch.randn(others + 3, dim, generator=gen), torch.randn(others + 3, dim, generator=gen)
        p, c = torch.rand(others + 3, hc, generator=gen), torch.rand(others + 3, hc, hc, generator=gen)
        streams[at], a[at], b[at], p[at], c[at] = needle, block_a, block_b, post, comb
        for got, solo in zip(run(streams, a, b, p, c), alone, strict=True):
            assert torch.equal(got[at], solo), others


def test_offered_indexer_scores_keep_a_querys_bits_at_any_query_count():
    """The backend's one-query-row indexer kernel for every query count (the fast path's query-tile kernel from 17
    queries a sequence is not offered): a needle sequence's scores alone equal them among others, close to the
    reference, also at prefill sizes (40 queries)."""
    from bi_harness import check_indexer_close, check_indexer_scores

    op = OFFERED["indexer_scores"]
    assert check_indexer_scores(op, trials=6) == []
    check_indexer_close(op, REF["indexer_scores"])
    gen = torch.Generator().manual_seed(9)
    q, keys, w = torch.randn(2, 40, 4, 16, generator=gen), torch.randn(2, 70, 16, generator=gen), torch.randn(2, 40, 4)
    every = op(q, keys, w, 0.25)
    assert torch.equal(op(q[1:, 17:18], keys[1:], w[1:, 17:18], 0.25)[0, 0], every[1, 17])
    close(every, REF["indexer_scores"](q, keys, w, 0.25), atol=1e-5, rtol=1e-5)
    with pytest.raises(UnsupportedBackendError, match="index heads of 24 dims"):
        op(torch.randn(1, 2, 4, 24), torch.randn(1, 5, 24), torch.randn(1, 2, 4), 0.25)


def test_offered_indexer_topk_selects_a_querys_entries_whatever_the_batch():
    assert check_indexer_topk(OFFERED["indexer_topk"], trials=6) == []


def test_install_takes_the_backends_ops_and_rebuilds_the_ops_made_of_them():
    table = OpTable(variants=lambda kind: OFFERED if kind == SOURCE else {})
    bi_ops.install(table, "nvidia_sm100")
    sources = table.sources()
    assert {sources[name] for name in OFFERED} == {f"{SOURCE} (nvidia_sm100)"}
    assert {sources[name] for name in set(sources) - set(OFFERED)} == {SOURCE}
    assert table.rms_norm is OFFERED["rms_norm"] and table.moe_experts is OFFERED["moe_experts"]
    # roped_sink_attention is made of the backend's fused norm + RoPE, the plugin's attention and the backend's RoPE
    parts, _, _ = DERIVED["roped_sink_attention"]
    assert parts == ("rms_norm_rope", "sink_attention", "apply_rope_")
    assert table.roped_sink_attention is not bi_ops.implementations("nvidia_sm100")["roped_sink_attention"]
    assert table.moe_experts_mxfp4 is not bi_ops.implementations("nvidia_sm100")["moe_experts_mxfp4"]


def test_the_plugin_reaches_backend_kernels_only_through_the_op_table():
    package = Path(bi_ops.__file__).parent
    for source in package.glob("*.py"):
        assert "deepinfer_nvidia_sm100" not in source.read_text(), source.name


@pytest.mark.parametrize("case", fused_cases(), ids=lambda case: case.name)
def test_offered_fused_ops_at_the_tiny_models_sizes_keep_a_rows_bits(case):
    """The fused ops at the shipped checkpoint's sizes: one row alone vs among 1 (a decode step of 2) to 45 others."""
    assert check_rows(case, OFFERED[case.op], sizes=(1, 45), needle_rows=1) == []
    inputs = case.rows(5, torch.Generator().manual_seed(5))
    close(case.call(OFFERED[case.op], inputs), case.call(REF[case.op], inputs), atol=3e-5, rtol=3e-5)


def test_mix_split_variable_sets_the_modes_mixing_split(monkeypatch):
    """``DEEPINFER_NVIDIA_INVARIANT_MIX_SPLITS`` sets the most K splits of the mode's 16-bit mHC mixing (the split
    count still a function of the row length only). Values: on the GPU (``test_cuda.py``); the interpreter's bf16
    ``tl.dot`` is wrong (``triton_kernels``' docstring)."""
    from deepinfer_nvidia_sm100.kernels import hc

    gen = torch.Generator().manual_seed(3)
    streams = torch.randn(3, 4, 4096, generator=gen).bfloat16()  # [T, hc, D]: V4-Flash's K = 16,384, 128 steps of 128
    fn = torch.randn(24, 16384, generator=gen) * 0.02
    for value, splits in ((None, min(128, hc.INVARIANT_MIX_SPLITS)), ("32", 32), ("1", 1)):
        if value is None:
            monkeypatch.delenv("DEEPINFER_NVIDIA_INVARIANT_MIX_SPLITS", raising=False)
        else:
            monkeypatch.setenv("DEEPINFER_NVIDIA_INVARIANT_MIX_SPLITS", value)
        assert hc.hc_mix_logits(streams, fn, 1e-6, partials=True, invariant=True)[2] == splits
        assert hc.hc_mix_logits(streams[:1], fn, 1e-6, partials=True, invariant=True)[2] == splits  # any row count

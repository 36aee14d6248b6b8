"""Batch invariance on an NVIDIA GPU (marker ``nvidia``; skipped with the probe's reason elsewhere).

Op level: every CUDA variant gives a needle's rows the same bits alone and among random rows (the harness's
CPU-built inputs are moved to the GPU), at the test sizes and at DeepSeek-V4 sizes. End to end: the shipped
checkpoint (``deepinfer_core/assets/tiny_v4``) through ``LLM(..., backend="nvidia_sm100",
batch_invariant=True)``, a greedy and a seeded needle alone vs inside random batches of 2 to 64 requests
with chunked prefill, in bf16 and fp32: tokens and whole log-probability rows ``torch.equal``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from bi_harness import (
    RowCase,
    attention_tiles_agree,
    check_attention,
    check_indexer_scores,
    check_rows,
    close,
    fused_cases,
    outputs_equal,
    random_batch,
    record,
    row_cases,
)

pytestmark = pytest.mark.nvidia

TINY_V4 = Path(__file__).resolve().parents[3] / "deepinfer_core" / "assets" / "tiny_v4"
VOCAB = 4096


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple | list):
        return type(obj)(_to(o, device) for o in obj)
    return obj


def on_cuda(op):
    """``op`` with its tensor arguments moved to the GPU and its results back (for the CPU-built harness)."""

    def run(*args, **kwargs):
        return _to(op(*_to(args, "cuda"), **kwargs), "cpu")

    return run


@pytest.fixture(scope="module", params=["installed", "portable"])
def bi(request):
    """The ops as the mode installs them on this backend (its own batch-invariant kernels where it offers them,
    through the op table), or the plugin's portable forms alone."""
    from deepinfer_batch_invariant.ops import implementations
    from deepinfer_nvidia_sm100.backend import NvidiaBackend

    offered = NvidiaBackend().make_op_table().variants("batch_invariant") if request.param == "installed" else {}
    return implementations("nvidia_sm100", offered)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_ops_bitwise_invariant_on_gpu(bi, dtype):
    failures = {case.name: check_rows(case, on_cuda(bi[case.op]), sizes=(0, 1, 2, 7, 17, 64, 100, 300))
                for case in row_cases(dtype)}
    assert {name: f for name, f in failures.items() if f} == {}


@pytest.mark.parametrize("splits", ["32", "128"])
def test_hc_pre_invariant_at_the_mixing_splits_on_gpu(monkeypatch, splits):
    """bf16 ``hc_pre`` at V4-Flash's row length (4 streams x 4,096: 128 K steps) with
    ``DEEPINFER_NVIDIA_INVARIANT_MIX_SPLITS`` at the default 128 (one K step a split) and at 32: a row alone and among
    others, the same bits."""
    from deepinfer_batch_invariant.ops import implementations
    from deepinfer_nvidia_sm100.backend import NvidiaBackend

    monkeypatch.setenv("DEEPINFER_NVIDIA_INVARIANT_MIX_SPLITS", splits)
    op = implementations("nvidia_sm100", NvidiaBackend().make_op_table().variants("batch_invariant"))["hc_pre"]
    gen = torch.Generator().manual_seed(0)
    fn, base = torch.randn(24, 16384, generator=gen) * 0.01, torch.randn(24, generator=gen)
    scale = torch.randn(3, generator=gen)
    case = RowCase("hc_pre v4", "hc_pre", lambda n, g: [torch.randn(n, 4, 4096, generator=g).bfloat16()],
                   lambda op, r: op(r[0], fn, base, scale, 20, 1e-6, 1e-6))
    assert check_rows(case, on_cuda(op), sizes=(0, 1, 2, 7, 17, 64, 100, 300)) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_bitwise_invariant_on_gpu(bi, dtype):
    """``hc_pre_normed``, ``hc_post_sum`` and ``rms_norm_rope`` at the shipped checkpoint's sizes: one row alone vs
    among 1 (a decode step of 2) to 64 others at random places."""
    failures = {case.name: check_rows(case, on_cuda(bi[case.op]), sizes=(1, 2, 7, 45, 64), needle_rows=1)
                for case in fused_cases(dtype)}
    assert {name: f for name, f in failures.items() if f} == {}


def test_row_ops_close_to_reference_on_gpu(bi):
    from deepinfer_core.ops.table import reference_ops

    ref = reference_ops()
    for case in row_cases():
        inputs = case.rows(37, torch.Generator().manual_seed(7))
        close(case.call(on_cuda(bi[case.op]), inputs), case.call(ref[case.op], inputs), atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_and_indexer_invariant_on_gpu(bi, dtype):
    assert check_attention(on_cuda(bi["sink_attention"]), trials=12, dtype=dtype) == []
    assert check_indexer_scores(on_cuda(bi["indexer_scores"]), trials=8) == []


def test_attention_tiles_agree_bitwise_on_gpu(monkeypatch):
    """V4-Flash's 64 heads x 512 in bf16: 16 heads a program (decode of few queries) gives the 64-head tile's bits,
    so the tile may follow the number of queries."""
    from deepinfer_batch_invariant import triton_kernels

    from deepinfer_core.ops.table import reference_ops

    attention_tiles_agree(triton_kernels.sink_attention, reference_ops()["sink_attention"],
                          lambda few: monkeypatch.setattr(triton_kernels, "ATTN_FEW_PROGRAMS", few), H=64, d=512,
                          device="cuda")


def test_v4_sizes_invariant_on_gpu(bi):
    """DeepSeek-V4-Flash shapes: a 4096 -> 1024 bf16 projection with up to 2048 other rows, attention with
    64 heads x 512 and up to 5 other sequences, the indexer with 64 heads x 128."""
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(1024, 4096, generator=gen) * 0.02).bfloat16().cuda()
    needle = torch.randn(3, 4096, generator=gen).bfloat16().cuda()
    alone = bi["linear"](needle, w)
    for m in (1, 15, 63, 64, 200, 2048):
        x = torch.randn(m + 3, 4096, generator=gen).bfloat16().cuda()
        at = torch.randperm(m + 3, generator=gen)[:3].cuda()
        x[at] = needle
        assert torch.equal(bi["linear"](x, w)[at], alone), m
    assert check_attention(on_cuda(bi["sink_attention"]), trials=4, H=64, d=512, dtype=torch.bfloat16) == []
    assert check_indexer_scores(on_cuda(bi["indexer_scores"]), trials=4, Hi=64, di=128) == []


@pytest.mark.parametrize(("n", "k", "groups"), [(1024, 4096, 1), (4096, 8192, 1), (1024, 4096, 8), (129, 4096, 1)])
def test_gemm_launches_agree_bitwise_on_gpu(n, k, groups):
    """The GEMM's launches (split-K in 64 x 64 and 128 x 128 tiles, with the fused fold or a fold kernel;
    the prefill tile summing its splits in one program) give every element the same bits at V4 projection shapes
    (``wq_a``-like, ``wo_b``, the grouped ``wo_a``, a ragged N), at decode and prefill row counts: so the row count may
    pick the launch."""
    from deepinfer_batch_invariant import triton_kernels

    gen = torch.Generator().manual_seed(n + k + groups)
    w = (torch.randn(groups * n, k, generator=gen) * 0.02).bfloat16().cuda()
    for m in (1, 64, 200, 700):
        x = torch.randn(m, groups, k, generator=gen).bfloat16().cuda()
        split = triton_kernels._grouped_matmul(x, w, groups, launch="split")  # the fused fold where the weight is split
        assert torch.equal(triton_kernels._grouped_matmul(x, w, groups, launch="split", fused_fold=False), split), m
        for launch in triton_kernels.LAUNCHES:
            assert torch.equal(triton_kernels._grouped_matmul(x, w, groups, launch=launch), split), (m, launch)
    for counts in triton_kernels.FOLD_COUNTS.buffers():
        assert not counts.any()  # every tile's last program reset its count


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_fold_agrees_with_the_fold_kernel_on_gpu(dtype):
    """Split-K partials added by each tile's last program equal the fold kernel's, launch after launch (the counts
    return to zero), including GEMMs on a high-priority stream beside the main one (the engine's ``fork``: a count
    buffer per stream priority), and replayed from a CUDA graph captured after eager launches."""
    from deepinfer_batch_invariant import triton_kernels

    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(1024, 4096, generator=gen) * 0.02).to(dtype).cuda()  # 16 N tiles x 8 splits
    x = torch.randn(48, 4096, generator=gen).to(dtype).cuda()
    want = triton_kernels._grouped_matmul(x[:, None], w, 1, launch="split", fused_fold=False)[:, 0]
    side = torch.cuda.Stream(priority=-1)
    assert side.priority != torch.cuda.current_stream().priority
    for _ in range(20):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            beside = triton_kernels.matmul_nt(x, w)
        here = triton_kernels.matmul_nt(x, w)
        torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(here, want) and torch.equal(beside, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_kernels.matmul_nt(x, w)
    for _ in range(3):
        captured.zero_()
        graph.replay()
        assert torch.equal(captured, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_tiles_agree_bitwise_on_gpu(dtype):
    """The mode's MoE kernels (``invariant.MOE_TILE`` up to 64 assignments per expert, for 16-bit steps of one or two
    tokens over many experts ``MOE_DECODE_TILE``; above, the CUTLASS grouped GEMM for bf16 and ``MOE_PREFILL_TILE``)
    give every token the same bits: one token alone equals it among 1,500 others, through each of them."""
    from deepinfer_nvidia_sm100.kernels import invariant, moe

    gen = torch.Generator().manual_seed(3)
    E, D, I, top_k, T = 8, 4096, 2048, 6, 1501
    w1, w3 = ((torch.randn(E, I, D, generator=gen) * 0.02).to(dtype).cuda() for _ in range(2))
    w2 = (torch.randn(E, D, I, generator=gen) * 0.02).to(dtype).cuda()
    x = torch.randn(T, D, generator=gen).to(dtype).cuda()
    ids = torch.rand(T, E, generator=gen).topk(top_k, dim=-1).indices.cuda()
    weights = torch.rand(T, top_k, generator=gen).cuda()
    assert invariant.moe_tile(T * top_k, E, dtype) == invariant.MOE_PREFILL_TILE
    many = invariant.moe_experts(x, ids, weights, w1, w2, w3, 10.0)
    small = moe.moe_experts(x, ids, weights, w1, w2, w3, 10.0, config=invariant.MOE_TILE)
    wide = moe.moe_experts(x, ids, weights, w1, w2, w3, 10.0, config=invariant.MOE_PREFILL_TILE)
    assert torch.equal(many, small) and torch.equal(wide, small)
    if dtype == torch.bfloat16:
        assert invariant.moe_tile(top_k, 64, dtype) == invariant.MOE_DECODE_TILE  # a lone V4-Flash token
        assert torch.equal(moe.moe_experts(x, ids, weights, w1, w2, w3, 10.0, config=invariant.MOE_DECODE_TILE), small)
        assert moe.uses_grouped_gemm(x, T * top_k, E)
        assert torch.equal(moe.moe_experts_grouped(x, ids, weights, w1, w2, w3, 10.0), small)
    for t in (0, 777, T - 1):
        alone = invariant.moe_experts(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], w1, w2, w3, 10.0)
        assert torch.equal(alone, many[t:t + 1]), t


def test_sampler_row_ops_invariant_on_gpu():
    """The sampler's log_softmax / softmax (core code, plain torch) give a row the same bits in any batch."""
    gen = torch.Generator().manual_seed(0)
    needle = torch.randn(1, VOCAB, generator=gen).cuda() * 4
    for fn in (torch.log_softmax, torch.softmax):
        alone = fn(needle, dim=-1)
        for m in (1, 7, 64, 255):
            x = torch.randn(m + 1, VOCAB, generator=gen).cuda()
            x[m // 2] = needle[0]
            assert torch.equal(fn(x, dim=-1)[m // 2], alone[0]), (fn.__name__, m)


# ----------------------------------------------------------------------------- end to end
def _needles():
    from deepinfer_core import SamplingParams

    gen = torch.Generator().manual_seed(2024)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=VOCAB, prompt_logprobs=VOCAB)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seq_seed=1234, max_tokens=8, ignore_eos=True,
                            logprobs=VOCAB, prompt_logprobs=VOCAB)
    return [(torch.randint(3, VOCAB, (45,), generator=gen).tolist(), greedy),
            (torch.randint(3, VOCAB, (30,), generator=gen).tolist(), seeded)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_needles_bitwise_identical_in_random_batches_on_gpu(dtype):
    from deepinfer_core import LLM

    needles = _needles()

    def llm(**kwargs):
        return LLM(str(TINY_V4), backend="nvidia_sm100", dtype=dtype, batch_invariant=True,
                   max_num_seqs=64, enable_prefix_caching=False, **kwargs)

    solo = llm(max_num_batched_tokens=512)
    sources = set(solo.model.ops.sources().values())
    assert sources == {"batch_invariant", "batch_invariant (nvidia_sm100)"}, sources  # the backend's kernels too
    alone = [record(solo.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0], VOCAB) for p, sp in needles]
    del solo
    batched = llm(max_num_batched_tokens=128)  # chunked prefill: prompts split, mixed with decode tokens
    gen = torch.Generator().manual_seed(0)
    for num_others in (0, 1, 6, 21, 62):  # batches of 2 .. 64 requests
        prompts, params, where = random_batch(gen, num_others, needles, VOCAB,
                                              max_tokens=(24, 48) if num_others > 21 else (1, 12))
        outputs = batched.generate(prompts, params, use_tqdm=False)
        for needle, at in enumerate(where):
            assert outputs_equal(record(outputs[at], VOCAB), alone[needle]), (dtype, needle, len(prompts))

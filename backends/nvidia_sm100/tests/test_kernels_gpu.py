"""Every fast op against its reference op, on the GPU (marker ``nvidia``)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from deepinfer_core.ops import reference as ref

pytestmark = pytest.mark.nvidia


def _moe_case(T, E, k, D, I, dtype, seed=0, hot=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, D, device="cuda", generator=gen).to(dtype)
    w1 = (torch.randn(E, I, D, device="cuda", generator=gen) * D**-0.5).to(dtype)
    w2 = (torch.randn(E, D, I, device="cuda", generator=gen) * I**-0.5).to(dtype)
    w3 = (torch.randn(E, I, D, device="cuda", generator=gen) * D**-0.5).to(dtype)
    scores = torch.rand(T, E, device="cuda", generator=gen)
    if hot is not None:  # skew: every token picks expert `hot` first (many tokens on one expert)
        scores[:, hot] = 2.0
    ids = scores.topk(k, dim=-1).indices
    weights = torch.rand(T, k, device="cuda", generator=gen).float()
    return x, ids, weights, w1, w2, w3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, E, k, D, I, hot", [
    (1, 8, 2, 64, 32, None), (3, 4, 2, 32, 16, None), (64, 16, 6, 256, 128, None), (300, 8, 2, 128, 96, 3),
    (17, 64, 6, 512, 256, None), (1, 64, 6, 4096, 2048, None), (64, 64, 6, 4096, 2048, None),
])
def test_moe_experts_matches_reference(T, E, k, D, I, hot, dtype):
    from deepinfer_nvidia_sm100.kernels.moe import moe_experts

    x, ids, weights, w1, w2, w3 = _moe_case(T, E, k, D, I, dtype, hot=hot)
    limit = 0.5  # small: the clamp is active on many channels
    got = moe_experts(x, ids, weights, w1, w2, w3, limit)
    want = ref.moe_experts(x, ids, weights, w1, w2, w3, limit)
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("group_align", [1, 16])
@pytest.mark.parametrize("T, E, k, D, I, hot", [
    (300, 8, 2, 128, 96, 3), (2048, 64, 6, 4096, 2048, None), (1000, 16, 2, 256, 128, 5), (4100, 64, 6, 512, 256, 0),
])
def test_moe_experts_grouped_gemm_matches_reference(T, E, k, D, I, hot, group_align):
    """The prefill path through ``torch._grouped_mm`` (bf16 only), with skewed loads (``hot``: every token on one
    expert, some experts empty) and unpadded / padded expert runs; ``moe_experts`` takes it at these sizes."""
    from deepinfer_nvidia_sm100.kernels import moe

    x, ids, weights, w1, w2, w3 = _moe_case(T, E, k, D, I, torch.bfloat16, hot=hot)
    assert moe.uses_grouped_gemm(x, T * k, E)
    got = moe.moe_experts_grouped(x, ids, weights, w1, w2, w3, 0.5, group_align=group_align)
    want = ref.moe_experts(x, ids, weights, w1, w2, w3, 0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(moe.moe_experts(x, ids, weights, w1, w2, w3, 0.5).float(), want.float(),
                               atol=2e-2, rtol=2e-2)


def test_moe_align_layout():
    from deepinfer_nvidia_sm100.kernels.moe import align

    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device="cuda")
    sorted_assign, block_expert, dest = align(ids, num_experts=4, block_m=4)
    flat = ids.reshape(-1)
    for i, d in enumerate(dest.tolist()):
        assert sorted_assign[d].item() == i and block_expert[d // 4].item() == flat[i].item()
    assert (block_expert[block_expert >= 0].diff() >= 0).all()


@pytest.mark.parametrize("T", [16, 1024])  # Triton kernels; grouped GEMM (prefill sizes)
def test_moe_experts_in_cuda_graph_has_no_host_sync(T):
    from deepinfer_nvidia_sm100.backend import NvidiaBackend
    from deepinfer_nvidia_sm100.kernels.moe import moe_experts

    backend = NvidiaBackend()
    x, ids, weights, w1, w2, w3 = _moe_case(T, 16, 4, 256, 128, torch.bfloat16)
    run = backend.capture_graph(lambda a, b, c: moe_experts(a, b, c, w1, w2, w3, 1.0), (x, ids, weights))
    x2, ids2, weights2, *_ = _moe_case(T, 16, 4, 256, 128, torch.bfloat16, seed=1)
    got = run(x2, ids2, weights2)
    want = ref.moe_experts(x2, ids2, weights2, w1, w2, w3, 1.0)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_fork_runs_beside_the_callers_stream_until_joined():
    from deepinfer_nvidia_sm100.kernels import streams

    x = torch.zeros(4, device="cuda")

    def slow_fold(t: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU clock cycles on the side stream
        t.add_(1)
        return t * 2

    pending = streams.fork(slow_fold, x)
    mark = torch.cuda.Event()
    mark.record()  # the caller's stream: nothing queued since the fork
    mark.synchronize()
    assert not streams.side_stream(x.device).query(), "the forked work should still be running on the side stream"
    result = pending.join()
    assert torch.equal(result, torch.full((4,), 2.0, device="cuda")) and torch.equal(x, torch.ones(4, device="cuda"))


def test_fork_runs_prefill_sized_work_in_place():
    from deepinfer_nvidia_sm100.kernels import streams

    x = torch.zeros(streams.MAX_ROWS + 1, 4, device="cuda")
    pending = streams.fork(lambda t: t.add_(1), x)
    assert isinstance(pending, ref.Finished) and torch.equal(x, torch.ones_like(x))


def test_fork_inside_a_cuda_graph_replays_both_branches():
    from deepinfer_nvidia_sm100.backend import NvidiaBackend
    from deepinfer_nvidia_sm100.kernels import streams

    def step(a: torch.Tensor) -> torch.Tensor:
        pending = streams.fork(lambda t: t * 3, a)
        return (a + 1) + pending.join()

    run = NvidiaBackend().capture_graph(step, (torch.zeros(8, device="cuda"),))
    a = torch.arange(8, device="cuda", dtype=torch.float32)
    assert torch.equal(run(a), a * 4 + 1)


def test_sampled_rows_reach_the_host_beside_the_next_step():
    """The engine's copy of a step's sampled rows (``copy_rows_to_host``) runs on a side stream after the sampler: the
    rows read back exact, and the copy is done while work queued after it on the current stream still runs."""
    from deepinfer_core.engine.model_runner import LaunchedStep, copy_rows_to_host
    from deepinfer_core.engine.scheduler import SchedulerOutput
    from deepinfer_core.sampling.sampler import SamplerOutput

    ids = torch.tensor([5, 129279, 0], device="cuda")
    out = SamplerOutput(ids, torch.tensor([-0.5, -1.25, -3.0], device="cuda"), torch.tensor([1, 2, 7], device="cuda"))
    copy = LaunchedStep(SchedulerOutput([], []), out, ["a", "b", "c"], {}, *copy_rows_to_host(out), ready=None)
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(40):  # the next step, queued after the copy: tens of milliseconds
        a = a @ a * 1e-2
    later = torch.cuda.Event()
    later.record()
    rows = copy.read()
    assert not later.query(), "the copy waited for the work queued after it"
    assert rows.sampled_token_ids == [5, 129279, 0] and rows.logprobs == [-0.5, -1.25, -3.0]
    assert rows.ranks == [1, 2, 7] and rows.sampled == {"a": 5, "b": 129279, "c": 0}
    torch.cuda.synchronize()


def test_backend_contract_on_device():
    from deepinfer_nvidia_sm100.backend import NvidiaBackend

    backend = NvidiaBackend()
    caps = backend.capabilities()
    assert caps.distributed_backend == "nccl" and torch.bfloat16 in caps.dtypes
    mem = backend.memory_info()
    assert 0 < mem.free_bytes <= mem.total_bytes
    assert backend.device.type == "cuda"
    table = backend.make_op_table()
    assert table.sources()["moe_experts"] == "nvidia_sm100" and table.sources()["fork"] == "nvidia_sm100"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_ops_match_reference(dtype):
    """The compiled reference ops and the hand-written small Triton kernels (``backend.triton_ops``)."""
    from deepinfer_nvidia_sm100.backend import triton_ops
    from deepinfer_nvidia_sm100.kernels import compiled

    ops = triton_ops()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, device="cuda", generator=gen).to(dt)

    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for T in (1, 7, 64):
        hc, D = 4, 256
        streams, fn = rnd(T, hc, D), rnd((2 + hc) * hc, hc * D, dt=torch.float32) * 0.05
        base, scale = rnd((2 + hc) * hc, dt=torch.float32), rnd(3, dt=torch.float32)
        cases = {
            "rms_norm": (rnd(T, D), rnd(D, dt=torch.float32), 1e-6),
            "unweighted_rms_norm": (rnd(T, 4, 64), 1e-6),
            "apply_rope": (rnd(T, 4, 64), rnd(T, 8), rnd(T, 8)),
            "rope_cos_sin": (torch.arange(T, device="cuda") * 37, rnd(8, dt=torch.float32).abs(), 1.25, dtype),
            "hc_post": (streams, rnd(T, D), rnd(T, hc, dt=torch.float32), rnd(T, hc, hc, dt=torch.float32)),
            "hc_post_sum": (streams, rnd(T, D), rnd(T, D), rnd(T, hc, dt=torch.float32),
                            rnd(T, hc, hc, dt=torch.float32)),
            "hc_head": (streams, fn[:hc], base[:hc], scale[:1], 1e-6, 1e-6),
            "compressor_pool": (rnd(T, 8, 64), rnd(T, 8, 64), rnd(64, dt=torch.float32), 1e-6),
            "compressor_window": (  # T windows of 8 slots (CSA: ratio 4, width 2 x 64) over 3 carry slots
                rnd(T, 128), rnd(T, 128), rnd(3, 8, 128), rnd(3, 8, 128),
                torch.rand(T, 8, device="cuda", generator=gen) > 0.5,
                torch.randint(0, T, (T, 8), device="cuda", generator=gen),
                torch.randint(0, 3, (T, 8), device="cuda", generator=gen),
                torch.arange(8, device="cuda").expand(T, -1), torch.rand(T, 8, device="cuda", generator=gen) > 0.2,
                rnd(4, 128, dt=torch.float32), 4, True),
        }
        for name, args in cases.items():
            with compiled.capturing() if name in compiled.GRAPH_ONLY_OPS else contextlib.nullcontext():
                got = ops[name](*args)  # the graph-only ops as a graph capture runs them (compiled)
            want = getattr(ref, name)(*args)
            for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                torch.testing.assert_close(g.float(), w.float(), **tol, msg=lambda m, n=name, t=T: f"{n} T={t}: {m}")
        torch.testing.assert_close(ops["apply_rope"](*cases["apply_rope"], inverse=True).float(),
                                   ref.apply_rope(*cases["apply_rope"], inverse=True).float(), **tol)


@pytest.mark.parametrize("seqs, queries, entries", [(1, 1000, 2048), (4, 1, 1500), (2, 130, 520)])
def test_indexer_scores_matches_reference_at_preset_heads(seqs, queries, entries):
    """The preset's indexer (64 heads x 128) in bf16: prefill of one long prompt, decode rows, tiles past the ends."""
    from deepinfer_nvidia_sm100.kernels.indexer import indexer_scores

    gen = torch.Generator(device="cuda").manual_seed(entries)
    q = torch.randn(seqs, queries, 64, 128, device="cuda", generator=gen).to(torch.bfloat16)
    keys = torch.randn(seqs, entries, 128, device="cuda", generator=gen).to(torch.bfloat16)
    weights = torch.randn(seqs, queries, 64, device="cuda", generator=gen) * 0.125
    got = indexer_scores(q, keys, weights, 128**-0.5)
    want = ref.indexer_scores(q, keys, weights, 128**-0.5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _topk_case(seqs, queries, entries, levels, seed=0):
    """Scores with ``levels`` distinct values (0: bf16-rounded normals, still many ties), causal-like visibility with
    holes, a query that sees nothing and one that sees fewer entries than ``k``."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.randn(seqs, queries, entries, device="cuda", generator=gen).bfloat16().float()
    if levels:
        scores = torch.randint(0, levels, scores.shape, device="cuda", generator=gen).float() - levels / 2
    limit = torch.linspace(entries // 8, entries, queries, device="cuda").long()  # [Lq]
    visible = torch.arange(entries, device="cuda")[None, None, :] < limit[None, :, None]  # [1, Lq, E]
    visible = visible & (torch.rand(seqs, queries, entries, device="cuda", generator=gen) > 0.05)
    if queries > 1:  # a query that sees nothing, one that sees fewer entries than k
        visible[:, 0] = False
        visible[:, 1, 5:] = False
    else:  # decode rows (one query per sequence): the same cases across sequences
        visible[0] = False
        visible[1, :, 5:] = False
    return scores, visible


@pytest.mark.parametrize("seqs, queries, entries, levels, k", [
    (1, 256, 65536, 0, 512), (2, 64, 20000, 9, 512), (1, 300, 5000, 3, 2048), (16, 1, 32768, 0, 512),
])
def test_indexer_topk_matches_reference_at_long_rows(seqs, queries, entries, levels, k):
    """The selection is the reference's bit for bit (ties: lower entry index; invisible never), rows up to 64K: the
    op, and each of its forms (the radix select, order keys + ``torch.topk``) on every case."""
    from deepinfer_nvidia_sm100.kernels.indexer_topk import indexer_topk, keyed_topk, radix_topk

    scores, visible = _topk_case(seqs, queries, entries, levels, seed=entries)
    want = ref.indexer_topk(scores, visible, k)
    got = indexer_topk(scores, visible, k)
    assert torch.equal(got, want)
    assert (got.sum(-1) == torch.clamp(visible.sum(-1), max=k)).all()
    for form in (radix_topk, keyed_topk):
        assert torch.equal(form(scores.view(-1, entries), visible.view(-1, entries), k), want.view(-1, entries))


@pytest.mark.parametrize("radix", ["1", "0"])
def test_indexer_topk_replays_in_a_cuda_graph(radix, monkeypatch):
    """A captured prefill step runs the op inside a CUDA graph: capture, change the inputs in place, replay."""
    from deepinfer_nvidia_sm100.kernels.indexer_topk import indexer_topk

    monkeypatch.setenv("DEEPINFER_NVIDIA_RADIX_TOPK", radix)

    scores, visible = _topk_case(1, 128, 8192, 0, seed=1)
    indexer_topk(scores, visible, 512)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = indexer_topk(scores, visible, 512)
    new_scores, new_visible = _topk_case(1, 128, 8192, 5, seed=2)
    scores.copy_(new_scores)
    visible.copy_(new_visible)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref.indexer_topk(new_scores, new_visible, 512))


def _quantized_experts(fmt: str, E: int, D: int, I: int, seed: int = 0):
    """Experts of the preset's widths written as ``fmt`` (``"mxfp4"``; ``"fp8"``: 128 x 128 float32 blocks, as
    V4-Flash-Base): ``(w1, s1, w2, s2, w3, s3)``."""
    from deepinfer_core.quant import fp8_block, mxfp4

    gen = torch.Generator(device="cuda").manual_seed(seed)
    stored = []
    for rows, cols in ((I, D), (D, I), (I, D)):
        dense = (torch.randn(E, rows, cols, device="cuda", generator=gen) * cols**-0.5).to(torch.bfloat16)
        stored += mxfp4.quantize(dense) if fmt == "mxfp4" else fp8_block.quantize(dense, (128, 128), ue8m0=False)
    return tuple(stored)


def _quantized_moe(fmt: str):
    """(kernel, reference) of ``fmt``'s routed-experts op, taking ``(x, ids, weights, *stored, limit)``."""
    from deepinfer_nvidia_sm100.kernels import moe_quant

    if fmt == "mxfp4":
        return moe_quant.moe_experts_mxfp4, ref.moe_experts_mxfp4
    return (lambda *a: moe_quant.moe_experts_fp8_block(*a[:-1], (128, 128), a[-1]),
            lambda *a: ref.moe_experts_fp8_block(*a[:-1], (128, 128), a[-1]))


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@pytest.mark.parametrize("T", [1, 16, 64, 1024])
def test_quantized_moe_experts_match_reference_at_preset_sizes(fmt, T):
    """The v4-flash-8l64e-fp4 expert shapes (E=64, top-6, D=4096, I=2048), bf16 activations: one token (row
    kernels), the 16- and 64-row tiles, a prefill batch; against the reference op on the same stored bytes."""
    E, k, D, I = 64, 6, 4096, 2048
    gen = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, D, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand(T, E, device="cuda", generator=gen).topk(k, dim=-1).indices
    weights = torch.rand(T, k, device="cuda", generator=gen)
    stored = _quantized_experts(fmt, E, D, I)
    fast, reference = _quantized_moe(fmt)
    got, want = fast(x, ids, weights, *stored, 0.5), reference(x, ids, weights, *stored, 0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tile", [(8, 2048, 2, 1), (4, 2048, 2, 1), (2, 4096, 4, 1), (4, 2048, 4, 3), (2, 2048, 4, 3)])
def test_mxfp4_one_token_row_tiles_match_reference(tile):
    """The one-token row kernels at the sweep's other tiles (several rows of one scale group a thread, or slices of
    2,048 inputs; ``mxfp4_row_sums`` on each), at the preset's widths, against the reference op."""
    from deepinfer_nvidia_sm100.kernels import moe_quant

    E, k, D, I = 64, 6, 4096, 2048
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, D, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.randperm(E, device="cuda", generator=gen)[:k][None]
    weights = torch.rand(1, k, device="cuda", generator=gen)
    stored = _quantized_experts("mxfp4", E, D, I)
    got = moe_quant._run(moe_quant.MXFP4, x, ids, weights, *stored, moe_quant.MXFP4_BLOCK, 0.5, tile,
                         row_kernels=True)
    want = ref.moe_experts_mxfp4(x, ids, weights, *stored, 0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("path", ["one token grouped", "mxfp4 float32 decode"])
def test_mxfp4_experts_other_paths_match_reference_at_preset_sizes(path, monkeypatch):
    """The MXFP4 paths off by default at the preset's widths: one token through the grouped kernels' 16-row tiles
    (``ONE_TOKEN_ROW_KERNELS = False``) and 64 tokens through the float32 decode
    (``DEEPINFER_NVIDIA_MXFP4_DOT_SCALED=0``), against the reference op."""
    from deepinfer_nvidia_sm100.kernels import moe_quant

    E, k, D, I = 64, 6, 4096, 2048
    T = 1 if path == "one token grouped" else 64
    if path == "one token grouped":
        monkeypatch.setattr(moe_quant, "ONE_TOKEN_ROW_KERNELS", False)
    else:
        monkeypatch.setenv("DEEPINFER_NVIDIA_MXFP4_DOT_SCALED", "0")
        monkeypatch.setattr(moe_quant.moe_mxfp4_decode, "MAX_PER_EXPERT", 0)  # the grouped kernels, not these
    gen = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, D, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand(T, E, device="cuda", generator=gen).topk(k, dim=-1).indices
    weights = torch.rand(T, k, device="cuda", generator=gen)
    stored = _quantized_experts("mxfp4", E, D, I)
    got = moe_quant.moe_experts_mxfp4(x, ids, weights, *stored, 0.5)
    want = ref.moe_experts_mxfp4(x, ids, weights, *stored, 0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("T", [1, 16, 64, 256, 2048])
@pytest.mark.parametrize("variant", ["default", "128 inputs a step", "portable"])
def test_mxfp4_decode_kernels_match_reference_at_preset_sizes(T, variant):
    """``moe_mxfp4_decode`` at the preset's widths, bf16: its default launch for the token count (PTX decode; one token
    as ``run`` takes it when asked, though the op sends it to the row kernels), 128 inputs a loop step, and the decode
    without inline PTX; against the reference op."""
    from deepinfer_nvidia_sm100.kernels import moe_mxfp4_decode

    E, k, D, I = 64, 6, 4096, 2048
    gen = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, D, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand(T, E, device="cuda", generator=gen).topk(k, dim=-1).indices
    weights = torch.rand(T, k, device="cuda", generator=gen)
    stored = _quantized_experts("mxfp4", E, D, I)
    launch = list(moe_mxfp4_decode.tile(T * k, E))
    if variant == "128 inputs a step":
        launch[1] = 128
    decode = moe_mxfp4_decode.PORTABLE if variant == "portable" else None
    got = moe_mxfp4_decode.run(x, ids, weights, *(t.view(torch.uint8) for t in stored), 0.5, tuple(launch), decode)
    want = ref.moe_experts_mxfp4(x, ids, weights, *stored, 0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@pytest.mark.parametrize("T", [1, 16])
def test_quantized_moe_experts_in_cuda_graph_have_no_host_sync(fmt, T):
    from deepinfer_nvidia_sm100.backend import NvidiaBackend

    stored = _quantized_experts(fmt, 16, 256, 128)
    fast, reference = _quantized_moe(fmt)
    x, ids, weights, *_ = _moe_case(T, 16, 4, 256, 128, torch.bfloat16)
    run = NvidiaBackend().capture_graph(lambda a, b, c: fast(a, b, c, *stored, 1.0), (x, ids, weights))
    x2, ids2, weights2, *_ = _moe_case(T, 16, 4, 256, 128, torch.bfloat16, seed=1)
    torch.testing.assert_close(run(x2, ids2, weights2).float(), reference(x2, ids2, weights2, *stored, 1.0).float(),
                               atol=2e-2, rtol=2e-2)


def activations_as_quantized(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``x [rows, groups, K]`` as the tensor-core paths see it: quantized to e4m3 per row and ``block[1]`` inputs,
    decoded back to bf16."""
    from deepinfer_core.quant import fp8_block

    rows, groups, k = x.shape
    q, s = fp8_block.quantize(x.reshape(rows * groups, k).float(), (1, block[1]), ue8m0=False)
    return fp8_block.dequantize(q, s, (1, block[1])).view(rows, groups, k).to(torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 16, 64, 256, 2048])
@pytest.mark.parametrize("n, k, groups, block", [(4096, 8192, 1, (128, 128)), (1024, 4096, 8, (128, 128)),
                                                 (4096, 8192, 1, (32, 32))])  # wo_b; the grouped wo_a; V4.1 blocks
def test_fp8_linear_paths_match_reference_at_preset_sizes(rows, n, k, groups, block):
    """Each kernel at the preset's projection widths (ue8m0 blocks, bf16): the weight-only ones (row, split-K,
    weight-only, dequant) to bf16 rounding; the tensor-core ones (Triton's, and cuBLAS's blockwise ``SCALED_MM`` for
    128 x 128 blocks) to the reference run on the activations they quantize, and within fp8's error of the
    reference itself; the op is the path it picks, bit for bit."""
    from deepinfer_nvidia_sm100.kernels import fp8_linear

    from deepinfer_core.quant import fp8_block

    gen = torch.Generator(device="cuda").manual_seed(rows)
    weight, scale = fp8_block.quantize(torch.randn(groups * n, k, device="cuda", generator=gen) * k**-0.5, block, True)
    x = torch.randn(rows, groups, k, device="cuda", generator=gen).to(torch.bfloat16)
    want = ref.grouped_linear_fp8_block(x, weight, scale, block, groups).float()
    exact_paths = (fp8_linear.ROW, fp8_linear.SPLIT_K) if rows == 1 else (fp8_linear.SPLIT_K, fp8_linear.WEIGHT_ONLY,
                                                                         fp8_linear.DEQUANT)
    results = {path: fp8_linear.matmul(x, weight, scale, block, groups, path).float() for path in exact_paths}
    for path, got in results.items():
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, msg=lambda m, p=path: f"{p}: {m}")
    x_quantized = activations_as_quantized(x, block)
    quantizing = [fp8_linear.FP8_TC] + ([fp8_linear.SCALED_MM] if fp8_linear.scaled_mm_fits(x, n, k, block) else [])
    seen = ref.grouped_linear_fp8_block(x_quantized, weight, scale, block, groups).float()
    for path in quantizing:
        results[path] = fp8_linear.matmul(x, weight, scale, block, groups, path).float()
        torch.testing.assert_close(results[path], seen, atol=3e-2, rtol=3e-2, msg=lambda m, p=path: f"{p}: {m}")
        assert ((results[path] - want).abs().max() / want.abs().max()).item() < 0.05, path
    op = fp8_linear.grouped_linear_fp8_block(x, weight, scale, block, groups).float()
    path = fp8_linear.picked_path(x, n, block)
    torch.testing.assert_close(op, results[path], atol=0, rtol=0)


@pytest.mark.parametrize("rows", [1, 16, 256])
def test_fp8_linear_in_cuda_graph_has_no_host_sync(rows):
    from deepinfer_nvidia_sm100.backend import NvidiaBackend
    from deepinfer_nvidia_sm100.kernels import fp8_linear

    from deepinfer_core.quant import fp8_block

    weight, scale = fp8_block.quantize(torch.randn(512, 1024, device="cuda") * 0.03, (128, 128), True)
    x = torch.randn(rows, 1024, device="cuda").to(torch.bfloat16)
    run = NvidiaBackend().capture_graph(lambda a: fp8_linear.linear_fp8_block(a, weight, scale, (128, 128)), (x,))
    x2 = torch.randn(rows, 1024, device="cuda").to(torch.bfloat16)
    quantizing = fp8_linear.picked_path(x2.unsqueeze(1), 512, (128, 128)) in (fp8_linear.FP8_TC, fp8_linear.SCALED_MM)
    seen = activations_as_quantized(x2.unsqueeze(1), (128, 128)).squeeze(1) if quantizing else x2
    torch.testing.assert_close(run(x2).float(), ref.linear_fp8_block(seen, weight, scale, (128, 128)).float(),
                               atol=3e-2 if quantizing else 2e-2, rtol=3e-2 if quantizing else 2e-2)


@pytest.mark.parametrize("rows", [4, 16, 64])
def test_fp8_splits_meeting_in_the_kernel_replay_in_cuda_graphs(rows, monkeypatch):
    """``SPLITS_MEET``: a split-K (4 rows) or tensor-core (16, 64 rows) launch whose K splits add up in the kernel,
    captured in a CUDA graph (the counters made by the eager warm-up) and replayed on new inputs: the bits of the
    second-kernel sums every time, the counters back at zero after each replay."""
    from deepinfer_nvidia_sm100.backend import NvidiaBackend
    from deepinfer_nvidia_sm100.kernels import fp8_linear, k_splits

    from deepinfer_core.quant import fp8_block

    weight, scale = fp8_block.quantize(torch.randn(4096, 8192, device="cuda") * 0.01, (128, 128), True)  # wo_b
    x = torch.randn(rows, 8192, device="cuda").to(torch.bfloat16)
    assert fp8_linear._split_k_launch(rows, 4096, 8192, 1, 128, None)[1] > 1 or rows >= fp8_linear.FP8_TC_MIN_ROWS
    monkeypatch.setattr(fp8_linear, "SPLITS_MEET", True)
    run = NvidiaBackend().capture_graph(lambda a: fp8_linear.linear_fp8_block(a, weight, scale, (128, 128)), (x,))
    counters = k_splits.arrival_counters(x.device, 1)  # the buffer the eager warm-up made for this priority
    for seed in range(3):
        x2 = torch.randn(rows, 8192, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        x2 = x2.to(torch.bfloat16)
        got = run(x2).clone()
        torch.cuda.synchronize()
        assert not counters.any()
        with monkeypatch.context() as patch:
            patch.setattr(fp8_linear, "SPLITS_MEET", False)
            assert torch.equal(got, fp8_linear.linear_fp8_block(x2, weight, scale, (128, 128)))


def test_backend_table_takes_the_quantized_kernels():
    from deepinfer_nvidia_sm100.backend import NvidiaBackend

    sources = NvidiaBackend().make_op_table().sources()
    for name in ("linear_fp8_block", "grouped_linear_fp8_block", "swiglu_mlp_fp8_block", "moe_experts_fp8_block",
                 "moe_experts_mxfp4"):
        assert sources[name] == "nvidia_sm100", name


@pytest.mark.parametrize("n, k, groups", [(128, 256, 1), (256, 128, 1), (128, 128, 1), (384, 256, 1), (128, 256, 2),
                                          (256, 256, 2), (384, 512, 1), (256, 512, 2), (128, 1536, 3)])
def test_fp8_linear_matches_reference_at_narrow_widths(n, k, groups):
    """Weights of a few 128 x 128 blocks a side (the tiny model's widths: one or two scale columns, grouped
    ``wo_a``) at 1,024 rows, where the op takes ``SCALED_MM`` or ``DEQUANT``: the op against the reference (on the
    activations it quantizes, where it does), and cuBLAS's blockwise product wherever ``scaled_mm_fits`` lets it run
    (with K / 128 not a multiple of 4 it summed the wrong scales on the H200, silently)."""
    from deepinfer_nvidia_sm100.kernels import fp8_linear

    from deepinfer_core.quant import fp8_block

    gen = torch.Generator(device="cuda").manual_seed(n + k + groups)
    weight, scale = fp8_block.quantize(torch.randn(groups * n, k, device="cuda", generator=gen) * k**-0.5,
                                       (128, 128), True)
    x = torch.randn(1024, groups, k, device="cuda", generator=gen).to(torch.bfloat16)
    seen = activations_as_quantized(x, (128, 128))
    quantizing = fp8_linear.picked_path(x, n, (128, 128)) == fp8_linear.SCALED_MM
    want = ref.grouped_linear_fp8_block(seen if quantizing else x, weight, scale, (128, 128), groups).float()
    got = fp8_linear.grouped_linear_fp8_block(x, weight, scale, (128, 128), groups).float()
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    assert not (quantizing and k % 512), "K / 128 not a multiple of 4 must not reach cuBLAS's blockwise product"

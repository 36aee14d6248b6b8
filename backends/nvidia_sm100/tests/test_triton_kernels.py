"""The small Triton kernels against their references: ``hc_pre`` (``kernels/hc.py``) against the reference op,
the MoE ``align`` kernel against its torch version and the MoE combine inside ``moe_experts`` against the
reference op, RoPE, the attention keys, the MoE routing, the compressor's pooled windows, the greedy sampler. On the GPU where there is one; without a GPU,
in a child pytest process on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` must be set before
Triton is imported, and it would break the ahead-of-time compiles of test_triton_compile.py in this process).
The interpreter checks the kernels' logic: indexing, masks (an hc that is not a power of two, assignments
past a chunk), loop bounds, the placement order."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the test extra installs triton")
from deepinfer_nvidia_sm100.kernels import (
    cache_writes,
    compressor,
    greedy,
    hc,
    indexer,
    key_blocks,
    keys,
    moe,
    rope,
    route,
)
from interpreted import DEVICE, INTERPRETED, kernel_runs_here, run_under_interpreter, starts_the_interpreter

from deepinfer_core.ops import reference as ref


@starts_the_interpreter
def test_kernels_under_triton_interpreter():
    run_under_interpreter(__file__)


def _case(tokens, hc_mult, width, dtype, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def rnd(*shape, dt=torch.float32):
        return torch.randn(*shape, device=DEVICE, generator=gen).to(dt)

    mix = (2 + hc_mult) * hc_mult
    return (rnd(tokens, hc_mult, width, dt=dtype), rnd(mix, hc_mult * width) * 0.05, rnd(mix), rnd(3) + 1.0)


def _interpreter_runs_bf16_dot(tokens: int, dtype: torch.dtype) -> bool:
    """Whether bf16 streams would take the tensor-core mixing kernel under Triton's interpreter, which multiplies
    bf16 ``tl.dot`` tiles wrongly (numpy has no bf16): such cases run on the GPU only."""
    return DEVICE == "cpu" and dtype == torch.bfloat16 and tokens > 0


@kernel_runs_here
@pytest.mark.parametrize("tokens, hc_mult, iters, dtype", [
    (tokens, hc_mult, iters, dtype) for dtype in (torch.float32, torch.bfloat16)
    for tokens, hc_mult, iters in ((1, 4, 20), (7, 4, 1), (64, 4, 20), (5, 3, 7), (0, 4, 20))
    if not _interpreter_runs_bf16_dot(tokens, dtype)])
def test_hc_pre_matches_reference(tokens, hc_mult, iters, dtype):
    streams, fn, base, scale = _case(tokens, hc_mult, 64, dtype)
    got = hc.hc_pre(streams, fn, base, scale, iters, 1e-6, 1e-6)
    want = ref.hc_pre(streams, fn, base, scale, iters, 1e-6, 1e-6)
    for name, g, w in zip(("post", "comb", "collapsed"), got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        tol = {"atol": 1e-5, "rtol": 1e-5} if g.dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
        torch.testing.assert_close(g, w, **tol, msg=lambda m, n=name: f"{n}: {m}")


@kernel_runs_here
@pytest.mark.parametrize("tokens, hc_mult, dtype", [
    (tokens, hc_mult, dtype) for dtype in (torch.float32, torch.bfloat16) for tokens, hc_mult in ((0, 4), (1, 4),
                                                                                                   (70, 4), (9, 3))
    if not _interpreter_runs_bf16_dot(tokens, dtype)])
def test_batch_invariant_hc_pre_matches_reference_and_keeps_each_tokens_bits(tokens, hc_mult, dtype):
    """``invariant.hc_pre`` / ``hc_pre_normed`` (the mixing split by the row length only, one kernel for any token
    count): close to the reference, and a token's outputs alone equal to the same token among the others."""
    from deepinfer_nvidia_sm100.kernels import invariant

    streams, fn, base, scale = _case(tokens, hc_mult, 600, dtype)
    norm_w = torch.rand(600, device=DEVICE) + 0.5
    got = invariant.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    for g, w in zip(got, ref.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, **(tol if g.dtype == dtype else {"atol": 1e-5, "rtol": 1e-5}))
    normed = invariant.hc_pre_normed(streams, fn, base, scale, 20, 1e-6, 1e-6, norm_w)
    for t in range(min(tokens, 3)):
        for whole, alone in ((got, invariant.hc_pre(streams[t:t + 1], fn, base, scale, 20, 1e-6, 1e-6)),
                             (normed, invariant.hc_pre_normed(streams[t:t + 1], fn, base, scale, 20, 1e-6, 1e-6,
                                                              norm_w))):
            for w, a in zip(whole, alone, strict=True):
                assert torch.equal(w[t:t + 1], a), t


@kernel_runs_here
@pytest.mark.parametrize("tokens, hc_mult, width, dtype", [
    (tokens, hc_mult, width, dtype) for dtype in (torch.float32, torch.bfloat16)
    for tokens, hc_mult, width in ((1, 4, 2500), (7, 4, 64), (64, 4, 1024), (5, 3, 300), (0, 4, 64),
                                   (hc.MIX_KERNEL_MAX_TOKENS + 1, 2, 32), (2, 2, hc.NORM_MAX_BLOCK_D + 808))
    if not _interpreter_runs_bf16_dot(tokens, dtype)])
def test_hc_pre_normed_matches_hc_pre_then_the_norm(tokens, hc_mult, width, dtype):
    """The finishing kernel's norm of a token's collapsed row, in one block (2500 channels in a block of 4096) or
    block by block past ``NORM_MAX_BLOCK_D`` (the last block partial), against the reference ``hc_pre`` then
    ``rms_norm``; fp32 above the split kernels' token limit takes the compiled path and the norm kernel."""
    streams, fn, base, scale = _case(tokens, hc_mult, width, dtype, seed=width)
    weight = torch.randn(width, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(1))
    got = hc.hc_pre_normed(streams, fn, base, scale, 7, 1e-6, 1e-6, weight)
    want = ref.hc_pre_normed(streams, fn, base, scale, 7, 1e-6, 1e-6, weight)
    for name, g, w in zip(("post", "comb", "normed"), got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        tol = {"atol": 1e-5, "rtol": 1e-5} if g.dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
        torch.testing.assert_close(g, w, **tol, msg=lambda m, n=name: f"{n}: {m}")


@kernel_runs_here
@pytest.mark.parametrize("tokens, dtype", [
    (tokens, dtype) for tokens, dtype in ((1, torch.float32), (7, torch.float32), (1, torch.bfloat16),
                                          (64, torch.bfloat16)) if not _interpreter_runs_bf16_dot(tokens, dtype)])
def test_deferred_weights_reach_hc_post_as_the_fused_kernel_makes_them(tokens, dtype):
    """``hc_pre_normed_deferred`` (the Sinkhorn forked to the side stream, ``pre`` alone in the finishing kernel)
    then ``hc_post``, which joins it: the same collapsed row, weights and new streams as ``hc_pre_normed``."""
    streams, fn, base, scale = _case(tokens, 4, 256, dtype, seed=3)
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    weight, block = torch.randn(256, device=DEVICE, generator=gen), torch.randn(tokens, 256, device=DEVICE,
                                                                                  generator=gen).to(dtype)
    post, comb, x = hc.hc_pre_normed(streams, fn, base, scale, 20, 1e-6, 1e-6, weight)
    want = hc.hc_post(streams, block, post, comb)
    d_post, d_comb, d_x = hc.hc_pre_normed_deferred(streams, fn, base, scale, 20, 1e-6, 1e-6, weight)
    assert id(d_comb) in hc._DEFERRED
    got = hc.hc_post(streams, block, d_post, d_comb)
    assert id(d_comb) not in hc._DEFERRED  # joined
    assert torch.equal(d_x, x)
    torch.testing.assert_close(d_post, post, atol=0, rtol=1e-6)
    torch.testing.assert_close(d_comb, comb, atol=0, rtol=1e-6)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_the_weights_are_deferred_only_where_the_tables_hc_post_ops_join_them(monkeypatch):
    from deepinfer_core.ops.table import OpTable

    ours = {"hc_pre_normed": hc.hc_pre_normed, "hc_post": hc.hc_post, "hc_post_sum": hc.hc_post_sum}
    assert hc.defers_weights(OpTable(ours))
    assert not hc.defers_weights(OpTable({**ours, "hc_post_sum": ref.hc_post_sum}))  # a plugin's would read early
    assert not hc.defers_weights(OpTable({"hc_post": hc.hc_post, "hc_post_sum": hc.hc_post_sum}))
    monkeypatch.setenv("DEEPINFER_NVIDIA_HC_BESIDE", "0")
    assert not hc.defers_weights(OpTable(ours))


MIX_CASES = [(kernel, tokens, hc_mult, width, dtype) for dtype in (torch.float32, torch.bfloat16)
             for kernel, tokens, hc_mult, width in (
                 (None, 1, 4, 1024), (None, 3, 4, 100), (None, 6, 3, 300), (None, 64, 4, 64),
                 (None, hc.MIX_KERNEL_MAX_TOKENS + 1, 2, 32), ("split", 70, 4, 100), ("split", 65, 3, 64),
                 ("split", 3, 4, 100), ("split", 6, 3, 300))
             if kernel is not None or not _interpreter_runs_bf16_dot(tokens, dtype)]


@kernel_runs_here
@pytest.mark.parametrize("kernel, tokens, hc_mult, width, dtype", MIX_CASES)
def test_hc_mix_logits_matches_reference(kernel, tokens, hc_mult, width, dtype):
    """Split rows (the split past the row's end masked, 3 x 300 = 900 elements), token blocks past the batch, an
    output width that is not a power of two (hc 3: 15), the default kernels (tensor cores for bf16; for fp32 the
    split rows up to the token limit, the compiled reference above it), and the split kernels forced in bf16 and
    above the limit (the last token block partial, 70 and 65 tokens)."""
    streams, fn, _, _ = _case(tokens, hc_mult, width, dtype, seed=tokens)
    got = hc.hc_mix_logits(streams, fn, 1e-6, kernel=kernel)
    want = ref.hc_mix_logits(streams, fn, 1e-6)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


DOT_DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # the interpreter's bf16 tl.dot is wrong


@kernel_runs_here
@pytest.mark.parametrize("tokens, hc_mult, width, fn_rows", [
    (17, 4, 100, None), (70, 3, 300, None), (130, 4, 1024, None), (300, 4, 64, 4), (1, 2, 32, None)])
def test_hc_mix_logits_tensor_core_kernel_matches_reference(tokens, hc_mult, width, fn_rows):
    """The three-part ``fn`` split on tensor cores stays within fp32's worst-case error of the fp64 result, as the fp32
    reference does (on the GPU; the interpreter checks the indexing only): token blocks past the batch (17, 70, 130 of
    64-token blocks), a row that is no multiple of the 128-element step (400, 900), outputs fewer than the 16 a
    ``tl.dot`` needs (15; 4 rows: ``hc_head``'s ``fn``), several splits per row, and ``fn`` entries 300 times larger
    than their neighbours."""
    streams, fn, _, _ = _case(tokens, hc_mult, width, DOT_DTYPE, seed=tokens)
    if fn_rows is not None:
        fn = fn[:fn_rows].contiguous()
    fn[:, ::7] *= 300.0
    got = hc.hc_mix_logits(streams, fn, 1e-6, kernel="dot")
    want = ref.hc_mix_logits(streams, fn, 1e-6)
    assert got.shape == want.shape and got.dtype == torch.float32
    if DEVICE == "cpu":  # the interpreter rounds each 16-bit tl.dot to 16 bits: the indexing is what it checks
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
        return
    # fp64 truth (the reference op itself casts to fp32) and the worst-case error of any fp32 evaluation of it: a
    # K-term dot product summed in any order, the norm scale and fn's own rounding, (K + 8) u sum |x| |fn| rs
    x = streams.double().flatten(1)  # [T, K]: the bf16 values, exact
    scale = (x.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()  # [T, 1]
    exact = x @ fn.double().T * scale
    bound = (x.shape[1] + 8) * 2.0**-24 * (x.abs() @ fn.double().abs().T) * scale
    for name, result in (("kernel", got), ("fp32 reference", want)):
        excess = ((result.double() - exact).abs() - bound).max().item()
        assert excess <= 0, f"{name}: error above the fp32 bound by {excess:.2e}"


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, hc_mult, width", [(1, 4, 1024), (5, 4, 700), (3, 3, 64), (0, 4, 64)])
def test_hc_post_matches_reference(tokens, hc_mult, width, dtype):
    """Channel blocks past the row's end (700 = 512 + 188) and an hc that is not a power of two; ``hc_post_sum``
    (the block a sum of two, added in the kernel) against ``hc_post`` of the sum."""
    streams, _, _, _ = _case(tokens, hc_mult, width, dtype, seed=tokens + 1)
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    block_out = torch.randn(tokens, width, device=DEVICE, generator=gen).to(dtype)
    post = torch.rand(tokens, hc_mult, device=DEVICE, generator=gen) * 2
    comb = torch.rand(tokens, hc_mult, hc_mult, device=DEVICE, generator=gen)
    got, want = hc.hc_post(streams, block_out, post, comb), ref.hc_post(streams, block_out, post, comb)
    assert got.shape == want.shape and got.dtype == want.dtype
    # bf16: three roundings of terms up to ~16 (unit in the last place 0.0625) and another order inside the
    # matmul; a wrong index would be off by O(1)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.125, "rtol": 0}
    torch.testing.assert_close(got, want, **tol)
    extra = torch.randn(tokens, width, device=DEVICE, generator=gen).to(dtype)  # hc_post_sum: the added block
    got = hc.hc_post_sum(streams, block_out, extra, post, comb)
    sum_tol = tol if dtype == torch.float32 else {"atol": 0.125, "rtol": 2**-6}  # the larger block: larger ulps
    torch.testing.assert_close(got, ref.hc_post(streams, block_out + extra, post, comb), **sum_tol)


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, hc_mult, width", [(1, 4, 4096), (6, 4, 1500), (3, 3, 64), (0, 4, 64)])
def test_hc_collapse_matches_reference(tokens, hc_mult, width, dtype):
    """A channel block past the row's end (1500 = 1024 + 476), an hc that is not a power of two, no tokens."""
    streams, _, _, _ = _case(tokens, hc_mult, width, dtype, seed=tokens + 2)
    pre = torch.rand(tokens, hc_mult, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(5))
    got, want = hc.hc_collapse(pre, streams), ref.hc_collapse(pre, streams)
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(got, want, **tol)


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, half", [((3, 4, 512), 32), ((2, 64), 32), ((5, 2, 3, 40), 4), ((4, 6), 3)])
@pytest.mark.parametrize("inverse", [False, True])
def test_apply_rope_matches_reference(shape, half, inverse, dtype):
    """Several middle dims per token, only rotary channels (64 = 2 x 32), pass-through widths that are not powers
    of two."""
    gen = torch.Generator(device=DEVICE).manual_seed(len(shape) + half)
    x = torch.randn(*shape, device=DEVICE, generator=gen).to(dtype)
    angles = torch.rand(shape[0], half, device=DEVICE, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got, want = rope.apply_rope(x, cos, sin, inverse), ref.apply_rope(x, cos, sin, inverse)
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(got, want, **tol)


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, half", [((3, 4, 512), 32), ((2, 64), 32), ((5, 2, 3, 40), 4), ((17, 6), 3)])
@pytest.mark.parametrize("inverse", [False, True])
def test_apply_rope_in_place_rotates_only_the_rotary_channels(shape, half, inverse, dtype):
    """``apply_rope_`` equals the reference's in-place op, returns its input, and leaves the pass-through channels
    as they were (the same bits); a view that is not contiguous takes the copying kernel, written back into the
    view only."""
    gen = torch.Generator(device=DEVICE).manual_seed(len(shape) * 7 + half)
    x = torch.randn(*shape, device=DEVICE, generator=gen).to(dtype)
    angles = torch.rand(shape[0], half, device=DEVICE, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want = ref.apply_rope_(x.clone(), cos, sin, inverse)
    got = x.clone()
    assert rope.apply_rope_(got, cos, sin, inverse) is got
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(got[..., :-2 * half], x[..., :-2 * half])
    padded = torch.zeros(*shape[:-1], shape[-1] + 8, device=DEVICE, dtype=dtype)
    strided = padded[..., :shape[-1]]  # not contiguous: rows 8 channels apart
    strided.copy_(x)
    assert rope.apply_rope_(strided, cos, sin, inverse) is strided
    torch.testing.assert_close(strided, want, **tol)
    assert torch.equal(padded[..., shape[-1]:], torch.zeros_like(padded[..., shape[-1]:]))


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqs, window, entries, dim", [(3, 5, 0, 64), (4, 9, 13, 512), (1, 130, 40, 96),
                                                         (2, 3, None, 512)])
def test_gather_keys_matches_reference(seqs, window, entries, dim, dtype):
    """Window keys from ring slots (an expanded slot column, as the decode layout builds it) or this step's rows,
    then entries from a paged store (expanded rows); no store (sliding layers: ``entries`` None); rows and
    widths that do not fill a program's tile. A gather: equal to the reference, bit for bit."""
    gen = torch.Generator(device=DEVICE).manual_seed(seqs * 100 + window)

    def rnd(*shape):
        return torch.randn(*shape, device=DEVICE, generator=gen).to(dtype)

    def ints(high, *shape):
        return torch.randint(0, high, shape, device=DEVICE, generator=gen)

    ring, new_kv = rnd(seqs + 2, window, dim), rnd(seqs * 3, dim)
    slots = ints(seqs + 2, seqs, 1).expand(seqs, window)
    from_new = torch.rand(seqs, window, device=DEVICE, generator=gen) < 0.3
    new_rows = torch.where(from_new, ints(seqs * 3, seqs, window), 0)
    store = blocks = rows = None
    if entries is not None:
        store = rnd(7, 4, dim)
        blocks, rows = ints(7, seqs, entries), ints(4, 1, entries).expand(seqs, entries)
    args = (ring, slots, ints(window, seqs, window), new_kv, new_rows, from_new, store, blocks, rows)
    got, want = keys.gather_keys(*args), ref.gather_keys(*args)
    assert got.shape == want.shape == (seqs, window + (entries or 0), dim) and got.dtype == want.dtype
    assert torch.equal(got, want)


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_keys_with_an_empty_window_reads_the_entries(dtype):
    """``StepLayout.gather_entries``'s call (the indexer's keys): index tensors ``[S, 0]`` for the window, the store
    standing in for the ring and step rows (never read): the store's rows at the entries' places, bit for bit."""
    gen = torch.Generator(device=DEVICE).manual_seed(9)
    store = torch.randn(7, 4, 128, device=DEVICE, generator=gen).to(dtype)  # [blocks, rows, di]
    blocks = torch.randint(0, 7, (3, 21), device=DEVICE, generator=gen)  # [S, E]
    rows = torch.randint(0, 4, (3, 21), device=DEVICE, generator=gen)
    no_window = blocks[:, :0]  # [S, 0]
    got = keys.gather_keys(store, no_window, no_window, store[0], no_window, no_window.bool(), store, blocks, rows)
    assert torch.equal(got, store[blocks, rows])


@kernel_runs_here
@pytest.mark.parametrize("rows, lk, block_n, density", [(3, 200, 64, 0.1), (2, 64 * 70 + 5, 64, 0.02),
                                                        (4, 33, 16, 0.0), (0, 64, 64, 0.5), (5, 100, 16, 1.0)])
def test_visible_blocks_kernel_matches_torch(rows, lk, block_n, density):
    """More blocks than one loop chunk (70), a partial last block, rows with no visible key and all visible."""
    gen = torch.Generator(device=DEVICE).manual_seed(lk)
    vis = (torch.rand(rows, lk, device=DEVICE, generator=gen) < density).to(torch.uint8)
    blocks, counts = key_blocks.visible_blocks(vis, block_n)
    want_blocks, want_counts = key_blocks.visible_blocks_torch(vis, block_n)
    assert torch.equal(counts, want_counts)
    listed = torch.arange(blocks.shape[1], device=DEVICE)[None, :] < counts[:, None].long()
    assert torch.equal(torch.where(listed, blocks, 0), want_blocks)


@kernel_runs_here
def test_comb_is_doubly_stochastic_after_many_iterations():
    streams, fn, base, scale = _case(9, 4, 32, torch.float32, seed=3)
    _, comb, _ = hc.hc_pre(streams, fn, base, scale, 60, 1e-6, 1e-6)
    ones = torch.ones(9, 4, device=DEVICE)
    torch.testing.assert_close(comb.sum(dim=-1), ones, atol=1e-4, rtol=0)
    torch.testing.assert_close(comb.sum(dim=-2), ones, atol=1e-4, rtol=0)


@kernel_runs_here
@pytest.mark.parametrize("tokens, top_k, experts, block_m", [
    (1, 6, 64, 16), (3, 6, 64, 16), (20, 6, 64, 16), (5, 2, 4, 16), (64, 6, 64, 16), (70, 6, 64, 64),
    (3, 4, 7, 64), (40, 6, 300, 16), (256, 6, 64, 16), (100, 8, 256, 16), (1365, 6, 64, 16), (33, 5, 13, 64),
    (1366, 6, 64, 16)])
def test_align_kernel_matches_torch_align(tokens, top_k, experts, block_m):
    """One program up to 128 assignments (chunks of 16 to 64: one chunk at 6 and 18, two at 120), the chunked kernels
    up to 8192 (batch 256 x top-6: 1536; several scan groups at 256 experts; a last chunk cut short), torch ops
    beyond or past 256 experts."""
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    ids = torch.randint(0, experts, (tokens, top_k), device=DEVICE, generator=gen)
    ids[0] = ids[0, 0]  # one token picks an expert several times (hash routing can)
    got = moe.align(ids, experts, block_m)
    want = moe.align_torch(ids, experts, block_m)
    for name, g, w in zip(("sorted_assign", "block_expert", "dest"), got, want, strict=True):
        assert torch.equal(g, w), f"{name}: {g.tolist()} != {w.tolist()}"


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k, experts, dim, inter, repeat", [
    (6, 64, 32, 16, False), (6, 8, 45, 19, True), (1, 4, 64, 32, False),
    *([(3, 5, 4096, 2048, True)] if DEVICE == "cuda" else [])])  # the interpreter takes minutes at these widths
def test_moe_experts_one_token_matches_reference(top_k, experts, dim, inter, repeat, dtype):
    """One token (``moe_experts_one_token``, what ``moe_experts`` runs for it): picks in any order (6 of a
    ``K_P2`` of 8), full blocks (no masks), an expert picked twice (hash routing can), odd widths that leave partial
    column and ``K`` blocks in both kernels (45, 19), on the GPU the preset's widths (4096 / 2048). bf16 to the
    rounding of the reference's own steps."""
    gen = torch.Generator(device=DEVICE).manual_seed(top_k * experts + dim)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=DEVICE, generator=gen) * scale).to(dtype)

    x = rnd(1, dim)
    w1, w3 = rnd(experts, inter, dim, scale=dim**-0.5), rnd(experts, inter, dim, scale=dim**-0.5)
    w2 = rnd(experts, dim, inter, scale=inter**-0.5)
    ids = torch.randperm(experts, device=DEVICE, generator=gen)[:top_k][None, :]  # [1, k]
    if repeat:
        ids[0, -1] = ids[0, 0]
    weights = torch.rand(1, top_k, device=DEVICE, generator=gen)
    got = moe.moe_experts(x, ids, weights, w1, w2, w3, 0.7)
    want = ref.moe_experts(x, ids, weights, w1, w2, w3, 0.7)
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(moe.moe_experts_one_token(x, ids, weights, w1, w2, w3, 0.7), got, atol=0, rtol=0)


@kernel_runs_here
@pytest.mark.parametrize("tokens, top_k", [(1, 6), (9, 2), (33, 3)])
def test_moe_experts_combine_matches_reference_fp32(tokens, top_k):
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    E, D, inter = 8, 48, 32

    def rnd(*shape):
        return torch.randn(*shape, device=DEVICE, generator=gen)

    x, w1, w2, w3 = rnd(tokens, D), rnd(E, inter, D) * 0.2, rnd(E, D, inter) * 0.2, rnd(E, inter, D) * 0.2
    ids = torch.stack([torch.randperm(E, device=DEVICE, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, device=DEVICE, generator=gen)
    got = moe.moe_experts(x, ids, weights, w1, w2, w3, 0.7)
    want = ref.moe_experts(x, ids, weights, w1, w2, w3, 0.7)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@kernel_runs_here
@pytest.mark.parametrize("group_m", [1, 2, 16])
def test_moe_experts_grouped_program_order_keeps_the_bits(group_m):
    """A config's fifth entry walks the grouped GEMMs' row blocks ``group_m`` at a time across the column tiles (one
    grid axis, ``moe._block_tile``): the order of work only, so the same bits as the 2-D grid (fp32: every block of
    several experts, partial groups) and the reference's values."""
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    E, D, inter, T, top_k = 6, 96, 80, 70, 3

    def rnd(*shape):
        return torch.randn(*shape, device=DEVICE, generator=gen)

    x, w1, w2, w3 = rnd(T, D), rnd(E, inter, D) * 0.2, rnd(E, D, inter) * 0.2, rnd(E, inter, D) * 0.2
    ids = torch.stack([torch.randperm(E, device=DEVICE, generator=gen)[:top_k] for _ in range(T)])
    weights = torch.rand(T, top_k, device=DEVICE, generator=gen)
    tile = (16, 32, 32, 4)  # 5 column tiles of the 80 up columns, 3 of the 96 down columns
    plain = moe.moe_experts(x, ids, weights, w1, w2, w3, 0.7, config=tile)
    assert torch.equal(moe.moe_experts(x, ids, weights, w1, w2, w3, 0.7, config=(*tile, group_m)), plain)
    torch.testing.assert_close(plain, ref.moe_experts(x, ids, weights, w1, w2, w3, 0.7), atol=1e-5, rtol=1e-5)


@kernel_runs_here
@pytest.mark.parametrize("group_align", [1, 16])
def test_moe_experts_grouped_layout_and_combine(group_align):
    """The grouped-GEMM MoE path's layout (offsets of padded expert runs, an empty expert), SwiGLU epilogue and
    weighted combine against the reference op: fp32 here (``torch._grouped_mm`` on CPU, the kernels interpreted:
    exact up to fp32 sums), bf16 on the GPU (CUDA's grouped GEMM is bf16 only)."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    E, D, inter, T, top_k = 5, 64, 32, 150, 2

    def rnd(*shape):
        return torch.randn(*shape, device=DEVICE, generator=gen)

    x, w1, w2, w3 = rnd(T, D).to(dtype), *(w.to(dtype) for w in (
        rnd(E, inter, D) * 0.2, rnd(E, D, inter) * 0.2, rnd(E, inter, D) * 0.2))
    ids = torch.stack([torch.randperm(E - 1, device=DEVICE, generator=gen)[:top_k] for _ in range(T)])  # E-1 empty
    ids[:40, 0] = 0  # a hot expert
    ids[:40, 1] = 1
    weights = torch.rand(T, top_k, device=DEVICE, generator=gen)
    got = moe.moe_experts_grouped(x, ids, weights, w1, w2, w3, 0.7, group_align=group_align)
    want = ref.moe_experts(x, ids, weights, w1, w2, w3, 0.7)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), want.float(), **tol)
    _, block_expert, _ = moe.align(ids, E, group_align)
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    padded = (counts + group_align - 1) // group_align * group_align
    assert moe.group_offsets(block_expert, E, group_align).tolist() == torch.cumsum(padded, 0).tolist()


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.float32, DOT_DTYPE])
@pytest.mark.parametrize("seqs, queries, entries, heads, dim", [
    (1, 70, 130, 4, 32), (2, 17, 64, 2, 16), (2, 64, 7, 3, 32), (3, 1, 130, 20, 32), (2, 5, 70, 4, 16),
    (1, 1, 200, 8, 24), (2, 0, 5, 2, 16)])
def test_indexer_scores_matches_reference(seqs, queries, entries, heads, dim, dtype):
    """Query and entry tiles past the ends (70 of 64, 130 and 7 of 64), several sequences, ``q`` read through
    strides (a slice of wider heads), the per-row kernel of decode (1 and 5 queries; 20 heads padded to 32), a head
    dim the kernel does not take (24: the reference op), no queries."""
    gen = torch.Generator(device=DEVICE).manual_seed(queries + entries)
    wide = torch.randn(seqs, queries, heads, dim + 8, device=DEVICE, generator=gen).to(dtype)
    q = wide[..., :dim]  # [S, Lq, H, d], row stride d + 8
    keys = torch.randn(seqs, entries, dim, device=DEVICE, generator=gen).to(dtype)
    weights = torch.randn(seqs, queries, heads, device=DEVICE, generator=gen)
    got = indexer.indexer_scores(q, keys, weights, dim**-0.5)
    want = ref.indexer_scores(q, keys, weights, dim**-0.5)
    assert got.shape == want.shape == (seqs, queries, entries) and got.dtype == torch.float32
    tol = 1e-4 if dtype == torch.float32 or DEVICE == "cuda" else 5e-3  # the interpreter rounds 16-bit dots
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows, n, k", [(1, 129, 300), (1, 65, 4096), (5, 2048, 64)])
def test_gemv_linear_matches_reference(rows, n, k, dtype):
    """One row takes the kernel with ``row_config``'s launch for ``K`` below 4096 (``K`` not a multiple of the block)
    and from 4096 (four ``K`` blocks), each with a column block past ``N`` (odd widths, two columns a program); more
    rows and narrow outputs take ``F.linear``."""
    from deepinfer_nvidia_sm100.kernels import gemv

    gen = torch.Generator(device=DEVICE).manual_seed(rows + k)
    x = torch.randn(rows, k, device=DEVICE, generator=gen).to(dtype)
    w = (torch.randn(n, k, device=DEVICE, generator=gen) * 0.05).to(dtype)
    assert gemv.covered(x, w, rows, n) == (rows == 1)
    got = gemv.linear(x.view(rows, 1, k), w)  # leading dims kept
    want = ref.linear(x.float(), w.float()).to(dtype).view(rows, 1, n)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert not gemv.covered(x[:1], w[:32], 1, 32)


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n, k, groups, config", [
    (128, 1024, 1, None),  # the default launch, every block full (no masks)
    (130, 1000, 1, (8, 512, 4, 3)),  # a column block and a K block past the ends
    (48, 256, 3, (16, 128, 2, 1)),  # groups on the grid's second axis
    (64, 128, 1, (2, 128, 2, 1)),  # one K block
])
def test_gemv_row_kernel_matches_reference(n, k, groups, config, dtype):
    """The one-row kernel (no ``tl.dot``: any dtype runs under the interpreter) against the fp32 product."""
    from deepinfer_nvidia_sm100.kernels import gemv

    gen = torch.Generator(device=DEVICE).manual_seed(n + k)
    x = torch.randn(groups, k, device=DEVICE, generator=gen).to(dtype)  # [groups, K]
    w = (torch.randn(groups * n, k, device=DEVICE, generator=gen) * 0.05).to(dtype)
    out = torch.full((groups, n), float("nan"), device=DEVICE, dtype=dtype)
    gemv.launch_row(x, w, out, groups, config and gemv.RowConfig(*config))
    want = torch.einsum("gk,gnk->gn", x.float(), w.float().view(groups, n, k)).to(dtype)
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens, groups, per_group, k", [(1, 8, 72, 300), (1, 2, 80, 128), (3, 2, 80, 128)])
def test_gemv_grouped_linear_matches_reference(tokens, groups, per_group, k, dtype):
    """One token: groups on the grid's second axis (each reads its own block of the weight; 72 columns: a column
    block past the group's end), a strided input; more tokens take the strided cuBLAS batched GEMM."""
    from deepinfer_nvidia_sm100.kernels import gemv

    gen = torch.Generator(device=DEVICE).manual_seed(groups)
    x = torch.randn(tokens, k, groups, device=DEVICE, generator=gen).to(dtype).transpose(1, 2)
    w = (torch.randn(groups * per_group, k, device=DEVICE, generator=gen) * 0.05).to(dtype)
    assert gemv.covered(x, w, tokens, per_group) == (tokens == 1)
    got = gemv.grouped_linear(x, w, groups)
    want = ref.grouped_linear(x.float(), w.float(), groups).to(dtype)
    assert got.shape == (tokens, groups, per_group)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 4096), (5, 7, 512), (2, 300), (40, 64)])
def test_rms_norms_match_reference(shape, dtype):
    """Rows past the batch in a program's row block (5 x 7, 40 rows of 64), a width that is not a power of two (300);
    weighted in fp32 then rounded once, unweighted with the scale rounded to the input dtype, as the references."""
    from deepinfer_nvidia_sm100.kernels import norm

    gen = torch.Generator(device=DEVICE).manual_seed(shape[-1])
    x = (torch.randn(*shape, device=DEVICE, generator=gen) * 3).to(dtype)
    weight = torch.randn(shape[-1], device=DEVICE, generator=gen)  # fp32, as the model keeps norm weights
    # bf16: the sum of squares in another order can round a value (or the unweighted scale) the other way: 2 ulps
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2 * 2**-7}
    for got, want in ((norm.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6)),
                      (norm.unweighted_rms_norm(x, 1e-6), ref.unweighted_rms_norm(x, 1e-6))):
        assert got.shape == want.shape and got.dtype == want.dtype == dtype
        torch.testing.assert_close(got, want, **tol)


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_read_a_projections_column_block_in_place(dtype):
    """The model norms column blocks of its fused input projection (``q``, ``kv``: rows ``sum rows`` apart): the kernel
    reads them through the row stride (no copy) and writes packed rows, equal to the reference's."""
    from deepinfer_nvidia_sm100.kernels import norm

    gen = torch.Generator(device=DEVICE).manual_seed(7)
    fused = (torch.randn(19, 1024 + 512 + 300, device=DEVICE, generator=gen) * 3).to(dtype)
    q, kv = fused[:, :1024], fused[:, 1024:1536]  # [T, 1024] / [T, 512], row stride 1836
    weight = torch.randn(1024, device=DEVICE, generator=gen)
    angles = torch.randn(19, 32, device=DEVICE, generator=gen)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2 * 2**-7}
    for got, want in ((norm.rms_norm(q, weight, 1e-6), ref.rms_norm(q, weight, 1e-6)),
                      (norm.unweighted_rms_norm(q, 1e-6), ref.unweighted_rms_norm(q, 1e-6)),
                      (norm.rms_norm_rope(kv, weight[:512], 1e-6, cos, sin),
                       ref.rms_norm_rope(kv, weight[:512], 1e-6, cos, sin))):
        assert got.is_contiguous() and got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, **tol)


@kernel_runs_here
@pytest.mark.parametrize("shape", [(3, 512), (5, 4, 512), (2, 3, 96)])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rope_matches_the_norm_then_rope(shape, weighted, dtype):
    """One pass (the norm, then RoPE on the rounded rows' trailing 64 / 32 channels) against the reference norm and
    the reference in-place RoPE: a key row per token, several heads per token, a width that is not a power of two."""
    from deepinfer_nvidia_sm100.kernels import norm

    gen = torch.Generator(device=DEVICE).manual_seed(shape[-1] + len(shape))
    x = (torch.randn(*shape, device=DEVICE, generator=gen) * 3).to(dtype)
    weight = torch.randn(shape[-1], device=DEVICE, generator=gen) if weighted else None
    half = 32 if shape[-1] >= 512 else 16
    angles = torch.randn(shape[0], half, device=DEVICE, generator=gen) * 3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got = norm.rms_norm_rope(x, weight, 1e-6, cos, sin)
    want = ref.rms_norm_rope(x, weight, 1e-6, cos, sin)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2 * 2**-7}
    assert got.shape == want.shape and got.dtype == want.dtype == dtype
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got[..., : -2 * half], (ref.rms_norm(x, weight, 1e-6) if weighted else
                                                      ref.unweighted_rms_norm(x, 1e-6))[..., : -2 * half], **tol)


def _router_logits(tokens: int, experts: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Logits whose scores stay apart after rounding to ``dtype`` (a shuffled ramp per token), so the top-k order
    is not decided by rounding."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    ramp = torch.linspace(-3.0, 3.0, experts, device=DEVICE)
    rows = [torch.randperm(experts, device=DEVICE, generator=gen) for _ in range(tokens)]
    order = torch.stack(rows) if rows else torch.zeros(0, experts, dtype=torch.long, device=DEVICE)
    return ramp[order].to(dtype)  # [T, E]


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 64, 6), (37, 64, 6), (5, 6, 2), (3, 256, 8), (0, 64, 6)])
def test_moe_route_topk_matches_reference(tokens, experts, top_k, scoring, dtype):
    """Experts in the reference's order (by biased score, descending), weights to the dtype's rounding; the
    correction bias is fp32 as in the checkpoint and reorders experts."""
    logits = _router_logits(tokens, experts, dtype, seed=experts + top_k)
    bias = torch.linspace(0.05, -0.05, experts, device=DEVICE)  # fp32
    got_w, got_ids = route.moe_route_topk(logits, bias, top_k, 1.5, scoring)
    want_w, want_ids = ref.moe_route_topk(logits, bias, top_k, 1.5, scoring)
    assert got_ids.dtype == torch.long and got_w.dtype == dtype and got_w.shape == (tokens, top_k)
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    if dtype == torch.float32 or not INTERPRETED:
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_w, want_w, **tol)
        return
    # the interpreter truncates to bf16 where the GPU rounds: experts whose biased scores are within two bf16 steps
    # may trade places; the weights must be the reference's normalisation of the experts the kernel chose
    scores = ref._score(logits, scoring)  # [T, E]
    biased = (scores + bias.to(dtype)).float()
    got_b, want_b = biased.gather(1, got_ids).sort(1).values, biased.gather(1, want_ids).sort(1).values
    assert (got_b - want_b).abs().le(want_b.abs() * 2**-6).all()
    torch.testing.assert_close(got_w, ref._normalise(scores, got_ids, 1.5), **tol)


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_route_topk_breaks_ties_to_the_lower_expert_id(dtype):
    logits = torch.zeros(3, 16, device=DEVICE, dtype=dtype)
    logits[1, 9] = 1.0  # one clear winner, the rest tied
    bias = torch.zeros(16, device=DEVICE)
    got_w, got_ids = route.moe_route_topk(logits, bias, 4, 1.0, "sqrtsoftplus")
    want_w, want_ids = ref.moe_route_topk(logits, bias, 4, 1.0, "sqrtsoftplus")
    assert got_ids.tolist() == want_ids.tolist() == [[0, 1, 2, 3], [9, 0, 1, 2], [0, 1, 2, 3]]
    torch.testing.assert_close(got_w, want_w, atol=1e-2, rtol=1e-2)


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "softmax"])
def test_moe_route_hash_matches_reference(scoring, dtype):
    tokens, experts, top_k, vocab = 29, 64, 6, 1000
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    logits = torch.randn(tokens, experts, device=DEVICE, generator=gen).to(dtype)
    table = torch.stack([torch.randperm(experts, device=DEVICE, generator=gen)[:top_k] for _ in range(vocab)])
    token_ids = torch.randint(0, vocab, (tokens,), device=DEVICE, generator=gen)
    got_w, got_ids = route.moe_route_hash(logits, token_ids, table, 2.5, scoring)
    want_w, want_ids = ref.moe_route_hash(logits, token_ids, table, 2.5, scoring)
    assert torch.equal(got_ids, want_ids)
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(got_w, want_w, **tol)


def _logits_with_ties(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """fp32 logits ``[rows, vocab]`` (std 3, as a model's): row 0 a unique maximum, row 1 its maximum at three ids in
    different chunks (where the row has them), row 2 ``-inf`` over its first chunk and the maximum in the last (cut) chunk."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = torch.randn(rows, vocab, device=DEVICE, generator=gen) * 3.0
    if rows > 1:
        logits[1, [vocab - 1, 5, min(greedy.BLOCK + 7, vocab - 3)]] = 40.0
    if rows > 2:
        logits[2, :greedy.BLOCK] = float("-inf")
        logits[2, vocab - 2] = 41.0
    return logits


@kernel_runs_here
@pytest.mark.parametrize("rows, vocab, strided", [(1, 129280, False), (3, 10000, False), (4, 2 * 4096 + 100, True),
                                                  (2, 50, False), (0, 129280, False)])
def test_greedy_sample_matches_the_sampler(rows, vocab, strided):
    """Token ids and ranks equal the sampler's greedy rows (ties to the lowest id; a tie's rank counts every id
    at the maximum), log-probabilities to fp32 rounding; a row view with a wider stride too."""
    logits = _logits_with_ties(rows, vocab, seed=rows + vocab)
    if strided:
        logits = torch.cat([logits, logits[:, :3]], dim=1)[:, :vocab]  # row stride vocab + 3
    got = greedy.greedy_sample(logits)
    want = ref.greedy_sample(logits)
    assert [g.dtype for g in got] == [torch.long, torch.float32, torch.long]
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    if rows > 1:
        assert got[0][1].item() == 5 and got[2][1].item() == 3


def _window_case(windows: int, ratio: int, d: int, overlap: bool, dtype: torch.dtype, carry_dtype: torch.dtype,
                 seed: int):
    """Windows mixing carried and new slots, some slots before position 0; this step's rows as a column block of a
    wider projection and the carry's kv / gate as halves of one tensor (as the model passes them; two tensors where
    the carry's dtype differs)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    width, span, tokens, slots = (2 * d if overlap else d), (2 * ratio if overlap else ratio), 7, 3

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, device=DEVICE, generator=gen).to(dt)

    fused = rnd(tokens, 3 * width + 5)
    raw_kv, raw_gate = fused[:, 5:5 + width], fused[:, 5 + width:5 + 2 * width]  # [T, width], row stride 3w + 5
    if carry_dtype == dtype:  # halves of one carry, as the model allocates it (``CompressorCarry``)
        carry = rnd(slots, span, 2 * width, dt=carry_dtype)
        carry_kv, carry_gate = carry[..., :width], carry[..., width:]
    else:  # two tensors
        carry_kv, carry_gate = rnd(slots, span, width, dt=carry_dtype), rnd(slots, span, width, dt=carry_dtype)
    from_new = torch.rand(windows, span, device=DEVICE, generator=gen) < 0.4
    new_rows = torch.randint(0, tokens, (windows, span), device=DEVICE, generator=gen)
    carry_slots = torch.randint(0, slots, (windows, 1), device=DEVICE, generator=gen).expand(-1, span)
    carry_index = torch.randint(0, span, (windows, span), device=DEVICE, generator=gen)
    valid = torch.arange(span, device=DEVICE)[None, :] >= torch.randint(0, span, (windows, 1), device=DEVICE,
                                                                         generator=gen)
    valid[:1, :-1] = False  # window 0 as a static decode step's dummy: its last slot only
    ape, weight = rnd(ratio, width, dt=torch.float32), torch.rand(d, device=DEVICE, generator=gen) + 0.5
    return (raw_kv, raw_gate, carry_kv, carry_gate, from_new, new_rows, carry_slots, carry_index, valid, ape,
            weight, 1e-6, ratio, overlap)


@kernel_runs_here
@pytest.mark.parametrize("dtype, carry_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("windows, ratio, d, overlap, many_from", [
    (5, 4, 64, True, None), (3, 16, 96, False, None), (2, 128, 512, False, None), (0, 4, 64, True, None),
    (9, 16, 160, True, 9)])
def test_compressor_entries_match_reference(windows, ratio, d, overlap, many_from, dtype, carry_dtype, monkeypatch):
    """CSA (overlapping halves, 8 slots) and HCA-like windows (up to 128 slots, several slot blocks), channels
    that are not a multiple of the channel block, carried and new slots, slots before position 0 (the kernel's slot
    loop starts at the first valid one), a dummy window pooling its last slot; few windows (narrow channel blocks, one
    slot loop) and many (wide blocks, 160 channels = 128 + 32, several slot iterations); then with RoPE
    (``compressor_entries_rope``). The many-windows launch is taken from ``many_from`` windows on (the threshold
    ``FEW_WINDOWS`` lowered): the kernel with the same launch constants as from 64 windows on, at a seventh of the
    programs the interpreter would simulate there."""
    if many_from is not None:
        monkeypatch.setattr(compressor, "FEW_WINDOWS", many_from)
    args = _window_case(windows, ratio, d, overlap, dtype, carry_dtype, seed=windows * 31 + ratio + d)
    got, want = compressor.compressor_entries(*args), ref.compressor_entries(*args)
    assert got.shape == want.shape == (windows, d) and got.dtype == want.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    # 16-bit: the kernel rounds once where the reference rounds the weights and products too; its error against
    # an fp64 evaluation of the reference must stay within twice the reference's own
    exact = ref.compressor_entries(*(a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args))
    own = (want.double() - exact).abs().max().item() if windows else 0.0
    assert (got.double() - exact).abs().max().item() <= 2 * own + 1e-6 if windows else got.numel() == 0
    if windows:  # (the model folds no entries in a step without windows)
        _check_entries_rope(args, got)


def _check_entries_rope(args: tuple, entries: torch.Tensor) -> None:
    """``compressor_entries_rope`` (the pooling kernel, then the norm and RoPE in one pass) against RoPE applied
    to ``entries``, the kernel's own entries without it."""
    gen = torch.Generator(device=DEVICE).manual_seed(entries.shape[0])
    half = 16 if entries.shape[1] < 128 else 32
    cos = torch.rand(entries.shape[0], half, device=DEVICE, generator=gen).to(entries.dtype)  # [N, rope_dim // 2]
    sin = torch.rand(entries.shape[0], half, device=DEVICE, generator=gen).to(entries.dtype)
    got = compressor.compressor_entries_rope(*args, cos, sin)
    want = ref.apply_rope(entries, cos, sin)
    tol = {"atol": 1e-5, "rtol": 1e-5} if entries.dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got, want, **tol)


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 9, 0])
def test_shared_expert_reads_adjacent_w1_w3_in_one_gemm(tokens, dtype):
    """``swiglu_mlp`` with ``w1`` / ``w3`` as the model allocates them (row blocks of one tensor) equals the
    reference, clamp included (``limit`` below the activations' range); separate tensors take the reference."""
    gen = torch.Generator(device=DEVICE).manual_seed(tokens + 5)
    inter, dim, limit = 48, 32, 0.5
    x = torch.randn(tokens, dim, device=DEVICE, generator=gen).to(dtype)
    w13 = (torch.randn(2 * inter, dim, device=DEVICE, generator=gen) * 0.5).to(dtype)
    w1, w3 = w13.split(inter)
    w2 = (torch.randn(dim, inter, device=DEVICE, generator=gen) * 0.3).to(dtype)
    assert moe._rows_together(w1, w3) is not None and moe._rows_together(w3, w1) is None
    got, want = moe.swiglu_mlp(x, w1, w2, w3, limit), ref.swiglu_mlp(x, w1, w2, w3, limit)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, **tol)
    apart = torch.empty(2, inter, dim, device=DEVICE, dtype=dtype)  # adjacent rows of two storages: not one GEMM
    w1_alone, w3_alone = apart[0].clone(), apart[1].clone()
    w1_alone.copy_(w1), w3_alone.copy_(w3)
    assert moe._rows_together(w1_alone, w3_alone) is None
    torch.testing.assert_close(moe.swiglu_mlp(x, w1_alone, w2, w3_alone, limit), want, **tol)


@kernel_runs_here
@pytest.mark.parametrize("src_dtype, dst_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                                  (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("with_rows", [True, False])
@pytest.mark.parametrize("width", [512, 1100])
def test_write_rows_matches_reference(width, with_rows, src_dtype, dst_dtype):
    """Rows of a column block of a wider tensor (as the model's projections), picked by ``rows`` or in order, into
    ``[slot, index]`` places of a cache, cast to its dtype; other places untouched; nothing to write."""
    gen = torch.Generator(device=DEVICE).manual_seed(width + with_rows)
    wide = torch.randn(6, width + 7, device=DEVICE, generator=gen).to(src_dtype)
    src = wide[:, 3:3 + width]  # [6, width], rows width + 7 apart
    dst = torch.randn(4, 5, width, device=DEVICE, generator=gen).to(dst_dtype)
    slots, index = torch.tensor([3, 0, 2, 0, 1], device=DEVICE), torch.tensor([4, 4, 0, 1, 2], device=DEVICE)
    rows = torch.tensor([5, 0, 2, 2, 1], device=DEVICE) if with_rows else None
    want = ref.write_rows_(dst.clone(), slots, index, src[:5] if rows is None else src, rows)
    got = dst.clone()
    assert cache_writes.write_rows_(got, slots, index, src[:5] if rows is None else src, rows) is got
    if INTERPRETED and src_dtype == torch.float32:  # the interpreter truncates to bf16 where the GPU rounds
        torch.testing.assert_close(got, want, atol=0, rtol=2**-7)
    else:
        assert torch.equal(got, want)
    empty = torch.zeros(0, dtype=torch.long, device=DEVICE)
    assert torch.equal(cache_writes.write_rows_(dst.clone(), empty, empty, src, empty), dst)


@kernel_runs_here
@pytest.mark.parametrize("seqs, heads, dim, keys, splits", [
    (1, 64, 512, 384, 3), (1, 64, 512, 128, 1), (3, 32, 64, 200, 2), (2, 16, 128, 70, 4), (4, 16, 64, 130, 1)])
def test_decode_attention_matches_reference(seqs, heads, dim, keys, splits):
    """Decode rows (one query each) against the fp32 reference on the same 16-bit inputs: the bench's row (64 heads x
    512, the window plus compressed entries) in 3 splits and whole, a row with nothing visible (its output 0), a
    partial last key block, more splits than key blocks (empty splits), fully masked blocks left out of the lists."""
    from deepinfer_nvidia_sm100.kernels import decode_attention

    gen = torch.Generator(device=DEVICE).manual_seed(keys + splits)
    q = torch.randn(seqs, 1, heads, dim, device=DEVICE, generator=gen).to(DOT_DTYPE)
    kv = torch.randn(seqs, keys, dim, device=DEVICE, generator=gen).to(DOT_DTYPE)
    visible = torch.rand(seqs, 1, keys, device=DEVICE, generator=gen) < 0.7
    visible[0, :, 64:128] = False  # a whole key block unseen: not listed
    if seqs > 1:
        visible[1] = False  # nothing visible: 0
    sinks = torch.randn(heads, device=DEVICE, generator=gen)
    got = decode_attention.decode_attention(q, kv, visible, *_visible_blocks(visible), sinks, dim**-0.5, splits)
    want = ref.sink_attention(q.float(), kv.float(), visible, sinks, dim**-0.5)
    assert got.shape == want.shape and got.dtype == q.dtype
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    if seqs > 1:
        assert got[1].abs().max().item() == 0.0


def _visible_blocks(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from deepinfer_nvidia_sm100.kernels.decode_attention import _mask_blocks

    return _mask_blocks(visible)


@kernel_runs_here
def test_visible_block_lists_are_planned_once_per_mask():
    """``planned_blocks``: the same mask object gets the same block lists back (layers sharing a mask launch no
    second kernel); a new mask, even with equal contents, gets its own."""
    from deepinfer_nvidia_sm100.kernels import decode_attention as da

    visible = torch.rand(2, 1, 300, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(5)) < 0.3
    vis = visible.reshape(2, 300).view(torch.uint8)
    first = da.planned_blocks(visible)
    assert da.planned_blocks(visible) is first
    other = visible.clone()
    again = da.planned_blocks(other)
    assert again is not first and all(torch.equal(a, b) for a, b in zip(again, first, strict=True))
    want = key_blocks.visible_blocks_torch(vis, da.BLOCK_N)
    assert torch.equal(first[1], want[1])
    for row in range(2):
        count = int(want[1][row])
        assert torch.equal(first[0][row, :count], want[0][row, :count])


def test_decode_attention_splits_fill_the_gpu_once_with_two_key_blocks_each():
    """The split heuristic: two key blocks a split at batch 1 (the preset's 384 keys: 3 splits x 4 head blocks), no
    more programs than SMs at larger batches, at least one split."""
    from deepinfer_nvidia_sm100.kernels import decode_attention as da

    assert da.num_splits(1, 64, 384, 132) == 3
    assert da.num_splits(1, 64, 128, 132) == 1
    assert da.num_splits(16, 64, 2048, 132) == 2  # 64 programs a split
    assert da.num_splits(64, 64, 2048, 132) == 1


def test_decode_attention_takes_one_row_unless_told_otherwise(monkeypatch):
    """``covered``: decode rows of one sequence by default (where the kernel was timed), more with the variable; never
    prefill rows, fp32 or head counts that are not a multiple of 16."""
    from deepinfer_nvidia_sm100.kernels import decode_attention as da

    def case(seqs, queries, heads=64, dtype=torch.bfloat16):
        q = torch.empty(seqs, queries, heads, 512, dtype=dtype, device="meta")
        return q, torch.empty(seqs, 384, 512, dtype=dtype, device="meta")

    assert da.covered(*case(1, 1))
    assert not da.covered(*case(2, 1)) and not da.covered(*case(1, 7))
    assert not da.covered(*case(1, 1, dtype=torch.float32)) and not da.covered(*case(1, 1, heads=24))
    monkeypatch.setenv("DEEPINFER_NVIDIA_DECODE_ATTN_MAX_ROWS", "16")
    assert da.covered(*case(16, 1)) and not da.covered(*case(17, 1))

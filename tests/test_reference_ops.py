"""Unit tests for the plain-torch reference ops (``deepinfer_core.ops.reference``).

These ops are the spec every GPU / NPU backend must match, so each test pins their semantics against an
independent naive implementation written here (explicit loops over sequences, queries, heads, pairs,
experts, ...), never by re-calling the op under test. Shapes are tiny; the whole file runs in seconds.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from deepinfer_core.ops import reference as ref
from deepinfer_core.ops.table import OpTable, UnknownOpError, reference_ops

F32 = {"rtol": 1e-5, "atol": 1e-6}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(dtype)


def _distinct_scores(*shape: int, seed: int) -> torch.Tensor:
    """Tie-free scores: a random permutation of 0..n-1, scaled and shifted (some negative)."""
    n = math.prod(shape)
    return (torch.randperm(n, generator=_gen(seed)).float() / n - 0.5).view(*shape)


# ============================================================================ indexer_topk
def _naive_topk_mask(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """Per query: visible entries ordered by (higher score, lower index); keep the first k."""
    S, Lq, E = scores.shape
    out = torch.zeros(S, Lq, E, dtype=torch.bool)
    for s in range(S):
        for q in range(Lq):
            cands = [e for e in range(E) if visible[s, q, e]]
            cands.sort(key=lambda e: (-float(scores[s, q, e]), e))
            for e in cands[:k]:
                out[s, q, e] = True
    return out


@pytest.mark.parametrize(
    ("S", "Lq", "E", "k"),
    [(1, 1, 8, 1), (2, 3, 10, 4), (3, 4, 16, 7), (2, 5, 6, 6), (2, 3, 5, 9), (1, 4, 12, 12)],
)
def test_indexer_topk_tie_free_matches_torch_topk_among_visible(S, Lq, E, k):
    scores = _distinct_scores(S, Lq, E, seed=S * 100 + Lq * 10 + E)
    visible = torch.rand(S, Lq, E, generator=_gen(k)) < 0.6
    visible[0, 0] = False  # a row with nothing visible
    if Lq > 1:
        visible[-1, -1] = True  # a fully visible row
    got = ref.indexer_topk(scores, visible, k)
    assert got.dtype == torch.bool and got.shape == (S, Lq, E)
    assert not (got & ~visible).any(), "selected an invisible entry"
    for s in range(S):
        for q in range(Lq):
            vis_idx = visible[s, q].nonzero().flatten()
            want = torch.zeros(E, dtype=torch.bool)
            if len(vis_idx):
                kk = min(k, len(vis_idx))
                want[vis_idx[torch.topk(scores[s, q, vis_idx], kk).indices]] = True
            assert torch.equal(got[s, q], want), (s, q)
            assert int(got[s, q].sum()) == min(k, len(vis_idx))
    if k >= E:  # k at least the visible count: every visible entry is selected
        assert torch.equal(got, visible)


def test_indexer_topk_never_selects_invisible_even_with_best_scores():
    E = 8
    scores = torch.arange(E, dtype=torch.float32).flip(0).view(1, 1, E)  # entry 0 best, entry 7 worst
    visible = torch.zeros(1, 1, E, dtype=torch.bool)
    visible[..., 5:] = True  # only the three worst are visible
    got = ref.indexer_topk(scores, visible, 2)
    assert got[0, 0].nonzero().flatten().tolist() == [5, 6]
    got = ref.indexer_topk(scores, visible, 5)
    assert got[0, 0].nonzero().flatten().tolist() == [5, 6, 7]


def test_indexer_topk_ties_go_to_lower_entry_index():
    S, Lq, E = 2, 4, 12
    scores = torch.randint(0, 3, (S, Lq, E), generator=_gen(3)).float()  # many exact ties
    visible = torch.rand(S, Lq, E, generator=_gen(4)) < 0.75
    for k in (1, 2, 3, 5, 8, 20):
        got = ref.indexer_topk(scores, visible, k)
        assert torch.equal(got, _naive_topk_mask(scores, visible, k)), k
    # explicit: scores [1, 2, 2, 1, 2], k = 2 -> entries 1 and 2 (the lowest two of the tied 2s)
    row = torch.tensor([1.0, 2.0, 2.0, 1.0, 2.0]).view(1, 1, 5)
    assert ref.indexer_topk(row, torch.ones_like(row, dtype=torch.bool), 2)[0, 0].tolist() == [
        False, True, True, False, False]
    # +0.0 and -0.0 are equal scores: index order decides, not the sign bit
    row = torch.tensor([-0.0, 0.0, -0.0, 0.0]).view(1, 1, 4)
    assert ref.indexer_topk(row, torch.ones_like(row, dtype=torch.bool), 2)[0, 0].tolist() == [
        True, True, False, False]


def test_indexer_topk_all_zero_relu_scores_pick_lowest_visible_indices():
    # every q.k is negative -> relu zeroes everything -> all scores tie at exactly 0
    S, Lq, Hi, di, E = 2, 3, 2, 4, 9
    q = -torch.rand(S, Lq, Hi, di, generator=_gen(5)) - 0.1
    keys = torch.rand(S, E, di, generator=_gen(6)) + 0.1
    w = torch.rand(S, Lq, Hi, generator=_gen(7))
    scores = ref.indexer_scores(q, keys, w, 0.5)
    assert torch.equal(scores, torch.zeros(S, Lq, E))
    visible = torch.rand(S, Lq, E, generator=_gen(8)) < 0.7
    k = 3
    got = ref.indexer_topk(scores, visible, k)
    for s in range(S):
        for qi in range(Lq):
            vis_idx = visible[s, qi].nonzero().flatten().tolist()
            assert got[s, qi].nonzero().flatten().tolist() == vis_idx[:k]


@pytest.mark.parametrize("k", [9, 10, 64])
def test_indexer_topk_with_a_budget_of_every_entry_selects_exactly_the_visible_ones(k):
    """What lets the model skip the indexer while a step has at most ``index_topk`` entries: any scores, ties and
    -inf included, select exactly ``visible``."""
    S, Lq, E = 2, 5, 9
    scores = torch.randn(S, Lq, E, generator=_gen(11)).round()  # many ties
    scores[0, 0, 3] = float("-inf")
    visible = torch.rand(S, Lq, E, generator=_gen(12)) < 0.6
    got = ref.indexer_topk(scores, visible, k)
    for s, qi in itertools.product(range(S), range(Lq)):
        assert got[s, qi].tolist() == visible[s, qi].tolist()


# ============================================================================ indexer_scores
def test_indexer_scores_naive_sum_over_heads():
    S, Lq, Hi, di, E = 2, 3, 4, 5, 6
    q, keys = _randn(S, Lq, Hi, di, seed=10), _randn(S, E, di, seed=11)
    w = _randn(S, Lq, Hi, seed=12)  # signed head weights
    scale = 0.37
    got = ref.indexer_scores(q, keys, w, scale)
    assert got.dtype == torch.float32 and got.shape == (S, Lq, E)
    ql, kl, wl = q.tolist(), keys.tolist(), w.tolist()
    want = torch.zeros(S, Lq, E, dtype=torch.float64)
    for s in range(S):
        for t in range(Lq):
            for e in range(E):
                acc = 0.0
                for h in range(Hi):
                    dot = sum(ql[s][t][h][i] * kl[s][e][i] for i in range(di))
                    acc += wl[s][t][h] * max(dot, 0.0) * scale
                want[s, t, e] = acc
    torch.testing.assert_close(got, want.float(), **F32)
    # bf16 inputs are scored in fp32
    assert ref.indexer_scores(q.bfloat16(), keys.bfloat16(), w.bfloat16(), scale).dtype == torch.float32


# ============================================================================ sink_attention
def _naive_sink_attention(q, kv, visible, sinks, scale):
    S, Lq, H, d = q.shape
    Lk = kv.shape[1]
    out = torch.zeros(S, Lq, H, d, dtype=torch.float64)
    for s in range(S):
        for t in range(Lq):
            for h in range(H):
                logits = [scale * float(q[s, t, h].double() @ kv[s, j].double()) for j in range(Lk) if visible[s, t, j]]
                keys = [j for j in range(Lk) if visible[s, t, j]]
                sink = float(sinks[h])
                m = max(logits + [sink])
                denom = sum(math.exp(x - m) for x in logits) + math.exp(sink - m)
                for x, j in zip(logits, keys):
                    out[s, t, h] += math.exp(x - m) / denom * kv[s, j].double()
    return out


def test_sink_attention_matches_naive_loop():
    S, Lq, Lk, H, d = 2, 3, 6, 3, 4
    q, kv = _randn(S, Lq, H, d, seed=20), _randn(S, Lk, d, seed=21)
    visible = torch.rand(S, Lq, Lk, generator=_gen(22)) < 0.6
    visible[0, 0] = False
    visible[1, 2] = True
    sinks = torch.tensor([0.5, -1.0, 2.0])
    got = ref.sink_attention(q, kv, visible, sinks, 0.5)
    assert got.shape == (S, Lq, H, d) and got.dtype == torch.float32
    torch.testing.assert_close(got, _naive_sink_attention(q, kv, visible, sinks, 0.5).float(), **F32)


def test_sink_attention_nothing_visible_returns_exact_zero():
    S, Lq, Lk, H, d = 2, 2, 4, 2, 3
    q, kv = _randn(S, Lq, H, d, seed=23), _randn(S, Lk, d, seed=24) * 100
    visible = torch.ones(S, Lq, Lk, dtype=torch.bool)
    visible[1, 0] = False
    got = ref.sink_attention(q, kv, visible, torch.tensor([-5.0, 3.0]), 1.0)
    assert torch.equal(got[1, 0], torch.zeros(H, d))
    assert (got[0].abs().sum(-1) > 0).all()


def test_sink_attention_sink_mass_is_dropped_and_large_sinks_push_to_zero():
    S, Lq, Lk, H, d = 1, 2, 5, 1, 4
    q, kv = _randn(S, Lq, H, d, seed=25), _randn(S, Lk, d, seed=26)
    visible = torch.ones(S, Lq, Lk, dtype=torch.bool)
    norms = []
    for sink in (-30.0, 0.0, 2.0, 5.0, 20.0):
        out = ref.sink_attention(q, kv, visible, torch.tensor([sink]), 1.0)
        norms.append(float(out.norm()))
    assert all(a > b for a, b in itertools.pairwise(norms)), norms
    assert norms[-1] < 1e-6
    # a very negative sink leaves ordinary softmax attention
    plain = torch.softmax(torch.einsum("sqhd,skd->shqk", q, kv), dim=-1)
    torch.testing.assert_close(ref.sink_attention(q, kv, visible, torch.tensor([-1e4]), 1.0),
                               torch.einsum("shqk,skd->sqhd", plain, kv), **F32)
    # a sink equal to the only visible logit takes exactly half the mass
    vis1 = torch.zeros(S, Lq, Lk, dtype=torch.bool)
    vis1[..., 2] = True
    logit = float(q[0, 0, 0] @ kv[0, 2])
    out = ref.sink_attention(q[:, :1], kv, vis1[:, :1], torch.tensor([logit]), 1.0)
    torch.testing.assert_close(out[0, 0, 0], 0.5 * kv[0, 2], **F32)


# ============================================================================ rope
def _naive_rope(x, cos, sin, inverse=False):
    """Per-pair rotation of the trailing 2 * half channels: (a, b) -> (a c - b s, b c + a s)."""
    half = cos.shape[-1]
    dim = x.shape[-1]
    nope = dim - 2 * half
    out = x.clone().double()
    xs = x.double().reshape(x.shape[0], -1, dim)  # [T, H', dim]
    o = out.view(x.shape[0], -1, dim)
    for t in range(x.shape[0]):
        for h in range(xs.shape[1]):
            for i in range(half):
                c, s = float(cos[t, i]), float(sin[t, i])
                if inverse:
                    s = -s
                a, b = float(xs[t, h, nope + 2 * i]), float(xs[t, h, nope + 2 * i + 1])
                o[t, h, nope + 2 * i] = a * c - b * s
                o[t, h, nope + 2 * i + 1] = b * c + a * s
    return out


def test_rope_cos_sin_shapes_and_values():
    inv_freq = torch.tensor([1.0, 0.1, 0.01])
    positions = torch.tensor([0, 1, 5, 1000])
    cos, sin = ref.rope_cos_sin(positions, inv_freq, 1.25, torch.float32)
    assert cos.shape == sin.shape == (4, 3) and cos.dtype == sin.dtype == torch.float32
    for t, p in enumerate(positions.tolist()):
        for i, f in enumerate(inv_freq.tolist()):
            ang = p * float(torch.tensor(f))
            assert cos[t, i].item() == pytest.approx(math.cos(ang) * 1.25, rel=1e-5, abs=1e-5)
            assert sin[t, i].item() == pytest.approx(math.sin(ang) * 1.25, rel=1e-5, abs=1e-5)
    cos2, sin2 = ref.rope_cos_sin(positions.view(2, 2), inv_freq, 1.0, torch.bfloat16)
    assert cos2.shape == sin2.shape == (2, 2, 3) and cos2.dtype == torch.bfloat16
    assert torch.equal(cos2[0, 0], torch.ones(3, dtype=torch.bfloat16))
    assert torch.equal(sin2[0, 0], torch.zeros(3, dtype=torch.bfloat16))


@pytest.mark.parametrize("shape", [(5, 10), (5, 3, 10), (4, 6)])
def test_apply_rope_matches_naive_pairs_and_leaves_leading_channels(shape):
    T, dim = shape[0], shape[-1]
    half = 3  # (4, 6): rope on every channel
    x = _randn(*shape, seed=30 + len(shape) + dim)
    cos, sin = ref.rope_cos_sin(torch.arange(T) * 3 + 1, torch.tensor([1.0, 0.3, 0.05]), 1.0, torch.float32)
    for inverse in (False, True):
        got = ref.apply_rope(x, cos, sin, inverse=inverse)
        assert got.shape == x.shape and got.dtype == x.dtype
        torch.testing.assert_close(got, _naive_rope(x, cos, sin, inverse).float(), **F32)
        assert torch.equal(got[..., : dim - 2 * half], x[..., : dim - 2 * half])
    back = ref.apply_rope(ref.apply_rope(x, cos, sin), cos, sin, inverse=True)
    torch.testing.assert_close(back, x, **F32)


def test_apply_rope_pair_layout_is_interleaved():
    # one pair (channels 2, 3) rotated by 90 degrees: (a, b) -> (-b, a); channels 0, 1 untouched
    x = torch.tensor([[7.0, 8.0, 1.0, 2.0]])
    cos, sin = torch.tensor([[0.0]]), torch.tensor([[1.0]])
    assert ref.apply_rope(x, cos, sin).tolist() == [[7.0, 8.0, -2.0, 1.0]]
    assert ref.apply_rope(x, cos, sin, inverse=True).tolist() == [[7.0, 8.0, 2.0, -1.0]]


def test_apply_rope_bf16_keeps_dtype_and_nope_bits():
    x = _randn(3, 2, 8, seed=33, dtype=torch.bfloat16)
    cos, sin = ref.rope_cos_sin(torch.arange(3), torch.tensor([1.0, 0.5]), 1.0, torch.bfloat16)
    got = ref.apply_rope(x, cos, sin)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got[..., :4], x[..., :4])
    torch.testing.assert_close(got.float(), _naive_rope(x.float(), cos.float(), sin.float()).float(),
                               rtol=1.6e-2, atol=1e-2)


# ============================================================================ norms
def test_rms_norm_naive_fp32_and_bf16():
    x, w = _randn(4, 3, 16, seed=40), _randn(16, seed=41)
    eps = 1e-6
    want = torch.empty(4, 3, 16, dtype=torch.float64)
    for i in range(4):
        for j in range(3):
            row = x[i, j].double()
            ms = sum(float(v) ** 2 for v in row) / 16
            want[i, j] = row / math.sqrt(ms + eps) * w.double()
    torch.testing.assert_close(ref.rms_norm(x, w, eps), want.float(), **F32)
    got = ref.rms_norm(x.bfloat16(), w, eps)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
    assert ref.rms_norm(x.bfloat16(), w.bfloat16(), eps).dtype == torch.bfloat16
    # eps matters for tiny rows
    tiny = torch.full((1, 4), 1e-4)
    torch.testing.assert_close(ref.rms_norm(tiny, torch.ones(4), 1e-6),
                               tiny / math.sqrt(1e-8 + 1e-6), **F32)


def test_unweighted_rms_norm_naive_fp32_and_bf16():
    x = _randn(5, 12, seed=42) * 3
    eps = 1e-5
    want = torch.empty(5, 12, dtype=torch.float64)
    for i in range(5):
        row = x[i].double()
        want[i] = row / math.sqrt(float((row * row).sum()) / 12 + eps)
    torch.testing.assert_close(ref.unweighted_rms_norm(x, eps), want.float(), **F32)
    got = ref.unweighted_rms_norm(x.bfloat16(), eps)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
    tiny = torch.full((2, 4), 1e-3)  # mean square 1e-6: eps is not negligible
    torch.testing.assert_close(ref.unweighted_rms_norm(tiny, 1e-6), tiny / math.sqrt(2e-6), **F32)


# ============================================================================ compressor_pool
def test_compressor_pool_softmax_over_slots_then_rms_norm():
    N, slots, d = 3, 4, 6
    kv, gate = _randn(N, slots, d, seed=50), _randn(N, slots, d, seed=51)
    gate[0, 3] = float("-inf")  # a masked slot, whole window entry
    gate[1, :2, :3] = float("-inf")  # some channels masked in two slots
    kv[0, 3] = 1e6  # masked slots must get exactly zero weight
    kv[1, :2, :3] = -1e6
    w, eps = _randn(d, seed=52), 1e-6
    want = torch.empty(N, d, dtype=torch.float64)
    for n in range(N):
        pooled = []
        for c in range(d):
            gs = [float(gate[n, s, c]) for s in range(slots)]
            m = max(gs)
            ex = [math.exp(g - m) for g in gs]  # exp(-inf) == 0
            pooled.append(sum(e / sum(ex) * float(kv[n, s, c]) for s, e in enumerate(ex)))
        rms = math.sqrt(sum(p * p for p in pooled) / d + eps)
        want[n] = torch.tensor([p / rms for p in pooled], dtype=torch.float64) * w.double()
    got = ref.compressor_pool(kv, gate, w, eps)
    assert got.shape == (N, d) and torch.isfinite(got).all()
    torch.testing.assert_close(got, want.float(), **F32)


# ============================================================================ hyper-connections
def _naive_hc_pre(streams, fn, base, scale, iters, hc_eps, norm_eps):
    T, hc, D = streams.shape
    x = streams.double()
    fn, base, scale = fn.double(), base.double(), scale.double()
    pre = torch.empty(T, hc, dtype=torch.float64)
    post = torch.empty(T, hc, dtype=torch.float64)
    comb = torch.empty(T, hc, hc, dtype=torch.float64)
    for t in range(T):
        flat = x[t].reshape(-1)
        flat = flat / math.sqrt(float((flat * flat).mean()) + norm_eps)
        mixed = [float(fn[r] @ flat) for r in range(fn.shape[0])]
        for i in range(hc):
            pre[t, i] = 1 / (1 + math.exp(-(mixed[i] * scale[0] + base[i]))) + hc_eps
            post[t, i] = 2 / (1 + math.exp(-(mixed[hc + i] * scale[1] + base[hc + i])))
        m = [[mixed[2 * hc + i * hc + j] * float(scale[2]) + float(base[2 * hc + i * hc + j]) for j in range(hc)]
             for i in range(hc)]
        for i in range(hc):
            z = sum(math.exp(v) for v in m[i])
            m[i] = [math.exp(v) / z + hc_eps for v in m[i]]

        def norm_cols(m):
            for j in range(hc):
                c = sum(m[i][j] for i in range(hc)) + hc_eps
                for i in range(hc):
                    m[i][j] /= c

        norm_cols(m)
        for _ in range(iters - 1):
            for i in range(hc):
                r = sum(m[i]) + hc_eps
                m[i] = [v / r for v in m[i]]
            norm_cols(m)
        comb[t] = torch.tensor(m, dtype=torch.float64)
    collapsed = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        for i in range(hc):
            collapsed[t] += pre[t, i] * x[t, i]
    return pre, post, comb, collapsed


def _hc_params(hc, D, seed, peak=1.0):
    """mHC parameters; ``peak`` scales the comb logits (large -> near-one-hot rows, slow Sinkhorn)."""
    mix = (2 + hc) * hc
    return _randn(mix, hc * D, seed=seed) * 0.2, _randn(mix, seed=seed + 1), torch.tensor([0.8, 1.3, peak])


@pytest.mark.parametrize("hc", [1, 2, 4])
def test_hc_pre_matches_naive_and_comb_is_doubly_stochastic(hc):
    T, D, iters, hc_eps, norm_eps = 3, 8, 20, 1e-6, 1e-6
    streams = _randn(T, hc, D, seed=60 + hc) * 2
    fn, base, scale = _hc_params(hc, D, seed=70 + hc)
    post, comb, collapsed = ref.hc_pre(streams, fn, base, scale, iters, hc_eps, norm_eps)
    assert post.shape == (T, hc) and comb.shape == (T, hc, hc) and collapsed.shape == (T, D)
    assert comb.dtype == torch.float32
    n_pre, n_post, n_comb, n_collapsed = _naive_hc_pre(streams, fn, base, scale, iters, hc_eps, norm_eps)
    torch.testing.assert_close(post, n_post.float(), **F32)
    torch.testing.assert_close(comb, n_comb.float(), **F32)
    torch.testing.assert_close(collapsed, n_collapsed.float(), **F32)
    assert ((post > 0) & (post < 2)).all()
    assert ((n_pre > hc_eps) & (n_pre < 1 + hc_eps)).all()
    assert (comb > 0).all()
    torch.testing.assert_close(comb.sum(-1), torch.ones(T, hc), rtol=0, atol=1e-3)
    torch.testing.assert_close(comb.sum(-2), torch.ones(T, hc), rtol=0, atol=1e-3)


def test_hc_pre_sinkhorn_ends_on_columns_and_rows_converge_with_iterations():
    # peaked comb logits: Sinkhorn converges slowly on rows, but the last step always normalises columns
    T, hc, D = 3, 4, 8
    streams = _randn(T, hc, D, seed=64) * 2
    fn, base, scale = _hc_params(hc, D, seed=74, peak=5.0)
    row_err = []
    for iters in (1, 5, 20, 200):
        _, comb, _ = ref.hc_pre(streams, fn, base, scale, iters, 1e-6, 1e-6)
        _, _, n_comb, _ = _naive_hc_pre(streams, fn, base, scale, iters, 1e-6, 1e-6)
        torch.testing.assert_close(comb, n_comb.float(), **F32)
        torch.testing.assert_close(comb.sum(-2), torch.ones(T, hc), rtol=0, atol=1e-4)
        row_err.append(float((comb.sum(-1) - 1).abs().max()))
    assert all(a > b for a, b in itertools.pairwise(row_err)), row_err
    assert row_err[0] > 0.1 and row_err[2] > 1e-3 and row_err[-1] < 1e-3  # 20 iterations are not enough here


def test_hc_pre_bf16_streams_keep_dtype():
    T, hc, D = 2, 4, 8
    streams = _randn(T, hc, D, seed=80, dtype=torch.bfloat16)
    fn, base, scale = _hc_params(hc, D, seed=81)
    post, comb, collapsed = ref.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
    assert collapsed.dtype == torch.bfloat16 and comb.dtype == torch.float32 and post.dtype == torch.float32
    *_, n_collapsed = _naive_hc_pre(streams.float(), fn, base, scale, 20, 1e-6, 1e-6)
    torch.testing.assert_close(collapsed.float(), n_collapsed.float(), rtol=1.6e-2, atol=2e-2)


def test_hc_post_naive_loop():
    T, hc, D = 3, 4, 5
    streams, block = _randn(T, hc, D, seed=90), _randn(T, D, seed=91)
    post, comb = torch.rand(T, hc, generator=_gen(92)) * 2, torch.rand(T, hc, hc, generator=_gen(93))
    got = ref.hc_post(streams, block, post, comb)
    want = torch.zeros(T, hc, D, dtype=torch.float64)
    for t in range(T):
        for k in range(hc):
            want[t, k] = float(post[t, k]) * block[t].double()
            for j in range(hc):
                want[t, k] += float(comb[t, j, k]) * streams[t, j].double()  # comb[j, k]: stream j -> k
    assert got.shape == (T, hc, D)
    torch.testing.assert_close(got, want.float(), **F32)
    # an asymmetric comb distinguishes comb[j, k] from comb[k, j]
    eye_shift = torch.zeros(1, 2, 2)
    eye_shift[0, 0, 1] = 1.0  # stream 0 feeds output 1 only
    out = ref.hc_post(streams[:1, :2], torch.zeros(1, D), torch.zeros(1, 2), eye_shift)
    torch.testing.assert_close(out[0, 1], streams[0, 0], **F32)
    assert torch.equal(out[0, 0], torch.zeros(D))


def test_hc_post_sum_is_hc_post_of_the_sum_and_follows_an_hc_post_override():
    """The MoE block's two outputs added (in their dtype, as ``routed + shared``) before ``hc_post``; a backend that
    overrides only ``hc_post`` gets its kernel in ``hc_post_sum`` too."""
    T, hc, D = 3, 4, 8
    streams = _randn(T, hc, D, seed=94).bfloat16()
    routed, shared = _randn(T, D, seed=95).bfloat16(), _randn(T, D, seed=96).bfloat16()
    post, comb = torch.rand(T, hc, generator=_gen(97)) * 2, torch.rand(T, hc, hc, generator=_gen(98))
    want = ref.hc_post(streams, routed + shared, post, comb)
    assert torch.equal(ref.hc_post_sum(streams, routed, shared, post, comb), want)
    seen = []

    def gpu_hc_post(streams, block_out, post, comb):
        seen.append(block_out)
        return ref.hc_post(streams, block_out, post, comb)

    table = OpTable({"hc_post": gpu_hc_post}, source="gpu")
    assert torch.equal(table.hc_post_sum(streams, routed, shared, post, comb), want)
    assert len(seen) == 1 and torch.equal(seen[0], routed + shared)
    assert table.sources()["hc_post_sum"] == "gpu (hc_post, composed)"


def test_hc_head_naive():
    T, hc, D, hc_eps, norm_eps = 3, 4, 6, 1e-6, 1e-6
    streams = _randn(T, hc, D, seed=100)
    fn, base, scale = _randn(hc, hc * D, seed=101), _randn(hc, seed=102), torch.tensor([0.7])
    got = ref.hc_head(streams, fn, base, scale, hc_eps, norm_eps)
    want = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        flat = streams[t].double().reshape(-1)
        flat = flat / math.sqrt(float((flat * flat).mean()) + norm_eps)
        for i in range(hc):
            pre = 1 / (1 + math.exp(-(float(fn[i].double() @ flat) * 0.7 + float(base[i])))) + hc_eps
            want[t] += pre * streams[t, i].double()
    assert got.shape == (T, D)
    torch.testing.assert_close(got, want.float(), **F32)


# ============================================================================ MoE routing
def _naive_score(v: float, scoring: str, row: list[float]) -> float:
    if scoring == "sqrtsoftplus":
        return math.sqrt(math.log1p(math.exp(v)))
    if scoring == "sigmoid":
        return 1 / (1 + math.exp(-v))
    return math.exp(v) / sum(math.exp(u) for u in row)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_moe_route_topk_selection_and_weights(scoring):
    T, E, k, scaling = 5, 12, 3, 2.5
    logits = _distinct_scores(T, E, seed=110) * 8
    bias = _distinct_scores(E, seed=111) * 0.05  # small and distinct: tie-free biased scores
    weights, ids = ref.moe_route_topk(logits, bias, k, scaling, scoring)
    assert ids.shape == weights.shape == (T, k) and ids.dtype == torch.long
    for t in range(T):
        row = logits[t].tolist()
        scores = [_naive_score(v, scoring, row) for v in row]
        biased = [s + float(b) for s, b in zip(scores, bias.tolist())]
        want_ids = sorted(range(E), key=lambda e: -biased[e])[:k]
        assert ids[t].tolist() == want_ids  # ordered by biased score, best first
        sel = [scores[e] for e in want_ids]  # unbiased scores of the selected experts
        want_w = torch.tensor([s / sum(sel) * scaling for s in sel])
        torch.testing.assert_close(weights[t], want_w, **F32)
    torch.testing.assert_close(weights.sum(-1), torch.full((T,), scaling), **F32)


def test_moe_route_topk_bias_changes_selection_not_weight_formula():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    k, scaling = 2, 1.0
    _, ids0 = ref.moe_route_topk(logits, torch.zeros(4), k, scaling, "sqrtsoftplus")
    assert ids0.tolist() == [[0, 1]]
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    weights, ids = ref.moe_route_topk(logits, bias, k, scaling, "sqrtsoftplus")
    assert ids.tolist() == [[3, 0]]
    s = [math.sqrt(math.log1p(math.exp(v))) for v in (0.0, 3.0)]  # unbiased scores of experts 3 and 0
    torch.testing.assert_close(weights[0], torch.tensor([s[0] / sum(s), s[1] / sum(s)]), **F32)


def test_moe_route_topk_ties_go_to_lower_expert_id():
    logits = torch.tensor([[1.0, 2.0, 1.0, 2.0, 2.0, 0.0], [0.5] * 6])
    weights, ids = ref.moe_route_topk(logits, torch.zeros(6), 2, 1.0, "sqrtsoftplus")
    assert ids.tolist() == [[1, 3], [0, 1]]
    torch.testing.assert_close(weights, torch.full((2, 2), 0.5), **F32)
    # equal scores: the bias lifts expert 5 first, the remaining ties go to the lowest ids
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    _, ids = ref.moe_route_topk(torch.zeros(1, 6), bias, 3, 1.0, "sigmoid")
    assert ids.tolist() == [[5, 0, 1]]


def test_moe_route_hash_uses_tid2eid_rows():
    T, E, k, vocab, scaling = 4, 8, 2, 10, 1.5
    logits = _randn(T, E, seed=120)
    tid2eid = torch.randint(0, E, (vocab, k), generator=_gen(121))
    tid2eid[7] = torch.tensor([6, 1])
    token_ids = torch.tensor([7, 0, 9, 7])
    weights, ids = ref.moe_route_hash(logits, token_ids, tid2eid.int(), scaling, "sqrtsoftplus")
    assert ids.dtype == torch.long
    assert ids.tolist() == [tid2eid[t].tolist() for t in token_ids.tolist()]
    for t in range(T):
        sel = [math.sqrt(math.log1p(math.exp(float(logits[t, e])))) for e in ids[t].tolist()]
        torch.testing.assert_close(weights[t], torch.tensor([s / sum(sel) * scaling for s in sel]), **F32)


# ============================================================================ experts
def _naive_swiglu(xt, w1, w2, w3, limit):
    """One token: w2 @ (silu(min(w1 x, limit)) * clip(w3 x, -limit, limit)), element by element."""
    I = w1.shape[0]
    h = torch.empty(I, dtype=torch.float64)
    for i in range(I):
        g = min(float(w1[i].double() @ xt.double()), limit)
        u = max(min(float(w3[i].double() @ xt.double()), limit), -limit)
        h[i] = g / (1 + math.exp(-g)) * u
    return w2.double() @ h


def test_moe_experts_matches_naive_per_token_loop_and_skips_unselected():
    T, D, I, E, k, limit = 5, 6, 4, 6, 2, 7.0
    x = _randn(T, D, seed=130)
    w1, w2, w3 = _randn(E, I, D, seed=131), _randn(E, D, I, seed=132), _randn(E, I, D, seed=133)
    ids = torch.tensor([[0, 3], [3, 0], [5, 0], [3, 3], [0, 5]])  # experts 1, 2, 4 never selected; a duplicate
    weights = torch.rand(T, k, generator=_gen(134))
    for e in (1, 2, 4):
        w1[e], w2[e], w3[e] = float("nan"), float("nan"), float("nan")
    got = ref.moe_experts(x, ids, weights, w1, w2, w3, limit)
    assert got.shape == (T, D) and torch.isfinite(got).all()
    want = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            want[t] += float(weights[t, j]) * _naive_swiglu(x[t], w1[e], w2[e], w3[e], limit)
    torch.testing.assert_close(got, want.float(), **F32)


def test_swiglu_mlp_naive_and_clamps():
    T, D, I, limit = 3, 5, 4, 2.0
    x = _randn(T, D, seed=140) * 3
    w1, w2, w3 = _randn(I, D, seed=141), _randn(D, I, seed=142), _randn(I, D, seed=143)
    want = torch.stack([_naive_swiglu(x[t], w1, w2, w3, limit) for t in range(T)])
    torch.testing.assert_close(ref.swiglu_mlp(x, w1, w2, w3, limit), want.float(), **F32)
    # identity projections expose the clamps: gate clamps only above (max=limit), up clamps to +-limit
    limit = 7.0
    eye = torch.eye(4)
    g = torch.tensor([[100.0, -8.0, 3.0, 100.0]])
    u = torch.tensor([[100.0, -100.0, -3.0, -9.0]])
    x = torch.cat([g, u], dim=-1)  # [1, 8]
    w1 = torch.cat([eye, torch.zeros(4, 4)], dim=1)
    w3 = torch.cat([torch.zeros(4, 4), eye], dim=1)
    got = ref.swiglu_mlp(x, w1, eye, w3, limit)

    def silu(v):
        return v / (1 + math.exp(-v))

    want = torch.tensor([[silu(7.0) * 7.0, silu(-8.0) * -7.0, silu(3.0) * -3.0, silu(7.0) * -7.0]])
    torch.testing.assert_close(got, want, **F32)
    assert abs(float(got[0, 1]) - silu(-7.0) * -7.0) > 1e-2  # the gate is not clamped from below


# ============================================================================ fork
def test_fork_runs_its_function_at_once_and_join_returns_the_result():
    store = torch.zeros(3)

    def fold(values: torch.Tensor) -> torch.Tensor:
        store.add_(values)
        return values * 2

    pending = ref.fork(fold, torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(store, torch.tensor([1.0, 2.0, 3.0]))  # the reference ran it before returning
    assert torch.equal(pending.join(), torch.tensor([2.0, 4.0, 6.0]))


# ============================================================================ gather_keys
def test_gather_keys_reads_ring_step_rows_then_entries():
    """Window key j of sequence s: the step's row where flagged, else its ring slot's index; then the store's
    entries, in the keys' dtype; without a store the window alone."""
    ring = _randn(3, 4, 2, seed=170)  # [slots, W, d]
    new_kv = _randn(2, 2, seed=171)  # [T, d]
    store = _randn(4, 2, 2, seed=172, dtype=torch.bfloat16)  # [blocks, rows, d]
    slots, index = torch.tensor([[2, 2, 2], [0, 0, 0]]), torch.tensor([[3, 0, 1], [1, 2, 0]])
    from_new = torch.tensor([[False, False, True], [False, True, False]])
    new_rows = torch.tensor([[0, 0, 0], [0, 1, 0]])
    blocks, rows = torch.tensor([[3], [1]]), torch.tensor([[1], [0]])
    got = ref.gather_keys(ring, slots, index, new_kv, new_rows, from_new, store, blocks, rows)
    want = torch.stack([torch.stack([ring[2, 3], ring[2, 0], new_kv[0], store[3, 1].float()]),
                        torch.stack([ring[0, 1], new_kv[1], ring[0, 0], store[1, 0].float()])])
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(ref.gather_keys(ring, slots, index, new_kv, new_rows, from_new), want[:, :3])
    no_window = blocks[:, :0]  # [S, 0]: the entries alone, as StepLayout.gather_entries asks
    got = ref.gather_keys(store, no_window, no_window, store[0], no_window, no_window.bool(), store, blocks, rows)
    assert got.dtype == store.dtype and torch.equal(got, store[blocks, rows])


# ============================================================================ linear / head / embed
def test_grouped_linear_per_group_matmul():
    T, G, i_per, o_per = 3, 4, 5, 2
    x, w = _randn(T, G, i_per, seed=150), _randn(G * o_per, i_per, seed=151)
    got = ref.grouped_linear(x, w, G)
    assert got.shape == (T, G, o_per)
    want = torch.empty(T, G, o_per)
    for g in range(G):
        want[:, g] = x[:, g] @ w[g * o_per : (g + 1) * o_per].T
    torch.testing.assert_close(got, want, **F32)


def test_linear_logits_embed():
    x, w = _randn(3, 6, seed=160), _randn(4, 6, seed=161)
    torch.testing.assert_close(ref.linear(x, w), x @ w.T, **F32)
    out = ref.logits(x.bfloat16(), w.bfloat16())
    assert out.dtype == torch.float32 and out.shape == (3, 4)
    torch.testing.assert_close(out, x @ w.T, rtol=3e-2, atol=3e-2)
    assert ref.logits(x, w).dtype == torch.float32
    table = _randn(10, 4, seed=162, dtype=torch.bfloat16)
    ids = torch.tensor([3, 0, 9, 3])
    emb = ref.embed(ids, table)
    assert emb.dtype == torch.bfloat16 and emb.shape == (4, 4)
    for t, i in enumerate(ids.tolist()):
        assert torch.equal(emb[t], table[i])


# ============================================================================ OpTable
def test_an_apply_rope_override_serves_the_in_place_op_unless_that_has_its_own():
    """The model calls ``apply_rope_``; a backend that overrides only ``apply_rope`` keeps its kernel in use (its
    result written back into the input), and an explicit ``apply_rope_`` override wins in either order."""
    calls = []

    def rope(x, cos, sin, inverse=False):
        calls.append(x.shape)
        return ref.apply_rope(x, cos, sin, inverse)

    def own_in_place(x, cos, sin, inverse=False):
        return x

    x, angles = _randn(3, 2, 8, seed=180), _randn(3, 2, seed=181)
    cos, sin = angles.cos(), angles.sin()
    table = OpTable({"apply_rope": rope}, source="npu")
    got = table.apply_rope_(x.clone(), cos, sin)
    assert calls == [(3, 2, 8)] and table.sources()["apply_rope_"] == "npu (apply_rope, written back)"
    torch.testing.assert_close(got, ref.apply_rope_(x.clone(), cos, sin), **F32)
    for overrides in ({"apply_rope": rope, "apply_rope_": own_in_place}, {"apply_rope_": own_in_place, "apply_rope": rope}):
        table = OpTable(overrides, source="gpu")
        assert table.apply_rope_ is own_in_place and table.sources()["apply_rope_"] == "gpu"
    table = OpTable({"apply_rope": rope}, source="npu")
    table.override("apply_rope", ref.apply_rope, source="plugin")  # a later override re-derives the in-place form
    assert table.sources()["apply_rope_"] == "plugin (apply_rope, written back)"


def test_rms_norm_rope_is_the_norm_then_rope_and_follows_overrides_of_its_parts():
    """``rms_norm_rope`` equals the norm (unweighted without a weight) then the in-place RoPE; a backend overriding
    only ``apply_rope`` reaches it through ``apply_rope_`` (derivations chain), its own override wins."""
    x, w, angles = _randn(3, 2, 8, seed=190), _randn(8, seed=191), _randn(3, 2, seed=192)
    cos, sin = angles.cos(), angles.sin()
    torch.testing.assert_close(ref.rms_norm_rope(x, w, 1e-6, cos, sin),
                               ref.apply_rope_(ref.rms_norm(x, w, 1e-6), cos, sin), **F32)
    torch.testing.assert_close(ref.rms_norm_rope(x, None, 1e-6, cos, sin),
                               ref.apply_rope_(ref.unweighted_rms_norm(x, 1e-6), cos, sin), **F32)
    calls = []

    def rope(x, cos, sin, inverse=False):
        calls.append(x.shape)
        return ref.apply_rope(x, cos, sin, inverse)

    table = OpTable({"apply_rope": rope}, source="gpu")
    torch.testing.assert_close(table.rms_norm_rope(x, w, 1e-6, cos, sin), ref.rms_norm_rope(x, w, 1e-6, cos, sin),
                               **F32)
    assert calls == [(3, 2, 8)] and table.sources()["rms_norm_rope"] == "gpu (apply_rope_, composed)"
    table.override("rms_norm_rope", ref.rms_norm_rope, source="own")
    table.override("rms_norm", ref.rms_norm, source="later")
    assert table.rms_norm_rope is ref.rms_norm_rope and table.sources()["rms_norm_rope"] == "own"


def test_roped_sink_attention_norms_and_rotates_the_queries_then_rotates_the_output_back():
    """``roped_sink_attention`` is the per-head query norm (no weight) with RoPE, the attention, then the inverse RoPE
    of its output, each row by its own angle; a backend overriding only ``sink_attention`` gets its kernel in it
    too."""
    S, Lq, Lk, H, d, half = 2, 3, 5, 2, 8, 2
    q, kv = _randn(S, Lq, H, d, seed=200), _randn(S, Lk, d, seed=201)
    visible = torch.rand(S, Lq, Lk, generator=_gen(202)) < 0.7
    sinks, angles = torch.tensor([0.3, -0.5]), _randn(S, Lq, half, seed=203)
    cos, sin = angles.cos(), angles.sin()
    flat_q = ref.rms_norm_rope(q.reshape(S * Lq, H, d), None, 1e-6, cos.reshape(-1, half), sin.reshape(-1, half))
    out = ref.sink_attention(flat_q.view(S, Lq, H, d), kv, visible, sinks, 0.5)
    want = ref.apply_rope(out.reshape(S * Lq, H, d), cos.reshape(-1, half), sin.reshape(-1, half), inverse=True)
    got = ref.roped_sink_attention(q, kv, visible, sinks, 0.5, 1e-6, cos, sin)
    assert got.shape == (S, Lq, H, d)
    torch.testing.assert_close(got, want.view(S, Lq, H, d), **F32)
    rotated = ref.apply_rope(got.reshape(S * Lq, H, d), cos.reshape(-1, half), sin.reshape(-1, half))
    torch.testing.assert_close(rotated.view(S, Lq, H, d), out, **F32)  # the inverse undoes the forward rotation
    calls = []

    def gpu_attention(q, kv, visible, sinks, scale):
        calls.append(q.shape)
        return ref.sink_attention(q, kv, visible, sinks, scale)

    table = OpTable({"sink_attention": gpu_attention}, source="gpu")
    torch.testing.assert_close(table.roped_sink_attention(q, kv, visible, sinks, 0.5, 1e-6, cos, sin), got, **F32)
    assert calls == [(S, Lq, H, d)] and table.sources()["roped_sink_attention"] == "gpu (sink_attention, composed)"


def test_op_table_reference_defaults_and_override():
    names = set(reference_ops())
    assert {"rms_norm", "unweighted_rms_norm", "rope_cos_sin", "apply_rope", "linear", "grouped_linear",
            "sink_attention", "compressor_pool", "indexer_scores", "indexer_topk", "hc_pre", "hc_post",
            "hc_head", "moe_route_topk", "moe_route_hash", "swiglu_mlp", "moe_experts", "logits",
            "embed", "gather_keys", "fork", "compressor_entries"} <= names
    table = OpTable()
    assert table.rms_norm is ref.rms_norm
    assert set(table.sources().values()) == {"reference"}

    def fast_rms_norm(x, weight, eps):
        return x

    table = OpTable({"rms_norm": fast_rms_norm}, source="nvidia")
    assert table.rms_norm is fast_rms_norm
    assert table.sources()["rms_norm"] == "nvidia"
    assert table.sources()["linear"] == "reference" and table.linear is ref.linear
    table.override("embed", fast_rms_norm, "plugin-x")
    assert table.sources()["embed"] == "plugin-x" and table.embed is fast_rms_norm
    assert OpTable().rms_norm is ref.rms_norm  # overrides do not leak into other tables
    with pytest.raises(AttributeError, match="no_such_op"):
        table.no_such_op  # noqa: B018


def test_op_table_rejects_unknown_and_non_callable():
    with pytest.raises(UnknownOpError) as err:
        OpTable({"rms_nrom": ref.rms_norm}, source="nvidia")
    msg = str(err.value)
    assert "rms_nrom" in msg and "nvidia" in msg and "rms_norm" in msg and "sink_attention" in msg
    assert isinstance(err.value, KeyError)
    with pytest.raises(TypeError, match="rms_norm"):
        OpTable({"rms_norm": 3}, source="nvidia")
    table = OpTable()
    with pytest.raises(UnknownOpError):
        table.override("bogus", ref.linear, "x")
    with pytest.raises(TypeError):
        table.override("linear", None, "x")
    assert table.linear is ref.linear and table.sources()["linear"] == "reference"


# ============================================================================ compressor windows
@pytest.mark.parametrize("overlap", [False, True])
def test_compressor_window_takes_new_rows_and_carry_and_masks_before_position_zero(overlap):
    ratio, d = 2, 3
    width, span = (2 * d, 2 * ratio) if overlap else (d, ratio)
    raw_kv, raw_gate = torch.randn(4, width), torch.randn(4, width)  # this step's 4 token rows
    carry_kv, carry_gate = torch.randn(3, span, width), torch.randn(3, span, width)  # 3 slots
    ape = torch.randn(ratio, width)
    # two windows: window 0 mixes carry (slot 2) and new rows; window 1's first slot lies before position 0
    from_new = torch.tensor([[False] * (span - 1) + [True], [False] + [True] * (span - 1)])
    new_rows = torch.tensor([[0] * (span - 1) + [3], [0] + list(range(span - 1))])
    carry_slots = torch.full((2, span), 2)
    carry_index = torch.arange(span).repeat(2, 1)
    valid = torch.tensor([[True] * span, [False] + [True] * (span - 1)])
    kv, gate = ref.compressor_window(raw_kv, raw_gate, carry_kv, carry_gate, from_new, new_rows, carry_slots,
                                     carry_index, valid, ape, ratio, overlap)
    assert kv.shape == gate.shape == (2, span, d)
    for n in range(2):
        for j in range(span):
            src_kv = raw_kv[new_rows[n, j]] if from_new[n, j] else carry_kv[2, j]
            src_gate = raw_gate[new_rows[n, j]] if from_new[n, j] else carry_gate[2, j]
            channels = slice(0, d) if not overlap or j < ratio else slice(d, 2 * d)
            bias = ape[j % ratio, channels]
            if valid[n, j]:
                assert torch.equal(kv[n, j], src_kv[channels])
                assert torch.equal(gate[n, j], src_gate[channels] + bias)
            else:
                assert torch.equal(kv[n, j], torch.zeros(d)) and torch.isneginf(gate[n, j]).all()


def test_compressor_entries_pool_the_windows_and_follow_the_tables_parts():
    """``compressor_entries`` is ``compressor_pool`` of ``compressor_window``; an op table whose backend overrides
    only the pool composes that override with the window op, and an override of the composite itself wins;
    ``compressor_entries_rope`` is RoPE on the entries, made of the table's entries op."""
    ratio, d, span = 2, 3, 4
    gen = torch.Generator().manual_seed(190)
    raw_kv, raw_gate = torch.randn(4, 2 * d, generator=gen), torch.randn(4, 2 * d, generator=gen)
    carry_kv, carry_gate = torch.randn(3, span, 2 * d, generator=gen), torch.randn(3, span, 2 * d, generator=gen)
    from_new = torch.tensor([[False, False, True, True]])
    new_rows, carry_slots = torch.tensor([[0, 0, 1, 2]]), torch.full((1, span), 1)
    carry_index, valid = torch.arange(span)[None], torch.tensor([[False, True, True, True]])
    ape, norm = torch.randn(ratio, 2 * d, generator=gen), torch.rand(d, generator=gen) + 0.5
    args = (raw_kv, raw_gate, carry_kv, carry_gate, from_new, new_rows, carry_slots, carry_index, valid, ape)
    want = ref.compressor_pool(*ref.compressor_window(*args, ratio, True), norm, 1e-6)
    torch.testing.assert_close(ref.compressor_entries(*args, norm, 1e-6, ratio, True), want, **F32)
    pools = []

    def pool(kv, gate, weight, eps):
        pools.append(kv.shape)
        return ref.compressor_pool(kv, gate, weight, eps)

    table = OpTable({"compressor_pool": pool}, source="npu")
    torch.testing.assert_close(table.compressor_entries(*args, norm, 1e-6, ratio, True), want, **F32)
    assert pools == [(1, span, d)] and table.sources()["compressor_entries"] == "npu (compressor_pool, composed)"
    table.override("compressor_entries", ref.compressor_entries, source="gpu")
    table.override("compressor_window", ref.compressor_window, source="plugin")  # the composite's own override stays
    assert table.compressor_entries is ref.compressor_entries and table.sources()["compressor_entries"] == "gpu"
    cos, sin = torch.rand(1, 1, generator=gen), torch.rand(1, 1, generator=gen)  # the entry's RoPE (rope_dim 2)
    rotated = ref.compressor_entries_rope(*args, norm, 1e-6, ratio, True, cos, sin)
    torch.testing.assert_close(rotated, ref.apply_rope(want, cos, sin), **F32)
    assert table.sources()["compressor_entries_rope"] == "gpu (compressor_entries, composed)"
    torch.testing.assert_close(table.compressor_entries_rope(*args, norm, 1e-6, ratio, True, cos, sin), rotated,
                               **F32)

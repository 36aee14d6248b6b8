"""Op-level batch-invariance checks: a "needle" computed alone vs inside random batches.

Row-wise ops (one row per token, expert or compressor window): the needle's rows are scattered at
random positions among ``m`` random filler rows, for many ``m``. Sequence ops (attention, indexer):
the needle sequence sits at a random index among other sequences of random lengths, its queries at
random rows of the padded query axis, its keys at random (order-preserving) places of a longer padded
key axis filled with invisible junk, next to extra queries of its own sequence (as in chunked prefill).
A check returns the filler sizes (or trials) where the needle's output was not bitwise equal to the
needle computed alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

FILLER_SIZES = (0, 1, 2, 3, 7, 13, 16, 17, 31, 64, 100)


def _randn(gen, *shape, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _equal(a, b) -> bool:
    if isinstance(a, tuple | list):
        return all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a.dtype == b.dtype and torch.equal(a, b)


def _take(out, index):
    if isinstance(out, tuple | list):
        return tuple(_take(o, index) for o in out)
    return out[index]


def close(a, b, atol: float, rtol: float) -> None:
    """``torch.testing.assert_close`` over tensors or tuples of tensors."""
    if isinstance(a, tuple | list):
        for x, y in zip(a, b, strict=True):
            close(x, y, atol, rtol)
        return
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)


# ----------------------------------------------------------------------------- row-wise ops
@dataclasses.dataclass
class RowCase:
    """An op whose inputs and outputs share a leading row axis.

    ``rows(n, gen)`` makes the per-row inputs for ``n`` rows; ``call(op, rows)`` calls the op (with any
    fixed weights bound in) and returns a tensor or tuple of tensors with the same leading axis.
    """

    name: str
    op: str
    rows: Callable[[int, torch.Generator], list[torch.Tensor]]
    call: Callable[[Callable, list[torch.Tensor]], object]


def scatter_rows(needle: Sequence[torch.Tensor], filler: Sequence[torch.Tensor], gen) -> tuple[list, torch.Tensor]:
    """Needle rows at random positions among the filler rows; returns the inputs and the needle rows."""
    n, m = needle[0].shape[0], filler[0].shape[0]
    perm = torch.randperm(n + m, generator=gen)
    where, other = perm[:n].sort().values, perm[n:].sort().values
    mixed = []
    for a, b in zip(needle, filler, strict=True):
        t = a.new_empty((n + m, *a.shape[1:]))
        t[where] = a
        t[other] = b
        mixed.append(t)
    return mixed, where


def check_rows(case: RowCase, op: Callable, sizes: Sequence[int] = FILLER_SIZES, seed: int = 0,
               needle_rows: int = 3) -> list[int]:
    """Filler sizes where the needle's rows differ from the needle alone (empty: invariant)."""
    gen = torch.Generator().manual_seed(seed)
    needle = case.rows(needle_rows, gen)
    alone = case.call(op, needle)
    failures = []
    for m in sizes:
        mixed, where = scatter_rows(needle, case.rows(m, gen), gen)
        if not _equal(_take(case.call(op, mixed), where), alone):
            failures.append(m)
    return failures


# ----------------------------------------------------------------------------- attention
@dataclasses.dataclass
class Sequence_:
    q: torch.Tensor  # [n_q, H, d]
    kv: torch.Tensor  # [n_k, d]
    visible: torch.Tensor  # [n_q, n_k]


def _random_sequence(gen, H, d, max_q=12, max_k=150, dtype=torch.float32) -> Sequence_:
    n_q = int(torch.randint(1, max_q + 1, (1,), generator=gen))
    n_k = int(torch.randint(1, max_k + 1, (1,), generator=gen))
    visible = torch.rand(n_q, n_k, generator=gen) < 0.6
    visible[:, 0] = True
    return Sequence_(_randn(gen, n_q, H, d, dtype=dtype), _randn(gen, n_k, d, dtype=dtype), visible)


def _place(seq: Sequence_, Lq: int, Lk: int, gen, extra_queries: bool) -> tuple:
    """``seq`` padded into ``[Lq, ...]`` / ``[Lk, ...]`` at random order-preserving places, junk around it."""
    n_q, H, d = seq.q.shape
    n_k = seq.kv.shape[0]
    rows = torch.randperm(Lq, generator=gen)[:n_q].sort().values
    keys = torch.randperm(Lk, generator=gen)[:n_k].sort().values
    q = _randn(gen, Lq, H, d, dtype=seq.q.dtype)
    kv = _randn(gen, Lk, d, dtype=seq.kv.dtype) * 100  # junk keys: huge, so any leak shows
    visible = (torch.rand(Lq, Lk, generator=gen) < 0.5) if extra_queries else torch.zeros(Lq, Lk, dtype=torch.bool)
    q[rows] = seq.q
    kv[keys] = seq.kv
    visible[rows] = False
    visible[rows[:, None], keys[None, :]] = seq.visible
    return q, kv, visible, rows


def check_attention(op: Callable, trials: int = 25, H: int = 4, d: int = 32, seed: int = 0,
                    dtype=torch.float32) -> list[int]:
    """Trials where the needle sequence's attention output differs from the needle alone."""
    gen = torch.Generator().manual_seed(seed)
    sinks = _randn(gen, H)
    needle = _random_sequence(gen, H, d, dtype=dtype)
    alone = op(needle.q[None], needle.kv[None], needle.visible[None], sinks, d**-0.5)[0]
    failures = []
    for trial in range(trials):
        others = [_random_sequence(gen, H, d, dtype=dtype) for _ in range(int(torch.randint(0, 6, (1,), generator=gen)))]
        Lq = max([needle.q.shape[0], *(o.q.shape[0] for o in others)]) + int(torch.randint(0, 4, (1,), generator=gen))
        Lk = max([needle.kv.shape[0], *(o.kv.shape[0] for o in others)]) + int(torch.randint(0, 80, (1,), generator=gen))
        slot = int(torch.randint(0, len(others) + 1, (1,), generator=gen))
        seqs = others[:slot] + [needle] + others[slot:]
        placed = [_place(s, Lq, Lk, gen, extra_queries=s is needle and trial % 2 == 0) for s in seqs]
        q = torch.stack([p[0] for p in placed])
        kv = torch.stack([p[1] for p in placed])
        visible = torch.stack([p[2] for p in placed])
        got = op(q, kv, visible, sinks, d**-0.5)[slot, placed[slot][3]]
        if not torch.equal(got, alone):
            failures.append(trial)
    return failures


def attention_batch(gen, S=5, H=4, d=32, dtype=torch.float32):
    """A random padded attention batch (for comparing a variant with the reference op)."""
    seqs = [_random_sequence(gen, H, d, dtype=dtype) for _ in range(S)]
    Lq = max(s.q.shape[0] for s in seqs) + 2
    Lk = max(s.kv.shape[0] for s in seqs) + 10
    placed = [_place(s, Lq, Lk, gen, extra_queries=True) for s in seqs]
    return (torch.stack([p[0] for p in placed]), torch.stack([p[1] for p in placed]),
            torch.stack([p[2] for p in placed]), _randn(gen, H), d**-0.5)


def check_empty_attention_row(op: Callable, reference: Callable) -> None:
    """A query without visible keys gets exact zeros; the rest matches the reference op."""
    q, kv = torch.randn(1, 2, 4, 32), torch.randn(1, 5, 32)
    visible = torch.zeros(1, 2, 5, dtype=torch.bool)
    visible[0, 0, 1] = True
    sinks = torch.randn(4)
    out = op(q, kv, visible, sinks, 0.2)
    assert torch.equal(out[0, 1], torch.zeros(4, 32))
    close(out, reference(q, kv, visible, sinks, 0.2), atol=1e-6, rtol=1e-5)


def attention_tiles_agree(op: Callable, reference: Callable, set_few_programs: Callable[[int], None], H: int = 64,
                          d: int = 32, dtype=torch.bfloat16, device: str = "cpu", seed: int = 0) -> None:
    """``op`` (the CUDA variants' ``sink_attention``) with 64 heads a program (``set_few_programs(0)``) and with 16
    (``set_few_programs`` of a huge count) on queries of 0 to 300 visible keys: asserts the same bits, zeros for the
    query without keys, and ``reference``'s values."""
    gen = torch.Generator().manual_seed(seed)
    S, Lq, Lk = 3, 4, 300
    q, kv, sinks = _randn(gen, S, Lq, H, d), _randn(gen, S, Lk, d), _randn(gen, H)
    visible = torch.rand(S, Lq, Lk, generator=gen) < torch.rand(S, Lq, 1, generator=gen)  # [S, Lq, Lk]
    visible[0, 0] = False  # a query without keys
    args = [a.to(device=device, dtype=dtype) if a.is_floating_point() else a.to(device)
            for a in (q, kv, visible, sinks)]
    outs = []
    for few in (0, 1 << 30):
        set_few_programs(few)
        outs.append(op(*args, d**-0.5))
    assert torch.equal(outs[0], outs[1]), (outs[0].float() - outs[1].float()).abs().max()
    assert torch.equal(outs[0][0, 0], torch.zeros_like(outs[0][0, 0]))
    want = reference(*(a.float() if a.is_floating_point() else a for a in args), d**-0.5)
    close(outs[0], want, atol=3e-2, rtol=2e-2)


# ----------------------------------------------------------------------------- indexer
def _indexer_sequence(gen, Hi, di, max_q=10, max_e=150):
    n_q = int(torch.randint(1, max_q + 1, (1,), generator=gen))
    n_e = int(torch.randint(1, max_e + 1, (1,), generator=gen))
    return _randn(gen, n_q, Hi, di), _randn(gen, n_e, di), _randn(gen, n_q, Hi)


def check_indexer_scores(op: Callable, trials: int = 25, Hi: int = 2, di: int = 16, seed: int = 0) -> list[int]:
    """Trials where the needle sequence's scores (over its own entries) differ from the needle alone."""
    gen = torch.Generator().manual_seed(seed)
    q, keys, w = _indexer_sequence(gen, Hi, di)
    n_q, n_e = q.shape[0], keys.shape[0]
    alone = op(q[None], keys[None], w[None], di**-0.5)[0]
    failures = []
    for trial in range(trials):
        S = int(torch.randint(1, 6, (1,), generator=gen))
        slot = int(torch.randint(0, S, (1,), generator=gen))
        Lq = n_q + int(torch.randint(0, 8, (1,), generator=gen))
        E = n_e + int(torch.randint(0, 100, (1,), generator=gen))
        qs, ks, ws = _randn(gen, S, Lq, Hi, di), _randn(gen, S, E, di) * 100, _randn(gen, S, Lq, Hi)
        rows = torch.randperm(Lq, generator=gen)[:n_q].sort().values
        qs[slot, rows], ks[slot, :n_e], ws[slot, rows] = q, keys, w
        got = op(qs, ks, ws, di**-0.5)[slot, rows, :n_e]
        if not torch.equal(got, alone[:, :n_e]):
            failures.append(trial)
    return failures


def check_indexer_close(op: Callable, reference: Callable) -> None:
    """``indexer_scores`` matches the reference op on a padded 3-sequence batch."""
    gen = torch.Generator().manual_seed(5)
    q, keys, w = torch.randn(3, 7, 2, 16, generator=gen), torch.randn(3, 90, 16, generator=gen), torch.randn(3, 7, 2)
    close(op(q, keys, w, 0.25), reference(q, keys, w, 0.25), atol=1e-5, rtol=1e-5)


def check_indexer_topk(op: Callable, trials: int = 25, k: int = 5, seed: int = 0) -> list[int]:
    """Trials where the needle's selection over its own entries differs from the needle alone (scores with ties)."""
    gen = torch.Generator().manual_seed(seed)
    n_q, n_e = 6, 20
    scores = torch.randint(0, 4, (n_q, n_e), generator=gen).float()  # many ties
    visible = torch.rand(n_q, n_e, generator=gen) < 0.7
    alone = op(scores[None], visible[None], k)[0]
    failures = []
    for trial in range(trials):
        S = int(torch.randint(1, 5, (1,), generator=gen))
        slot = int(torch.randint(0, S, (1,), generator=gen))
        Lq, E = n_q + int(torch.randint(0, 4, (1,), generator=gen)), n_e + int(torch.randint(0, 30, (1,), generator=gen))
        s_all = torch.randint(0, 6, (S, Lq, E), generator=gen).float()
        v_all = torch.rand(S, Lq, E, generator=gen) < 0.7
        rows = torch.randperm(Lq, generator=gen)[:n_q].sort().values
        s_all[slot, rows, :n_e], v_all[slot, rows, :n_e] = scores, visible
        v_all[slot, rows, n_e:] = False  # entries past the sequence's own are never visible to it
        if not torch.equal(op(s_all, v_all, k)[slot, rows, :n_e], alone):
            failures.append(trial)
    return failures


# ----------------------------------------------------------------------------- the row-wise cases
def row_cases(dtype=torch.float32, seed: int = 1234) -> list[RowCase]:
    """One case per row-wise op of the table, with small odd sizes (widths that are not multiples of the
    SIMD width, so scalar tails appear) and fixed random weights."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.2):
        return _randn(g, *shape, scale=scale, dtype=dtype)

    def rows(*shape, scale=1.0, dt=None):
        return lambda n, gen: [_randn(gen, n, *shape, scale=scale, dtype=dt or dtype)]

    lin_small, lin_big, head = w(40, 48), w(96, 256, scale=0.05), w(100, 64)
    grouped = w(2 * 24, 32)
    norm_w = 1 + w(256, scale=0.1)
    hc, D = 4, 36
    pre_fn, pre_base, pre_scale = _randn(g, (2 + hc) * hc, hc * D, scale=0.1), _randn(g, (2 + hc) * hc), _randn(g, 3)
    head_fn, head_base, head_scale = _randn(g, hc, hc * D, scale=0.1), _randn(g, hc), _randn(g, 1)
    E, k, I, Dm = 6, 2, 24, 32
    bias = _randn(g, E, scale=0.1)
    tid2eid = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(50)])
    w1, w2, w3 = w(E, I, Dm), w(E, Dm, I), w(E, I, Dm)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8).float() / 8))
    table = w(50, 32)
    cnorm = 1 + _randn(g, 32, scale=0.1)

    def route_rows(n, gen):
        return [_randn(gen, n, E, scale=2.0)]

    def hash_rows(n, gen):
        return [_randn(gen, n, E, scale=2.0), torch.randint(0, 50, (n,), generator=gen)]

    def expert_rows(n, gen):
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(n)]) if n else torch.zeros(0, k).long()
        return [_randn(gen, n, Dm, dtype=dtype), ids, torch.rand(n, k, generator=gen)]

    def rope_rows(n, gen):
        return [_randn(gen, n, 4, 32, dtype=dtype), _randn(gen, n, 4), _randn(gen, n, 4)]

    def pool_rows(n, gen):
        gate = _randn(gen, n, 8, 32, dtype=dtype)
        masked = torch.rand(n, 8, 1, generator=gen) < 0.3
        masked[:, -1] = False
        return [_randn(gen, n, 8, 32, dtype=dtype), gate.masked_fill(masked, float("-inf"))]

    def hc_post_rows(n, gen):
        return [_randn(gen, n, hc, D, dtype=dtype), _randn(gen, n, D, dtype=dtype), torch.rand(n, hc, generator=gen),
                torch.rand(n, hc, hc, generator=gen)]

    cases = [
        RowCase("linear 48->40", "linear", rows(48), lambda op, r: op(r[0], lin_small)),
        RowCase("linear 256->96", "linear", rows(256), lambda op, r: op(r[0], lin_big)),
        RowCase("grouped_linear", "grouped_linear", rows(2, 32), lambda op, r: op(r[0], grouped, 2)),
        RowCase("logits", "logits", rows(64), lambda op, r: op(r[0], head)),
        RowCase("rms_norm", "rms_norm", rows(256), lambda op, r: op(r[0], norm_w, 1e-6)),
        RowCase("unweighted_rms_norm", "unweighted_rms_norm", rows(4, 32), lambda op, r: op(r[0], 1e-6)),
        RowCase("rope_cos_sin", "rope_cos_sin", lambda n, gen: [torch.randint(0, 5000, (n,), generator=gen)],
                lambda op, r: op(r[0], inv_freq, 1.0, dtype)),
        RowCase("apply_rope", "apply_rope", rope_rows, lambda op, r: op(r[0], r[1], r[2])),
        RowCase("apply_rope inverse", "apply_rope", rope_rows, lambda op, r: op(r[0], r[1], r[2], inverse=True)),
        RowCase("hc_pre", "hc_pre", rows(hc, D), lambda op, r: op(r[0], pre_fn, pre_base, pre_scale, 20, 1e-6, 1e-6)),
        RowCase("hc_post", "hc_post", hc_post_rows, lambda op, r: op(*r)),
        RowCase("hc_head", "hc_head", rows(hc, D), lambda op, r: op(r[0], head_fn, head_base, head_scale, 1e-6, 1e-6)),
        *(RowCase(f"moe_route_topk {f}", "moe_route_topk", route_rows,
                  lambda op, r, f=f: op(r[0], bias, k, 1.5, f)) for f in ("sqrtsoftplus", "sigmoid", "softmax")),
        RowCase("moe_route_hash", "moe_route_hash", hash_rows,
                lambda op, r: op(r[0], r[1], tid2eid, 1.5, "sqrtsoftplus")),
        RowCase("swiglu_mlp", "swiglu_mlp", rows(Dm), lambda op, r: op(r[0], w1[0], w2[0], w3[0], 10.0)),
        RowCase("moe_experts", "moe_experts", expert_rows, lambda op, r: op(r[0], r[1], r[2], w1, w2, w3, 10.0)),
        RowCase("compressor_pool", "compressor_pool", pool_rows, lambda op, r: op(r[0], r[1], cnorm, 1e-6)),
        RowCase("embed", "embed", lambda n, gen: [torch.randint(0, 50, (n,), generator=gen)],
                lambda op, r: op(r[0], table)),
    ]
    return cases


def fused_cases(dtype=torch.float32, hc: int = 4, dim: int = 256, head_dim: int = 64, half: int = 8,
                seed: int = 4321) -> list[RowCase]:
    """The fused ops the model calls, at the shipped tiny checkpoint's sizes (``hc`` 4, hidden 256, head dim 64,
    8 RoPE pairs): ``hc_pre_normed`` (its fp32 mixing: K = hc * hidden = 1024), ``hc_post_sum`` and ``rms_norm_rope``
    with each row's own angle, as the GPU row cases do not cover them."""
    g = torch.Generator().manual_seed(seed)
    fn, base, scale = _randn(g, (2 + hc) * hc, hc * dim, scale=0.05), _randn(g, (2 + hc) * hc), torch.rand(3, generator=g)
    norm_w = torch.rand(dim, generator=g) + 0.5

    def post_rows(n, gen):
        return [_randn(gen, n, hc, dim, dtype=dtype), _randn(gen, n, dim, dtype=dtype), _randn(gen, n, dim, dtype=dtype),
                torch.rand(n, hc, generator=gen), torch.rand(n, hc, hc, generator=gen)]

    def rope_rows(n, gen):
        return [_randn(gen, n, head_dim, dtype=dtype), torch.rand(n, half, generator=gen).to(dtype),
                torch.rand(n, half, generator=gen).to(dtype)]

    return [
        RowCase("hc_pre_normed", "hc_pre_normed", lambda n, gen: [_randn(gen, n, hc, dim, dtype=dtype)],
                lambda op, r: op(r[0], fn, base, scale, 20, 1e-6, 1e-6, norm_w.to(dtype))),
        RowCase("hc_post_sum", "hc_post_sum", post_rows, lambda op, r: op(*r)),
        RowCase("rms_norm_rope", "rms_norm_rope", rope_rows, lambda op, r: op(r[0], None, 1e-6, r[1], r[2])),
    ]


# ----------------------------------------------------------------------------- end to end
def record(output, vocab: int):
    """Tokens, per-step log-probability rows ``[steps, vocab]`` and prompt rows ``[P - 1, vocab]`` of a
    ``RequestOutput`` generated with ``logprobs = prompt_logprobs = vocab``."""
    completion = output.outputs[0]
    steps = torch.tensor([[entry[t].logprob for t in range(vocab)] for entry in completion.logprobs])
    prompt = torch.tensor([[entry[t].logprob for t in range(vocab)] for entry in output.prompt_logprobs[1:]])
    return list(completion.token_ids), steps, prompt


def outputs_equal(a, b) -> bool:
    """Two ``record`` results are the same tokens and bitwise the same log-probabilities."""
    return a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])


def random_batch(gen, num_others: int, needles, vocab: int, max_tokens: tuple[int, int] = (1, 12)):
    """``num_others`` random requests (random prompts, greedy or seeded sampling, random lengths) with the
    ``needles`` (``(prompt ids, params)``) inserted at random positions; returns prompts, params and the
    needles' indices."""
    from deepinfer_core import SamplingParams

    prompts, params = [], []
    for _ in range(num_others):
        prompts.append(torch.randint(2, vocab, (int(torch.randint(1, 50, (1,), generator=gen)),), generator=gen).tolist())
        greedy = bool(torch.rand(1, generator=gen) < 0.3)
        params.append(SamplingParams(
            temperature=0.0 if greedy else float(torch.rand(1, generator=gen)) + 0.2,
            seed=int(torch.randint(0, 10**6, (1,), generator=gen)), max_tokens=int(torch.randint(*max_tokens, (1,), generator=gen)),
            ignore_eos=True))
    where = []
    for prompt, p in needles:
        at = int(torch.randint(0, len(prompts) + 1, (1,), generator=gen))
        where = [w + (w >= at) for w in where] + [at]
        prompts.insert(at, prompt)
        params.insert(at, p)
    return [{"prompt_token_ids": p} for p in prompts], params, where

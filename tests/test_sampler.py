"""The sampler: noise hash, greedy, filters, penalties, batch invariance, logprobs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.sampling import SamplingMetadata, SamplingParams, compute_prompt_logprobs, request_seed, sample
from deepinfer_core.sampling.noise import derive_seed, python_uniform, uniform_noise
from deepinfer_core.sampling.sampler import apply_penalties, apply_top_k_top_p, argmax_lowest, greedy_rows

INT64 = st.integers(-(2**63), 2**63 - 1)
# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_CRIT_001 = {3: 16.27, 4: 18.47, 5: 20.52, 7: 24.32}


def meta(rows: int, **kw) -> SamplingMetadata:
    """Hand-built metadata: defaults are temperature 1, filters and penalties off, seed i, position 0."""

    def vec(name, default, dtype=torch.float32):
        value = kw.pop(name, default)
        if isinstance(value, torch.Tensor):
            return value.to(dtype)
        if isinstance(value, (list, tuple)):
            return torch.tensor(value, dtype=dtype)
        return torch.full((rows,), value, dtype=dtype)

    out = SamplingMetadata(
        temperature=vec("temperature", 1.0),
        top_p=vec("top_p", 1.0),
        top_k=vec("top_k", 0, torch.int64),
        min_p=vec("min_p", 0.0),
        repetition_penalty=vec("repetition_penalty", 1.0),
        presence_penalty=vec("presence_penalty", 0.0),
        frequency_penalty=vec("frequency_penalty", 0.0),
        seeds=vec("seeds", torch.arange(rows), torch.int64),
        positions=vec("positions", 0, torch.int64),
        prompt_token_ids=kw.pop("prompt_token_ids", [[] for _ in range(rows)]),
        output_token_ids=kw.pop("output_token_ids", [[] for _ in range(rows)]),
        min_tokens=kw.pop("min_tokens", [0] * rows),
        stop_token_ids=kw.pop("stop_token_ids", [[] for _ in range(rows)]),
        allowed_token_mask=kw.pop("allowed_token_mask", None),
        num_logprobs=kw.pop("num_logprobs", None),
    )
    assert not kw, f"unknown keys {kw}"
    return out


def draws(logits_row: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """``n`` tokens drawn from one logits row, one per seed 0..n-1 (one batched call)."""
    out = sample(logits_row.expand(n, -1).clone(), meta(n, **kw))
    return out.sampled_token_ids


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


# ---------------------------------------------------------------------------------------------
# noise


@settings(max_examples=200, deadline=None)
@given(seed=INT64, position=st.integers(0, 2**40), vocab_id=st.integers(0, 300))
def test_torch_noise_matches_python_bigint_reference(seed, position, vocab_id):
    u = uniform_noise(torch.tensor([seed]), torch.tensor([position]), vocab_id + 1)[0, vocab_id].item()
    assert u == python_uniform(seed, position, vocab_id)
    assert 0 < u < 1


def test_noise_is_uniform_and_not_constant():
    u = uniform_noise(torch.arange(64), torch.zeros(64, dtype=torch.int64), 1000).flatten()
    assert abs(u.mean().item() - 0.5) < 0.01
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert chi_square(counts, torch.full((10,), 0.1, dtype=torch.float64)) < 27.88  # df 9, p=0.001
    assert u.unique().numel() == u.numel()


def test_derive_seed():
    assert derive_seed(123, 0) == 123
    seeds = {derive_seed(123, i) for i in range(100)}
    assert len(seeds) == 100
    assert derive_seed(2**64 + 5, 0) == 5


def test_request_seed_uses_params_seed_or_random():
    assert request_seed(SamplingParams(seed=9)) == 9
    assert request_seed(SamplingParams(seed=9), 1) == derive_seed(9, 1) != 9
    assert request_seed(SamplingParams()) != request_seed(SamplingParams())


# ---------------------------------------------------------------------------------------------
# greedy


@settings(max_examples=50, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.integers(1, 50), seed=st.integers(0, 1000))
def test_greedy_is_argmax(rows, vocab, seed):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))
    out = sample(logits, meta(rows, temperature=0.0))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_greedy_ties_go_to_lowest_id():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0], [5.0, 5.0, 5.0, 5.0, 5.0]])
    assert sample(logits, meta(2, temperature=0.0)).sampled_token_ids.tolist() == [1, 0]
    assert argmax_lowest(torch.tensor([[1.0, 2.0, 2.0]])).tolist() == [1]


def test_greedy_and_random_rows_mix():
    logits = torch.tensor([[0.0, 1.0, 0.5], [0.0, 1.0, 0.5]])
    out = sample(logits, meta(2, temperature=[0.0, 1.0], top_k=[0, 1]))
    assert out.sampled_token_ids.tolist() == [1, 1]


def test_plain_greedy_rows_take_the_greedy_op_with_the_general_paths_result():
    """A step of plain greedy rows goes through ``greedy`` (a backend's ``greedy_sample``) and gets what the general
    path gives (asking for 0 top log-probabilities keeps the general path): ids, raw log-probabilities, ranks."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(5)) * 3
    logits[1, [7, 200]] = 30.0  # a tie: the lower id, rank 2
    calls = []

    def greedy(rows):
        calls.append(rows.shape)
        return greedy_rows(rows)

    fast = sample(logits, meta(4, temperature=0.0), greedy=greedy)
    general = sample(logits, meta(4, temperature=0.0, num_logprobs=0), greedy=greedy)
    assert calls == [(4, 300)]
    assert torch.equal(fast.sampled_token_ids, general.sampled_token_ids)
    assert torch.equal(fast.sampled_ranks, general.sampled_ranks)
    assert torch.equal(fast.sampled_logprobs, general.sampled_logprobs)
    assert fast.sampled_token_ids[1].item() == 7 and fast.sampled_ranks[1].item() == 2


@pytest.mark.parametrize("blocker", [
    {"repetition_penalty": 1.5, "output_token_ids": [[1]]}, {"min_tokens": [1], "stop_token_ids": [[3]]},
    {"allowed_token_mask": torch.tensor([[True, False, True, True]])}, {"num_logprobs": 2}, {"temperature": 0.5}])
def test_greedy_op_is_skipped_where_a_row_needs_more_than_the_argmax(blocker):
    logits = torch.tensor([[0.0, 1.0, 0.5, 2.0]])
    called = []
    out = sample(logits, meta(1, **{"temperature": 0.0, **blocker}), greedy=lambda rows: called.append(rows))
    assert not called and out.sampled_token_ids.shape == (1,)


def test_sample_does_not_modify_logits():
    logits = torch.randn(3, 20)
    before = logits.clone()
    sample(logits, meta(3, repetition_penalty=1.5, top_k=3, output_token_ids=[[1], [2], [3]], min_tokens=[2] * 3,
                        stop_token_ids=[[0]] * 3, allowed_token_mask=torch.rand(3, 20) < 0.8))
    assert torch.equal(logits, before)


# ---------------------------------------------------------------------------------------------
# unfiltered sampling, top-k, top-p, min-p


def test_unfiltered_sampling_matches_softmax_over_seeds_and_over_positions():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -1.0, -3.0, 1.5])
    probs = torch.softmax(logits / 0.8, dim=-1).double()
    n = 4000
    by_seed = torch.bincount(draws(logits, n, temperature=0.8), minlength=8).double()
    by_pos = torch.bincount(draws(logits, n, temperature=0.8, seeds=7, positions=torch.arange(n)), minlength=8)
    for counts in (by_seed, by_pos.double()):
        assert chi_square(counts, probs) < CHI2_CRIT_001[7]
        assert 0.5 * (counts / n - probs).abs().sum() < 0.03


def test_top_k_keeps_exactly_k_even_with_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 2.0]])
    kept = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(kept).sum().item() == 2
    assert torch.isfinite(kept[0, [1, 2]]).all()  # ties: lower ids first


@pytest.mark.parametrize("k", [1, 3, 5])
def test_top_k_sampling_never_leaves_top_k_and_uses_all_of_it(k):
    logits = torch.tensor([0.3, 0.1, 0.2, 0.25, 0.05, 0.15, 0.0, 0.22, 0.12, 0.01])
    top = set(torch.topk(logits, k).indices.tolist())
    got = draws(logits, 2000, top_k=k)
    assert set(got.tolist()) == top


def test_top_p_matches_renormalised_nucleus():
    probs = torch.tensor([0.35, 0.25, 0.15, 0.1, 0.08, 0.04, 0.02, 0.01])
    logits = probs.log()
    top_p = 0.8  # nucleus: 0.35 + 0.25 + 0.15 = 0.75 < 0.8, so the 4th token (0.1) is needed too
    nucleus = probs.clone()
    nucleus[4:] = 0
    nucleus = (nucleus / nucleus.sum()).double()
    n = 4000
    got = draws(logits, n, top_p=top_p)
    assert set(got.tolist()) <= {0, 1, 2, 3}
    counts = torch.bincount(got, minlength=8).double()
    assert chi_square(counts, nucleus) < CHI2_CRIT_001[3]
    assert 0.5 * (counts / n - nucleus).abs().sum() < 0.03


def test_top_k_ties_over_a_large_vocab_go_to_lowest_ids():
    logits = torch.zeros(1, 5000)
    logits[0, ::7] = 1.0
    kept = apply_top_k_top_p(logits, torch.tensor([6]), torch.tensor([1.0]))
    assert torch.isfinite(kept[0]).nonzero().flatten().tolist() == [0, 7, 14, 21, 28, 35]


def test_top_p_boundary_is_the_smallest_set_reaching_p():
    # four tokens of probability exactly 0.25: mass 0.5 needs exactly two of them (as vLLM)
    kept = apply_top_k_top_p(torch.zeros(1, 4), torch.tensor([0]), torch.tensor([0.5]))
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]


def test_top_p_always_keeps_the_best_token():
    logits = torch.tensor([[5.0, 0.0, 0.0]])
    kept = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([1e-6]))
    assert torch.isfinite(kept).tolist() == [[True, False, False]]


def test_top_p_one_keeps_tiny_probabilities():
    logits = torch.tensor([[0.0, -60.0, -80.0]])
    kept = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([1.0]))
    assert torch.isfinite(kept).all()


def test_top_k_then_top_p():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    # top_k=2 renormalises to [4/7, 3/7]; top_p=0.5 then keeps only the first.
    kept = apply_top_k_top_p(probs.log(), torch.tensor([2]), torch.tensor([0.5]))
    assert torch.isfinite(kept).tolist() == [[True, False, False, False]]


def test_min_p():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    n = 3000
    got = draws(probs.log(), n, min_p=0.3)  # threshold 0.12: keeps 0.4, 0.3, 0.15
    assert set(got.tolist()) == {0, 1, 2}
    expected = torch.tensor([0.4, 0.3, 0.15, 0, 0], dtype=torch.float64) / 0.85
    counts = torch.bincount(got, minlength=5).double()
    assert chi_square(counts, expected) < CHI2_CRIT_001[3]


def test_temperature_sharpens():
    logits = torch.tensor([1.0, 0.0, 0.0, 0.0])
    cold = (draws(logits, 2000, temperature=0.1) == 0).float().mean()
    hot = (draws(logits, 2000, temperature=5.0) == 0).float().mean()
    assert cold > 0.99 and hot < 0.4


# ---------------------------------------------------------------------------------------------
# penalties and masks


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    md = meta(
        2,
        repetition_penalty=[2.0, 1.0],
        frequency_penalty=[0.5, 0.0],
        presence_penalty=[0.25, 1.0],
        prompt_token_ids=[[0, 1], [5]],
        output_token_ids=[[2, 2, 3], [0, 0, 0]],
    )
    got = apply_penalties(logits, md)
    # row 0: 0 and 1 in prompt; 2 (twice) and 3 (once) in output; 4, 5 unseen.
    row0 = [2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.5 * 2 - 0.25, -0.5 * 2 - 0.5 * 1 - 0.25, 3.0, 1.0]
    # row 1: only presence 1.0 on token 0; repetition 1 and frequency 0 are no-ops.
    row1 = [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert torch.allclose(got, torch.tensor([row0, row1]))


def test_penalties_off_returns_input_unchanged():
    logits = torch.randn(2, 5)
    assert torch.equal(apply_penalties(logits, meta(2, output_token_ids=[[1], [2]])), logits)


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[2.0, 1.5]])
    md = meta(1, temperature=0.0, repetition_penalty=2.0, output_token_ids=[[0]])
    assert sample(logits, md).sampled_token_ids.tolist() == [1]


def test_min_tokens_masks_stop_ids_until_reached():
    logits = torch.tensor([[9.0, 1.0, 8.0], [9.0, 1.0, 8.0]])
    md = meta(2, temperature=0.0, min_tokens=[2, 2], stop_token_ids=[[0], [0]], output_token_ids=[[1], [1, 1]])
    assert sample(logits, md).sampled_token_ids.tolist() == [2, 0]


def test_allowed_token_mask():
    logits = torch.tensor([[9.0, 1.0, 8.0, 0.0]] * 200)
    mask = torch.tensor([[False, True, False, True]] * 200)
    got = sample(logits, meta(200, allowed_token_mask=mask)).sampled_token_ids
    assert set(got.tolist()) == {1, 3}
    with pytest.raises(ValueError, match="allows no token at all in rows \\[1\\]"):
        sample(logits[:2], meta(2, allowed_token_mask=torch.tensor([[True] * 4, [False] * 4])))


def test_shape_errors():
    with pytest.raises(ValueError, match="logits has 3 rows but metadata has 2"):
        sample(torch.zeros(3, 4), meta(2))
    with pytest.raises(ValueError, match="allowed_token_mask must be bool"):
        sample(torch.zeros(2, 4), meta(2, allowed_token_mask=torch.ones(2, 4)))


# ---------------------------------------------------------------------------------------------
# determinism and batch invariance


def test_same_seed_same_tokens():
    logits = torch.randn(8, 100)
    md = meta(8, seeds=list(range(100, 108)), positions=list(range(8)), top_p=0.9)
    assert torch.equal(sample(logits, md).sampled_token_ids, sample(logits, md).sampled_token_ids)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(2, 8),
    seed_list=st.lists(INT64, min_size=8, max_size=8),
    data=st.data(),
)
def test_row_result_independent_of_batch_layout(rows, seed_list, data):
    vocab = 64
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(abs(seed_list[0]) % 1000))
    params = {
        "seeds": seed_list[:rows],
        "positions": data.draw(st.lists(st.integers(0, 10_000), min_size=rows, max_size=rows)),
        "temperature": data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=rows, max_size=rows)),
        "top_k": data.draw(st.lists(st.sampled_from([0, 1, 5, 20]), min_size=rows, max_size=rows)),
        "top_p": data.draw(st.lists(st.sampled_from([1.0, 0.9, 0.3]), min_size=rows, max_size=rows)),
        "min_p": data.draw(st.lists(st.sampled_from([0.0, 0.1]), min_size=rows, max_size=rows)),
    }
    full = sample(logits, meta(rows, **params)).sampled_token_ids
    perm = data.draw(st.permutations(list(range(rows))))
    sub = perm[: data.draw(st.integers(1, rows))]  # a subset of the rows, in another order
    sub_params = {k: [v[i] for i in sub] for k, v in params.items()}
    part = sample(logits[sub], meta(len(sub), **sub_params)).sampled_token_ids
    assert part.tolist() == full[sub].tolist()


def test_different_seeds_give_different_draws():
    logits = torch.zeros(1000)
    got = draws(logits, 500)
    assert got.unique().numel() > 350  # 500 uniform draws from 1000 ids: ~393 distinct expected
    same_seed_over_positions = draws(logits, 500, seeds=3, positions=torch.arange(500))
    assert same_seed_over_positions.unique().numel() > 350
    assert (got != same_seed_over_positions).float().mean() > 0.9


def test_seed_and_position_both_matter():
    logits = torch.zeros(4, 1 << 16)
    md = meta(4, seeds=[1, 1, 2, 2], positions=[0, 1, 0, 1])
    ids = sample(logits, md).sampled_token_ids.tolist()
    assert len(set(ids)) == 4


# ---------------------------------------------------------------------------------------------
# logprobs


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 5), vocab=st.integers(2, 40), n=st.integers(0, 6), seed=st.integers(0, 10_000))
def test_logprobs_and_ranks_match_log_softmax(rows, vocab, n, seed):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    out = sample(logits, meta(rows, num_logprobs=n))
    ref = torch.log_softmax(logits, dim=-1)
    ids = out.sampled_token_ids
    assert torch.allclose(out.sampled_logprobs, ref[torch.arange(rows), ids])
    for r in range(rows):
        assert out.sampled_ranks[r].item() == 1 + (ref[r] > ref[r, ids[r]]).sum().item()
    k = min(n, vocab)
    assert out.top_token_ids.shape == (rows, k) and out.top_logprobs.shape == (rows, k)
    assert torch.allclose(out.top_logprobs, torch.topk(ref, k).values)
    assert torch.allclose(ref.gather(1, out.top_token_ids), out.top_logprobs)


def test_logprobs_are_of_the_raw_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    md = meta(1, temperature=0.0, repetition_penalty=100.0, output_token_ids=[[2]], num_logprobs=3)
    out = sample(logits, md)
    ref = torch.log_softmax(logits, dim=-1)
    assert out.sampled_token_ids.tolist() == [1]  # the penalty moved the choice ...
    assert torch.allclose(out.sampled_logprobs, ref[:, 1])  # ... but not the reported logprobs
    assert out.sampled_ranks.tolist() == [2]
    assert out.top_token_ids.tolist() == [[2, 1, 0]]


def test_no_logprobs_requested():
    out = sample(torch.randn(2, 5), meta(2))
    assert out.top_token_ids is None and out.top_logprobs is None
    assert out.sampled_logprobs.shape == (2,) and out.sampled_ranks.shape == (2,)


def test_compute_prompt_logprobs():
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([3, 0, 29, 7, 7, 12])
    out = compute_prompt_logprobs(logits, targets, top_n=4)
    ref = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(out.token_logprobs, ref[torch.arange(6), targets])
    want_ranks = [(ref[i] >= ref[i, t]).sum().item() for i, t in enumerate(targets.tolist())]
    assert out.ranks.tolist() == want_ranks
    assert torch.allclose(out.top_logprobs, torch.topk(ref, 4).values)
    assert out.top_token_ids.shape == (6, 4)
    with pytest.raises(ValueError, match="target_ids"):
        compute_prompt_logprobs(logits, targets[:3], 1)


# ---------------------------------------------------------------------------------------------
# metadata from params


def test_metadata_from_params():
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(seed=5, top_k=-1, top_p=0.5, min_tokens=1, stop_token_ids=[7], logprobs=4),
        SamplingParams(seed=6, ignore_eos=True, min_tokens=1),
    ]
    md = SamplingMetadata.from_params(
        params, seeds=[request_seed(p) for p in params], prompt_token_ids=[[1, 2], [3], []],
        output_token_ids=[[], [4, 5], [6]], eos_token_id=2,
    )
    assert md.temperature.tolist() == [0.0, 1.0, 1.0]
    assert md.top_k.tolist() == [0, 0, 0] and md.top_p.tolist() == [1.0, 0.5, 1.0]
    assert md.seeds[1:].tolist() == [5, 6]
    assert md.positions.tolist() == [2, 3, 1]
    assert md.stop_token_ids == [[2], [2, 7], []]
    assert md.num_logprobs == 4
    with pytest.raises(ValueError, match="seeds has 1 rows but params has 3"):
        SamplingMetadata.from_params(params, seeds=[1], prompt_token_ids=[[]] * 3, output_token_ids=[[]] * 3)


def test_row_kinds_from_params_equal_the_kinds_read_from_the_tensors():
    """``from_params`` knows on the host which features the rows use; hand-built metadata finds out from its
    tensors. Both must agree, or the sampler would skip a filter or a penalty some row asked for."""
    variants = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7), SamplingParams(top_k=5),
                SamplingParams(top_p=0.9), SamplingParams(min_p=0.1), SamplingParams(repetition_penalty=1.2),
                SamplingParams(presence_penalty=0.5), SamplingParams(frequency_penalty=-0.3)]
    for rows in ([0], [1], [0, 1], [2, 6], [3, 4, 5], [7, 0], list(range(8))):
        params = [variants[i] for i in rows]
        md = SamplingMetadata.from_params(params, seeds=[0] * len(params), prompt_token_ids=[[1]] * len(params),
                                          output_token_ids=[[]] * len(params))
        assert md.kinds is not None
        assert md.kinds == dataclasses.replace(md, kinds=None).row_kinds(), rows


def test_large_vocab_is_vectorised_and_finite():
    logits = torch.randn(4, 129_280)
    out = sample(logits, meta(4, top_p=0.95, top_k=[0, 50, 0, 1], num_logprobs=5))
    assert out.sampled_token_ids.shape == (4,)
    assert math.isfinite(out.sampled_logprobs.sum().item())
    assert out.sampled_token_ids[3].item() == logits[3].argmax().item()


def test_top_n_equals_the_first_n_of_a_stable_descending_sort():
    """top-n logprobs without sorting the vocabulary: same values and ids as the stable sort, ties included
    (coarse score levels, rows of -inf, n above the vocabulary size)."""
    from deepinfer_core.sampling.sampler import top_n

    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        rows, vocab = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(1, 300, (1,), generator=gen))
        levels = int(torch.randint(1, 20, (1,), generator=gen))
        scores = torch.randint(0, levels, (rows, vocab), generator=gen).float() / 3 - 2
        if trial % 4 == 0:
            scores[0] = float("-inf")
        n = int(torch.randint(1, 25, (1,), generator=gen))
        want_values, want_ids = scores.sort(dim=-1, descending=True, stable=True)
        values, ids = top_n(scores, n)
        assert torch.equal(ids, want_ids[:, :min(n, vocab)]) and torch.equal(values, want_values[:, :min(n, vocab)])

"""Deterministic sampling: the core's sampler gives a row the same token and log-probabilities whatever
else is in the batch (its noise is keyed by (seed, position, vocab id); its log_softmax, softmax, sort
and cumsum are per-row invariant on CPU). Nothing here needs the plugin: batch-invariant logits plus
this sampler give batch-invariant tokens."""

from __future__ import annotations

import torch

from deepinfer_core.sampling.noise import gumbel_noise
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.sampler import SamplingMetadata, compute_prompt_logprobs, sample

VOCAB = 257  # not a multiple of the SIMD width: scalar tails exist in every row


def _random_params(gen) -> SamplingParams:
    kind = int(torch.randint(0, 4, (1,), generator=gen))
    if kind == 0:
        return SamplingParams(temperature=0.0, logprobs=3)
    return SamplingParams(
        temperature=float(torch.rand(1, generator=gen)) + 0.1, top_k=int(torch.randint(0, 50, (1,), generator=gen)),
        top_p=float(torch.rand(1, generator=gen)) * 0.9 + 0.1, min_p=0.05 if kind == 3 else 0.0,
        repetition_penalty=1.2 if kind == 2 else 1.0, frequency_penalty=0.3 if kind == 2 else 0.0,
        seed=int(torch.randint(0, 10**6, (1,), generator=gen)), logprobs=5)


def _sample(logits, params, seeds, prompts, outputs):
    metadata = SamplingMetadata.from_params(params, seeds=seeds, prompt_token_ids=prompts, output_token_ids=outputs)
    out = sample(logits, metadata)
    return out


def _row(out, i):
    return (out.sampled_token_ids[i], out.sampled_logprobs[i], out.sampled_ranks[i],
            None if out.top_logprobs is None else out.top_logprobs[i, :5],
            None if out.top_token_ids is None else out.top_token_ids[i, :5])


def _same(a, b) -> bool:
    return all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


def test_a_row_samples_the_same_inside_any_batch():
    gen = torch.Generator().manual_seed(0)
    needles = [
        (torch.randn(VOCAB, generator=gen) * 3, SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=1234,
                                                              logprobs=5), [5, 6, 7], [9, 9]),
        (torch.randn(VOCAB, generator=gen) * 3, SamplingParams(temperature=0.0, logprobs=5), [1, 2], []),
        (torch.randn(VOCAB, generator=gen) * 3, SamplingParams(temperature=1.0, seq_seed=99, min_p=0.02,
                                                              repetition_penalty=1.3, logprobs=5), [4] * 9, [8, 3]),
    ]
    for logits, params, prompt, output in needles:
        alone = _row(_sample(logits[None], [params], [params.seed or 0], [prompt], [output]), 0)
        for size in (1, 2, 7, 31, 64):
            rows = [_random_params(gen) for _ in range(size)]
            batch = torch.randn(size, VOCAB, generator=gen) * 3
            where = int(torch.randint(0, size + 1, (1,), generator=gen))
            batch = torch.cat([batch[:where], logits[None], batch[where:]])
            params_all = rows[:where] + [params] + rows[where:]
            seeds = [p.seed or 0 for p in params_all]
            prompts = [[int(t) for t in torch.randint(0, VOCAB, (5,), generator=gen)] for _ in params_all]
            outputs = [[int(t) for t in torch.randint(0, VOCAB, (3,), generator=gen)] for _ in params_all]
            prompts[where], outputs[where] = prompt, output
            assert _same(_row(_sample(batch, params_all, seeds, prompts, outputs), where), alone), (params, size)


def test_noise_depends_only_on_seed_position_and_vocab_id():
    seeds, positions = torch.tensor([7, 123456789, -5]), torch.tensor([0, 41, 2**40])
    alone = gumbel_noise(seeds[1:2], positions[1:2], VOCAB)
    assert torch.equal(gumbel_noise(seeds, positions, VOCAB)[1], alone[0])
    assert torch.equal(gumbel_noise(seeds.flip(0), positions.flip(0), VOCAB)[1], alone[0])


def test_prompt_logprobs_rows_are_batch_independent():
    gen = torch.Generator().manual_seed(1)
    logits, targets = torch.randn(9, VOCAB, generator=gen), torch.randint(0, VOCAB, (9,), generator=gen)
    alone = compute_prompt_logprobs(logits[4:5], targets[4:5], 5)
    mixed = compute_prompt_logprobs(logits, targets, 5)
    assert torch.equal(mixed.token_logprobs[4], alone.token_logprobs[0])
    assert torch.equal(mixed.top_logprobs[4], alone.top_logprobs[0])


def test_seq_seed_is_seed():
    assert SamplingParams(seq_seed=5).seed == SamplingParams(seed=5).seed == 5


def test_sampling_controls_keep_a_row_the_same_inside_any_batch():
    """logit_bias, allowed_token_ids and bad_words are per-row masks and adds: a row's token and log-probabilities
    do not depend on its neighbours' controls."""
    gen = torch.Generator().manual_seed(2)
    params = SamplingParams(temperature=0.9, seed=7, logprobs=3, logit_bias={3: 2.5, 11: -1.0},
                            allowed_token_ids=list(range(0, VOCAB, 3)), bad_words=["w"])
    logits, words = torch.randn(VOCAB, generator=gen) * 3, [[6], [9, 12]]

    def run(batch_logits, rows, where):
        outputs = [[9]] * len(rows)
        metadata = SamplingMetadata.from_params(
            rows, seeds=[p.seed or 0 for p in rows], prompt_token_ids=[[1, 2]] * len(rows), output_token_ids=outputs,
            bad_words_token_ids=[words if i == where else [[5]] for i in range(len(rows))])
        return _row(sample(batch_logits, metadata), where)

    alone = run(logits[None], [params], 0)
    for size in (1, 5, 33):
        others = [SamplingParams(temperature=float(t), seed=i, logit_bias={i % VOCAB: 5.0}, bad_words=["x"], logprobs=3)
                  for i, t in enumerate(torch.rand(size, generator=gen) + 0.1)]
        where = int(torch.randint(0, size + 1, (1,), generator=gen))
        batch = torch.randn(size + 1, VOCAB, generator=gen) * 3
        batch[where] = logits
        assert _same(run(batch, others[:where] + [params] + others[where:], where), alone), size

"""End to end through ``LLM(..., batch_invariant=True)``: a needle request alone vs inside random batches.

Two needles (one greedy, one seeded sampling with top-p) are run alone, then at random positions inside
batches of 2 to 64 requests with random prompts, lengths and sampling parameters, under a small token
budget (chunked prefill; prefill chunks share steps with other requests' decode tokens). At every step
the needle's whole log-probability row (``logprobs`` = vocabulary size) and every prompt log-probability
row must be bitwise equal to the needle alone, and so must its tokens. The plain path (no mode) fails
the same comparison.

Prefix caching is on: the needles repeat across batches, so later runs hit the cache and rebuild the sliding
window by replay (with a step budget smaller than the replay in the second test); the bits must not change.
"""

from __future__ import annotations

import pytest
import torch
from bi_harness import outputs_equal as _equal
from bi_harness import random_batch, record

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.plugins import get_plugin_manager, register_plugin

VOCAB = 64
BUDGET = 128  # tokens per step: room for 64 decode tokens plus prefill chunks, which it splits
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=VOCAB, prompt_logprobs=VOCAB)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seq_seed=1234, max_tokens=8, ignore_eos=True, logprobs=VOCAB,
                        prompt_logprobs=VOCAB)


def _needles():
    gen = torch.Generator().manual_seed(2024)
    return [(torch.randint(2, VOCAB, (45,), generator=gen).tolist(), GREEDY),
            (torch.randint(2, VOCAB, (30,), generator=gen).tolist(), SEEDED)]


NEEDLES = _needles()


def _llm(folder, **kwargs) -> LLM:
    kwargs.setdefault("max_num_batched_tokens", BUDGET)
    kwargs.setdefault("enable_mixed_chunk", True)  # steps mixing prompt chunks and decodes: the hardest batches
    return LLM(str(folder), block_size=8, max_num_seqs=64, **kwargs)


def _record(output):
    return record(output, VOCAB)


def _random_batch(gen, num_others: int, max_tokens: tuple[int, int] = (1, 12)):
    return random_batch(gen, num_others, NEEDLES, VOCAB, max_tokens)


def _alone(llm):
    return [_record(llm.generate({"prompt_token_ids": prompt}, p, use_tqdm=False)[0]) for prompt, p in NEEDLES]


class _StepRecorder:
    """A test plugin: notes what each step ran (request id -> (start, tokens))."""

    DEEPINFER_HOOK_API_VERSION = 1

    def __init__(self):
        self.steps = []

    @hookimpl
    def deepinfer_before_step(self, scheduler_output):
        self.steps.append({c.request.request_id: (c.start, c.num_tokens, len(c.request.prompt_token_ids))
                           for c in scheduler_output.chunks})


@pytest.fixture
def recorder():
    pm = get_plugin_manager()
    rec = _StepRecorder()
    register_plugin(pm, rec, "bi_test_step_recorder")
    yield rec
    pm.unregister(rec)
    pm.records.pop("bi_test_step_recorder", None)


@pytest.fixture(scope="module")
def alone(tiny_ckpt):
    """The needles alone, each prefilled in one step (large budget), in batch-invariant mode."""
    return _alone(_llm(tiny_ckpt, batch_invariant=True, max_num_batched_tokens=512))


def test_needles_are_bitwise_identical_alone_and_in_random_batches(tiny_ckpt, alone, recorder):
    llm = _llm(tiny_ckpt, batch_invariant=True)
    gen = torch.Generator().manual_seed(0)
    widest, needle_chunks = 0, []
    for num_others in (0, 1, 6, 21, 62):  # batches of 2 .. 64 requests
        recorder.steps.clear()
        prompts, params, where = _random_batch(gen, num_others, max_tokens=(24, 48) if num_others > 21 else (1, 12))
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for needle, at in enumerate(where):
            assert _equal(_record(outputs[at]), alone[needle]), f"needle {needle} in a batch of {len(prompts)}"
        widest = max(widest, max(len(step) for step in recorder.steps))
        needle_id = outputs[where[0]].request_id + "-0"
        needle_chunks.append(sum(needle_id in step and step[needle_id][0] < 45 for step in recorder.steps))
        mixed = [s for s in recorder.steps
                 if any(start < n_prompt for start, _, n_prompt in s.values())
                 and any(start >= n_prompt for start, _, n_prompt in s.values())]
        if num_others >= 6:
            assert mixed, "expected steps mixing prefill chunks with decode tokens"
    assert widest >= 60, f"expected steps running (nearly) all 64 requests, widest was {widest}"
    assert max(needle_chunks) >= 2, "expected the needle's prompt split over several steps in some batch"


def test_needles_in_other_engine_sizes(tiny_ckpt, alone):
    """Fewer running sequences (requests queue) and a budget below the needle's prompt: still the same bits."""
    llm = LLM(str(tiny_ckpt), block_size=8, max_num_seqs=5, max_num_batched_tokens=23, batch_invariant=True)
    assert all(_equal(a, b) for a, b in zip(_alone(llm), alone))  # alone, prompt in 2-3 chunks: same as one
    gen = torch.Generator().manual_seed(1)
    prompts, params, where = _random_batch(gen, 12)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for needle, at in enumerate(where):
        assert _equal(_record(outputs[at]), alone[needle])


def _decode_rows(output):
    """Tokens and per-step log-probability rows ``[steps, VOCAB]`` (no prompt logprobs: those skip the cache)."""
    completion = output.outputs[0]
    return completion.token_ids, torch.tensor([[e[t].logprob for t in range(VOCAB)] for e in completion.logprobs])


def test_needle_after_a_prefix_cache_hit_keeps_its_bits(tiny_ckpt):
    """The needle's prompt is cached by an earlier run, so in the batch it hits the cache and rebuilds its
    sliding window by replaying more tokens than one step's budget holds: its bits must not change."""
    prompt = NEEDLES[0][0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=VOCAB)
    fresh = _llm(tiny_ckpt, batch_invariant=True, max_num_batched_tokens=512)
    want_tokens, want_rows = _decode_rows(fresh.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0])
    llm = LLM(str(tiny_ckpt), block_size=8, max_num_seqs=8, max_num_batched_tokens=23, batch_invariant=True)
    llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)  # fills the prefix cache
    prompts, batch_params, where = random_batch(torch.Generator().manual_seed(3), 6, [(prompt, params)], VOCAB)
    tokens, rows = _decode_rows(llm.generate(prompts, batch_params, use_tqdm=False)[where[0]])
    assert llm.engine.state_manager.hits > 0
    assert tokens == want_tokens and torch.equal(rows, want_rows)


def test_without_the_mode_the_needle_changes_and_the_mode_stays_close(tiny_ckpt, alone):
    """The inverse: the plain path gives the needle different bits in a batch; the mode changes values
    only at rounding level (same model)."""
    plain = _llm(tiny_ckpt)
    assert "batch_invariant" not in plain.model.ops.sources().values()
    plain_alone = _alone(plain)
    gen = torch.Generator().manual_seed(0)
    differs = 0
    for num_others in (1, 6, 21):
        prompts, params, where = _random_batch(gen, num_others)
        outputs = plain.generate(prompts, params, use_tqdm=False)
        differs += sum(not _equal(_record(outputs[at]), plain_alone[n]) for n, at in enumerate(where))
    assert differs > 0, "the plain CPU path happened to be batch invariant here"
    for ours, theirs in zip(alone, plain_alone):
        torch.testing.assert_close(ours[2], theirs[2], atol=1e-4, rtol=0)  # prompt rows: same inputs
        if ours[0] == theirs[0]:
            torch.testing.assert_close(ours[1], theirs[1], atol=1e-4, rtol=0)


def test_needles_through_the_static_decode_path(tiny_ckpt):
    """Decode chunks replayed through the static-shape graph path (padded batch, keys and entries; run eagerly on
    CPU), next to eager prefill chunks in the same steps: the needles keep the bits they have alone on the
    dynamic path. (No prompt logprobs here: a request that wants them always runs eagerly.)"""
    needles = [(prompt, SamplingParams(temperature=p.temperature, top_p=p.top_p, seq_seed=p.seed, max_tokens=8,
                                       ignore_eos=True, logprobs=VOCAB)) for prompt, p in NEEDLES]
    fresh = _llm(tiny_ckpt, batch_invariant=True, max_num_batched_tokens=512)
    want = [_decode_rows(fresh.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0]) for p, sp in needles]
    llm = _llm(tiny_ckpt, batch_invariant=True, cuda_graph_sizes=[1, 2, 4, 8, 16])
    prompts, params, where = random_batch(torch.Generator().manual_seed(5), 9, needles, VOCAB)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.runner.decode_graphs.num_replays > 0 and llm.engine.runner.num_mixed_steps > 0
    for (tokens, rows), at in zip(want, where, strict=True):
        got_tokens, got_rows = _decode_rows(outputs[at])
        assert got_tokens == tokens and torch.equal(got_rows, rows)


def test_a_lone_needle_through_the_padded_prefill_step_keeps_its_bits(tiny_ckpt):
    """Each needle alone is prefilled through the padded static prefill step (its prompt padded to a 64-token bucket;
    run eagerly on CPU, what a captured prefill graph replays on a GPU) and keeps the bits it has inside a random
    batch on the dynamic path: the padding changes none of the prompt's rows."""
    needles = [(prompt, SamplingParams(temperature=p.temperature, top_p=p.top_p, seq_seed=p.seed, max_tokens=8,
                                       ignore_eos=True, logprobs=VOCAB)) for prompt, p in NEEDLES]
    llm = _llm(tiny_ckpt, batch_invariant=True, cuda_graph_sizes=[1], prefill_graph_buckets=[64],
               max_num_batched_tokens=512)
    alone = [_decode_rows(llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0]) for p, sp in needles]
    assert llm.engine.runner.prefill_graphs.num_replays == len(needles)
    batched = _llm(tiny_ckpt, batch_invariant=True)
    prompts, params, where = random_batch(torch.Generator().manual_seed(6), 9, needles, VOCAB)
    outputs = batched.generate(prompts, params, use_tqdm=False)
    for (tokens, rows), at in zip(alone, where, strict=True):
        got_tokens, got_rows = _decode_rows(outputs[at])
        assert got_tokens == tokens and torch.equal(got_rows, rows)

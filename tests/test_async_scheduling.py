"""Asynchronous scheduling: step N + 1 is planned and launched before step N's tokens are read.

The outputs must be those of the synchronous engine: every sampling feature, early stops (one wasted row),
length limits (no wasted row), preemption while a token is in flight, prefix hits, and the static-shape decode
path whose input ids are written on the device. On CPU the overlap buys nothing (ops finish before the host
moves on); these tests check the bookkeeping that makes it exact.
"""

from __future__ import annotations

import dataclasses

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.scheduler import FcfsScheduler
from deepinfer_core.models.deepseek_v4.state import DeepseekV4State

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Foo:\n    def", "# a program\nprint(",
           {"prompt_token_ids": [(7 * i) % 4000 + 50 for i in range(40)]}]


def _pair(prompts, params, **kwargs):
    """(synchronous outputs, asynchronous engine, its outputs) for the same requests."""
    kwargs = {"max_model_len": 256, "max_num_seqs": 8, **kwargs}
    sync = LLM(async_scheduling=False, **kwargs).generate(prompts, params, use_tqdm=False)
    llm = LLM(async_scheduling=True, **kwargs)
    return sync, llm, llm.generate(prompts, params, use_tqdm=False)


def _assert_same(sync, overlapped, tol=1e-4) -> None:
    for a, b in zip(sync, overlapped, strict=True):
        assert len(a.outputs) == len(b.outputs)
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert (y.token_ids, y.text, y.finish_reason, y.stop_reason) == (
                x.token_ids, x.text, x.finish_reason, x.stop_reason)
            assert abs(x.cumulative_logprob - y.cumulative_logprob) < tol * max(1, len(x.token_ids))
            for la, lb in zip(x.logprobs or [], y.logprobs or [], strict=True):
                assert la.keys() == lb.keys() and all(abs(la[t].logprob - lb[t].logprob) < tol for t in la)
        for la, lb in zip(a.prompt_logprobs or [], b.prompt_logprobs or [], strict=True):
            assert (la is None) == (lb is None)
            if la is not None:
                assert la.keys() == lb.keys() and all(abs(la[t].logprob - lb[t].logprob) < tol for t in la)


def _spy_steps(llm) -> list[tuple[str, int]]:
    """Record ("launch", k) / ("collect", k) in the order the engine calls the runner."""
    events, runner = [], llm.engine.runner
    launch, collect = runner.launch, runner.collect
    steps = []  # every launched step, kept alive: numbering by id() would reuse the id of a collected one

    def spy_launch(scheduled, previous=None):
        launched = launch(scheduled, previous)
        steps.append(launched)
        events.append(("launch", len(steps) - 1))
        return launched

    def spy_collect(launched):
        events.append(("collect", next(k for k, step in enumerate(steps) if step is launched)))
        return collect(launched)

    runner.launch, runner.collect = spy_launch, spy_collect
    return events


def test_every_sampling_feature_equals_the_synchronous_engine():
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=7, max_tokens=9, ignore_eos=True, logprobs=1)
    sync_greedy = LLM(max_model_len=256, async_scheduling=False).generate(PROMPTS[:2], greedy, use_tqdm=False)
    stop_token = sync_greedy[0].outputs[0].token_ids[4]  # ends request 0 early: its next row is wasted
    stop_text = sync_greedy[1].outputs[0].text[3:6]
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop_text]),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, n=2, max_tokens=7, ignore_eos=True, prompt_logprobs=1),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),  # its only token is the prefill's
        SamplingParams(temperature=0.7, min_p=0.05, seed=5, min_tokens=6, max_tokens=8, logprobs=3),
    ]
    sync, llm, overlapped = _pair(PROMPTS, params)
    _assert_same(sync, overlapped)
    assert sync[0].outputs[0].finish_reason == "stop" and len(sync[0].outputs[0].token_ids) == 5
    assert sync[1].outputs[0].stop_reason == stop_text
    engine = llm.engine
    assert engine.num_overlapped_steps == engine.num_steps - 1  # every step but the first overlapped
    _, _, again = _pair(PROMPTS[:2], [seeded, greedy])
    assert [o.outputs[0].token_ids for o in again] == [
        o.outputs[0].token_ids for o in LLM(max_model_len=256).generate(PROMPTS[:2], [seeded, greedy],
                                                                        use_tqdm=False)]
    engine.state_manager.check_invariants([])
    assert not engine.has_unfinished() and engine._in_flight is None


def test_next_step_launches_before_the_last_step_is_read():
    llm = LLM(max_model_len=256, async_scheduling=True)
    events = _spy_steps(llm)
    llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    launches = [k for kind, k in events if kind == "launch"]
    assert launches == list(range(len(launches))) and len(launches) >= 6
    for k in range(1, len(launches)):  # step k is queued before step k - 1's tokens are read
        assert events.index(("launch", k)) < events.index(("collect", k - 1))
    assert [k for kind, k in events if kind == "collect"] == launches  # every step read once, in order


def test_length_limits_waste_no_step_and_early_stops_waste_one_row():
    llm = LLM(max_model_len=256, async_scheduling=True)
    rows = []
    launch = llm.engine.runner.launch
    llm.engine.runner.launch = lambda scheduled, previous=None: rows.append(
        [c.request.request_id for c in scheduled.chunks if c.samples]) or launch(scheduled, previous)
    varied = SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    tokens = LLM(max_model_len=256).generate(PROMPTS[1], varied, use_tqdm=False)[0].outputs[0].token_ids
    stop = next(t for t in tokens[1:] if t != tokens[0])  # ends the request after at least two tokens
    length = tokens.index(stop) + 1
    out = llm.generate(PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                                     dataclasses.replace(varied, stop_token_ids=[stop])], use_tqdm=False)
    sampled = [r for step in rows for r in step]
    assert len(out[0].outputs[0].token_ids) == 5 and sampled.count(f"{out[0].request_id}-0") == 5
    assert length < 8 and out[1].outputs[0].token_ids == tokens[:length]
    assert sampled.count(f"{out[1].request_id}-0") == length + 1


def test_penalties_wait_for_the_previous_tokens():
    """Penalties need the previous token's id on the host: those steps are not overlapped, results equal."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.4, presence_penalty=0.2, logprobs=1)
    sync, llm, overlapped = _pair(PROMPTS[:3], params)
    _assert_same(sync, overlapped)
    assert llm.engine.num_overlapped_steps == 0 and llm.engine.num_steps == 8  # prefill, then 7 decodes


@pytest.mark.parametrize("lengths, num_blocks, budget, mid_prefill", [
    ((100, 105, 110), 5, None, False),  # one block each to start (block 128); all cross into a second while decoding
    ((124, 230, 110), 3, 32, True),  # the victim is still prefilling: its prompt logprobs in flight are dropped
])
def test_preemption_with_tokens_in_flight(monkeypatch, lengths, num_blocks, budget, mid_prefill):
    probe = LLM(max_model_len=256)
    config = probe.model.config
    block = max(config.block_multiple, 16)
    memory = 3 * DeepseekV4State.bytes_per_slot(config, block, probe.dtype) + num_blocks * (
        DeepseekV4State.bytes_per_block(config, block, probe.dtype))
    prompts = [{"prompt_token_ids": [(11 * i + j) % 3000 + 40 for i in range(n)]} for j, n in enumerate(lengths)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    seen = []  # per preemption: (tokens in flight, still prefilling)
    preempt = FcfsScheduler._preempt

    def spy(scheduler, request):
        seen.append((request.num_inflight_tokens, request.num_computed_tokens < len(request.prompt_token_ids)))
        preempt(scheduler, request)

    monkeypatch.setattr(FcfsScheduler, "_preempt", spy)
    sync, llm, overlapped = _pair(prompts, params, max_num_seqs=3, kv_cache_memory_bytes=memory,
                                  max_num_batched_tokens=budget)
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(prefilling for _, prefilling in seen) if mid_prefill else max(n for n, _ in seen) == 1
    _assert_same(sync, overlapped)
    assert all(len(o.prompt_logprobs) == len(o.prompt_token_ids) for o in overlapped)
    llm.engine.state_manager.check_invariants([])


def test_prefix_hits_and_static_decode_steps():
    """Decode steps on the static-shape path (what CUDA graphs replay) read in-flight tokens on the device;
    a second round hits the prefix cache."""
    shared = [(13 * i) % 3000 + 60 for i in range(200)]
    rounds = [[{"prompt_token_ids": shared + [7 + j, 9]} for j in range(3)], [{"prompt_token_ids": shared + [5]}]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    kwargs = {"max_model_len": 320, "max_num_seqs": 4, "cuda_graph_sizes": [1, 2, 4]}
    sync_llm, llm = LLM(async_scheduling=False, **kwargs), LLM(async_scheduling=True, **kwargs)
    for prompts in rounds:
        _assert_same(sync_llm.generate(prompts, params, use_tqdm=False), llm.generate(prompts, params, use_tqdm=False))
    assert llm.engine.state_manager.hits > 0 and llm.engine.runner.decode_graphs.num_replays >= 18
    assert llm.engine.num_overlapped_steps > 0


@pytest.mark.parametrize("value, expected", [(None, False), (True, True), (False, False)])
def test_the_default_comes_from_the_backend(value, expected):
    llm = LLM(max_model_len=64, async_scheduling=value)
    assert llm.async_scheduling is expected and llm.engine.config.async_scheduling is expected


def test_a_non_boolean_setting_is_refused():
    with pytest.raises(ValueError, match="async_scheduling must be True, False or None"):
        LLM(max_model_len=64, async_scheduling="yes")

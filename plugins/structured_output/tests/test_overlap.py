"""Token masks prepared off the critical path (issue #35, point 3) on the embedded tiny model (CPU).

The llguidance processor is two-phase: ``prepare`` (the masks) runs on the engine's worker thread while the step's
forward pass runs, ``apply`` in the sampler. Checked here: asynchronous scheduling gives the synchronous loop's
outputs (JSON schemas, regex, choice, a stop string; greedy and seeded; n = 3; preemption under a tight state budget;
prefix hits), each mask equals the one a fresh matcher computes synchronously from the output tokens, ``prepare``
runs beside the forward pass (it waits for the forward to start: run before it on one thread, it could not finish),
and with the previous tokens still on the device (the accelerator's order) the forward is queued first and the
masks start before the previous step's results are applied.
"""

from __future__ import annotations

import collections
import json
import re
import threading
from pathlib import Path

import llguidance
import numpy as np
import pytest
import torch
from deepinfer_structured_output.plugin import KEY
from deepinfer_structured_output.processor import grammar_of

from deepinfer_core import LLM, SamplingParams, StructuredOutputsParams
from deepinfer_core.engine.model_runner import LaunchedStep
from deepinfer_core.models.deepseek_v4.state import DeepseekV4State
from deepinfer_core.sampling.token_bitmask import bitmask_words

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "tags", "ok"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "minItems": 1,
                                  "maxItems": 3},
                         "ok": {"type": "boolean"}}}
REGEX = r"(ab|cd)[0-9]{2,3}-[xyz]{1,4};"
CONSTRAINTS = [
    (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), None),
    (StructuredOutputsParams(regex=REGEX), None),
    (StructuredOutputsParams(choice=["alpha", "beta", "gamma delta"]), None),
    (StructuredOutputsParams(regex=REGEX), ["-"]),  # a stop string ends it before the grammar completes
]
PREFIX = [(7 * i) % 3000 + 40 for i in range(128)]  # one full state block every prompt shares
TAILS = (112, 116, 119, 122)  # prompts of 240-250 tokens: they cross into a third block while decoding
SAMPLINGS = {"greedy": {"temperature": 0}, "seeded": {"temperature": 1.0, "seed": 5}}


def _prompts():
    """Each constraint twice (greedy, then seeded), every prompt starting with ``PREFIX``: the prompts admitted after
    the first take its block from the prefix cache."""
    return [{"prompt_token_ids": PREFIX + [(11 * i + j) % 3000 + 40 for i in range(n)]}
            for j, n in enumerate(TAILS * 2)]


def _params():
    return [SamplingParams(n=3, max_tokens=24, structured_outputs=c, stop=stop, **sampling)
            for sampling in SAMPLINGS.values() for c, stop in CONSTRAINTS]


def _tight_llm(async_scheduling: bool, memory: int) -> LLM:
    return LLM(max_model_len=320, max_num_seqs=6, kv_cache_memory_bytes=memory, enforce_eager=True,
               async_scheduling=async_scheduling)


def _tight_memory() -> int:
    """Six sequences, nine state blocks: the shared one and two per sequence once they cross into a third block
    would be thirteen, so running requests are preempted."""
    probe = LLM(max_model_len=320)
    config = probe.model.config
    block = max(config.block_multiple, 16)
    return 6 * DeepseekV4State.bytes_per_slot(config, block, probe.dtype) + 9 * DeepseekV4State.bytes_per_block(
        config, block, probe.dtype)


def _record_masks(llm) -> dict[tuple[str, int], list[torch.Tensor]]:
    """(request id, output tokens before it) -> every mask ``prepare`` filled for that row."""
    processor = llm.engine.context.plugin_state[KEY]
    prepare, masks = processor.prepare, collections.defaultdict(list)

    def recording(rows):
        bitmask = prepare(rows)
        for i, row in enumerate(rows):
            masks[row.request_id, row.num_output_tokens].append(bitmask[i].clone())
        return bitmask

    processor.prepare = recording
    return masks


def _texts(outputs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def runs():
    """(sync outputs, async outputs, sync masks, async masks, async engine) of the suite, greedy and seeded."""
    memory, per_mode = _tight_memory(), []
    for overlap in (False, True):
        llm = _tight_llm(overlap, memory)
        masks = _record_masks(llm)
        per_mode.append((llm.generate(_prompts(), _params(), use_tqdm=False), masks, llm))
    (sync, sync_masks, _), (overlapped, async_masks, llm) = per_mode
    return sync, overlapped, sync_masks, async_masks, llm


def test_async_scheduling_gives_the_synchronous_outputs(runs):
    sync, overlapped, _, _, llm = runs
    assert _texts(overlapped) == _texts(sync)
    engine = llm.engine
    assert engine.num_overlapped_steps > 0 and engine.scheduler.num_preemptions > 0
    assert any(o.num_cached_tokens > 0 for o in overlapped)  # prompts admitted later hit the shared block
    assert engine.preparer.stats.num_rows > 0
    for output in overlapped:
        assert output.error is None and len(output.outputs) == 3
    for (constraint, stop), output in zip(CONSTRAINTS * 2, overlapped):
        for completion in output.outputs:
            if stop:
                assert completion.stop_reason == "-" and re.fullmatch(r"(ab|cd)[0-9]{2,3}", completion.text)
            elif completion.finish_reason == "stop":
                if constraint.kind == "json":
                    json.loads(completion.text)
                elif constraint.kind == "regex":
                    assert re.fullmatch(REGEX, completion.text)
                else:
                    assert completion.text in constraint.choice


def test_each_mask_is_the_synchronous_one(runs):
    """The masks of both loops are equal, and equal a fresh matcher's fed the final output tokens one by one. (The
    asynchronous loop also prepares the row a request samples after its last token, which the engine drops.)"""
    _, overlapped, sync_masks, async_masks, llm = runs
    lengths = {f"{o.request_id}-{i}": len(c.token_ids) for o in overlapped for i, c in enumerate(o.outputs)}
    assert sync_masks.keys() <= async_masks.keys()
    assert all(k == lengths[request_id] for request_id, k in async_masks.keys() - sync_masks.keys())
    for key, masks in sync_masks.items():
        assert all(torch.equal(m, masks[0]) for m in masks + async_masks[key]), key
    processor = llm.engine.context.plugin_state[KEY]
    tokenizer = llguidance.LLTokenizer((Path(llm.engine.context.model_dir) / "tokenizer.json").read_text(),
                                       n_vocab=processor.vocab_size, eos_token=processor.eos_token_id)
    checked = 0
    for (constraint, _), output in zip(CONSTRAINTS * 2, overlapped):
        for i, completion in enumerate(output.outputs):
            matcher = llguidance.LLMatcher(tokenizer, grammar_of(constraint))
            for k, token in enumerate(completion.token_ids):
                expected = _bitmask(matcher)
                if not matcher.is_stopped():
                    assert np.array_equal(async_masks[f"{output.request_id}-{i}", k][0].numpy(), expected)
                    checked += 1
                assert matcher.consume_token(token)
    assert checked > 100


def test_prepare_runs_beside_the_forward_pass():
    """Each ``prepare`` waits (on the worker thread) until the forward pass of its step has started: had the masks
    been computed on the engine's thread before the forward, it would never finish. The order of the engine's calls
    (CPU: the previous tokens are on the host at once): prepare started, forward, previous results applied,
    sampling."""
    llm = LLM(max_num_seqs=4, enforce_eager=True, async_scheduling=True)
    engine, processor = llm.engine, llm.engine.context.plugin_state[KEY]
    events, forwards, expected, cond, late = [], [0], collections.deque(), threading.Condition(), []
    _spy(engine, "runner", "forward", events, before=lambda: _count(forwards, cond))
    _spy(engine, "preparer", "start", events, before=lambda: expected.append(forwards[0]))
    _spy(engine, "runner", "sample", events)
    _spy(engine, "", "_update", events)
    prepare = processor.prepare

    def waiting(rows):
        target = expected.popleft()
        with cond:
            late.append(not cond.wait_for(lambda: forwards[0] > target, timeout=30))
        events.append(("prepared", threading.current_thread().name))
        return prepare(rows)

    processor.prepare = waiting
    params = SamplingParams(n=2, temperature=0, max_tokens=24, structured_outputs=CONSTRAINTS[0][0])
    (output,) = llm.generate(["hello"], params, use_tqdm=False)
    assert len(output.outputs) == 2 and late and not any(late)
    assert {name for kind, name in events if kind == "prepared"} == {"deepinfer-prepare_0"}
    main = [kind for kind, _ in events if kind != "prepared"]
    steps = _steps(main)
    assert len(steps) >= 10 and steps[0] == ["start", "forward", "sample"]  # the first: nothing before it
    assert all(step == ["start", "forward", "_update", "sample"] for step in steps[1:-1]), steps


def test_with_the_previous_tokens_on_the_device_the_forward_is_queued_first(monkeypatch):
    """The accelerator's order, forced on the CPU (``LaunchedStep.is_ready`` False): queue the forward, read the
    previous step's tokens, start ``prepare``, apply the previous results, queue the sampling; same outputs."""
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=32, structured_outputs=CONSTRAINTS[0][0])
    sync = LLM(max_num_seqs=4, enforce_eager=True).generate(["hello", "def f(x):"], params, use_tqdm=False)
    monkeypatch.setattr(LaunchedStep, "is_ready", lambda self: False)
    llm = LLM(max_num_seqs=4, enforce_eager=True, async_scheduling=True)
    events = []
    _spy(llm.engine, "runner", "forward", events)
    _spy(llm.engine, "preparer", "start", events)
    _spy(llm.engine, "runner", "sample", events)
    _spy(llm.engine, "", "_update", events)
    overlapped = llm.generate(["hello", "def f(x):"], params, use_tqdm=False)
    assert _texts(overlapped) == _texts(sync)
    steps = _steps([kind for kind, _ in events])
    assert steps[0] == ["start", "forward", "sample"]  # no step before it: prepared before the forward
    assert len(steps) >= 10 and all(step == ["forward", "start", "_update", "sample"] for step in steps[1:-1]), steps


def test_speculative_rows_and_rollback():
    """Rows of one request at consecutive positions (a draft being verified) get one mask each, as the synchronous
    replay gives; a shorter or different output rolls the matcher back to the shared prefix."""
    llm = LLM(max_num_seqs=2, enforce_eager=True)
    processor = llm.engine.context.plugin_state[KEY]
    from deepinfer_core.sampling import LogitsRow

    (output,) = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=40, structured_outputs=CONSTRAINTS[0][0]),
                             use_tqdm=False)
    tokens = list(output.outputs[0].token_ids)
    params = SamplingParams(structured_outputs=CONSTRAINTS[0][0])
    rows = [LogitsRow("spec-0", params, [1], tokens[:k], k) for k in (3, 4, 5, 6)]
    drafts = processor.prepare(rows)
    tokenizer = llguidance.LLTokenizer((Path(llm.engine.context.model_dir) / "tokenizer.json").read_text(),
                                       n_vocab=processor.vocab_size,
                                       eos_token=processor.eos_token_id)
    matcher = llguidance.LLMatcher(tokenizer, grammar_of(CONSTRAINTS[0][0]))
    matcher.consume_tokens(tokens[:3])
    for i in range(4):
        assert np.array_equal(drafts[i].numpy(), _bitmask(matcher))
        matcher.consume_token(tokens[3 + i])
    allowed = [t for t in range(processor.vocab_size) if (int(drafts[1][t // 32]) >> (t % 32)) & 1]
    rejected = next(t for t in allowed if t != tokens[4])  # another token the grammar allows after tokens[:4]
    again = processor.prepare([LogitsRow("spec-0", params, [1], tokens[:4] + [rejected], 5)])
    replay = llguidance.LLMatcher(tokenizer, grammar_of(CONSTRAINTS[0][0]))
    replay.consume_tokens(tokens[:4] + [rejected])
    assert np.array_equal(again[0].numpy(), _bitmask(replay))
    processor.rollback("spec-0", 1)
    back = processor.prepare([LogitsRow("spec-0", params, [1], tokens[:4], 4)])
    assert torch.equal(back[0], drafts[1])
    with pytest.raises(ValueError, match="cannot roll back 9 tokens"):
        processor.rollback("spec-0", 9)


# ---------------------------------------------------------------------------------------------- helpers
def _bitmask(matcher) -> np.ndarray:
    """The matcher's packed mask as computed synchronously, over the tiny model's 4096 ids."""
    return np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)[:bitmask_words(4096)]


def _count(forwards, cond):
    with cond:
        forwards[0] += 1
        cond.notify_all()


def _spy(engine, owner: str, name: str, events: list, before=None) -> None:
    """Record ``name`` in ``events`` each time the engine calls it (after ``before()``)."""
    target = getattr(engine, owner) if owner else engine
    method = getattr(target, name)

    def spy(*args, **kwargs):
        if before is not None:
            before()
        events.append((name, None))
        return method(*args, **kwargs)

    setattr(target, name, spy)


def _steps(calls: list[str]) -> list[list[str]]:
    """The engine's calls cut into steps, each ending with its ``sample`` (the calls after the last one: the end)."""
    steps: list[list[str]] = [[]]
    for call in calls:
        steps[-1].append(call)
        if call == "sample":
            steps.append([])
    return steps


def test_batch_invariant_mode_keeps_a_constrained_request_bitwise():
    """Batch-invariant mode, asynchronous scheduling: a constrained request alone and inside a batch of other
    constrained and plain requests gives the same tokens and logprobs, bit for bit."""
    llm = LLM(max_num_seqs=6, enforce_eager=True, async_scheduling=True, batch_invariant=True)
    needle = SamplingParams(temperature=1.0, seed=9, max_tokens=24, logprobs=0, structured_outputs=CONSTRAINTS[0][0])
    (alone,) = llm.generate(["hello"], needle, use_tqdm=False)
    others = [SamplingParams(temperature=0, max_tokens=20, structured_outputs=CONSTRAINTS[1][0]),
              SamplingParams(temperature=0.8, seed=1, max_tokens=12)]
    crowd = llm.generate(["def f(x):", "hello", "import os", "hello"], [others[0], needle, others[1], others[0]],
                         use_tqdm=False)
    a, b = alone.outputs[0], crowd[1].outputs[0]
    assert a.token_ids == b.token_ids
    assert [lp[t].logprob for lp, t in zip(a.logprobs, a.token_ids)] == [
        lp[t].logprob for lp, t in zip(b.logprobs, b.token_ids)]


def test_speculative_drafts_on_constrained_requests_give_the_outputs_without_speculation():
    """ngram drafts on grammar-constrained requests: each verified position gets its own mask, drafts the grammar
    refuses are rejected, the matcher rolls back past rejected drafts; greedy and seeded outputs equal those without
    speculation, and drafts are both accepted and rejected."""
    schema = {"type": "array", "minItems": 3, "maxItems": 5, "items": {
        "type": "object", "additionalProperties": False, "required": ["id", "ok"],
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}}}}
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    prompts = ['[{"id":1,"ok":true},{"id":2,"ok":false},', "hello", '{"a": [1, 2, 3], "b": [1, 2, 3]}'] * 2
    constraints = [StructuredOutputsParams(json=schema, disable_any_whitespace=True),
                   StructuredOutputsParams(regex=r"(ab){2,6}c"),
                   StructuredOutputsParams(json=schema, disable_any_whitespace=True)]
    params = [SamplingParams(max_tokens=40, structured_outputs=c, **sampling)
              for sampling in SAMPLINGS.values() for c in constraints]
    base = LLM(max_num_seqs=6, enforce_eager=True).generate(prompts, params, use_tqdm=False)
    llm = LLM(max_num_seqs=6, enforce_eager=True, speculative_config=ngram)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert _texts(spec) == _texts(base)
    metrics = {m.name: m.value for m in llm.get_metrics()}
    drafted, accepted = (metrics[f"deepinfer:spec_decode_num_{k}_tokens"] for k in ("draft", "accepted"))
    assert 0 < accepted < drafted
    assert all(re.fullmatch(r"(ab){2,6}c", o.outputs[0].text) for o in spec[1::3])

"""The mtp / dspark proposers in the engine: greedy outputs equal those without speculation (chunked prefill, a
prefix hit, n = 2, preemption), the metrics count what was drafted, verified and accepted, and
``DEEPINFER_USE_NEXTN_DECODE`` selects dspark."""

from __future__ import annotations

import pytest
import torch
from deepinfer_dspark import DSparkProposer, MtpProposer

from deepinfer_core.llm import LLM
from deepinfer_core.sampling.params import SamplingParams

test_spec_decode = pytest.importorskip("test_spec_decode", reason="needs the repository's tests/test_spec_decode.py")
assert_same_or_near_tie = test_spec_decode.assert_same_or_near_tie

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
METHODS = {"mtp": {"method": "mtp", "num_speculative_tokens": 3},
           "dspark": {"method": "dspark", "num_speculative_tokens": 3, "verify_fraction": 0.6}}


def _llm(folder, **kwargs) -> LLM:
    kwargs.setdefault("block_size", 8)
    kwargs.setdefault("max_num_seqs", 8)
    return LLM(str(folder), **kwargs)


def _prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 64, (n,), generator=gen).tolist() for n in lengths]


def _generate(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _metrics(llm) -> dict:
    return {m.name: m.value for m in llm.get_metrics()}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_greedy_outputs_equal_without_speculation(mtp_ckpt, method):
    prompts = _prompts([9, 23, 14, 30], seed=1)
    prompts.append(list(prompts[1]))  # a prefix-cache hit: the draft starts past token 0
    base = _generate(_llm(mtp_ckpt, max_num_batched_tokens=16), prompts, GREEDY)
    llm = _llm(mtp_ckpt, max_num_batched_tokens=16, speculative_config=METHODS[method])
    assert isinstance(llm.engine.speculator.proposer, DSparkProposer if method == "dspark" else MtpProposer)
    assert_same_or_near_tie(base, _generate(llm, prompts, GREEDY))
    assert llm.engine.state_manager.hits > 0
    metrics = _metrics(llm)
    assert metrics["deepinfer:spec_decode_num_drafts"] > 0
    assert metrics["deepinfer:spec_decode_num_verified_tokens"] <= metrics["deepinfer:spec_decode_num_draft_tokens"]
    pair = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2, logprobs=2)
    assert_same_or_near_tie(_generate(_llm(mtp_ckpt), prompts[:2], pair), _generate(llm, prompts[:2], pair))
    llm.engine.state_manager.check_invariants([])


def test_greedy_outputs_equal_through_preemption(mtp_ckpt):
    from deepinfer_core.models.deepseek_v4.state import DeepseekV4State

    probe = _llm(mtp_ckpt)
    per_block = DeepseekV4State.bytes_per_block(probe.model.config, 8, torch.float32)
    per_slot = DeepseekV4State.bytes_per_slot(probe.model.config, 8, torch.float32)
    per_slot += 8 * 32 * 4  # the draft layer's ring: window 8 x head_dim 32, fp32 (MtpProposer.slot_state_bytes)
    prompts = _prompts([27, 30, 25, 29], seed=6)
    base = _generate(_llm(mtp_ckpt, max_num_seqs=4), prompts, GREEDY)
    llm = _llm(mtp_ckpt, max_num_seqs=4, kv_cache_memory_bytes=4 * per_slot + 10 * per_block,
               speculative_config=METHODS["dspark"])
    assert_same_or_near_tie(base, _generate(llm, prompts, GREEDY))
    assert llm.engine.scheduler.num_preemptions > 0


def test_rounds_whose_drafts_the_budget_leaves_unverified_still_count(mtp_ckpt):
    """A budget of 0 verifies nothing: every step still drafted k tokens per sequence (fewer near max_tokens), so
    each is a draft round of 0 accepted tokens (acceptance length 1.0, as the tokens per step say), not a round left
    out of the counters."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = _llm(mtp_ckpt, speculative_config={"method": "dspark", "num_speculative_tokens": 3,
                                             "num_verify_tokens": 0})
    out = _generate(llm, _prompts([12], seed=3), params)
    assert len(out[0].outputs[0].token_ids) == 10 and llm.engine.num_steps == 10
    metrics = _metrics(llm)
    # drafts after outputs 1..8, each min(3, 9 - outputs) tokens (none after the 9th: one token left)
    assert metrics["deepinfer:spec_decode_num_drafts"] == 8
    assert metrics["deepinfer:spec_decode_num_draft_tokens"] == 3 * 6 + 2 + 1
    assert metrics["deepinfer:spec_decode_num_verified_tokens"] == metrics["deepinfer:spec_decode_num_accepted_tokens"] == 0


def test_batch_invariant_mode_makes_mtp_drafts_bitwise(mtp_ckpt):
    """With batch-invariant ops, verifying MTP drafts (DSpark's budgeted prefixes) gives the tokens and logprobs of
    the run without speculation bit for bit."""
    pytest.importorskip("deepinfer_batch_invariant")
    prompts = _prompts([9, 23, 14], seed=1)
    base = _generate(_llm(mtp_ckpt, batch_invariant=True), prompts, GREEDY)
    llm = _llm(mtp_ckpt, batch_invariant=True, speculative_config=METHODS["dspark"])
    spec = _generate(llm, prompts, GREEDY)
    assert _metrics(llm)["deepinfer:spec_decode_num_accepted_tokens"] > 0
    for b, s in zip(base, spec, strict=True):
        assert b.outputs[0].token_ids == s.outputs[0].token_ids
        assert [lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)] == [
            lp[t].logprob for lp, t in zip(s.outputs[0].logprobs, s.outputs[0].token_ids)]


def test_seeded_sampling_under_dspark_is_the_sampling_without_it(mtp_ckpt):
    """Seeded random sampling: greedy MTP drafts are one-hot q, so every emitted token is the token the request's
    seeded sampler gives without speculation (batch-invariant ops: no rounding difference between a verification
    step and one-token steps), and the same seed gives the same output again."""
    pytest.importorskip("deepinfer_batch_invariant")
    prompts = _prompts([11, 17], seed=4)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=123, max_tokens=16, ignore_eos=True)
    base = _generate(_llm(mtp_ckpt, batch_invariant=True), prompts, params)
    llm = _llm(mtp_ckpt, batch_invariant=True, speculative_config=METHODS["dspark"])
    first, again = _generate(llm, prompts, params), _generate(llm, prompts, params)
    assert _metrics(llm)["deepinfer:spec_decode_num_drafts"] > 0
    for b, f, a in zip(base, first, again, strict=True):
        assert b.outputs[0].token_ids == f.outputs[0].token_ids == a.outputs[0].token_ids


def test_nextn_variable_selects_dspark(mtp_ckpt, monkeypatch):
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")
    llm = _llm(mtp_ckpt)
    proposer = llm.engine.speculator.proposer
    assert isinstance(proposer, DSparkProposer) and proposer.k == 2


CODE_PROMPTS = ["def fibonacci(n):\n", "import os\n\n\nclass Config:\n    def __init__(self, path):\n",
                "    for name in sorted(names):\n        if name.startswith('_'):\n"]


@pytest.fixture(scope="module")
def embedded():
    """The embedded tiny model (its trained MTP layer and confidence head), greedy without speculation."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    base = LLM().generate(CODE_PROMPTS, params, use_tqdm=False)
    return params, base


@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_embedded_model_drafts_accepted_tokens_losslessly(embedded, method):
    params, base = embedded
    config = {"method": method, "num_speculative_tokens": 5}
    llm = LLM(speculative_config=config)
    assert llm.engine.speculator.proposer.draft.has_confidence_head
    assert_same_or_near_tie(base, llm.generate(CODE_PROMPTS, params, use_tqdm=False))
    m = _metrics(llm)
    drafts, accepted = m["deepinfer:spec_decode_num_drafts"], m["deepinfer:spec_decode_num_accepted_tokens"]
    assert 1 + accepted / drafts > 1.8, (accepted, drafts)  # the trained layer's drafts are mostly accepted
    verified, drafted = m["deepinfer:spec_decode_num_verified_tokens"], m["deepinfer:spec_decode_num_draft_tokens"]
    if method == "mtp":
        assert verified == drafted
    else:  # the default budget: 0.75 of the drafted tokens of each step
        assert verified <= 0.75 * drafted + drafts


def test_bench_compares_dspark_with_none_and_mtp_in_one_run(tmp_path):
    """``deepinfer bench --speculative-config dspark --compare-speculative``: no speculation, fixed-k MTP and DSpark
    on the same prompts of the embedded model; DSpark verifies fewer draft tokens for the same accepted ones, and the
    greedy tokens are those of the none run."""
    from deepinfer_core.bench import runner
    from deepinfer_core.bench.report import format_report

    path = tmp_path / "code.txt"
    path.write_text("\n".join(line.replace("\n", " ") for line in CODE_PROMPTS) + "\n")
    config = runner.BenchConfig(input_len=32, output_len=16, num_prompts=3, max_num_seqs=3, warmup=0,
                                enforce_eager=True, prompts_file=str(path), compare_speculative=[],
                                speculative_config={"method": "dspark", "num_speculative_tokens": 5})
    result = runner.run_bench(config)
    none, mtp, dspark = result["speculative_comparison"]["runs"]
    assert [none["label"], mtp["label"], dspark["label"]] == ["none", "mtp k=5", "dspark k=5"]
    assert mtp["acceptance_length"] > 1.5 and dspark["acceptance_length"] > 1.5
    assert mtp["num_verified_tokens"] == mtp["num_draft_tokens"]
    assert dspark["num_verified_tokens"] < mtp["num_verified_tokens"]
    assert dspark["verified_per_draft"] < mtp["verified_per_draft"] <= 5
    assert mtp["same_outputs_as_none"] == dspark["same_outputs_as_none"] == 3
    assert dspark["speedup_vs_none"] == dspark["output_throughput"] / none["output_throughput"]
    assert "requests with the none run's tokens: mtp k=5 3/3, dspark k=5 3/3" in format_report(result)

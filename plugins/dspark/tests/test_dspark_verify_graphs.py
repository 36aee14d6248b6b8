"""MTP and DSpark drafts verified through the core's static verification steps (``engine/verify_graphs.py``; on CPU
the padded step runs without capture): outputs equal eager verification's (greedy tokens, logprobs within the
speculative tests' tolerance) through a batch mix, chunked prefill, a prefix hit and preemption, the proposer reading
the target's hidden states from the static step; the replay counters show which path ran."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.llm import LLM
from deepinfer_core.sampling.params import SamplingParams

test_spec_decode = pytest.importorskip("test_spec_decode", reason="needs the repository's tests/test_spec_decode.py")
assert_same_or_near_tie = test_spec_decode.assert_same_or_near_tie

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
METHODS = {"mtp": {"method": "mtp", "num_speculative_tokens": 4},
           "dspark": {"method": "dspark", "num_speculative_tokens": 4, "verify_fraction": 0.6}}
SIZES = [1, 2, 4, 8]


def _llm(folder, **kwargs) -> LLM:
    kwargs.setdefault("block_size", 8)
    kwargs.setdefault("max_num_seqs", 8)
    return LLM(str(folder), **kwargs)


def _generate(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 64, (n,), generator=gen).tolist() for n in lengths]


def _spec_metrics(llm) -> dict:
    return {m.name: m.value for m in llm.get_metrics() if m.name.startswith("deepinfer:spec_decode_")}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_static_verification_equals_eager_verification(mtp_ckpt, method):
    prompts = _prompts([9, 23, 14, 30], seed=1)
    prompts.append(list(prompts[1]))  # a prefix-cache hit
    config = METHODS[method]
    eager = _llm(mtp_ckpt, max_num_batched_tokens=16, enforce_eager=True, speculative_config=config)
    static = _llm(mtp_ckpt, max_num_batched_tokens=16, cuda_graph_sizes=SIZES, speculative_config=config)
    graphs = static.engine.runner.verify_graphs
    assert graphs.return_hidden  # the proposer reads the target's hidden states from the static step
    assert_same_or_near_tie(_generate(eager, prompts, GREEDY), _generate(static, prompts, GREEDY))
    assert graphs.num_replays > 0
    metrics, eager_metrics = _spec_metrics(static), _spec_metrics(eager)
    assert 0 < metrics["deepinfer:spec_decode_num_accepted_tokens"] < metrics["deepinfer:spec_decode_num_verified_tokens"]
    assert metrics == eager_metrics  # the same drafts, verified and accepted on both paths
    static.engine.state_manager.check_invariants([])


def test_static_verification_through_preemption(mtp_ckpt):
    from deepinfer_core.models.deepseek_v4.state import DeepseekV4State

    probe = _llm(mtp_ckpt, enforce_eager=True)
    per_block = DeepseekV4State.bytes_per_block(probe.model.config, 8, torch.float32)
    per_slot = DeepseekV4State.bytes_per_slot(probe.model.config, 8, torch.float32)
    per_slot += 8 * 32 * 4  # the draft layer's ring: window 8 x head_dim 32, fp32 (MtpProposer.slot_state_bytes)
    prompts = _prompts([27, 30, 25, 29], seed=6)
    config = METHODS["mtp"]
    base = _generate(_llm(mtp_ckpt, max_num_seqs=4, enforce_eager=True, speculative_config=config), prompts, GREEDY)
    llm = _llm(mtp_ckpt, max_num_seqs=4, kv_cache_memory_bytes=5 * per_slot + 10 * per_block,
               cuda_graph_sizes=SIZES, speculative_config=config)
    assert_same_or_near_tie(base, _generate(llm, prompts, GREEDY))
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.runner.verify_graphs.num_replays > 0

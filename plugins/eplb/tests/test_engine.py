"""EPLB in a running expert-parallel engine (2 ranks, gloo, fp32 CPU): rebalances forced every 2 steps move experts
(replicas included, quantized experts with their scales) while requests run, and the outputs stay those of one
process (bitwise in batch-invariant mode); ``moe_lb`` comes back in the ranks' metrics; an engine EPLB cannot balance is refused by name.

The tests that start ranks are marked ``distributed`` and bounded by ``DEEPINFER_DISTRIBUTED_TIMEOUT``."""

from __future__ import annotations

import time

import pytest
import torch
from deepinfer_eplb import EplbConfigError

from deepinfer_core import LLM, SamplingParams

TIMEOUT_S = 60
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
FORCED = {"num_redundant_experts": 2, "window_size": 2, "step_interval": 2}  # a rebalance every 2 steps
MOE_LB, BEFORE, STATIC = "deepinfer:eplb_moe_lb", "deepinfer:eplb_moe_lb_before", "deepinfer:eplb_moe_lb_static"
REBALANCES, COPIES = "deepinfer:eplb_rebalances", "deepinfer:eplb_expert_copies_received"


@pytest.fixture(autouse=True)
def _bounded(monkeypatch):
    monkeypatch.setenv("DEEPINFER_DISTRIBUTED_TIMEOUT", str(TIMEOUT_S))
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    monkeypatch.delenv("DEEPINFER_PLUGINS", raising=False)


def _prompts(lengths, seed, vocab=60):
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(2, vocab, (n,), generator=gen).tolist()} for n in lengths]


def _assert_same(want, got, tolerance):
    """Same tokens; logprobs within ``tolerance`` (0: bitwise)."""
    for a, b in zip(want, got, strict=True):
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert cb.token_ids == ca.token_ids
            for pa, pb in zip(ca.logprobs, cb.logprobs, strict=True):
                assert pa.keys() == pb.keys()
                assert max(abs(pa[t].logprob - pb[t].logprob) for t in pa) <= tolerance


def _balanced_run(model, kwargs, batches, tolerance):
    """Each batch through one process, then through 2 ranks with EPLB forced; returns the ranks' statistics after
    each batch."""
    one = LLM(model, **kwargs)
    reference = [one.generate(prompts, GREEDY, use_tqdm=False) for prompts in batches]
    start = time.monotonic()
    ranks = LLM(model, data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True, eplb_config=FORCED,
                **kwargs)
    try:
        stats = []
        for prompts, want in zip(batches, reference, strict=True):
            _assert_same(want, ranks.generate(prompts, GREEDY, use_tqdm=False), tolerance)
            stats.append(ranks._parallel.stats)
    finally:
        ranks.shutdown()
    assert time.monotonic() - start < TIMEOUT_S
    return stats


@pytest.mark.distributed
def test_forced_rebalances_keep_every_output_bitwise():
    """The embedded tiny model (4 experts): 6 slots over 2 ranks, a rebalance every 2 steps while 8 requests decode;
    the second call starts on the placement the first left. In batch-invariant mode an expert's rows give the same
    bits however they are split over replicas and ranks, so the logprobs equal one process's exactly."""
    pytest.importorskip("deepinfer_batch_invariant")
    batches = [_prompts([12, 30, 7, 22, 15, 9, 18, 5], seed=2), _prompts([25, 6, 14], seed=3)]
    stats = _balanced_run(None, {"dtype": "float32", "max_num_seqs": 4, "batch_invariant": True}, batches, 0.0)
    first, last = [rank["metrics"] for rank in stats[0]], [rank["metrics"] for rank in stats[-1]]
    assert first[0][REBALANCES] >= 2 and last[0][REBALANCES] > first[0][REBALANCES]
    assert all(rank[COPIES] > 0 for rank in last)  # weights crossed between the ranks
    assert last[0][MOE_LB] == last[1][MOE_LB]  # every rank planned from the same summed load
    assert all(1.0 <= last[0][name] <= 2.0 for name in (MOE_LB, BEFORE, STATIC))  # 2 ranks: at most 2


@pytest.fixture(scope="module")
def fp4_mixed(tmp_path_factory):
    """Sliding and CSA layers (a hash-routed MoE first), 8 routed experts stored as MXFP4 with ue8m0 scales."""
    from deepinfer_core.bench.presets import PRESETS, write_random_checkpoint
    from deepinfer_core.quant.writer import QuantRecipe, quantize_checkpoint

    config = {"vocab_size": 64, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 3,
              "layer_types": ["sliding_attention", "compressed_sparse_attention", "sliding_attention"],
              "mlp_layer_types": ["hash_moe", "moe", "moe"], "num_attention_heads": 2, "head_dim": 32,
              "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
              "index_n_heads": 2, "index_head_dim": 16, "index_topk": 64, "hc_mult": 2, "sliding_window": 8,
              "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
              "partial_rotary_factor": 0.25, "max_position_embeddings": 256}
    source = tmp_path_factory.mktemp("eplb") / "bf16"
    write_random_checkpoint(source, PRESETS["tiny"].config_dict(config), seed=3)
    folder = source.parent / "fp4"
    quantize_checkpoint(source, folder, QuantRecipe("fp4", "fp8", 32))
    return str(folder)


@pytest.mark.distributed
def test_quantized_experts_move_with_their_scales(fp4_mixed):
    """MXFP4 experts (packed weights and ue8m0 scales) in 10 slots over 2 ranks, rebalanced every 2 steps. Default
    mode: logprobs within 1e-5, since an expert's GEMM runs over other row counts when replicas split its rows."""
    stats = _balanced_run(fp4_mixed, {"dtype": "float32", "max_num_seqs": 4, "block_size": 8},
                          [_prompts([9, 17, 6, 12, 20, 7], seed=4)], 1e-5)
    ranks = [rank["metrics"] for rank in stats[0]]
    assert ranks[0][REBALANCES] >= 2 and ranks[1][COPIES] > 0


def test_eplb_without_expert_parallelism_is_refused():
    with pytest.raises(EplbConfigError, match="enable_expert_parallel=True"):
        LLM(dtype="float32", enable_eplb=True)


def test_eplb_on_one_rank_is_refused():
    """Expert parallelism asked for in one process: nothing to balance over, refused at engine start."""
    with pytest.raises(EplbConfigError, match="this engine has one"):
        LLM(dtype="float32", enable_expert_parallel=True, enable_eplb=True)


@pytest.mark.distributed
def test_bench_reports_moe_lb_over_data_parallel_ranks(tmp_path, capsys):
    """``deepinfer bench --data-parallel-size 2 --enable-expert-parallel --option enable_eplb=true``: the table's
    moe_lb line and the JSON's ``engine_metrics`` / ``ranks``; per-request times are not seen across ranks."""
    import json

    from deepinfer_core.cli import main

    out = tmp_path / "bench.json"
    code = main(["bench", "--preset", "tiny", "--cache-dir", str(tmp_path / "cache"), "--input-len", "12",
                 "--output-len", "6", "--num-prompts", "5", "--max-num-seqs", "4", "--warmup", "0",
                 "--data-parallel-size", "2", "--enable-expert-parallel", "--option", "enable_eplb=true",
                 "--option", json.dumps({"num_redundant_experts": 2, "window_size": 3, "step_interval": 3}).join(
                     ("eplb_config=", "")), "--json", str(out)])
    table = capsys.readouterr().out
    assert code == 0
    engine = json.loads(out.read_text())["engine"]
    figures = engine["engine_metrics"]
    assert figures[REBALANCES] == 2 and 1.0 <= figures[MOE_LB] <= 2.0  # 6 lockstep steps, one every 3
    assert f"moe_lb (EPLB, busiest rank / mean, latest window): {figures[MOE_LB]:.3f}" in table
    assert [rank["requests"] for rank in engine["ranks"]] == [3, 2] and engine["steps"] == 6
    assert engine["output_tokens"] == 30 and engine["ttft_s"]["mean"] is None

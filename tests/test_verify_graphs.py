"""Verification steps through the static-shape path (``engine/verify_graphs.py``, docs/speculative.md): on CPU the
padded step runs without capture, and its outputs must equal eager verification's (greedy tokens, logprobs within
the speculative tests' tolerance) through batch mixes, rejections, a prefix hit, n = 2 and preemption; the replay
counters show which path ran."""

from __future__ import annotations

import pytest
import torch
from test_spec_decode import GREEDY, _generate, _llm, _repetitive_prompts, assert_same_or_near_tie
from v4_factory import ALL_TYPES, tiny_checkpoint

from deepinfer_core import SamplingParams
from deepinfer_core.engine.verify_graphs import VerifyGraphs

pytest.importorskip("transformers")

SIZES = [1, 2, 4, 8]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("verify_graphs") / "ckpt"
    tiny_checkpoint(path, layer_types=ALL_TYPES * 2, hc_mult=2)  # sliding, CSA (ratio 4), HCA layers
    return path


def _ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}


@pytest.mark.parametrize("k", [3, 6])
def test_static_verification_equals_eager_verification(folder, k):
    """A batch mix with chunked prefill, a prefix hit and n = 2; k = 6 pads steps to 7 tokens per sequence, so a
    sequence can complete two CSA windows in one step (the plan's fixed window count per sequence)."""
    prompts = _repetitive_prompts([9, 23, 14, 31], seed=1)
    prompts.append(list(prompts[1]))
    eager = _llm(folder, enforce_eager=True, max_num_batched_tokens=16, speculative_config=_ngram(k))
    static = _llm(folder, cuda_graph_sizes=SIZES, max_num_batched_tokens=16, speculative_config=_ngram(k))
    assert_same_or_near_tie(_generate(eager, prompts, GREEDY), _generate(static, prompts, GREEDY))
    graphs = static.engine.runner.verify_graphs
    assert graphs.num_replays > 0 and len(graphs.replays_by_tokens) > 1  # several tokens-per-sequence shapes
    assert max(graphs.replays_by_tokens) <= k + 1
    metrics = {m.name: m.value for m in static.get_metrics()}
    assert metrics["deepinfer:spec_decode_num_accepted_tokens"] < metrics["deepinfer:spec_decode_num_verified_tokens"]
    assert static.engine.state_manager.hits > 0
    pair = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2, logprobs=2)
    assert_same_or_near_tie(_generate(eager, prompts[:2], pair), _generate(static, prompts[:2], pair))
    static.engine.state_manager.check_invariants([])


def test_static_verification_through_preemption(folder):
    from deepinfer_core.models.deepseek_v4.state import DeepseekV4State

    probe = _llm(folder, enforce_eager=True)
    per_block = DeepseekV4State.bytes_per_block(probe.model.config, 8, torch.float32)
    per_slot = DeepseekV4State.bytes_per_slot(probe.model.config, 8, torch.float32)
    budget = 5 * per_slot + 10 * per_block  # 4 sequences (and the spare slot) want up to 4 x 7 blocks
    prompts = _repetitive_prompts([27, 30, 25, 29], seed=6)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    base = _generate(_llm(folder, max_num_seqs=4, enforce_eager=True, speculative_config=_ngram(3)), prompts, params)
    llm = _llm(folder, max_num_seqs=4, kv_cache_memory_bytes=budget, cuda_graph_sizes=SIZES,
               speculative_config=_ngram(3))
    assert_same_or_near_tie(base, _generate(llm, prompts, params))
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.runner.verify_graphs.num_replays > 0
    llm.engine.state_manager.check_invariants([])


def test_padding_rows_leave_the_slot_state_of_eager_verification(folder):
    """Sequences verifying drafts of different lengths (draft-less ones padded to the step's tokens per sequence)
    leave every slot's sliding rings and compressor carries as eager verification leaves them: a padding row is
    put back like a rejected draft."""
    prompts = _repetitive_prompts([12, 17, 9], seed=3)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    eager = _llm(folder, enforce_eager=True, speculative_config=_ngram(4))
    static = _llm(folder, cuda_graph_sizes=SIZES, speculative_config=_ngram(4))
    assert [o.outputs[0].token_ids for o in _generate(eager, prompts, params)] == [
        o.outputs[0].token_ids for o in _generate(static, prompts, params)]
    assert static.engine.runner.verify_graphs.num_replays > 0
    slots = static.engine.runner.verify_graphs.spare_slot  # the slots sequences use, the spare one left out
    for (ours, _), (theirs, _) in zip(static.engine.runner.state.slot_rings(), eager.engine.runner.state.slot_rings(),
                                      strict=True):
        torch.testing.assert_close(ours[:slots], theirs[:slots], atol=1e-4, rtol=0)


def test_batch_invariant_static_verification_is_bitwise_and_async_scheduling_changes_nothing(folder):
    """With batch-invariant ops the static verification step's rows equal one-token decode steps' bit for bit (the
    padding rows and dummy sequences change no real row); with asynchronous scheduling on, outputs are the same."""
    pytest.importorskip("deepinfer_batch_invariant")
    prompts = _repetitive_prompts([9, 23, 14], seed=1)
    base = _generate(_llm(folder, batch_invariant=True, cuda_graph_sizes=SIZES), prompts, GREEDY)
    llm = _llm(folder, batch_invariant=True, cuda_graph_sizes=SIZES, async_scheduling=True,
               speculative_config=_ngram(3))
    spec = _generate(llm, prompts, GREEDY)
    assert llm.engine.runner.verify_graphs.num_replays > 0
    for b, s in zip(base, spec, strict=True):
        assert b.outputs[0].token_ids == s.outputs[0].token_ids
        assert [lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)] == [
            lp[t].logprob for lp, t in zip(s.outputs[0].logprobs, s.outputs[0].token_ids)]


def test_a_failed_capture_leaves_verification_eager(folder, caplog):
    """A backend whose capture fails (e.g. an op that synchronises with the host) gets a warning naming the shape,
    and verification steps run eagerly from then on, with the same outputs."""
    prompts = _repetitive_prompts([9, 23], seed=4)
    eager = _generate(_llm(folder, enforce_eager=True, speculative_config=_ngram(3)), prompts, GREEDY)
    llm = _llm(folder, cuda_graph_sizes=SIZES, speculative_config=_ngram(3))

    def refuse(fn, example_inputs):
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = llm.engine.runner.verify_graphs
    graphs.capture = refuse
    assert_same_or_near_tie(eager, _generate(llm, prompts, GREEDY))
    assert graphs.num_replays == 0 and "verification graph at batch" in graphs.disabled_reason
    assert "operation not permitted" in caplog.text


def test_without_a_speculator_the_single_token_path_is_untouched(folder):
    llm = _llm(folder, cuda_graph_sizes=SIZES)
    assert llm.engine.runner.verify_graphs is None
    _generate(llm, _repetitive_prompts([9, 14], seed=2), GREEDY)
    assert llm.engine.runner.decode_graphs.num_replays > 0


def test_a_model_without_static_verification_keeps_verifying_eagerly():
    class Plain:
        pass

    assert not VerifyGraphs.supported(Plain())


def test_the_step_benchmark_times_draft_and_verify_steps():
    """``tools/bench_spec_steps.py`` on the embedded tiny model (its MTP layer), one iteration each: a verify and a
    draft time per (batch, tokens per sequence), and the computed speedup from them."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "bench_spec_steps.py"
    spec = importlib.util.spec_from_file_location("bench_spec_steps", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--batch", "2", "--tokens", "1", "2", "3", "--iters", "1", "--warmup", "0",
                         "--context", "40", "--acceptance", "2"])
    rows = {(r["batch"], r["tokens"]): r for r in result["rows"]}
    assert set(rows) == {(2, 1), (2, 2), (2, 3)}
    assert all(r["verify_ms"] > 0 and r["draft_ms"] > 0 for r in rows.values())
    computed = {e["k"]: e for e in result["computed_speedup"]}
    assert set(computed) == {1, 2}  # k + 1 >= 2 tokens per step, verify(k + 1) measured
    want = 2 * rows[2, 1]["verify_ms"] / (rows[2, 1]["draft_ms"] + rows[2, 2]["verify_ms"])
    assert computed[1]["speedup"] == pytest.approx(want)

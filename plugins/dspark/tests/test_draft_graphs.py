"""Static MTP draft rounds (``deepinfer_dspark/draft_graphs.py``; on CPU the padded round runs without capture) against
the eager round: the same tokens, confidences and draft state (fp32, up to the last bits: the padded round's
GEMMs see other row counts than the ragged eager round's) after it, over batch mixes,
padded batch sizes, fold rows of 1 .. k + 1 per sequence, k 1 .. 5, a sequence past a prefix hit, and both methods;
and the engine's greedy outputs with draft graphs equal those without."""

from __future__ import annotations

import pytest
import torch
from deepinfer_dspark import DSparkProposer, MtpProposer
from test_proposer import TOKENS, hidden_of

from deepinfer_core.engine_context import EngineContext
from deepinfer_core.models.deepseek_v4.loader import load_deepseek_v4
from deepinfer_core.ops.table import OpTable
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.spec_decode import SpeculativeConfig
from deepinfer_core.spec_decode.proposer import DraftBatch, DraftSequence

SIZES = [1, 2, 4]
NO_CAPTURE = lambda fn, example_inputs: fn  # the CPU backend's capture_graph
LONG = TOKENS[0] + TOKENS[1] + TOKENS[0]  # 47 tokens
SEQUENCES = (LONG, LONG[::-1], TOKENS[1] + TOKENS[0] + TOKENS[1])


@pytest.fixture(scope="module")
def target(mtp_ckpt):
    return load_deepseek_v4(mtp_ckpt, OpTable())


@pytest.fixture(scope="module")
def hidden(target):
    """The target's last streams over each sequence's tokens (every round reads its rows from these)."""
    return [hidden_of(target, tokens) for tokens in SEQUENCES]


def _pair(method, target, mtp_ckpt, k, **options):
    """An eager proposer and one drafting through static rounds, over the same draft layer."""
    cls = DSparkProposer if method == "dspark" else MtpProposer
    config = SpeculativeConfig(method, k, options)
    eager = cls(config, target, EngineContext("cpu", model_dir=mtp_ckpt))
    static = cls(config, target, draft=eager.draft)
    for proposer in (eager, static):
        proposer.allocate(4)
    static.use_graphs(NO_CAPTURE, SIZES)
    return eager, static


def _seq(hidden, s, slot, first, computed, k, tokens=None):
    tokens = tokens or SEQUENCES[s]
    rows = hidden[s][first:computed]
    return DraftSequence(f"r{s}", slot, list(tokens[:computed + 1]), computed, first, rows, 0, SamplingParams(), k)


def _same(eager, static, batch):
    want, got = eager.propose(batch), static.propose(batch)
    assert [d.token_ids for d in got] == [d.token_ids for d in want]
    for d_got, d_want in zip(got, want, strict=True):  # fp32 GEMMs over padded vs ragged rows: last-bit rounding
        assert d_got.confidences == pytest.approx(d_want.confidences, rel=1e-5, abs=1e-6)
    assert [d.num_proposed for d in got] == [d.num_proposed for d in want]
    for ring_e, ring_s in zip(eager.state.rings, static.state.rings, strict=True):
        torch.testing.assert_close(ring_s[:4], ring_e[:4], rtol=1e-5, atol=1e-6)  # the spare slot aside
    return got


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_static_rounds_draft_what_eager_rounds_draft(target, mtp_ckpt, hidden, method, k):
    """Three rounds over three sequences in slots 3, 0, 1: a prompt (folded eagerly: more rows than a graph takes),
    then rounds of 1 .. k + 1 fold rows per sequence (batch sizes 3 -> padded to 4, then 1 and 2)."""
    eager, static = _pair(method, target, mtp_ckpt, k, **({"verify_fraction": 0.6} if method == "dspark" else {}))
    _same(eager, static, DraftBatch([_seq(hidden, 0, 3, 0, 9, k), _seq(hidden, 1, 0, 0, 4, k),
                                     _seq(hidden, 2, 1, 0, 20, k)]))
    assert static.graphs.num_replays == (1 if 4 <= k + 1 else 0)  # the 4-row prompt rides in a graph when it fits
    ends, slots = [9, 4, 20], (3, 0, 1)
    for step in range(3):
        seqs = []
        for s in (0, 1, 2) if step != 1 else (1,):  # step 1: a lone sequence, batch 1
            grow = 1 + (step + s) % (k + 1)  # 1 + accepted rows
            seqs.append(_seq(hidden, s, slots[s], ends[s], ends[s] + grow, k))
            ends[s] += grow
        before = static.graphs.num_replays
        _same(eager, static, DraftBatch(seqs))
        assert static.graphs.num_replays == before + 1
    assert set(static.graphs.replays_by_rows) <= set(range(1, k + 2))


@pytest.mark.parametrize("k", [2, 5])
def test_static_rounds_are_bitwise_with_batch_invariant_ops(mtp_ckpt, k):
    """With the batch-invariant plugin's ops (a row's result independent of the rows beside it and the padding) the
    static round's confidences and draft state equal the eager round's bit for bit."""
    invariant = pytest.importorskip("deepinfer_batch_invariant.ops", reason="needs the deepinfer-batch-invariant plugin")
    table = OpTable()
    invariant.install(table, "cpu")
    target = load_deepseek_v4(mtp_ckpt, table)
    hidden = [hidden_of(target, tokens) for tokens in SEQUENCES]
    eager, static = _pair("dspark", target, mtp_ckpt, k)
    ends = [4, 6, 3]
    for step in range(3):
        seqs = []
        for s, slot in enumerate((2, 0, 3)):
            grow = 1 + (step + s) % (k + 1) if step else ends[s]
            seqs.append(_seq(hidden, s, slot, ends[s] - grow if not step else ends[s], ends[s] + (grow if step else 0), k))
            ends[s] += grow if step else 0
        got, want = static.propose(DraftBatch(seqs)), eager.propose(DraftBatch(seqs))
        assert [(d.token_ids, d.confidences) for d in got] == [(d.token_ids, d.confidences) for d in want]
        for ring_e, ring_s in zip(eager.state.rings, static.state.rings, strict=True):
            assert torch.equal(ring_e[:4], ring_s[:4])
    assert static.graphs.num_replays >= 2


def test_a_prefix_hit_floor_in_a_static_round(target, mtp_ckpt, hidden):
    """A sequence whose first computed position is 20 (rows below it never folded) in a slot another sequence used:
    the static round reads no ring row below its floor, as the eager one."""
    eager, static = _pair("mtp", target, mtp_ckpt, 4)
    _same(eager, static, DraftBatch([_seq(hidden, 2, 0, 0, 5, 4)]))  # slot 0's ring holds another sequence's rows
    hit = _seq(hidden, 2, 0, 20, 24, 4, tokens=LONG)
    hit.request_id = "hit"
    _same(eager, static, DraftBatch([hit]))
    assert static.graphs.num_replays == 2


def test_engine_greedy_outputs_are_unchanged_with_draft_graphs(mtp_ckpt):
    """The engine with cuda_graph_sizes (static verification and draft rounds) against enforce_eager: the same
    tokens and the same speculative metrics."""
    from deepinfer_core.llm import LLM

    prompts = [torch.randint(2, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 23, 14)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    config = {"method": "dspark", "num_speculative_tokens": 3}
    runs = {}
    for name, kwargs in (("eager", {"enforce_eager": True}), ("static", {"cuda_graph_sizes": [1, 2, 4]})):
        llm = LLM(str(mtp_ckpt), block_size=8, max_num_seqs=4, speculative_config=config, **kwargs)
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        metrics = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("deepinfer:spec_decode_")}
        runs[name] = ([o.outputs[0].token_ids for o in out], metrics, llm.engine.speculator.proposer.graphs)
    assert runs["eager"][2] is None
    assert runs["static"][0] == runs["eager"][0]
    assert runs["static"][1] == runs["eager"][1]
    assert runs["static"][2].num_replays > 0

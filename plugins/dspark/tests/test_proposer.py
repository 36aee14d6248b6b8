"""The mtp / dspark proposers over hand-built DraftBatches (what the engine hands them after each step)."""

from __future__ import annotations

import pytest
from deepinfer_dspark import DSparkError, DSparkProposer, MtpProposer, allocate_verification

from deepinfer_core.engine_context import EngineContext
from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.models.deepseek_v4.loader import load_deepseek_v4
from deepinfer_core.ops.table import OpTable
from deepinfer_core.plugins import get_plugin_manager
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.spec_decode import SpeculativeConfig
from deepinfer_core.spec_decode.proposer import DraftBatch, DraftSequence, default_registry

TOKENS = [[5, 9, 17, 3, 3, 40, 22, 8, 61, 12, 7, 30, 30, 2, 19, 44, 11, 6], [4, 8, 15, 16, 23, 42, 4, 8, 15, 16, 23]]


@pytest.fixture(scope="module")
def target(mtp_ckpt):
    return load_deepseek_v4(mtp_ckpt, OpTable())


def hidden_of(target, tokens):
    """The target's last streams over ``tokens`` ``[T, hc, D]`` (what return_hidden gives the proposer)."""
    state = target.new_state(1, 8)
    batch = ForwardBatch.build([tokens], [0], [0], [list(range(8))], logits="all")
    last = target.config.num_hidden_layers - 1
    return target.forward(batch, state, capture_layers=[last]).hidden_states[last]


def sequence(target, s, tokens, first, computed, max_draft_len=4):
    """Sequence ``s`` after a step that computed positions ``[first, computed)``; its newest token ``tokens[computed]``."""
    hidden = hidden_of(target, tokens[:computed])[first:computed]
    return DraftSequence(f"r{s}", s, list(tokens[: computed + 1]), computed, first, hidden, 0, SamplingParams(),
                         max_draft_len)


def build(method, target, mtp_ckpt, k=4, **options):
    config = SpeculativeConfig(method, k, options)
    cls = DSparkProposer if method == "dspark" else MtpProposer
    proposer = cls(config, target, EngineContext("cpu", model_dir=mtp_ckpt))
    proposer.allocate(4)
    return proposer


def test_the_plugin_registers_mtp_and_dspark():
    registry = default_registry(get_plugin_manager())
    methods = registry.methods()
    assert methods["mtp"] == ()
    assert set(methods["dspark"]) == {"num_verify_tokens", "verify_fraction"}


def test_incremental_steps_draft_what_one_catch_up_drafts(target, mtp_ckpt):
    """Rows folded over two steps (a prompt, then 1 + accepted tokens) leave the draft where folding them at once
    does: the same next drafts."""
    a, b = build("mtp", target, mtp_ckpt), build("mtp", target, mtp_ckpt)
    tokens = TOKENS[0]
    first = a.propose(DraftBatch([sequence(target, 0, tokens, 0, 9)]))[0]
    assert len(first.token_ids) == 4 and first.draft_probs is None and len(first.confidences) == 4
    later = a.propose(DraftBatch([sequence(target, 0, tokens, 9, 12)]))[0]
    at_once = b.propose(DraftBatch([sequence(target, 0, tokens, 0, 12)]))[0]
    assert later.token_ids == at_once.token_ids
    assert later.confidences == pytest.approx(at_once.confidences, abs=1e-5)


def test_a_batch_drafts_what_each_sequence_drafts_alone(target, mtp_ckpt):
    both = build("mtp", target, mtp_ckpt).propose(DraftBatch(
        [sequence(target, 0, TOKENS[0], 0, 14), sequence(target, 1, TOKENS[1], 0, 8, max_draft_len=2)]))
    alone = [build("mtp", target, mtp_ckpt).propose(DraftBatch([seq]))[0] for seq in
             (sequence(target, 0, TOKENS[0], 0, 14), sequence(target, 1, TOKENS[1], 0, 8, max_draft_len=2))]
    assert [d.token_ids for d in both] == [d.token_ids for d in alone]
    assert len(both[1].token_ids) == 2  # max_draft_len caps a draft


def test_no_draft_when_the_engine_allows_none(target, mtp_ckpt):
    drafts = build("mtp", target, mtp_ckpt).propose(DraftBatch([sequence(target, 0, TOKENS[0], 0, 6, max_draft_len=0)]))
    assert drafts[0].token_ids == []


@pytest.mark.parametrize("budget", [0, 3, 5, 8])
def test_dspark_verifies_the_prefixes_its_budget_buys(target, mtp_ckpt, budget):
    seqs = lambda: [sequence(target, 0, TOKENS[0], 0, 14), sequence(target, 1, TOKENS[1], 0, 8)]
    fixed = build("mtp", target, mtp_ckpt).propose(DraftBatch(seqs()))
    scheduled = build("dspark", target, mtp_ckpt, num_verify_tokens=budget).propose(DraftBatch(seqs()))
    lengths = allocate_verification([d.confidences for d in fixed], budget)
    assert [len(d.token_ids) for d in scheduled] == lengths
    assert sum(lengths) == min(budget, 8)
    for full, cut in zip(fixed, scheduled, strict=True):
        assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
        assert cut.num_drafted == 4


def test_dspark_default_budget_is_a_fraction_of_the_drafts(target, mtp_ckpt):
    seqs = [sequence(target, 0, TOKENS[0], 0, 14), sequence(target, 1, TOKENS[1], 0, 8)]
    drafts = build("dspark", target, mtp_ckpt, verify_fraction=0.5).propose(DraftBatch(seqs))
    assert sum(len(d.token_ids) for d in drafts) == 4


@pytest.mark.parametrize(("options", "match"), [
    ({"num_verify_tokens": -1}, "num_verify_tokens must be an integer >= 0"),
    ({"verify_fraction": 0}, "verify_fraction must be a number in \\(0, 1\\]"),
    ({"verify_fraction": "half"}, "verify_fraction must be a number"),
])
def test_bad_dspark_options_are_refused(target, mtp_ckpt, options, match):
    with pytest.raises(DSparkError, match=match):
        build("dspark", target, mtp_ckpt, **options)


def test_a_checkpoint_without_draft_layers_is_refused(tmp_path):
    import v4_factory

    v4_factory.tiny_checkpoint(tmp_path, layer_types=v4_factory.MTP_TARGET_LAYERS)
    plain = load_deepseek_v4(tmp_path, OpTable())
    with pytest.raises(DSparkError, match="holds no MTP draft layers"):
        MtpProposer(SpeculativeConfig("mtp", 3), plain, EngineContext("cpu", model_dir=tmp_path))


def test_a_long_catch_up_folds_only_the_last_window_and_drafts_the_same(target, mtp_ckpt):
    """17 rows with window 8: the proposer folds the last 8; the drafts equal folding all 17, then and a step later."""
    proposer = build("mtp", target, mtp_ckpt)
    draft, tokens = proposer.draft, TOKENS[0]
    assert draft.config.sliding_window == 8
    hidden = hidden_of(target, tokens)
    full_state = draft.new_state(1)
    batch = ForwardBatch.build([tokens[1:15]], [0], [0], [[]])
    everything = draft.propose(batch, full_state, hidden[:14], 4)
    windowed = proposer.propose(DraftBatch([sequence(target, 0, tokens, 0, 14)]))[0]
    assert windowed.token_ids == everything.token_ids[0].tolist()
    assert windowed.confidences == pytest.approx(everything.confidence[0].tolist(), abs=1e-5)
    later = proposer.propose(DraftBatch([sequence(target, 0, tokens, 14, 17)]))[0]
    batch = ForwardBatch.build([tokens[15:18]], [14], [0], [[]])
    assert later.token_ids == draft.propose(batch, full_state, hidden[14:17], 4).token_ids[0].tolist()


def test_rows_below_a_prefix_hit_are_never_read_from_a_reused_slot(target, mtp_ckpt):
    """A sequence whose first computed position is 5 (a prefix hit) in a slot another request used before: its drafts,
    this step and the next, equal those from an empty slot (the rows below 5 are not read, speculative ones included)."""
    reused, fresh = build("mtp", target, mtp_ckpt), build("mtp", target, mtp_ckpt)
    reused.propose(DraftBatch([sequence(target, 0, TOKENS[1], 0, 10)]))
    reused.on_finish("r0")
    tokens = TOKENS[0]
    for first, end in ((5, 9), (9, 12)):
        a = reused.propose(DraftBatch([sequence(target, 0, tokens, first, end)]))[0]
        b = fresh.propose(DraftBatch([sequence(target, 0, tokens, first, end)]))[0]
        assert a.token_ids == b.token_ids
        assert a.confidences == pytest.approx(b.confidences, abs=1e-6)

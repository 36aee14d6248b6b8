"""Index mode (``DEEPINFER_SPARSE_CSA_ATTENTION=1``) without ``[S, Lq, E]`` entry masks (issue #38 point 2): with causal
compression every query row sees a prefix of the compressed entries, so the layout hands a CSA layer whose indexer
selects per-row visible counts ``[S, Lq]`` (``EntryLayout.counts``) and the indexer's top-k reads them
(``indexer_topk_index_counts``). The counts must stand for exactly the rows of the mask they replace, and the selection
from counts must be the mask-based selection bit for bit."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.models.deepseek_v4.layout import DecodeInputs, DecodeLayout, StaticShape, StepLayout
from deepinfer_core.ops import reference as ref
from deepinfer_core.ops.table import OpTable

WINDOW, BLOCK = 8, 16
RATIOS = (4, 8)


def _batch(rng: random.Random, chunks: list[int], prefixes: list[int]) -> ForwardBatch:
    """Sequences of ``prefixes[i]`` tokens in state and a chunk of ``chunks[i]`` new ones (a later prefill chunk)."""
    blocks = iter(rng.sample(range(1000), 1000))
    tables = [[next(blocks) for _ in range(-(-(ctx + n) // BLOCK))] for ctx, n in zip(prefixes, chunks, strict=True)]
    tokens = [[rng.randrange(2, 60) for _ in range(n)] for n in chunks]
    return ForwardBatch.build(tokens, prefixes, list(range(len(chunks))), tables)


@pytest.mark.parametrize("chunks,prefixes,context_len", [
    ([40], [0], None),  # a first chunk
    ([33, 9, 20], [64, 3, 0], None),  # later chunks beside a first one: padding rows, prefixes not multiples of 4
    ([24], [100], 256),  # a static chunk (shapes fixed by context_len): entries padded past the sequence's own
])
def test_layout_counts_are_the_entry_masks_rows(chunks, prefixes, context_len):
    """A counted ratio defers its mask; its counts are the mask's rows (``arange(E) < counts``, 0 for padding rows),
    and the mask it builds on demand is the one an uncounted layout builds."""
    batch = _batch(random.Random(len(chunks)), chunks, prefixes)
    args = (batch, WINDOW, BLOCK, torch.device("cpu"), ((4, 8), (8, 8)), RATIOS)
    masked = StepLayout(*args, context_len=context_len)
    counted = StepLayout(*args, context_len=context_len, counted_ratios=(4,))
    for ratio in RATIOS:
        spec, ours = masked.entries(ratio), counted.entries(ratio)
        assert spec.mask is not None and (ours.mask is None) == (ratio == 4)
        counts = ours.counts
        assert counts.dtype == torch.int32 and counts.shape == spec.visible.shape[:2]
        E = spec.blocks.shape[1]
        assert torch.equal(torch.arange(E) < counts[..., None].long(), spec.visible)
        assert torch.equal(counts, spec.counts)  # the mask's rows summed
        assert torch.equal(ours.visible, spec.visible)
    assert counted.entries(4).counts.max() > 0 and (counted.entries(4).counts[~counted.query_valid] == 0).all()


def test_decode_layout_counts_are_its_masks_rows():
    """A static decode step's entries (``DecodeLayout``: padded to ``context_len // ratio``) count what its mask
    shows."""
    ctxs = [5, 63, 0, 30]
    tables = [[i * 4 + j for j in range(4)] for i in range(4)]
    batch = ForwardBatch(input_ids=torch.zeros(4, dtype=torch.long), positions=torch.tensor(ctxs),
                         query_start=list(range(5)), context_lens=ctxs, slots=[0, 1, 2, 3], block_tables=tables,
                         logits_rows=torch.arange(4), compressed_write_start=[0] * 4, sliding_floor=[0] * 4)
    static = StaticShape(4, WINDOW, 64, 9, 40, ((4, 8),), (4,))
    decode = DecodeLayout(DecodeInputs.from_batch(batch, static, BLOCK), WINDOW, BLOCK, static)
    entries = decode.entries(4)
    assert entries.counts.tolist() == [[(c + 1) // 4] for c in ctxs]
    assert torch.equal(torch.arange(16) < entries.counts[..., None], entries.visible)


def _scores(gen: torch.Generator, S: int, Lq: int, E: int, levels: int) -> torch.Tensor:
    """Scores with ``levels`` distinct values (ties at the k-th key; 0: continuous), signed zeros, infinities."""
    scores = torch.randn(S, Lq, E, generator=gen)
    if levels:
        scores = torch.randint(0, levels, (S, Lq, E), generator=gen).float() - levels // 2
    special = torch.rand(S, Lq, E, generator=gen)
    scores = torch.where(special < 0.03, -0.0, scores)
    scores = torch.where((special >= 0.03) & (special < 0.035), float("-inf"), scores)
    return torch.where((special >= 0.035) & (special < 0.04), float("inf"), scores)


@pytest.mark.parametrize("S,Lq,E,levels,k", [
    (2, 7, 30, 3, 5),  # tiny
    (1, 24, 4096, 5, 512),  # ties everywhere: five score values over 4,096 entries
    (2, 9, 3000, 0, 512),  # continuous, rows from under k visible to every entry
    (1, 5, 1031, 2, 1030),  # k = E - 1
])
def test_counted_selection_equals_the_masked_selection(S, Lq, E, levels, k):
    """``indexer_topk_index_counts`` against ``indexer_topk_index`` of the mask the counts stand for, on rows that see
    nothing, fewer than ``k``, exactly ``k`` and all entries; and the op rebuilt over a backend's
    ``indexer_topk_index``."""
    gen = torch.Generator().manual_seed(E)
    scores = _scores(gen, S, Lq, E, levels)
    counts = torch.randint(0, E + 1, (S, Lq), generator=gen, dtype=torch.int32)
    counts[0, :4] = torch.tensor([0, min(k - 1, E), k, E], dtype=torch.int32)
    mask = torch.arange(E) < counts[..., None]
    want = ref.indexer_topk_index(scores, mask, k)
    got = ref.indexer_topk_index_counts(scores, counts, k)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert (got[0, 0] == -1).all() and got[0, 2].tolist() == list(range(k))  # nothing; k of k visible
    spied = []
    table = OpTable({"indexer_topk_index": lambda *a: spied.append(1) or ref.indexer_topk_index(*a)}, "spy")
    assert table.sources()["indexer_topk_index_counts"] == "spy (indexer_topk_index, composed)"
    assert torch.equal(table.indexer_topk_index_counts(scores, counts, k), want) and spied == [1]


def test_counted_selection_of_a_chunk_with_a_prefix_equals_the_masked_one():
    """A later prefill chunk's rows (a prefix in state, padding rows of a shorter sequence): the selection from the
    layout's counts is the one from its mask, slice by slice of query rows as ``Indexer.select`` slices them."""
    batch = _batch(random.Random(7), [300, 120], [2000, 900])
    layout = StepLayout(batch, WINDOW, BLOCK, torch.device("cpu"), ((4, 8),), (4,), counted_ratios=(4,))
    entries = layout.entries(4)
    gen = torch.Generator().manual_seed(1)
    E = entries.blocks.shape[1]
    scores = _scores(gen, 2, 300, E, 4)
    want = ref.indexer_topk_index(scores, entries.visible, 64)
    for rows in (300, 37):
        got = torch.cat([ref.indexer_topk_index_counts(scores[:, s:s + rows], entries.counts[:, s:s + rows], 64)
                         for s in range(0, 300, rows)], dim=1)
        assert torch.equal(got, want)


def test_index_mode_builds_no_csa_entry_mask(tmp_path, monkeypatch):
    """In index mode a CSA layer whose indexer selects reads the layout's counts: the ratio-4 mask is never built
    (prefill steps and decode steps, eager), and the counted op is what selects."""
    pytest.importorskip("transformers")
    from v4_factory import ALL_TYPES, tiny_checkpoint

    monkeypatch.setenv("DEEPINFER_SPARSE_CSA_ATTENTION", "1")
    tiny_checkpoint(tmp_path, layer_types=ALL_TYPES, index_topk=3)  # CSA ratio 4: the indexer selects past 12 tokens
    llm = LLM(str(tmp_path), max_model_len=256, max_num_seqs=2, block_size=8, enforce_eager=True)
    model = llm.model
    assert model.counted_ratios == (4,)
    layouts, calls = [], []
    step_layout = model.step_layout
    monkeypatch.setattr(model, "step_layout", lambda *a, **kw: layouts.append(step_layout(*a, **kw)) or layouts[-1])
    counted = model.ops.indexer_topk_index_counts
    model.ops.override("indexer_topk_index_counts", lambda s, c, k: calls.append(c.shape) or counted(s, c, k), "spy")
    prompts = [{"prompt_token_ids": [(5 * i + j) % 50 + 2 for i in range(n)]} for j, n in enumerate((70, 40))]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    selecting = [lay for lay in layouts if lay.entries(4).blocks.shape[1] > 3]
    assert selecting and calls and all(len(shape) == 2 for shape in calls)
    assert all(lay.entries(4).mask is None for lay in selecting)


def test_index_mode_padded_prefill_step_equals_eager(tmp_path, monkeypatch):
    """The padded static prefill step (what a captured prefill graph replays; its masks and counts built by
    ``build_masks`` from the placed index tensors) in index mode gives the eager index-mode run's tokens and
    logprobs."""
    pytest.importorskip("transformers")
    from v4_factory import ALL_TYPES, tiny_checkpoint

    monkeypatch.setenv("DEEPINFER_SPARSE_CSA_ATTENTION", "1")
    tiny_checkpoint(tmp_path, layer_types=ALL_TYPES, index_topk=3)
    prompts = [{"prompt_token_ids": [(3 * i + 1) % 50 + 2 for i in range(n)]} for n in (70, 100)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    common = {"max_model_len": 256, "max_num_seqs": 1, "block_size": 8}
    eager = LLM(str(tmp_path), enforce_eager=True, **common)
    static = LLM(str(tmp_path), cuda_graph_sizes=[1], prefill_graph_buckets=[128], **common)
    for prompt in prompts:
        want, got = (llm.generate([prompt], params, use_tqdm=False)[0].outputs[0] for llm in (eager, static))
        assert got.token_ids == want.token_ids
        for lp_got, lp_want in zip(got.logprobs, want.logprobs, strict=True):
            assert lp_got.keys() == lp_want.keys()
            assert max(abs(lp_got[k].logprob - lp_want[k].logprob) for k in lp_got) < 1e-4
    assert static.engine.runner.prefill_graphs.num_replays == len(prompts)

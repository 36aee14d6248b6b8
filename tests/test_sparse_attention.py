"""Top-k sparse CSA attention (``models/deepseek_v4/sparse_attention.py``, ``DEEPINFER_SPARSE_CSA_ATTENTION=1`` or
``gather``): each query row attends to its window keys and selected entries only (read in place by index, or
gathered), and must give what the dense masked path gives (the same visible keys; fp32 sums in another order), in
prefill chunks, eager decode and static decode steps."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine import decode_graphs
from deepinfer_core.errors import EnvironmentVariableError
from deepinfer_core.models.deepseek_v4.sparse_attention import key_index, row_key_indices, rows_per_slice, sparse_mode
from deepinfer_core.ops import reference as ref
from deepinfer_core.ops.table import OpTable


def test_sparse_mode_reads_the_variable():
    assert sparse_mode({}) == sparse_mode({"DEEPINFER_SPARSE_CSA_ATTENTION": ""}) == "index"  # the default
    assert [sparse_mode({"DEEPINFER_SPARSE_CSA_ATTENTION": v}) for v in ("0", "false", "1", "true", "Gather")] == [
        "dense", "dense", "index", "index", "gather"]
    with pytest.raises(EnvironmentVariableError, match="0 \\(dense\\), 1 .* or gather"):
        sparse_mode({"DEEPINFER_SPARSE_CSA_ATTENTION": "fast"})


def test_indexer_topk_index_lists_the_selection():
    """``indexer_topk_index`` is the selection's entries ascending, then -1: rows that select fewer than ``k`` (few
    visible entries) and none; a table whose ``indexer_topk`` is overridden composes it from that part."""
    gen = torch.Generator().manual_seed(6)
    scores = torch.randint(-3, 4, (2, 5, 300), generator=gen).float()  # many ties
    visible = torch.rand(2, 5, 300, generator=gen) < 0.5
    visible[0, 0] = False
    visible[0, 1] = False
    visible[0, 1, :5] = True
    got = ref.indexer_topk_index(scores, visible, 64)
    assert got.shape == (2, 5, 64) and got.dtype == torch.int32
    assert torch.equal(got, ref.visible_index(ref.indexer_topk(scores, visible, 64), 64))
    assert (got[0, 0] == -1).all() and got[0, 1, :5].tolist() == [0, 1, 2, 3, 4] and (got[0, 1, 5:] == -1).all()
    table = OpTable({"indexer_topk": ref.indexer_topk}, "spy")
    assert table.sources()["indexer_topk_index"] == "spy (indexer_topk, composed)"
    assert torch.equal(table.indexer_topk_index(scores, visible, 64), got)


def test_visible_index_lists_the_first_visible_places_ascending():
    gen = torch.Generator().manual_seed(0)
    visible = torch.rand(2, 5, 40, generator=gen) < 0.3
    visible[0, 0] = False
    for count in (3, 40, 50):
        got = ref.visible_index(visible, count)
        assert got.shape == (2, 5, count) and got.dtype == torch.int32
        for s in range(2):
            for t in range(5):
                want = visible[s, t].nonzero().flatten().tolist()[:count]
                assert got[s, t].tolist() == want + [-1] * (count - len(want))


def _window_and_selection(gen, S, Lq, Lk, E, W, k, density=0.6):
    """A causal sliding window ``[S, Lq, Lk]`` (row t sees keys t .. t + W - 1) and an indexer selection ``[S, Lq,
    E]`` of at most ``k`` entries among a random visible set."""
    window = torch.zeros(S, Lq, Lk, dtype=torch.bool)
    for t in range(Lq):
        window[:, t, t:t + W] = True
    scores = torch.randn(S, Lq, E, generator=gen)
    return window, ref.indexer_topk(scores, torch.rand(S, Lq, E, generator=gen) < density, k)


@pytest.mark.parametrize("S,Lq,Lk,E,H,d,W,k,budget", [
    (2, 9, 12, 30, 4, 32, 4, 5, 1 << 26),
    (2, 9, 12, 30, 4, 32, 4, 5, 100),  # one query row a slice
    (1, 24, 151, 3000, 2, 64, 128, 512, 1 << 26),  # long: thousands of entries, V4's window and top-k
])
def test_sparse_sink_attention_equals_the_masked_attention(S, Lq, Lk, E, H, d, W, k, budget, monkeypatch):
    """``sparse_sink_attention`` over each row's listed keys (``key_index``: window, then selected entries, -1 past
    them; a row with nothing listed) against ``sink_attention`` over every key under the mask."""
    monkeypatch.setattr(ref, "SPARSE_SLICE_KEYS", budget)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(S, Lq, H, d, generator=gen)
    keys = torch.randn(S, Lk + E, d, generator=gen)
    window, selected = _window_and_selection(gen, S, Lq, Lk, E, W, k)
    window[0, 0] = False
    selected[0, 0] = False  # row (0, 0) lists nothing: 0
    index = key_index(OpTable(), window, ref.visible_index(selected, k), W)
    assert index.shape == (S, Lq, min(W, Lk) + min(k, E)) and (index[0, 0] == -1).all()
    sinks = torch.randn(H, generator=gen)
    got = ref.sparse_sink_attention(q, keys, index, sinks, d**-0.5)
    want = ref.sink_attention(q, keys, torch.cat([window, selected], -1), sinks, d**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got[0, 0].abs().max() == 0


def test_roped_sparse_attention_equals_the_roped_masked_attention():
    """The derived op (query norm and RoPE, the attention, the output rotated back) against ``roped_sink_attention``,
    through the model's ``indexed_roped_attention`` over the indexer's selection as indices (``indexer_topk_index``);
    a table whose ``sparse_sink_attention`` is overridden rebuilds it from that part."""
    from deepinfer_core.models.deepseek_v4.sparse_attention import indexed_roped_attention

    gen = torch.Generator().manual_seed(3)
    S, Lq, Lk, E, H, d, W, k = 2, 7, 10, 40, 4, 32, 4, 6
    q = torch.randn(S, Lq, H, d, generator=gen)
    keys = torch.randn(S, Lk + E, d, generator=gen)
    window, _ = _window_and_selection(gen, S, Lq, Lk, E, W, k)
    scores, entry_visible = torch.randn(S, Lq, E, generator=gen), torch.rand(S, Lq, E, generator=gen) < 0.5
    selected = ref.indexer_topk(scores, entry_visible, k)
    cos, sin = torch.randn(S, Lq, 4, generator=gen), torch.randn(S, Lq, 4, generator=gen)
    sinks = torch.randn(H, generator=gen)
    calls = []
    table = OpTable({"sparse_sink_attention": lambda *a: calls.append(1) or ref.sparse_sink_attention(*a)}, "spy")
    got = indexed_roped_attention(table, q, keys, window, table.indexer_topk_index(scores, entry_visible, k), W, sinks,
                                  d**-0.5, 1e-6, cos, sin)
    want = ref.roped_sink_attention(q, keys, torch.cat([window, selected], -1), sinks, d**-0.5, 1e-6, cos, sin)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert calls and table.sources()["roped_sparse_sink_attention"].startswith("spy")


def test_row_key_indices_list_every_visible_key_ascending():
    gen = torch.Generator().manual_seed(0)
    visible = torch.rand(2, 5, 40, generator=gen) < 0.2
    visible[0, 0] = False  # nothing visible
    index, valid = row_key_indices(visible, 20)
    assert index.shape == (2, 5, 20) and valid.sum(-1).tolist() == visible.sum(-1).tolist()
    for s in range(2):
        for t in range(5):
            assert index[s, t][valid[s, t]].tolist() == visible[s, t].nonzero().flatten().tolist()
    assert row_key_indices(visible, 100)[0].shape == (2, 5, 40)


def test_rows_per_slice_keep_the_budget():
    assert rows_per_slice(1, 16384, 640, 1024, 1 << 30) == 1638
    assert rows_per_slice(2, 10, 640, 1024, 1) == 1
    assert rows_per_slice(1, 10, 8, 4, 1 << 30) == 10


@pytest.mark.parametrize("budget", [1 << 30, 3000])  # one slice; one query row a slice (2 x 9 keys x 128 B)
def test_gathered_rows_equal_the_masked_attention(budget, monkeypatch):
    """The op level: per-row gathered keys against ``roped_sink_attention`` over every key under the mask."""
    from deepinfer_core.models.deepseek_v4 import sparse_attention
    from deepinfer_core.models.deepseek_v4.sparse_attention import sparse_roped_attention

    monkeypatch.setattr(sparse_attention, "GATHER_BYTES", budget)

    gen = torch.Generator().manual_seed(1)
    S, Lq, Lk, E, H, d, W, k = 2, 9, 12, 30, 4, 32, 4, 5
    q = torch.randn(S, Lq, H, d, generator=gen)
    keys = torch.randn(S, Lk + E, d, generator=gen)
    window = torch.zeros(S, Lq, Lk, dtype=torch.bool)
    for t in range(Lq):
        window[:, t, t:t + W] = True
    scores = torch.randn(S, Lq, E, generator=gen)
    selected = ref.indexer_topk(scores, torch.rand(S, Lq, E, generator=gen) < 0.6, k)
    cos, sin = torch.randn(S, Lq, 4, generator=gen), torch.randn(S, Lq, 4, generator=gen)
    sinks = torch.randn(H, generator=gen)
    got = sparse_roped_attention(OpTable(), q, keys, window, selected, W, k, sinks, d**-0.5, 1e-6, cos, sin)
    want = ref.roped_sink_attention(q, keys, torch.cat([window, selected], -1), sinks, d**-0.5, 1e-6, cos, sin)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _run(folder, prompts, params, shapes, **kwargs):
    """Outputs and the engine; ``shapes`` collects the query shapes of every attention call (the sparse op's as
    ``("index", S, Lq, whether it read the entries from the store)``)."""
    llm = LLM(str(folder), max_model_len=256, max_num_seqs=4, block_size=8, **kwargs)
    for name in ("roped_sink_attention", "roped_sparse_sink_attention"):
        attend = llm.model.ops.__getattr__(name)
        tag = ("index",) if "sparse" in name else ()
        llm.model.ops.override(
            name, lambda q, *a, attend=attend, tag=tag: shapes.append(
                tag + tuple(q.shape[:2]) + ((len(a) > 7 and a[7] is not None,) if tag else ())) or attend(q, *a),
            "spy")
    return llm.generate(prompts, params, use_tqdm=False), llm


@pytest.mark.parametrize("mode", ["1", "gather"])
def test_sparse_model_equals_dense(tmp_path, monkeypatch, mode):
    pytest.importorskip("transformers")
    from v4_factory import ALL_TYPES, tiny_checkpoint

    monkeypatch.setattr(decode_graphs, "MIN_CONTEXT_BUCKET", 16)
    tiny_checkpoint(tmp_path, layer_types=ALL_TYPES * 2, index_topk=3)  # CSA ratio 4: sparse beyond 12 tokens
    prompts = [{"prompt_token_ids": [(7 * i + j) % 60 + 2 for i in range(n)]} for j, n in enumerate((90, 61, 20))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    monkeypatch.setenv("DEEPINFER_SPARSE_CSA_ATTENTION", "0")
    dense_shapes = []
    dense, _ = _run(tmp_path, prompts, params, dense_shapes, enforce_eager=True)
    assert all(len(shape) == 2 and shape[0] <= 3 for shape in dense_shapes)  # whole sequences under a mask
    monkeypatch.setenv("DEEPINFER_SPARSE_CSA_ATTENTION", mode)
    for kwargs in ({"enforce_eager": True}, {"cuda_graph_sizes": [1, 2, 4]}):
        shapes = []
        sparse, llm = _run(tmp_path, prompts, params, shapes, **kwargs)
        if mode == "gather":
            assert any(shape[0] > 90 and shape[1] == 1 for shape in shapes)  # the prefill step's rows, one query each
        else:
            assert any(shape[0] == "index" and shape[2] >= 90 for shape in shapes)  # the prefill step, read by index
            assert all(shape[3] for shape in shapes if shape[0] == "index")  # the entries from the store
            assert not any(len(shape) == 2 and shape[1] == 1 and shape[0] > 4 for shape in shapes)
        if "cuda_graph_sizes" in kwargs:
            assert llm.engine.runner.decode_graphs.num_replays > 0
        for a, b in zip(dense, sparse, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            pairs = [(x, y) for x, y in zip(a.prompt_logprobs, b.prompt_logprobs, strict=True) if x is not None]
            pairs += list(zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True))
            for x, y in pairs:
                assert x.keys() == y.keys()
                assert max(abs(x[t].logprob - y[t].logprob) for t in x) < 1e-4


def paged(entries: torch.Tensor, per_block: int, gen: torch.Generator):
    """``entries [S, E, d]`` in a paged store ``[blocks, per_block, d]`` at shuffled blocks: ``(store, blocks [S, E],
    rows [S, E])`` with ``store[blocks, rows] == entries``."""
    S, E, d = entries.shape
    per_seq = -(-E // per_block)
    order = torch.randperm(S * per_seq + 3, generator=gen)[:S * per_seq].view(S, per_seq)  # [S, blocks a sequence]
    store = torch.randn(S * per_seq + 3, per_block, d, generator=gen)
    ids = torch.arange(E)
    blocks, rows = order[:, ids // per_block], (ids % per_block).expand(S, -1)
    store[blocks, rows] = entries
    return store, blocks, rows


def test_sparse_sink_attention_reads_entries_from_a_paged_store():
    """The entries where they lie (a paged store and its places, as ``gather_keys`` reads them) give what the keys
    with the entries gathered behind the window give."""
    gen = torch.Generator().manual_seed(5)
    S, Lq, Lk, E, H, d, W, k = 2, 6, 10, 700, 4, 32, 4, 64
    q = torch.randn(S, Lq, H, d, generator=gen)
    keys = torch.randn(S, Lk + E, d, generator=gen)
    window, selected = _window_and_selection(gen, S, Lq, Lk, E, W, k)
    index = key_index(OpTable(), window, ref.visible_index(selected, k), W)
    sinks = torch.randn(H, generator=gen)
    store, blocks, rows = paged(keys[:, Lk:], 16, gen)
    got = ref.sparse_sink_attention(q, keys[:, :Lk], index, sinks, d**-0.5, store, blocks, rows)
    torch.testing.assert_close(got, ref.sparse_sink_attention(q, keys, index, sinks, d**-0.5), atol=1e-6, rtol=1e-6)


def test_rows_sparse_attention_equals_the_op():
    """``rows_sparse_attention`` (the op made of a ``sink_attention`` over each row's gathered keys: the
    batch-invariant mode builds it from its own) gives what ``sparse_sink_attention`` gives, store or not."""
    gen = torch.Generator().manual_seed(7)
    S, Lq, Lk, E, H, d, W, k = 2, 5, 9, 200, 4, 16, 4, 20
    q = torch.randn(S, Lq, H, d, generator=gen)
    keys = torch.randn(S, Lk + E, d, generator=gen)
    window, selected = _window_and_selection(gen, S, Lq, Lk, E, W, k)
    selected[1, 2] = False
    window[1, 2] = False  # a row listing nothing
    index = key_index(OpTable(), window, ref.visible_index(selected, k), W)
    sinks = torch.randn(H, generator=gen)
    by_rows = ref.rows_sparse_attention(ref.sink_attention)
    want = ref.sparse_sink_attention(q, keys, index, sinks, 0.25)
    torch.testing.assert_close(by_rows(q, keys, index, sinks, 0.25), want, atol=1e-6, rtol=1e-6)
    store, blocks, rows = paged(keys[:, Lk:], 8, gen)
    torch.testing.assert_close(by_rows(q, keys[:, :Lk], index, sinks, 0.25, store, blocks, rows), want, atol=1e-6,
                               rtol=1e-6)

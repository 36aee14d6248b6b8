"""Top-k sparse CSA attention (``models/deepseek_v4/sparse_attention.py``, ``DEEPINFER_SPARSE_CSA_ATTENTION=1``): each
query row attends to its gathered window keys and selected entries only, and must give what the dense masked path
gives (the same visible keys; fp32 sums in another order), in prefill chunks, eager decode and static decode steps."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine import decode_graphs
from deepinfer_core.models.deepseek_v4.sparse_attention import row_key_indices, rows_per_slice
from deepinfer_core.ops import reference as ref


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
    from deepinfer_core.ops.table import OpTable

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
    """Outputs and the engine; ``shapes`` collects the query shapes of every attention call."""
    llm = LLM(str(folder), max_model_len=256, max_num_seqs=4, block_size=8, **kwargs)
    attend = llm.model.ops.roped_sink_attention
    llm.model.ops.override("roped_sink_attention",
                           lambda q, *a, attend=attend: shapes.append(tuple(q.shape[:2])) or attend(q, *a), "spy")
    return llm.generate(prompts, params, use_tqdm=False), llm


def test_sparse_model_equals_dense(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from v4_factory import ALL_TYPES, tiny_checkpoint

    monkeypatch.setattr(decode_graphs, "MIN_CONTEXT_BUCKET", 16)
    tiny_checkpoint(tmp_path, layer_types=ALL_TYPES * 2, index_topk=3)  # CSA ratio 4: sparse beyond 12 tokens
    prompts = [{"prompt_token_ids": [(7 * i + j) % 60 + 2 for i in range(n)]} for j, n in enumerate((90, 61, 20))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    monkeypatch.delenv("DEEPINFER_SPARSE_CSA_ATTENTION", raising=False)
    dense_shapes = []
    dense, _ = _run(tmp_path, prompts, params, dense_shapes, enforce_eager=True)
    assert all(rows <= 3 for rows, _ in dense_shapes)  # whole sequences under a mask
    monkeypatch.setenv("DEEPINFER_SPARSE_CSA_ATTENTION", "1")
    for kwargs in ({"enforce_eager": True}, {"cuda_graph_sizes": [1, 2, 4]}):
        shapes = []
        sparse, llm = _run(tmp_path, prompts, params, shapes, **kwargs)
        assert any(rows > 90 and n == 1 for rows, n in shapes)  # the prefill step's rows, one query each
        if "cuda_graph_sizes" in kwargs:
            assert llm.engine.runner.decode_graphs.num_replays > 0
        for a, b in zip(dense, sparse, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            pairs = [(x, y) for x, y in zip(a.prompt_logprobs, b.prompt_logprobs, strict=True) if x is not None]
            pairs += list(zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True))
            for x, y in pairs:
                assert x.keys() == y.keys()
                assert max(abs(x[t].logprob - y[t].logprob) for t in x) < 1e-4

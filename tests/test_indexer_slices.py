"""The lightning indexer scores and selects in query slices bounded by ``DEEPINFER_INDEXER_CHUNK_ENTRIES``
(``Indexer.select``, issue #38 point 1): a long prefill chunk at long context must not hold ``[S, Lq, E]`` fp32 scores
and the top-k's temporaries at once. Slicing is over query rows only and every op is row-wise, so a sliced run gives
the same bits as an unsliced one."""

from __future__ import annotations

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.models.deepseek_v4.model import query_slice_rows


def test_query_slice_rows_keep_the_budget_and_take_at_least_one_row():
    assert query_slice_rows(1, 16384, 262144, 1 << 28) == 1024  # a 16K chunk at 1M context: 16 slices
    assert query_slice_rows(1, 16384, 2048, 1 << 28) == 16384  # 8K context: one call
    assert query_slice_rows(2, 100, 50, 1000) == 10
    assert query_slice_rows(4, 100, 10**9, 1) == 1
    assert query_slice_rows(1, 3, 5, 0) == 1


def _run(folder, prompts, params, calls):
    llm = LLM(str(folder), max_model_len=256, max_num_seqs=4, block_size=8, enforce_eager=True)
    score = llm.model.ops.indexer_scores
    llm.model.ops.override("indexer_scores", lambda *a, score=score: calls.append(a[0].shape[1]) or score(*a),
                           "test spy")
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


@pytest.mark.parametrize("sparse", ["0", "1"])  # the selection as a mask; as indices (indexer_topk_index)
def test_sliced_selection_gives_the_same_bits_as_one_call(tmp_path, monkeypatch, sparse):
    pytest.importorskip("transformers")
    from v4_factory import ALL_TYPES, tiny_checkpoint

    monkeypatch.setenv("DEEPINFER_SPARSE_CSA_ATTENTION", sparse)

    tiny_checkpoint(tmp_path, layer_types=ALL_TYPES * 2, index_topk=3)  # CSA ratio 4: sparse beyond 12 tokens
    prompts = [{"prompt_token_ids": [(7 * i + j) % 60 + 2 for i in range(n)]} for j, n in enumerate((90, 61, 20))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    whole, sliced = [], []
    monkeypatch.delenv("DEEPINFER_INDEXER_CHUNK_ENTRIES", raising=False)
    expected = _run(tmp_path, prompts, params, whole)
    monkeypatch.setenv("DEEPINFER_INDEXER_CHUNK_ENTRIES", "100")  # 3 x 90 tokens see 22 entries: 1 row per slice
    got = _run(tmp_path, prompts, params, sliced)
    assert max(whole) > 20 and max(sliced) == 1 and len(sliced) > 10 * len(whole)
    assert all(prompt is not None and sampled for prompt, _, sampled in expected)
    assert got == expected

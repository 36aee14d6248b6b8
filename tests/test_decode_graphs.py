"""The static-shape decode path (what CUDA graphs replay) against the dynamic path, on CPU.

On CPU ``capture_graph`` captures nothing, so ``cuda_graph_sizes`` runs the very same static-shape step
eagerly: padded batch sizes, keys padded to the window, entries to the context bucket, dummy windows
writing the spare block. Results must equal the dynamic path's up to summation order.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine import decode_graphs
from deepinfer_core.static_buffers import StaticBuffers

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Foo:\n    def", "# a program\nprint(",
           {"prompt_token_ids": [(7 * i) % 4000 + 50 for i in range(120)]}]  # 120 + 24 crosses the 128 bucket


def _both_paths(prompts, params, sizes, generate=None, **llm_kwargs):
    """The same requests through an engine without static decode steps and one with them (``sizes``):
    (dynamic outputs, the static engine, its outputs). ``generate(llm)`` replaces one ``llm.generate`` call."""
    llm_kwargs = {"max_model_len": 400, "max_num_seqs": 8, **llm_kwargs}
    generate = generate or (lambda llm: llm.generate(prompts, params, use_tqdm=False))
    static_llm = LLM(cuda_graph_sizes=sizes, **llm_kwargs)
    return generate(LLM(**llm_kwargs)), static_llm, generate(static_llm)


def _assert_same_greedy(dynamic, static) -> None:
    assert [o.outputs[0].token_ids for o in static] == [o.outputs[0].token_ids for o in dynamic]
    assert _max_logprob_diff(dynamic, static) < 1e-4


def _max_logprob_diff(a, b) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        for la, lb in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            worst = max(worst, *(abs(la[k].logprob - lb[k].logprob) for k in la))
    return worst


@pytest.fixture(scope="module")
def greedy_pair(monkeypatch_module):
    # a small first bucket (the tiny model's block multiple, 128) so decoding crosses into a second one
    monkeypatch_module.setattr(decode_graphs, "MIN_CONTEXT_BUCKET", 16)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    dynamic, llm, static = _both_paths(PROMPTS, params, [1, 2, 4, 8])
    return llm, dynamic, static


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_static_decode_equals_dynamic_greedy(greedy_pair):
    llm, dynamic, static = greedy_pair
    graphs = llm.engine.runner.decode_graphs
    assert graphs.num_replays >= 23  # every decode step took the static path
    sizes = {size for size, _ in graphs.captured}
    contexts = {context for _, context in graphs.captured}
    assert sizes == {8}  # 5 sequences pad to 8
    assert len(contexts) >= 2, f"decoding should cross a context bucket, captured {sorted(graphs.captured)}"
    _assert_same_greedy(dynamic, static)


def test_spare_state_is_beyond_what_the_state_manager_hands_out(greedy_pair):
    llm = greedy_pair[0]
    graphs = llm.engine.runner.decode_graphs
    manager = llm.engine.state_manager
    state = llm.engine.runner.state
    assert graphs.spare_slot == state.num_slots - 1 == llm.engine.config.max_num_seqs
    assert graphs.spare_block == state.num_blocks - 1 == manager.num_blocks


def test_static_decode_with_prefix_hits_and_batch_growth():
    """Requests of one shared prefix (prefix-cache hits with a replay) decode in static steps of
    different padded sizes (1, then 4) and match the dynamic path."""
    prefix = "def add(a, b):\n    return a + b\n\n" * 24  # > 2 blocks of 128 tokens
    prompts = [prefix + "def sub", prefix + "def mul", prefix + "def div"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    dynamic, llm, static = _both_paths(
        prompts, params, [1, 4], max_model_len=600, max_num_seqs=4,
        generate=lambda llm: llm.generate(prompts[:1], params, use_tqdm=False) + llm.generate(
            prompts[1:], params, use_tqdm=False))
    assert llm.engine.state_manager.hits > 0
    graphs = llm.engine.runner.decode_graphs
    assert {size for size, _ in graphs.captured} == {1, 4}
    _assert_same_greedy(dynamic, static)


def test_seeded_sampling_and_prompt_logprobs_mix_with_static_steps():
    """A request with prompt logprobs forces its steps eager; seeded sampling gives the same tokens."""
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=7, prompt_logprobs=1)
    dynamic, llm, static = _both_paths(PROMPTS[:2], params, [2])
    assert llm.engine.runner.decode_graphs.num_replays >= 8
    assert [o.outputs[0].token_ids for o in static] == [o.outputs[0].token_ids for o in dynamic]


def test_enforce_eager_and_bad_sizes():
    assert LLM(enforce_eager=True, cuda_graph_sizes=[1]).engine.runner.decode_graphs is None
    assert LLM().engine.runner.decode_graphs is None  # CPU: no graphs unless sizes are given
    with pytest.raises(ValueError, match="cuda_graph_sizes must be positive integers"):
        LLM(cuda_graph_sizes=[0, 2])


def test_static_buffers_keep_their_storage_and_refuse_a_changed_shape():
    buffers = StaticBuffers(torch.device("cpu"))
    sized = [buffers.place(torch.arange(3)), buffers.place(torch.tensor([True, False]))]  # sizing build
    assert [t.tolist() for t in sized] == [[0, 1, 2], [True, False]]
    buffers.seal()
    builds = []
    for step in range(2):
        buffers.rewind()
        builds.append([buffers.place(torch.arange(3) + step), buffers.place(torch.tensor([step == 1, True]))])
        buffers.upload()
        assert builds[-1][0].tolist() == [step, step + 1, step + 2]
        assert builds[-1][1].tolist() == [step == 1, True]
    assert all(a is b for a, b in zip(*builds, strict=True))  # the same tensors every step
    buffers.rewind()
    with pytest.raises(RuntimeError, match="static layout tensor 0 changed"):
        buffers.place(torch.arange(5))
    buffers.rewind()
    buffers.place(torch.arange(3))
    buffers.place(torch.tensor([True, True]))
    with pytest.raises(RuntimeError, match="more tensors than the 2 it was sealed with"):
        buffers.place(torch.arange(3))


def test_context_bucket_is_a_power_of_two_within_max_model_len():
    llm = LLM(max_model_len=1000, cuda_graph_sizes=[1])
    graphs = llm.engine.runner.decode_graphs
    multiple = llm.model.config.block_multiple
    assert graphs.context_bucket(1) == max(decode_graphs.MIN_CONTEXT_BUCKET, multiple)
    assert graphs.context_bucket(257) == 512
    assert graphs.context_bucket(999) == -(-1000 // multiple) * multiple
    assert all(graphs.context_bucket(n) >= n for n in (1, 255, 256, 513, 1000))


def test_long_context_buckets_pad_by_at_most_a_quarter():
    """Beyond ``FINE_CONTEXT_FROM`` a bucket is 1, 1.25, 1.5 or 1.75 times a power of two: a 128K context decodes in
    a 160K bucket, not 256K; up to it, powers of two."""
    bucket = decode_graphs.context_bucket
    assert bucket(131072, 128, 1 << 20) == 131072 and bucket(131073, 128, 1 << 20) == 163840
    assert bucket(200000, 128, 1 << 20) == 229376 and bucket(8193, 128, 1 << 20) == 10240
    assert bucket(5000, 128, 1 << 20) == 8192 and bucket(131073, 128, 140032) == 140032
    for n in range(decode_graphs.FINE_CONTEXT_FROM + 1, 1 << 20, 997):
        b = bucket(n, 128, 1 << 21)
        assert n <= b <= 1.25 * n + 128 and b % 128 == 0


def test_decodes_replay_beside_an_eager_prefill_in_one_step():
    """A long prompt prefilled in chunks while short ones decode: each such step runs the decodes in the static
    graph path and the prompt chunk eagerly; results equal the all-dynamic run."""
    prompts = PROMPTS[:3] + [{"prompt_token_ids": [(11 * i) % 4000 + 60 for i in range(300)]}]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    dynamic, llm, mixed = _both_paths(prompts, params, [1, 2, 4], max_num_seqs=4, max_num_batched_tokens=40,
                                      enable_mixed_chunk=True)
    assert llm.engine.runner.num_mixed_steps >= 3
    _assert_same_greedy(dynamic, mixed)


@pytest.mark.parametrize("layer_types", [
    ["sliding_attention", "sliding_attention"],  # no compressor: the static shape has no windows or entries
    ["compressed_sparse_attention", "compressed_sparse_attention"],
    ["heavily_compressed_attention", "sliding_attention", "compressed_sparse_attention"],
])
def test_static_decode_equals_dynamic_for_each_layer_mix(tmp_path, layer_types):
    """Tiny random checkpoints (CSA ratio 4, HCA 8, window 8, block 8): decode crosses many compressor windows
    and context buckets; the static path equals the dynamic one."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from v4_factory import tiny_checkpoint

    tiny_checkpoint(tmp_path, seed=1, layer_types=layer_types, hc_mult=2)
    prompts = [{"prompt_token_ids": [(5 * i + s) % 60 + 2 for i in range(n)]} for s, n in ((0, 3), (1, 17), (2, 9))]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2)
    dynamic, llm, static = _both_paths(prompts, params, [1, 2, 4], model=str(tmp_path), block_size=8,
                                       max_model_len=64, max_num_seqs=4)
    graphs = llm.engine.runner.decode_graphs
    assert graphs.num_replays >= 29 and len({context for _, context in graphs.captured}) >= 1
    _assert_same_greedy(dynamic, static)


def test_n_samples_and_stop_strings_through_the_static_path():
    """n > 1 completions (their slots copied from the prompt's) and per-request stops decode in static steps
    whose batch shrinks as requests finish: the same as the dynamic path."""
    params = [SamplingParams(temperature=0.7, seed=3, n=3, max_tokens=20, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=25, stop=["\n\n"], logprobs=1)]
    dynamic, llm, static = _both_paths(PROMPTS[:2], params, [1, 2, 4, 8])
    assert llm.engine.runner.decode_graphs.num_replays > 10
    for a, b in zip(dynamic, static, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert [c.finish_reason for c in a.outputs] == [c.finish_reason for c in b.outputs]


def test_every_captured_step_writes_one_shared_logits_buffer():
    """Captured graphs keep no logits of their own (a graph's outputs stay allocated in its memory pool): what
    a replay returns is a view of the engine's single ``[largest size, vocab]`` buffer, whatever the size."""
    llm = LLM(max_model_len=400, max_num_seqs=4, cuda_graph_sizes=[1, 2, 4])
    graphs = llm.engine.runner.decode_graphs
    assert graphs.logits.shape == (4, llm.model.config.vocab_size)
    returned = []
    run = graphs.run
    graphs.run = lambda chunks, fill=None: returned.append(run(chunks, fill)) or returned[-1]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 6, 9)]
    llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert {size for size, _ in graphs.captured} == {1, 2, 4}
    assert {t.shape[0] for t in returned} == {1, 2, 3}
    assert all(t.data_ptr() == graphs.logits.data_ptr() for t in returned)


def test_sparse_indexer_selection_through_the_static_path(tmp_path, monkeypatch_module):
    """``index_topk`` below the entries a sequence has: the indexer scores and selects (below that it is skipped,
    every visible entry being selected), in the dynamic and in the padded static layout alike."""
    pytest.importorskip("transformers")
    from v4_factory import ALL_TYPES, tiny_checkpoint

    monkeypatch_module.setattr(decode_graphs, "MIN_CONTEXT_BUCKET", 16)
    folder = tmp_path / "sparse"
    tiny_checkpoint(folder, layer_types=ALL_TYPES * 2, index_topk=3)  # CSA ratio 4: sparse beyond 12 tokens
    prompts = [{"prompt_token_ids": [(5 * i + j) % 60 + 2 for i in range(n)]} for j, n in enumerate((30, 45, 9))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    scored = []
    outputs = []
    for sizes in (None, [1, 2, 4]):
        llm = LLM(str(folder), max_model_len=128, max_num_seqs=4, block_size=8, cuda_graph_sizes=sizes)
        score = llm.model.ops.indexer_scores
        llm.model.ops.override("indexer_scores", lambda *a, score=score: scored.append(a[1].shape[1]) or score(*a),
                               "test spy")
        outputs.append(llm.generate(prompts, params, use_tqdm=False))
    assert max(scored) > 3 and llm.engine.runner.decode_graphs.num_replays >= 10
    _assert_same_greedy(*outputs)

"""The padded static prefill step (what a captured prefill graph replays) against the eager prefill, on CPU.

On CPU ``capture_graph`` captures nothing, so ``prefill_graph_buckets`` runs the very same padded step eagerly: the
prompt padded to its bucket, only the prompt's tokens writing the ring and the carries, the padding's compressor
windows writing the spare block. Tokens and state must equal the eager prefill's up to summation order.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams

BUCKETS = [256, 512]
LENGTHS = [130, 256, 301]  # just past the shortest a bucket takes (128), a bucket's exact size, the next bucket


def _prompt(length: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(length + seed)
    return torch.randint(50, 4000, (length,), generator=gen).tolist()


def _llm(**kwargs) -> LLM:
    """Prompts are not split before their last token (``prefix_state_split_min_tokens=0``), so a prompt sent again
    is a hit whose exact replay (the padded step at an offset) these tests check."""
    return LLM(max_model_len=600, max_num_seqs=2, kv_cache_memory_bytes=64 << 20, prefix_state_split_min_tokens=0,
               **kwargs)


@pytest.fixture(scope="module")
def engines():
    return _llm(), _llm(cuda_graph_sizes=[1, 2], prefill_graph_buckets=BUCKETS)


def _prefilled(llm: LLM, ids: list[int], name: str):
    """Add one request and run its prefill step alone; returns the request (still running)."""
    engine = llm.engine
    engine.add_request(name, None, ids, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()
    return engine.groups[name][0]


def _finish(llm: LLM) -> None:
    while llm.engine.has_unfinished():
        llm.engine.step()


@pytest.mark.parametrize("length", LENGTHS)
def test_padded_prefill_writes_the_eager_prefills_state(engines, length):
    """After the prefill step the request's ring, carries and compressed stores (its blocks) equal the eager
    step's: the padding wrote none of them."""
    eager, static = engines
    replays = static.engine.runner.prefill_graphs.num_replays
    ids = _prompt(length)
    a, b = _prefilled(eager, ids, f"state-{length}"), _prefilled(static, ids, f"state-{length}")
    assert static.engine.runner.prefill_graphs.num_replays == replays + 1
    sa, sb = eager.engine.runner.state, static.engine.runner.state
    tol = {"atol": 1e-5, "rtol": 1e-4}
    for layer in sa.swa:
        torch.testing.assert_close(sb.swa[layer][b.slot], sa.swa[layer][a.slot], **tol)
    for pools_a, pools_b in ((sa.compressed, sb.compressed), (sa.index_keys, sb.index_keys)):
        for layer in pools_a:
            torch.testing.assert_close(pools_b[layer][b.block_ids], pools_a[layer][a.block_ids], **tol)
    for carry_a, carry_b in ((sa.carry, sb.carry), (sa.index_carry, sb.index_carry)):
        for layer in carry_a:
            torch.testing.assert_close(carry_b[layer].rows[b.slot], carry_a[layer].rows[a.slot], **tol)
    _finish(eager)
    _finish(static)


def test_padded_prefill_then_decode_equals_eager(engines):
    """Greedy tokens and logprobs of lone prompts prefilled through the padded step equal the eager engine's; the
    same prompt again (a prefix-cache hit, whose exact replay reaches back to token 0 here) takes the padded step too;
    a prompt asking for prompt logprobs runs eagerly."""
    eager, static = engines
    graphs = static.engine.runner.prefill_graphs
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    for length in LENGTHS:
        replays = graphs.num_replays
        prompt = {"prompt_token_ids": _prompt(length, seed=1)}
        want, got = (llm.generate([prompt], params, use_tqdm=False)[0].outputs[0] for llm in (eager, static))
        assert graphs.num_replays == replays + 1
        assert got.token_ids == want.token_ids
        for lp_got, lp_want in zip(got.logprobs, want.logprobs, strict=True):
            assert lp_got.keys() == lp_want.keys()
            assert max(abs(lp_got[k].logprob - lp_want[k].logprob) for k in lp_got) < 1e-4
        replays = graphs.num_replays
        again = static.generate([prompt], params, use_tqdm=False)[0]  # a prefix hit when the prompt has a full block
        assert graphs.num_replays == replays + 1
        assert again.outputs[0].token_ids == want.token_ids
        static.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        assert graphs.num_replays == replays + 1


def test_prefill_graphs_take_lone_prompts_in_their_buckets(engines):
    _, static = engines
    graphs = static.engine.runner.prefill_graphs
    assert graphs.min_tokens == 128 and graphs.buckets == BUCKETS
    replays = graphs.num_replays
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for ids in (_prompt(100), _prompt(513)):  # shorter than the ring, longer than the largest bucket
        static.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    static.generate([{"prompt_token_ids": _prompt(200, seed=s)} for s in (5, 6)], params, use_tqdm=False)  # two
    assert graphs.num_replays == replays


@pytest.mark.parametrize("buckets", [[0], [256, -1], ["512"]])
def test_bad_prefill_buckets_are_refused(buckets):
    with pytest.raises(ValueError, match="prefill_graph_buckets"):
        _llm(cuda_graph_sizes=[1], prefill_graph_buckets=buckets)


def test_a_failed_capture_prefills_eagerly_from_then_on(caplog):
    """A capture that fails (an op synchronising with the host, say) is logged once with its reason; that prompt and
    every later one are prefilled eagerly, with the eager engine's tokens."""
    llm = _llm(cuda_graph_sizes=[1], prefill_graph_buckets=BUCKETS)
    graphs = llm.engine.runner.prefill_graphs

    def failing(step_fn, example_inputs):
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs.capture = failing
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": _prompt(length, seed=9)} for length in (200, 300)]
    with caplog.at_level("WARNING", logger="deepinfer"):
        got = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    want = [out.outputs[0].token_ids for out in _llm().generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert graphs.num_replays == 0 and not graphs.captured
    assert "prefill graph of 256 tokens: capture failed: operation not permitted" in graphs.disabled_reason
    assert sum("capture failed" in r.getMessage() for r in caplog.records) == 1


LONG = 1000  # the embedded model's exact replay span is 768 tokens: a hit at 896 replays from token 128


@pytest.fixture(scope="module")
def long_engines():
    kwargs = {"max_model_len": 1024, "max_num_seqs": 2, "kv_cache_memory_bytes": 64 << 20, "dtype": "float32",
              "prefix_state_split_min_tokens": 0}
    return (LLM(enable_prefix_caching=False, **kwargs), LLM(**kwargs),
            LLM(cuda_graph_sizes=[1, 2], prefill_graph_buckets=[256, 1024], **kwargs))


def test_a_prefix_hits_replay_takes_the_padded_step_at_an_offset(long_engines):
    """The replay that rebuilds the window after a hit starts past token 0, writes no compressed entry below the
    hit and reads no key below its start: it runs the padded static step (``num_offset_replays``), and its tokens and
    logprobs equal the eager engine's after the same hit and a cold run's (fp32)."""
    cold, eager, static = long_engines
    graphs = static.engine.runner.prefill_graphs
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompt = {"prompt_token_ids": _prompt(LONG, seed=7)}
    want = cold.generate([prompt], params, use_tqdm=False)[0]
    eager.generate([prompt], params, use_tqdm=False)
    static.generate([prompt], params, use_tqdm=False)
    offset, replays = graphs.num_offset_replays, graphs.num_replays
    admitted = []
    static.engine.runner.prefill_graphs.bucket = _spy(graphs.bucket, admitted)
    hits = [llm.generate([prompt], params, use_tqdm=False)[0] for llm in (eager, static)]
    assert (graphs.num_offset_replays, graphs.num_replays) == (offset + 1, replays + 1)
    (start, replay_until, floor, key), = admitted
    assert (start, replay_until, floor, key) == (896 - 768, 896, 128, (1024, 2048))
    for got in hits:
        assert got.num_cached_tokens == 896
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for lp_got, lp_want in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
            assert lp_got.keys() == lp_want.keys()
            assert max(abs(lp_got[k].logprob - lp_want[k].logprob) for k in lp_got) < 1e-4


def _spy(bucket, into: list):
    """``PrefillGraphs.bucket`` that also records (start, replay_until, sliding_floor, key) of the lone chunks past
    token 0 it takes."""

    def recorded(chunks):
        key = bucket(chunks)
        if key is not None and chunks[0].start > 0:
            request = chunks[0].request
            into.append((chunks[0].start, request.replay_until, request.sliding_floor, key))
        return key

    return recorded


def test_a_replay_chunk_writes_the_eager_replays_state(long_engines):
    """After a hit's padded replay step the request's ring, carries and its own blocks equal the eager replay's, and
    the cached blocks below the hit are untouched (the windows before ``replay_until`` wrote the spare block)."""
    _, eager, static = long_engines
    ids = _prompt(LONG, seed=8)
    for llm in (eager, static):
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
    state = static.engine.runner.state
    cached = [b for b in range(static.engine.state_manager.num_blocks) if b in static.engine.state_manager.block_hash]
    before = {layer: store[cached].clone() for layer, store in state.compressed.items()}
    offset = static.engine.runner.prefill_graphs.num_offset_replays
    a, b = _prefilled(eager, ids, "replay-state"), _prefilled(static, ids, "replay-state")
    assert static.engine.runner.prefill_graphs.num_offset_replays == offset + 1
    sa, sb = eager.engine.runner.state, state
    tol = {"atol": 1e-5, "rtol": 1e-4}
    for layer in sa.swa:
        torch.testing.assert_close(sb.swa[layer][b.slot], sa.swa[layer][a.slot], **tol)
    for carry_a, carry_b in ((sa.carry, sb.carry), (sa.index_carry, sb.index_carry)):
        for layer in carry_a:
            torch.testing.assert_close(carry_b[layer].rows[b.slot], carry_a[layer].rows[a.slot], **tol)
    for pools_a, pools_b in ((sa.compressed, sb.compressed), (sa.index_keys, sb.index_keys)):
        for layer in pools_a:
            torch.testing.assert_close(pools_b[layer][b.block_ids[7:]], pools_a[layer][a.block_ids[7:]], **tol)
    for layer, store in state.compressed.items():
        assert torch.equal(store[cached], before[layer])
    _finish(eager)
    _finish(static)

"""Offline engine on CPU: exact against HF transformers through chunking, prefix hits and preemption."""

from __future__ import annotations

import pytest
import torch
from v4_factory import ALL_TYPES, tiny_checkpoint

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.detokenizer import SequenceDetokenizer
from deepinfer_core.engine.stop import check_stop

pytest.importorskip("transformers")

VOCAB = 64


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("engine") / "ckpt"
    hf = tiny_checkpoint(folder, layer_types=ALL_TYPES * 2, hc_mult=2)
    return folder, hf


def _llm(folder, **kwargs) -> LLM:
    kwargs.setdefault("block_size", 8)
    kwargs.setdefault("max_num_seqs", 8)
    return LLM(str(folder), **kwargs)


def _prompts(lengths, seed=0, prefix=()):
    gen = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _hf_greedy(hf, prompt, max_tokens):
    """HF greedy continuation and the log-probability of each chosen token (fp32)."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                      pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)


def _check_against_hf(hf, prompts, outputs, max_tokens=10):
    for prompt, output in zip(prompts, outputs):
        tokens, logprobs = _hf_greedy(hf, prompt, max_tokens)
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        ours = [completion.logprobs[i][t].logprob for i, t in enumerate(tokens)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(logprobs), atol=1e-4, rtol=0)


def test_greedy_tokens_and_logprobs_match_hf_with_chunked_prefill(ckpt):
    folder, hf = ckpt
    prompts = _prompts([5, 21, 37, 12])
    llm = _llm(folder, max_num_batched_tokens=16)  # prompts are split into several chunks
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    _check_against_hf(hf, prompts, outputs)
    assert llm.engine.num_steps > 10 + 37 // 16


def test_prefix_cache_hits_replay_the_window_exactly(ckpt):
    folder, hf = ckpt
    llm = _llm(folder)
    span = llm.model.prefix_replay_span()
    shared = _prompts([span + 40], seed=3)[0]
    first = llm.generate({"prompt_token_ids": shared + [7, 8, 9]}, GREEDY, use_tqdm=False)
    prompts = [shared + tail for tail in _prompts([3, 11, 1], seed=4)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    hit_requests = [r for r in llm.engine.scheduler.running] or None
    assert hit_requests is None  # all finished
    assert llm.engine.state_manager.hits >= 3
    _check_against_hf(hf, [shared + [7, 8, 9]] + prompts, first + outputs)


def test_prefix_hit_replays_from_a_nonzero_start(ckpt):
    """The hit is long enough that replay starts after token 0 (the exact-rebuild path, not a recompute)."""
    folder, hf = ckpt
    llm = _llm(folder)
    span = llm.model.prefix_replay_span()
    prompt = _prompts([span + 60], seed=5)[0]
    llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    starts = []
    original = llm.engine.scheduler._admit

    def spy(request, budget, chunks):
        chunk = original(request, budget, chunks)
        if chunk is not None:
            starts.append((chunk.start, request.num_cached_tokens))
        return chunk

    llm.engine.scheduler._admit = spy
    again = llm.generate({"prompt_token_ids": prompt + [5]}, GREEDY, use_tqdm=False)
    (start, cached), = starts
    assert cached > span and start == cached - span > 0
    _check_against_hf(hf, [prompt + [5]], again)


def test_preemption_under_tiny_budget_still_exact(ckpt):
    folder, hf = ckpt
    probe = _llm(folder)
    from deepinfer_core.models.deepseek_v4.state import DeepseekV4State

    per_block = DeepseekV4State.bytes_per_block(probe.model.config, 8, torch.float32)
    per_slot = DeepseekV4State.bytes_per_slot(probe.model.config, 8, torch.float32)
    budget = 4 * per_slot + 10 * per_block  # 4 sequences want 4 x 6 blocks
    llm = _llm(folder, max_num_seqs=4, kv_cache_memory_bytes=budget)
    prompts = _prompts([30, 33, 29, 31], seed=6)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    _check_against_hf(hf, prompts, outputs, max_tokens=14)
    llm.engine.state_manager.check_invariants([])


def test_batched_equals_one_by_one(ckpt):
    folder, _ = ckpt
    prompts = _prompts([4, 19, 9, 26, 13], seed=8)
    params = [SamplingParams(temperature=t, top_p=0.9, seed=s, max_tokens=8, ignore_eos=True, logprobs=2)
              for t, s in ((0, None), (0.8, 1), (1.2, 2), (0.7, 3), (1.0, 4))]
    batched = _llm(folder).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, p, together in zip(prompts, params, batched):
        alone = _llm(folder).generate({"prompt_token_ids": prompt}, p, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == together.outputs[0].token_ids
        for a, b in zip(alone.outputs[0].logprobs, together.outputs[0].logprobs):
            assert a.keys() == b.keys()
            for token in a:
                assert abs(a[token].logprob - b[token].logprob) < 1e-4


def test_outputs_in_input_order_with_n_samples_and_seeds(ckpt):
    folder, _ = ckpt
    llm = _llm(folder)
    prompts = _prompts([30, 3, 12], seed=9)
    params = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    for output in outputs:
        assert [c.index for c in output.outputs] == [0, 1, 2]
        assert len({tuple(c.token_ids) for c in output.outputs}) > 1  # distinct samples
    again = _llm(folder).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[c.token_ids for c in o.outputs] for o in again]


def test_prompt_logprobs_match_hf(ckpt):
    folder, hf = ckpt
    prompt = _prompts([23], seed=10)[0]
    llm = _llm(folder, max_num_batched_tokens=8)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    plp = out[0].prompt_logprobs
    assert plp[0] is None and len(plp) == len(prompt)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    for i in range(1, len(prompt)):
        assert abs(plp[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item()) < 1e-4


def test_text_prompts_stop_strings_and_chat(ckpt):
    folder, _ = ckpt
    llm = _llm(folder)
    out = llm.generate("w5 w6 w7", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    text = out.outputs[0].text
    assert out.prompt == "w5 w6 w7" and text.split() and all(w.startswith("w") for w in text.split())
    stop_word = text.split()[2]
    stopped = llm.generate("w5 w6 w7", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                      stop=[stop_word]), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_word
    assert stop_word not in stopped.text and text.startswith(stopped.text)
    chat = llm.chat([{"role": "user", "content": "w9 w10"}], SamplingParams(temperature=0, max_tokens=3),
                    use_tqdm=False)[0]
    assert chat.prompt_token_ids == llm.get_tokenizer().encode("w2 w9 w10 w3", add_special_tokens=False)
    assert len(chat.outputs[0].token_ids) <= 3


def test_text_decoded_while_the_next_step_runs_and_whole_at_finish(ckpt):
    """A running request's last token is decoded during the next step (after it is launched, before its tokens
    are read); every finished output has the whole text of its tokens."""
    folder, _ = ckpt
    llm = _llm(folder)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(_prompts([5, 9, 3])):
        engine.add_request(f"r{i}", None, prompt, params)
    events = []
    processor = engine.output_processor
    launch, collect, catch_up = engine.runner.launch, engine.runner.collect, processor.catch_up_text
    engine.runner.launch = lambda *args: events.append("launch") or launch(*args)
    engine.runner.collect = lambda launched: events.append("collect") or collect(launched)
    processor.catch_up_text = lambda: events.append(len(processor._deferred_text)) or catch_up()
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
        running = [r for rs in engine.groups.values() for r in rs if not r.is_finished]
        assert all(processor.completions[r.request_id].detokenizer.has_deferred_text
                   for r in running if r.output_token_ids)
    assert max(e for e in events if isinstance(e, int)) == 3 and not processor._deferred_text
    assert len(events) % 3 == 0 and events[0::3] == ["launch"] * (len(events) // 3)
    assert events[2::3] == ["collect"] * (len(events) // 3)  # every catch-up between a launch and its read
    for out in outputs:
        completion = out.outputs[0]
        token_by_token = SequenceDetokenizer(engine.tokenizer, params, out.prompt_token_ids)
        for n, token in enumerate(completion.token_ids, 1):
            stop = check_stop(params, len(out.prompt_token_ids), completion.token_ids[:n], engine.eos_token_id,
                              llm.max_model_len)
            token_by_token.append(token, stop)
        assert len(completion.token_ids) == 6 and token_by_token.finish_reason == completion.finish_reason
        assert completion.text == token_by_token.text and completion.text.strip()


def test_long_prompt_refused_alone_batch_mates_complete(ckpt):
    folder, _ = ckpt
    llm = _llm(folder, max_model_len=40)
    prompts = [{"prompt_token_ids": p} for p in _prompts([10, 41, 0, 5], seed=11)]
    prompts[2] = {"prompt_token_ids": [3, 999]}
    outputs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert "41 tokens" in outputs[1].error and "max_model_len=40" in outputs[1].error
    assert "999" in outputs[2].error
    for i in (0, 3):
        assert outputs[i].error is None and len(outputs[i].outputs[0].token_ids) == 4
    assert outputs[1].outputs == []


def test_generation_stops_at_max_model_len(ckpt):
    folder, _ = ckpt
    out = _llm(folder, max_model_len=20).generate({"prompt_token_ids": _prompts([15])[0]},
                                                  SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5 and out[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("kwargs,message", [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"dtype": "float8"}, "unknown dtype"),
    ({"kv_cache_memory_bytes": 10}, "kv_cache_memory_bytes"),
    ({"no_such_feature": True}, "no_such_feature"),
    ({"backend": "no_such_backend"}, "no_such_backend"),
])
def test_bad_engine_arguments(ckpt, kwargs, message):
    folder, _ = ckpt
    with pytest.raises(Exception, match=message):
        _llm(folder, **kwargs)


def test_sampling_params_count_must_match(ckpt):
    folder, _ = ckpt
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        _llm(folder).generate(["w2", "w3", "w4"], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_prefix_hit_replay_longer_than_the_step_budget(ckpt):
    """The replay after a hit is itself chunked; chunks ending below the hit complete no window."""
    folder, hf = ckpt
    llm = _llm(folder, max_num_batched_tokens=16)
    prompt = _prompts([llm.model.prefix_replay_span() + 30], seed=12)[0]
    first = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    again = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    assert llm.engine.state_manager.hits == 1
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids
    _check_against_hf(hf, [prompt], again)


def test_prompt_logprobs_survive_preemption(ckpt):
    folder, _ = ckpt
    from deepinfer_core.models.deepseek_v4.state import DeepseekV4State

    config = _llm(folder).model.config
    budget = 4 * DeepseekV4State.bytes_per_slot(config, 8, torch.float32) + 10 * DeepseekV4State.bytes_per_block(
        config, 8, torch.float32)
    prompts = [{"prompt_token_ids": p} for p in _prompts([30, 33, 29, 31], seed=13)]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, prompt_logprobs=1)
    tight = _llm(folder, max_num_seqs=4, kv_cache_memory_bytes=budget, max_num_batched_tokens=16)
    squeezed = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    roomy = _llm(folder).generate(prompts, params, use_tqdm=False)
    for a, b in zip(squeezed, roomy):
        assert len(a.prompt_logprobs) == len(a.prompt_token_ids)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)


def test_vllm_constructor_arguments_are_accepted(ckpt, tmp_path):
    folder, _ = ckpt
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, tmp_path / name)
    llm = _llm(folder, gpu_memory_utilization=0.5, tensor_parallel_size=1, enforce_eager=True,
               trust_remote_code=True, tokenizer=str(tmp_path))
    out = llm.generate("w5 w6", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        _llm(folder, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        _llm(folder, gpu_memory_utilization=1.5)


def test_token_budget_defaults_to_the_backends_and_an_explicit_one_wins(ckpt, monkeypatch):
    """``max_num_batched_tokens`` unset: the backend's ``default_max_num_batched_tokens`` (a GPU backend prefills in
    longer steps than the CPU); given, it is used as is; zero or negative is refused by name."""
    from deepinfer_core.backends.cpu import CpuBackend

    folder, _ = ckpt
    assert _llm(folder).engine.scheduler.max_num_batched_tokens == CpuBackend.default_max_num_batched_tokens == 2048
    monkeypatch.setattr(CpuBackend, "default_max_num_batched_tokens", 24)
    llm = _llm(folder)
    assert llm.max_num_batched_tokens == llm.engine.scheduler.max_num_batched_tokens == 24
    out = llm.generate([{"prompt_token_ids": _prompts([40])[0]}], SamplingParams(max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2  # the 40-token prompt prefilled in 24-token chunks, not refused
    assert _llm(folder, max_num_batched_tokens=16).engine.scheduler.max_num_batched_tokens == 16
    with pytest.raises(ValueError, match="max_num_batched_tokens must be a positive integer"):
        _llm(folder, max_num_batched_tokens=0)

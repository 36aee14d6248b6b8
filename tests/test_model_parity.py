"""The engine's DeepSeek-V4 forward matches HF transformers 5.23 (fp32, CPU) per position to 1e-4."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from v4_factory import ALL_TYPES, tiny_hf_model

from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.models.deepseek_v4.loader import load_deepseek_v4
from deepinfer_core.ops.table import OpTable

pytest.importorskip("transformers")

TOL = 1e-4
BLOCK = 8


def _engine(folder):
    return load_deepseek_v4(folder, OpTable(), dtype=torch.float32)


def _tables(num_seqs: int, blocks_each: int = 16):
    return [[s * blocks_each + b for b in range(blocks_each)] for s in range(num_seqs)]


def _hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def _prompts(lengths, seed=1, vocab=64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _run_chunked(model, tokens, chunks, slot=0, table=None, state=None):
    """Prefill ``tokens`` in the given chunk sizes, then decode the rest one token per step."""
    state = state or model.new_state(num_slots=2, num_blocks=32, block_size=BLOCK)
    table = table or _tables(1)[0]
    pos, out = 0, []
    for size in chunks:
        batch = ForwardBatch.build([tokens[pos:pos + size]], [pos], [slot], [table], logits="all")
        out.append(model.forward(batch, state).logits)
        pos += size
    while pos < len(tokens):
        batch = ForwardBatch.build([[tokens[pos]]], [pos], [slot], [table], logits="all")
        out.append(model.forward(batch, state).logits)
        pos += 1
    return torch.cat(out)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v4") / "ckpt"
    hf = tiny_hf_model(folder, layer_types=ALL_TYPES * 2, hc_mult=2)
    return folder, hf, _engine(folder)


def test_batch_of_different_lengths_matches_hf(checkpoint):
    _, hf, model = checkpoint
    prompts = _prompts([5, 23, 40, 1, 17])
    state = model.new_state(num_slots=len(prompts), num_blocks=128, block_size=BLOCK)
    batch = ForwardBatch.build(prompts, [0] * len(prompts), list(range(len(prompts))), _tables(len(prompts)),
                               logits="all")
    logits = model.forward(batch, state).logits
    offset = 0
    for tokens in prompts:
        ref = _hf_logits(hf, tokens)
        torch.testing.assert_close(logits[offset:offset + len(tokens)], ref, atol=TOL, rtol=0)
        offset += len(tokens)


@pytest.mark.parametrize("chunks", [[3, 7, 9], [1, 1, 16], [8, 8], [33], [12, 5, 4, 2]])
def test_chunked_prefill_then_decode_matches_hf(checkpoint, chunks):
    _, hf, model = checkpoint
    tokens = _prompts([45], seed=sum(chunks))[0]
    torch.testing.assert_close(_run_chunked(model, tokens, chunks), _hf_logits(hf, tokens), atol=TOL, rtol=0)


def test_mixed_prefill_and_decode_in_one_step(checkpoint):
    """Sequences at different points (decode, mid-prefill, fresh) share one step and stay exact."""
    _, hf, model = checkpoint
    prompts = _prompts([30, 26, 19], seed=7)
    state = model.new_state(num_slots=3, num_blocks=64, block_size=BLOCK)
    tables = _tables(3)
    done = [0, 0, 0]
    schedule = [[20, 9, 0], [1, 9, 11], [1, 8, 8], [8, 0, 0]]  # tokens per sequence per step
    outputs: list[list[torch.Tensor]] = [[], [], []]
    for step in schedule:
        active = [s for s in range(3) if step[s]]
        batch = ForwardBatch.build([prompts[s][done[s]:done[s] + step[s]] for s in active], [done[s] for s in active],
                                   active, [tables[s] for s in active], logits="all")
        logits = model.forward(batch, state).logits
        for i, s in enumerate(active):
            start = batch.query_start[i]
            outputs[s].append(logits[start:start + step[s]])
            done[s] += step[s]
    for s in range(3):
        got = torch.cat(outputs[s])
        torch.testing.assert_close(got, _hf_logits(hf, prompts[s][:done[s]]), atol=TOL, rtol=0)


@pytest.mark.parametrize("hc_mult", [1, 2, 4])
@pytest.mark.parametrize("layer_types,num_hash", [
    (["sliding_attention"] * 2, 1),
    (["compressed_sparse_attention"] * 2, 2),
    (["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"], 2),
])
def test_layer_types_hash_layers_and_hc_mult(tmp_path, hc_mult, layer_types, num_hash):
    hf = tiny_hf_model(tmp_path / "ckpt", seed=hc_mult, layer_types=layer_types, hc_mult=hc_mult,
                       num_hash_layers=num_hash)
    model = _engine(tmp_path / "ckpt")
    tokens = _prompts([37], seed=hc_mult)[0]
    torch.testing.assert_close(_run_chunked(model, tokens, [13, 6]), _hf_logits(hf, tokens), atol=TOL, rtol=0)


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_prefix_logits_do_not_change_when_tokens_follow(checkpoint, data):
    _, _, model = checkpoint
    total = data.draw(st.integers(2, 48), label="total")
    prefix = data.draw(st.integers(1, total - 1), label="prefix")
    tokens = data.draw(st.lists(st.integers(0, 63), min_size=total, max_size=total), label="tokens")
    state = model.new_state(num_slots=2, num_blocks=32, block_size=BLOCK)
    tables = _tables(2)
    batch = ForwardBatch.build([tokens[:prefix], tokens], [0, 0], [0, 1], tables, logits="all")
    logits = model.forward(batch, state).logits
    # fp32 sums over the two sequences' different key counts differ in the last bits (1.07e-5 on logits of up to 4.2
    # for total 43, prefix 42); a token that leaked into an earlier position would move them by far more
    torch.testing.assert_close(logits[:prefix], logits[prefix:2 * prefix], atol=1e-4, rtol=0)


def test_bf16_error_no_larger_than_hf_bf16(checkpoint):
    """bf16 weights and activations: our error vs the fp32 reference stays within HF bf16's own error."""
    from transformers import DeepseekV4ForCausalLM

    folder, hf, _ = checkpoint
    tokens = _prompts([24], seed=3)[0]
    ref = _hf_logits(hf, tokens)
    hf_bf16 = DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    hf_error = (_hf_logits(hf_bf16, tokens).float() - ref).abs().amax(-1).median()
    ours = _run_chunked(load_deepseek_v4(folder, OpTable(), dtype=torch.bfloat16), tokens, [24])
    assert ours.dtype == torch.float32  # logits are returned in fp32
    # Median over positions: isolated positions flip an expert choice in bf16 (HF's too, elsewhere).
    assert (ours - ref).abs().amax(-1).median() <= 2 * hf_error + 0.02

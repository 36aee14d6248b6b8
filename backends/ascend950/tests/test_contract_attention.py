"""CONTRACT tests (CPU, not hardware): sink_attention through npu_fused_infer_attention_score_v2.

torch_npu is replaced by ``contract_reference``: the op's documented semantics (masked scaled softmax,
softmax_lse, the all-masked-row correction) in plain torch, with undefined outputs filled with NaN / inf.
These tests check the adapter's layout, mask convention, head grouping and the sink correction
(out * sigmoid(lse - sink)) against ``deepinfer_core.ops.reference.sink_attention``.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.ops import reference


def _inputs(seqs, q_len, heads, dim, kv_len, dtype, seed=0, visible=None):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(seqs, q_len, heads, dim, generator=gen).to(dtype)
    kv = torch.randn(seqs, kv_len, dim, generator=gen).to(dtype)
    if visible is None:
        visible = torch.rand(seqs, q_len, kv_len, generator=gen) < 0.6
    sinks = torch.randn(heads, generator=gen) * 2  # fp32, as the model keeps them
    return q, kv, visible, sinks, dim**-0.5


def _check(npu_ops, q, kv, visible, sinks, scale):
    got = npu_ops.sink_attention(q, kv, visible, sinks, scale)
    assert got.dtype == q.dtype and got.shape == q.shape
    # The op computes in fp32 inside; compare with the reference on the same inputs in fp32.
    want = reference.sink_attention(q.float(), kv.float(), visible, sinks, scale)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    return got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_contract_prefill_random_visibility(npu_ops, dtype):
    _check(npu_ops, *_inputs(seqs=2, q_len=5, heads=4, dim=32, kv_len=11, dtype=dtype))


def test_contract_decode_step_with_a_row_that_sees_nothing(npu_ops):
    q, kv, visible, sinks, scale = _inputs(seqs=3, q_len=1, heads=4, dim=32, kv_len=9, dtype=torch.bfloat16)
    visible[1] = False  # the stand-in returns NaN for such rows (undefined by the docs at Q_S == 1)
    got = _check(npu_ops, q, kv, visible, sinks, scale)
    assert torch.equal(got[1], torch.zeros_like(got[1]))


def test_contract_sliding_window_plus_compressed_entries_layout(npu_ops):
    """The model's layout: window keys then compressed entries, concatenated, with one visibility mask."""
    window, ratio, q_len, start = 4, 4, 6, 10  # queries at positions 10..15
    positions = torch.arange(start, start + q_len)
    window_keys = torch.arange(start - window + 1, start + q_len)  # ring contents, oldest first
    window_visible = (window_keys[None] <= positions[:, None]) & (window_keys[None] > positions[:, None] - window)
    entries = (start + q_len) // ratio  # one entry per complete group of `ratio` tokens
    entry_end = (torch.arange(entries) + 1) * ratio
    entry_visible = entry_end[None] <= positions[:, None] + 1
    visible = torch.cat([window_visible, entry_visible], dim=-1)[None]  # [1, Lq, window + entries]
    q, kv, _, sinks, scale = _inputs(1, q_len, 4, 32, visible.shape[-1], torch.bfloat16, visible=visible)
    _check(npu_ops, q, kv, visible, sinks, scale)


def test_contract_more_heads_than_one_fia_call_allows(npu_ops, stand_in, monkeypatch):
    """FIA allows num_query_heads / num_key_value_heads <= 64; V4 has one KV head, so heads go in groups."""
    groups = []
    original = stand_in.npu_fused_infer_attention_score_v2

    def spy(query, key, value, **kwargs):
        groups.append(kwargs["num_query_heads"])
        return original(query, key, value, **kwargs)

    monkeypatch.setattr(stand_in, "npu_fused_infer_attention_score_v2", spy)
    _check(npu_ops, *_inputs(seqs=1, q_len=3, heads=72, dim=16, kv_len=5, dtype=torch.bfloat16))
    assert groups == [64, 8]


def test_contract_sinks_are_applied_after_the_op(npu_ops):
    """Large sinks soak up most of the mass; the result still matches the reference."""
    q, kv, visible, _, scale = _inputs(seqs=1, q_len=4, heads=4, dim=32, kv_len=6, dtype=torch.bfloat16)
    _check(npu_ops, q, kv, visible, torch.tensor([-5.0, 0.0, 3.0, 8.0]), scale)


def test_contract_fp32_takes_the_reference_path(npu_ops, stand_in, monkeypatch):
    """The op documents fp16 / bf16 queries only."""
    monkeypatch.setattr(stand_in, "npu_fused_infer_attention_score_v2", lambda *a, **k: pytest.fail("fp32 reached FIA"))
    q, kv, visible, sinks, scale = _inputs(seqs=1, q_len=3, heads=4, dim=32, kv_len=5, dtype=torch.float32)
    assert torch.equal(npu_ops.sink_attention(q, kv, visible, sinks, scale),
                       reference.sink_attention(q, kv, visible, sinks, scale))


def test_contract_empty_key_axis_returns_zeros(npu_ops):
    q, kv, visible, sinks, scale = _inputs(seqs=1, q_len=2, heads=4, dim=32, kv_len=0, dtype=torch.bfloat16)
    got = npu_ops.sink_attention(q, kv, visible, sinks, scale)
    assert torch.equal(got, torch.zeros_like(q))
    torch.testing.assert_close(got, reference.sink_attention(q, kv, visible, sinks, scale))

"""The roofline's attention, indexer and compressor terms (``bench/roofline.py``) against hand-computed counts."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.bench import presets, roofline
from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config

PEAK = roofline.KNOWN_PEAKS["H200"]


def _model_bytes(name: str, dtype: torch.dtype) -> roofline.ModelBytes:
    return roofline.model_bytes(DeepseekV4Config.from_dict(presets.get_preset(name).config_dict()), dtype)


@pytest.fixture(scope="module")
def tiny() -> roofline.AttentionShape:
    """layers [sliding, CSA, HCA, CSA]; 4 heads x 64, window 128, ratios 4 / 128, indexer 4 x 32, top-256; fp32."""
    return _model_bytes("tiny", torch.float32).attention


@pytest.fixture(scope="module")
def flash() -> roofline.ModelBytes:
    return _model_bytes("v4-flash-8l64e", torch.bfloat16)


def test_query_flops_by_layer_type_match_hand_counts(tiny):
    per_key = 4 * 4 * 64  # scores and values: 2 x heads x head_dim each
    # context 1000: window 128; CSA sees 250 entries, selects all 250 (< top-256); HCA sees 7
    assert tiny.query_flops(1000) == {
        "sliding": 1 * per_key * 128,
        "csa": 2 * per_key * (128 + 250),
        "hca": 1 * per_key * (128 + 7),
        "indexer": 2 * (2 * 4 * 32 + 2 * 4) * 250,  # 2 CSA layers x (4 heads x 32 dims + the head weights) x 250
        "compressor": 2 * 4 * (64 + 32) + 1 * 2 * 64,  # CSA: overlapping windows of 8 rows per 4 tokens; HCA: 1
    }
    # context 2000: CSA selects 256 of 500; the indexer still scores all 500
    at_2k = tiny.query_flops(2000)
    assert at_2k["csa"] == 2 * per_key * (128 + 256) and at_2k["indexer"] == 2 * 264 * 500
    assert at_2k["hca"] == per_key * (128 + 15)
    assert tiny.query_flops(50)["sliding"] == per_key * 50  # the window is not full yet


def test_decode_state_bytes_by_layer_type_match_hand_counts(tiny):
    # fp32; CSA carry 8 rows x 384 (kv + gate of attention 2x64 and indexer 2x32 wide) = 12,288 B, HCA 128 x 128
    csa_carry = 12288 / 8 + 12288 / 4  # the row written, plus the 8 rows pooled every 4 steps
    hca_carry = 65536 / 128 + 65536 / 128
    assert tiny.state_bytes(1000) == {
        "sliding": 128 * 64 * 4,
        "csa": 2 * ((128 * 64 + 250 * 64 + 250 * 32) * 4 + csa_carry),  # window, selected entries, indexer keys
        "hca": (128 * 64 + 7 * 64) * 4 + hca_carry,
    }
    # past top-k x ratio the CSA entries read stop growing; the indexer keys do not
    grow = tiny.state_bytes(4000)["csa"] - tiny.state_bytes(2000)["csa"]
    assert grow == 2 * (500 * 32 * 4)


def test_prefill_flops_are_the_sum_of_the_queries(tiny):
    for end, start in ((1, 0), (127, 0), (1500, 0), (1500, 700), (2048, 1024), (5000, 4999)):
        brute = sum(sum(tiny.query_flops(context).values()) for context in range(start + 1, end + 1))
        assert tiny.prefill_flops(end, start) == brute


def test_floors_grow_with_context_as_the_formulas_say(flash):
    a = flash.attention
    # past 2048 tokens the CSA attention is 512 + 128 keys per query: constant; the indexer is linear
    assert a.query_flops(8192)["csa"] == a.query_flops(1 << 20)["csa"] == 3 * 4 * 64 * 512 * (128 + 512)
    assert a.query_flops(1 << 20)["indexer"] == 128 * a.query_flops(8192)["indexer"]
    decode = [roofline.decode_step_floor(flash, PEAK, 1, n) for n in (1024, 8192, 131072, 1 << 20)]
    assert decode == sorted(decode)
    extra = sum(a.state_bytes(1 << 20).values()) - sum(a.state_bytes(8192).values())
    assert decode[-1] - decode[1] == pytest.approx(extra / PEAK.bandwidth)  # bandwidth-bound at batch 1
    prefill = {n: roofline.prefill_wave_floor(flash, PEAK, 1, n, n) for n in (8192, 131072, 1 << 20)}
    assert prefill[1 << 20] > 8 * prefill[131072] > 64 * prefill[8192]  # the indexer's quadratic term
    assert prefill[1 << 20] == pytest.approx((2 * flash.active_params * (1 << 20) + a.prefill_flops(1 << 20))
                                             / PEAK.flops)


def test_the_1k_preset_floor_barely_moves(flash):
    """At 1K tokens the new terms move the v4-flash-8l64e floor by little: prefill +3.2%, decode per step
    unchanged (the same bytes up to the carries), a 1 x 1K / 128-token run +0.12%."""
    prefill_weights_only = 2 * flash.active_params * 1024 / PEAK.flops
    floors = roofline.run_floor(flash, PEAK, num_prompts=1, input_len=1024, output_len=128, batch=1)
    assert floors["prefill_floor_s"] / prefill_weights_only == pytest.approx(1.032, abs=0.002)
    step_before = (flash.weight_bytes_touched(1) + 1025 * flash.state_bytes_per_token
                   + flash.state_bytes_per_seq) / PEAK.bandwidth
    assert roofline.decode_step_floor(flash, PEAK, 1, 1025) == pytest.approx(step_before, rel=1e-3)
    before = prefill_weights_only + sum(
        (flash.weight_bytes_touched(1) + (1024 + s) * flash.state_bytes_per_token + flash.state_bytes_per_seq)
        / PEAK.bandwidth for s in range(1, 128))
    assert floors["floor_s"] / before == pytest.approx(1.0012, abs=0.0005)

"""The CPU backend's fast ops equal the reference ops (the spec) on fp32 and bf16 inputs."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backends.cpu import CpuBackend
from deepinfer_core.backends.cpu_ops import OVERRIDES
from deepinfer_core.ops import reference as ref


def _rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_cpu_backend_registers_its_fast_ops():
    table = CpuBackend().make_op_table()
    for name in OVERRIDES:
        assert table.sources()[name] == "cpu"
    assert table.sources()["sink_attention"] == "reference"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_rms_norms(dtype, tol):
    x, w = _rand(7, 3, 48, dtype=dtype), 1 + 0.1 * _rand(48, seed=1)
    torch.testing.assert_close(OVERRIDES["rms_norm"](x, w, 1e-6), ref.rms_norm(x, w, 1e-6), atol=tol, rtol=tol)
    got = OVERRIDES["unweighted_rms_norm"](x, 1e-6)
    assert got.dtype == dtype
    torch.testing.assert_close(got, ref.unweighted_rms_norm(x, 1e-6), atol=tol, rtol=tol)


@pytest.mark.parametrize("shape", [(9, 32), (9, 4, 32), (9, 2, 3, 32)])
@pytest.mark.parametrize("inverse", [False, True])
def test_apply_rope(shape, inverse):
    x = _rand(*shape)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    cos, sin = ref.rope_cos_sin(torch.arange(9) * 37, inv_freq, 1.0, torch.float32)
    got = OVERRIDES["apply_rope"](x, cos, sin, inverse)
    torch.testing.assert_close(got, ref.apply_rope(x, cos, sin, inverse), atol=1e-6, rtol=1e-6)
    assert torch.equal(got[..., :-16], x[..., :-16])
    in_place = x.clone()
    assert OVERRIDES["apply_rope_"](in_place, cos, sin, inverse) is in_place
    assert torch.equal(in_place, got)  # the same rotation, written into the rotary channels only


@pytest.mark.parametrize("hc", [1, 2, 4])
@pytest.mark.parametrize("tokens", [1, 13])
def test_hc_pre(hc, tokens):
    D = 24
    streams = _rand(tokens, hc, D)
    fn = 0.1 * _rand((2 + hc) * hc, hc * D, seed=2)
    base = 0.3 * _rand((2 + hc) * hc, seed=3)
    scale = 0.5 + _rand(3, seed=4).abs()
    got = OVERRIDES["hc_pre"](streams, fn, base, scale, 20, 1e-6, 1e-6)
    want = ref.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("experts", [4, 16])
@pytest.mark.parametrize("tokens", [1, 11])
def test_moe_experts(experts, tokens):
    D, I, k = 16, 8, 2
    x = _rand(tokens, D)
    gen = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    weights = _rand(tokens, k, seed=6).abs()
    w1, w3 = _rand(experts, I, D, seed=7), _rand(experts, I, D, seed=8)
    w2 = _rand(experts, D, I, seed=9)
    got = OVERRIDES["moe_experts"](x, ids, weights, w1, w2, w3, 2.0)  # small limit: the clamps matter
    torch.testing.assert_close(got, ref.moe_experts(x, ids, weights, w1, w2, w3, 2.0), atol=1e-5, rtol=1e-5)

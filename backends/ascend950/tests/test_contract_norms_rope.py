"""CONTRACT tests (CPU, not hardware): npu_rms_norm / npu_rotary_mul adapters vs the reference ops.

torch_npu is replaced by ``contract_reference`` (the documented semantics in plain torch). Passing here means
the adapters call the documented API correctly; it does not mean an Ascend 950 computes this.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.ops import reference

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 64), (5, 4, 32), (2, 3, 4, 16)])
def test_contract_rms_norm_matches_reference(npu_ops, dtype, shape):
    x = torch.randn(shape, generator=_gen()).to(dtype)
    weight = 1 + 0.1 * torch.randn(shape[-1], generator=_gen(1))  # fp32, as the model keeps norm weights
    torch.testing.assert_close(npu_ops.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), **TOL[dtype])
    torch.testing.assert_close(npu_ops.unweighted_rms_norm(x, 1e-6), reference.unweighted_rms_norm(x, 1e-6),
                               **TOL[dtype])


def test_contract_rms_norm_falls_back_outside_the_documented_ranks(npu_ops):
    x = torch.randn(16, generator=_gen())  # 1-D: npu_rms_norm documents 2-8 dims
    weight = torch.rand(16, generator=_gen(1))
    assert torch.equal(npu_ops.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))


def _cos_sin(tokens, rope_dim, dtype):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    return reference.rope_cos_sin(torch.arange(3, 3 + tokens), inv_freq, 1.0, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("shape", [(6, 32), (6, 4, 32), (6, 2, 3, 48)])
def test_contract_apply_rope_matches_reference(npu_ops, dtype, inverse, shape):
    x = torch.randn(shape, generator=_gen()).to(dtype)
    cos, sin = _cos_sin(shape[0], 16, dtype)  # rope on the trailing 16 channels; the rest passes through
    got = npu_ops.apply_rope(x, cos, sin, inverse=inverse)
    torch.testing.assert_close(got, reference.apply_rope(x, cos, sin, inverse=inverse), **TOL[dtype])
    assert torch.equal(got[..., :-16], x[..., :-16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 32), (6, 4, 32), (6, 2, 3, 48)])
def test_contract_apply_rope_in_place_matches_reference(npu_ops, dtype, shape):
    """The model's in-place call: the rotary channels of ``x`` itself rewritten, the rest untouched."""
    x = torch.randn(shape, generator=_gen()).to(dtype)
    cos, sin = _cos_sin(shape[0], 16, dtype)
    got = x.clone()
    assert npu_ops.apply_rope_(got, cos, sin, inverse=True) is got
    torch.testing.assert_close(got, reference.apply_rope_(x.clone(), cos, sin, inverse=True), **TOL[dtype])
    assert torch.equal(got[..., :-16], x[..., :-16])


def test_contract_rope_layout_matters_half_mode_would_be_wrong(stand_in):
    """DeepSeek-V4 rotates interleaved pairs; npu_rotary_mul's default 'half' mode rotates halves."""
    x = torch.randn(1, 5, 2, 16, generator=_gen())
    cos, sin = _cos_sin(5, 16, torch.float32)
    r1 = cos.repeat_interleave(2, -1).view(1, 5, 1, 16)
    r2 = sin.repeat_interleave(2, -1).view(1, 5, 1, 16)
    want = reference.apply_rope(x[0], cos, sin)
    torch.testing.assert_close(stand_in.npu_rotary_mul(x, r1, r2, rotary_mode="interleave")[0], want)
    assert not torch.allclose(stand_in.npu_rotary_mul(x, r1, r2)[0], want, atol=1e-3)


def test_contract_rope_passes_the_documented_interleave_layout(npu_ops, stand_in, monkeypatch):
    calls = []
    original = stand_in.npu_rotary_mul

    def spy(input, r1, r2, rotary_mode="half", rotate=None):
        calls.append((tuple(input.shape), tuple(r1.shape), rotary_mode))
        return original(input, r1, r2, rotary_mode, rotate)

    monkeypatch.setattr(stand_in, "npu_rotary_mul", spy)
    cos, sin = _cos_sin(6, 16, torch.float32)
    npu_ops.apply_rope(torch.randn(6, 4, 32, generator=_gen()), cos, sin)
    assert calls == [((1, 6, 4, 16), (1, 6, 1, 16), "interleave")]  # BSND input, 1S1D cos/sin


def test_contract_rope_falls_back_when_heads_exceed_the_documented_limit(npu_ops, stand_in, monkeypatch):
    monkeypatch.setattr(stand_in, "npu_rotary_mul", lambda *a, **k: pytest.fail("B * N >= 1000 must not reach the op"))
    x = torch.randn(2, 1000, 16, generator=_gen())
    cos, sin = _cos_sin(2, 8, torch.float32)
    assert torch.equal(npu_ops.apply_rope(x, cos, sin), reference.apply_rope(x, cos, sin))

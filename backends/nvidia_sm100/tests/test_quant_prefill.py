"""The quantized ops' prefill paths that run vendor GEMMs on fp8 tensor cores (GPU only: cuBLAS's blockwise
``torch._scaled_mm`` and CUTLASS's ``torch._scaled_grouped_mm`` have no CPU or interpreter form; the kernels around
them, the e4m3 conversion and the SwiGLU quantization, are checked exactly in test_quant_kernels.py). Both quantize
activations, so they are checked against the reference op on the activations as quantized (to the GEMM's own
rounding) and, loosely, on the activations themselves (fp8's error, which docs/quantization.md measures on a
model)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the test extra installs triton")
from deepinfer_nvidia_sm100.kernels import fp8_linear, moe_mxfp4_prefill, moe_quant

from deepinfer_core.ops import reference as ref
from deepinfer_core.quant import fp8_block, mxfp4

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="fp8 GEMMs of cuBLAS / CUTLASS: an SM90+ GPU")
DEVICE = "cuda"


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def _quantized_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x [M, K]`` as the fp8 paths see it: e4m3 per row and ``block`` inputs, dequantized (float32)."""
    q, s = fp8_block.quantize(x.float(), (1, block), ue8m0=False)
    return fp8_block.dequantize(q, s, (1, block))


@pytest.mark.parametrize("M, groups", [(1337, 1), (1024, 1), (1030, 3)])
def test_fp8_linear_prefill_is_cublas_blockwise_on_quantized_activations(M, groups):
    """From ``DEQUANT_MIN_ROWS`` rows, bf16 with 128 x 128 blocks takes ``SCALED_MM`` (one cuBLAS call a group,
    written in place for one group of whole 16-row runs, rows padded otherwise): the reference op on the activations as quantized, up to the output's bf16
    rounding; a few % from the reference op on the activations themselves."""
    assert M >= fp8_linear.DEQUANT_MIN_ROWS
    gen = torch.Generator(device=DEVICE).manual_seed(M)
    n, k, block = 384, 512, (128, 128)
    x = torch.randn(M, groups, k, device=DEVICE, generator=gen).to(torch.bfloat16)
    weight, scale = fp8_block.quantize(torch.randn(groups * n, k, device=DEVICE, generator=gen) * k**-0.5, block,
                                       True)
    assert fp8_linear.scaled_mm_fits(x, n, k, block)
    got = fp8_linear.grouped_linear_fp8_block(x, weight, scale, block, groups)
    assert got.shape == (M, groups, n) and got.dtype == torch.bfloat16
    seen = _quantized_rows(x.reshape(M * groups, k), block[1]).view(M, groups, k)
    torch.testing.assert_close(got.float(), ref.grouped_linear_fp8_block(seen, weight, scale, block, groups),
                               atol=2e-2, rtol=2e-2)
    assert 0 < _relative(got, ref.grouped_linear_fp8_block(x.float(), weight, scale, block, groups)) < 0.1


def test_fp8_linear_prefill_decodes_where_cublas_would_misread_the_scales():
    """cuBLAS reads 128 x 128 weight scales with ``K / 128`` rounded up to a multiple of 4 (and declined the tiny
    model's 128 x 128 weight at 8,160 rows): such products take the exact ``DEQUANT`` one without trying cuBLAS."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for n, k in ((128, 128), (256, 256), (384, 128)):
        x = torch.randn(fp8_linear.DEQUANT_MIN_ROWS, 1, k, device=DEVICE, generator=gen).to(torch.bfloat16)
        weight, scale = fp8_block.quantize(torch.randn(n, k, device=DEVICE, generator=gen) * 0.1, (128, 128), True)
        assert fp8_linear.picked_path(x, n, (128, 128)) == fp8_linear.DEQUANT
        got = fp8_linear.grouped_linear_fp8_block(x, weight, scale, (128, 128), 1)
        want = ref.grouped_linear_fp8_block(x, weight, scale, (128, 128), 1)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        assert (1, n, k) not in fp8_linear._SCALED_MM_REFUSED


def test_fp8_linear_prefill_paths_by_block_and_switch(monkeypatch):
    """``SCALED_MM`` only for 128 x 128 blocks with ``K / 128`` a multiple of 4 (V4.1's 32 x 32 decode the weight,
    exactly) and only while ``DEEPINFER_NVIDIA_FP8_SCALED_MM`` is on."""
    x = torch.zeros(fp8_linear.DEQUANT_MIN_ROWS, 1, 512, dtype=torch.bfloat16, device=DEVICE)
    assert fp8_linear.scaled_mm_fits(x, 256, 512, (128, 128))
    assert not fp8_linear.scaled_mm_fits(x, 256, 512, (32, 32))
    assert not fp8_linear.scaled_mm_fits(x, 200, 512, (128, 128))  # a partial block
    assert not fp8_linear.scaled_mm_fits(x[..., :256], 256, 256, (128, 128))  # K / 128 = 2
    assert not fp8_linear.scaled_mm_fits(x.float(), 256, 512, (128, 128))
    monkeypatch.setenv("DEEPINFER_NVIDIA_FP8_SCALED_MM", "0")
    assert not fp8_linear.scaled_mm_fits(x, 256, 512, (128, 128))


def _moe_case(T: int, E: int, top_k: int, D: int, inter: int, seed: int):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(T, D, device=DEVICE, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device=DEVICE, generator=gen)[:top_k] for _ in range(T)])
    weights = torch.rand(T, top_k, device=DEVICE, generator=gen)
    dense = [torch.randn(E, *shape, device=DEVICE, generator=gen) * shape[1] ** -0.5
             for shape in ((inter, D), (D, inter), (inter, D))]
    stored = tuple(t for w in dense for t in mxfp4.quantize(w))
    return x, ids, weights, stored


def _emulated(x, ids, weights, stored, limit):
    """``moe_mxfp4_prefill``'s math in torch: per expert, its rows quantized per row (fp8, float32 values), the
    exact weights, bf16 GEMM outputs, ``moe.swiglu``'s rounding, the SwiGLU rows quantized, the reference's combine."""
    w1, s1, w2, s2, w3, s3 = stored
    silu = torch.nn.functional.silu

    def run_expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        up_w, down_w, gate_w = (mxfp4.dequantize(w[e], s[e]) for w, s in ((w3, s3), (w2, s2), (w1, s1)))
        seen = _quantized_rows(rows, rows.shape[1])
        gate, up = (seen @ gate_w.t()).to(rows.dtype), (seen @ up_w.t()).to(rows.dtype)
        h = silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)  # rounded as the op rounds it
        return (_quantized_rows(h, h.shape[1]) @ down_w.t()).to(rows.dtype)

    return ref.routed_sum(x, ids, weights, w1.shape[0], run_expert)


@pytest.mark.parametrize("chunk", [None, 3])
def test_moe_mxfp4_prefill_on_fp8_tensor_cores(chunk, monkeypatch):
    """From ``DEEPINFER_NVIDIA_MXFP4_FP8_MIN_PER_EXPERT`` assignments per expert the MXFP4 op takes
    ``moe_mxfp4_prefill``: its math emulated in torch (``_emulated``) up to the GEMMs' sums and bf16 rounding;
    within fp8's error of the reference op (activations and the SwiGLU quantized per row; the weights exact, their
    scales' spread being small); the same result, to the GEMMs' rounding, when the experts are converted a few at a
    time (``EXPERT_CHUNK``: the rows of each run read on the host)."""
    T, E, top_k, D, inter, limit = 1200, 8, 2, 256, 128, 0.7
    x, ids, weights, stored = _moe_case(T, E, top_k, D, inter, seed=7)
    w1, s1, w2, s2, _, s3 = stored
    assert moe_mxfp4_prefill.exact_rows(torch.cat([s1, s3], 1)).all() and moe_mxfp4_prefill.exact_rows(s2).all()
    monkeypatch.setenv("DEEPINFER_NVIDIA_MXFP4_FP8_MIN_PER_EXPERT", str(T * top_k // E))
    assert moe_mxfp4_prefill.used(T * top_k, x, w1, w2)
    whole = moe_quant.moe_experts_mxfp4(x, ids, weights, *stored, limit)
    want = ref.moe_experts_mxfp4(x, ids, weights, *stored, limit)
    assert whole.shape == want.shape and whole.dtype == want.dtype
    torch.testing.assert_close(whole.float(), _emulated(x, ids, weights, stored, limit).float(), atol=2e-2,
                               rtol=2e-2)
    assert 0 < _relative(whole, want) < 0.1
    if chunk is not None:
        monkeypatch.setattr(moe_mxfp4_prefill, "EXPERT_CHUNK", chunk)
        torch.testing.assert_close(moe_quant.moe_experts_mxfp4(x, ids, weights, *stored, limit), whole,
                                   atol=1e-2, rtol=1e-2)
    monkeypatch.setenv("DEEPINFER_NVIDIA_MXFP4_FP8_MIN_PER_EXPERT", str(T * top_k // E + 1))
    assert not moe_mxfp4_prefill.used(T * top_k, x, w1, w2)
    exact = moe_quant.moe_experts_mxfp4(x, ids, weights, *stored, limit)  # the bf16-product kernels below it
    assert _relative(exact, want) < 2e-2 and _relative(exact, want) < _relative(whole, want)

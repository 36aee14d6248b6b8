"""``kernels/blas.py``: ``grouped_linear`` as a strided batched GEMM against the reference op. Plain torch, so it runs
on the CPU in CI too; on the GPU it runs cuBLAS with the strided views."""

from __future__ import annotations

import pytest
import torch
from deepinfer_nvidia_sm100.kernels import blas

from deepinfer_core.ops import reference as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, groups, width, per_group", [(1, 8, 64, 16), (7, 2, 96, 48), (33, 4, 32, 8),
                                                              (0, 8, 64, 16)])
@pytest.mark.parametrize("strided", [False, True])
def test_grouped_linear_matches_reference(tokens, groups, width, per_group, dtype, strided):
    """Every group's rows against the reference's einsum; a row-strided input (a column block of a wider tensor)
    and an empty batch; the result is contiguous, so the model's ``flatten`` copies nothing."""
    gen = torch.Generator(device=DEVICE).manual_seed(tokens + groups)
    wide = torch.randn(tokens, groups * width + (5 if strided else 0), device=DEVICE, generator=gen).to(dtype)
    x = wide[:, -groups * width:].view(tokens, groups, width) if not strided else \
        wide[:, 5:].unflatten(1, (groups, width))  # [T, g, in]
    weight = (torch.randn(groups * per_group, width, device=DEVICE, generator=gen) * 0.1).to(dtype)
    got, want = blas.grouped_linear(x, weight, groups), ref.grouped_linear(x, weight, groups)
    assert got.shape == want.shape == (tokens, groups, per_group) and got.dtype == dtype and got.is_contiguous()
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got, want, **tol)

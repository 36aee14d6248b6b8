"""Op ``grouped_linear`` as one cuBLAS strided-batched GEMM over views of its operands.

The reference's ``einsum("tgi,goi->tgo")`` lowers to ``bmm`` over ``x`` permuted to ``[groups, T, in]``, which it
copies to contiguous memory first, and returns a permuted result that the model's next ``flatten`` copies again (at
8192 prefill tokens ~670 MB copied per attention output projection, ``wo_a``, 8 times a step on the bench preset).
Here ``torch.bmm`` gets ``x [T, g, in]`` as ``[g, T, in]`` with a row stride of ``g * in`` and writes into the
``[T, g, out]`` result seen as ``[g, T, out]``: strides cuBLAS takes as leading dimensions, so
neither operand nor the result is copied.
"""

from __future__ import annotations

import torch

from deepinfer_nvidia_sm100.kernels.compiled import opaque_under_compile


@opaque_under_compile("blas_grouped_linear",
                      lambda x, weight, groups: x.new_empty(x.shape[0], groups, weight.shape[0] // groups))
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """``reference.grouped_linear``: ``x [T, groups, in]``, ``weight [groups * out, in]`` -> ``[T, groups, out]``."""
    tokens, _, width = x.shape
    per_group = weight.shape[0] // groups
    w = weight.view(groups, per_group, width)  # [g, out, in]
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(tokens, groups, per_group, dtype=x.dtype, device=x.device)  # [T, g, out]
    if tokens:
        torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=out.transpose(0, 1))  # [g, T, in] @ [g, in, out]
    return out

"""Building blocks whose result for one row never depends on the other rows of the call (CPU).

Three things make a plain torch CPU op give a row different bits in a different batch, measured on
torch 2.13 + MKL 2024.2 (AVX2), with 1 and 2 threads:

1. GEMM kernel choice follows the row count. ``F.linear`` with M = 1 (MKL gemv) differs from M >= 2,
   and a row's result also changes between M = 2, 4, 5, 7, 64, ... and with its position. For one
   fixed call shape the result of a row depends only on that row (checked for M = 1 .. 128).
2. Vector body vs scalar tail. ``torch.sigmoid``, ``F.silu`` and ``F.softplus`` run the SIMD kernel on
   full vectors and a scalar formula on the tail of each contiguous chunk; the two disagree in the
   last bit for ~5% of inputs, so an element's result depends on where it lands in the tensor (and
   for >= 32768 elements on where OpenMP splits it). ``exp``, ``log``, ``log1p``, ``expm1``,
   ``cos``, ``sin``, ``rsqrt``, ``softmax`` and ``log_softmax`` go through vectorised code for every
   element (partial-vector loads for the tail) and agree bit for bit wherever the element sits.
3. Reductions over the batch-dependent length of a padded axis (attention keys padded to the
   longest sequence of the batch) add different numbers of zeros in a different tree.

The remedies, used by ``cpu_ops``:

* ``matmul_nt``: ``x @ w.T`` in row tiles of a fixed height ``TILE_ROWS`` (the last tile zero-padded),
  all tiles in one ``torch.bmm`` whose every item has the same shape. Every tile of a float32 call is
  64-byte aligned (16 rows), so MKL sees the same shapes and alignment for a row whatever the batch.
* ``sigmoid`` / ``silu`` / ``softplus`` built from ``exp`` / ``log1p`` and IEEE arithmetic.
* ``fold``: a sum over a small axis as an explicit left fold in index order.
"""

from __future__ import annotations

import torch

TILE_ROWS = 16
"""Rows per GEMM tile. Fixed for the process: changing it changes results (not their invariance).
16 float32 rows of any width start on a 64-byte boundary. Measured against plain ``F.linear`` (1 thread,
1024 x 1024): 1.4x at 16-64 rows, 1.25x at 2048, 19x for a single row (MKL's gemv); 8-row tiles cost
more everywhere but the single row, 32-row tiles less from 256 rows up and more below (docs/batch-invariant.md)."""

KV_CHUNK = 64
"""Keys per attention / indexer chunk: the fixed split of every key reduction."""

_BMM_DTYPES = (torch.float32, torch.float64)


def matmul_nt(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for ``x [..., K]``, ``weight [N, K]``; row results independent of the other rows.

    float32 / float64: one ``bmm`` over ``[tiles, TILE_ROWS, K]`` (MKL's batched GEMM, one item shape).
    Other dtypes (bf16, fp16): one ``mm`` per tile, because torch picks the oneDNN or the native bf16
    GEMM from the *total* size of a bmm, which would follow the batch.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    if m == 0:
        return x.new_empty(*lead, n)
    tiles = -(-m // TILE_ROWS)
    padded = x.new_zeros(tiles * TILE_ROWS, k)  # fresh, aligned, contiguous; tail rows zero
    padded[:m] = rows
    wt = weight.t()  # [K, N] view
    if x.dtype in _BMM_DTYPES:
        out = torch.bmm(padded.view(tiles, TILE_ROWS, k), wt.unsqueeze(0).expand(tiles, k, n))
        out = out.view(tiles * TILE_ROWS, n)
    else:
        out = x.new_empty(tiles * TILE_ROWS, n)
        for t in range(tiles):
            rows_t = slice(t * TILE_ROWS, (t + 1) * TILE_ROWS)
            torch.mm(padded[rows_t], wt, out=out[rows_t])
    return out[:m].reshape(*lead, n)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))``: same bits for an element wherever it sits in the tensor."""
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x / (1 + exp(-x))`` (position independent; ``F.silu`` is not)."""
    return x / (1.0 + torch.exp(-x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """``log1p(exp(x))``, and ``x`` above 20 as ``F.softplus`` (position independent; ``F.softplus`` is not)."""
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x.clamp(max=20.0))))


def fold(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` as ``((x0 + x1) + x2) + ...`` in index order (``dim`` is removed)."""
    parts = x.unbind(dim)
    acc = parts[0]
    for part in parts[1:]:
        acc = acc + part
    return acc


def chunks_for(length: int, chunk: int = KV_CHUNK) -> int:
    """Number of fixed-size chunks covering ``length`` keys (at least one)."""
    return max(1, -(-length // chunk))

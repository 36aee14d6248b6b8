"""Op ``indexer_scores`` (the lightning indexer's scores) as one Triton kernel.

``deepinfer_core.ops.reference.indexer_scores`` materialises every head's dot products ``[S, Lq, Hi, E]`` in fp32
and reduces them in three more passes: at one 8K-token prompt (64 heads, 2,048 entries) that is a 4.3 GB tensor per
CSA layer and an fp32 GEMM. Here a program owns a tile of ``BLOCK_T`` queries x ``TILE_E`` entries of one
sequence: it keeps the entries' keys on chip and, head by head, multiplies the queries with them on tensor cores
(fp32 accumulation: the reference's fp32 products are exact for 16-bit inputs), applies ReLU and the head weight and
adds into one fp32 accumulator, so only the scores ``[S, Lq, E]`` reach memory. The grid walks entry tiles first:
the programs running at once share one query tile, so a long chunk's queries are read from memory once, not once
per entry tile. With few queries per sequence
(decode) a query-row tile would be mostly padding: there a program takes one query row and all its heads as the rows
of one product instead (``_indexer_scores_rows_kernel``). fp32 inputs multiply in IEEE fp32. Head dims that are not a
power of two of at least 16 take the reference op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.ops import reference as ref
from deepinfer_nvidia_sm100.kernels.compiled import opaque_under_compile

BLOCK_T, BLOCK_E = 64, 64
TILE_E, TILE_WARPS, STAGES = 128, 4, 2  # the query-tile kernel's entries per program, warps, pipeline stages
QUERY_TILES = (BLOCK_T, TILE_E, TILE_WARPS, STAGES)  # its launch: queries, entries a program, warps, stages


@triton.jit
def _indexer_scores_kernel(q_ptr, k_ptr, w_ptr, out_ptr, Lq, E, H, scale,
                           stride_qs, stride_qt, stride_qh, stride_ks, stride_ke, stride_ws, stride_wt,
                           D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, PRECISION: tl.constexpr):
    """Program (entry tile, query tile, sequence): ``out[s, t, e] = scale * sum_h w[s, t, h] * relu(q[s, t, h] .
    k[s, e])`` (``q [S, Lq, H, D]`` with unit stride over ``D``, ``k [S, E, D]``, ``w [S, Lq, H]`` fp32, ``out [S,
    Lq, E]`` fp32 contiguous)."""
    seq = tl.program_id(2).to(tl.int64)
    es = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)  # [BE]
    ts = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    ds = tl.arange(0, D)  # [D]
    in_t, in_e = ts < Lq, es < E
    keys = tl.load(k_ptr + seq * stride_ks + es[None, :].to(tl.int64) * stride_ke + ds[:, None],
                   mask=in_e[None, :], other=0.0)  # [D, BE]
    q_rows = q_ptr + seq * stride_qs + ts[:, None].to(tl.int64) * stride_qt + ds[None, :]  # [BT, D] of head 0
    w_rows = w_ptr + seq * stride_ws + ts.to(tl.int64) * stride_wt  # [BT]
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for h in range(H):
        q = tl.load(q_rows + h * stride_qh, mask=in_t[:, None], other=0.0)  # [BT, D]
        dots = tl.dot(q, keys, input_precision=PRECISION)  # [BT, BE] fp32
        weight = tl.load(w_rows + h, mask=in_t, other=0.0)  # [BT]
        acc += tl.maximum(dots, 0.0) * weight[:, None]
    out = out_ptr + seq * Lq * E + ts[:, None].to(tl.int64) * E + es[None, :]
    tl.store(out, acc * scale, mask=in_t[:, None] & in_e[None, :])


@triton.jit
def _indexer_scores_rows_kernel(q_ptr, k_ptr, w_ptr, out_ptr, Lq, E, H, scale,
                                stride_qs, stride_qt, stride_qh, stride_ks, stride_ke, stride_ws, stride_wt,
                                D: tl.constexpr, H_P2: tl.constexpr, BLOCK_E: tl.constexpr, PRECISION: tl.constexpr):
    """The same scores for few queries per sequence (decode): program (query row, entry tile) multiplies the row's
    heads ``[H, D]`` with the tile's keys in one ``tl.dot`` (heads as the M dimension) and reduces over heads."""
    row = tl.program_id(0).to(tl.int64)
    seq, t = row // Lq, row % Lq
    hs = tl.arange(0, H_P2)  # [HP]
    es = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)  # [BE]
    ds = tl.arange(0, D)  # [D]
    in_h, in_e = hs < H, es < E
    q = tl.load(q_ptr + seq * stride_qs + t * stride_qt + hs[:, None] * stride_qh + ds[None, :],
                mask=in_h[:, None], other=0.0)  # [HP, D]
    keys = tl.load(k_ptr + seq * stride_ks + es[None, :].to(tl.int64) * stride_ke + ds[:, None],
                   mask=in_e[None, :], other=0.0)  # [D, BE]
    dots = tl.dot(q, keys, input_precision=PRECISION)  # [HP, BE] fp32
    weight = tl.load(w_ptr + seq * stride_ws + t * stride_wt + hs, mask=in_h, other=0.0)  # [HP]
    scores = tl.sum(tl.maximum(dots, 0.0) * weight[:, None], axis=0)  # [BE]
    tl.store(out_ptr + row * E + es, scores * scale, mask=in_e)


ROWS_KERNEL_MAX_QUERIES = 16  # up to this many queries per sequence, one program per query row (decode)


def _scores_fake(q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, scale: float) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1], keys.shape[1]), dtype=torch.float32)


@opaque_under_compile("indexer_scores", _scores_fake)
def indexer_scores(q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, scale: float) -> torch.Tensor:
    """Op ``indexer_scores`` (same contract as the reference op): ``q [S, Lq, H, di]``, ``keys [S, E, di]``,
    ``head_weights [S, Lq, H]`` -> fp32 scores ``[S, Lq, E]``."""
    Lq, D = q.shape[1], q.shape[3]
    if not takes(D):
        return ref.indexer_scores(q, keys, head_weights, scale)
    out, q, keys, weights, strides = _prepare(q, keys, head_weights)
    if out.numel() == 0:
        return out
    if Lq <= ROWS_KERNEL_MAX_QUERIES:
        return _rows(q, keys, weights, out, scale, strides)
    return query_tiles(q, keys, weights, out, scale, strides)


def query_tiles(q, keys, weights, out, scale: float, strides: tuple,
                config: tuple[int, int, int, int] = QUERY_TILES) -> torch.Tensor:
    """``_indexer_scores_kernel`` into ``out [S, Lq, E]`` (operands and strides as ``_prepare`` returns them) with
    ``config`` = (queries, entries a program, warps, pipeline stages); the grid walks entry tiles first, so the
    programs running at once share one query tile."""
    block_t, tile_e, warps, stages = config
    S, Lq, H, D = q.shape
    E = keys.shape[1]
    grid = (triton.cdiv(E, tile_e), triton.cdiv(Lq, block_t), S)
    _indexer_scores_kernel[grid](q, keys, weights, out, Lq, E, H, float(scale), *strides, D=D, BLOCK_T=block_t,
                                 BLOCK_E=tile_e, PRECISION=_precision(q), num_warps=warps, num_stages=stages)
    return out


def indexer_scores_rows(q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """``indexer_scores`` through ``_indexer_scores_rows_kernel`` for any number of queries: one program per (query,
    entry tile), so a query's scores depend on its own row and keys only (the batch-invariant mode). Head dims must
    be ``takes``-able (the caller checks)."""
    out, q, keys, weights, strides = _prepare(q, keys, head_weights)
    return out if out.numel() == 0 else _rows(q, keys, weights, out, scale, strides)


def takes(head_dim: int) -> bool:
    """Whether the kernels take this head dim: ``tl.dot`` needs a power of two of at least 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def _precision(q: torch.Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 inputs: exact fp32 products, no TF32


def _prepare(q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor):
    """The output ``[S, Lq, E]`` fp32 (zeroed when empty), the operands with the unit strides the kernels read, and
    their strides."""
    S, Lq = q.shape[:2]
    E = keys.shape[1]
    out = torch.empty((S, Lq, E), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out.zero_(), q, keys, head_weights, ()
    if keys.dtype != q.dtype:
        keys = keys.to(q.dtype)
    if q.stride(-1) != 1:
        q = q.contiguous()
    keys = keys.contiguous()
    weights = head_weights.float()
    if weights.stride(-1) != 1:
        weights = weights.contiguous()
    strides = (q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), weights.stride(0),
               weights.stride(1))
    return out, q, keys, weights, strides


def _rows(q, keys, weights, out, scale: float, strides: tuple) -> torch.Tensor:
    S, Lq, H, D = q.shape
    E = keys.shape[1]
    _indexer_scores_rows_kernel[(S * Lq, triton.cdiv(E, BLOCK_E))](
        q, keys, weights, out, Lq, E, H, float(scale), *strides, D=D, H_P2=max(16, triton.next_power_of_2(H)),
        BLOCK_E=BLOCK_E, PRECISION=_precision(q), num_warps=4)
    return out

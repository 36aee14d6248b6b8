"""Routed experts as two Triton grouped GEMMs over the token -> expert assignment (op ``moe_experts``).

Matches ``deepinfer_core.ops.reference.moe_experts``: ``out[t] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t])``
with ``expert(x) = w2 @ (silu(clamp(w1 x, max=limit)) * clamp(w3 x, -limit, limit))``.

How it runs, with no host synchronisation and no weight copies (so it can be captured in a CUDA graph):

1. ``align``: the T * k assignments are sorted by expert and each expert's run is padded to a multiple of
   ``BLOCK_M`` rows (padding rows hold -1). Every block of ``BLOCK_M`` rows belongs to one expert
   (``block_expert``; -1 for blocks past the end). All sizes are static upper bounds of T, k, E.
2. ``_up_kernel``: per (block, tile of I): ``h = silu(clamp(x w1^T)) * clamp(x w3^T)`` (fp32 accumulate,
   SwiGLU and clamps fused), written in sorted order. Each chosen expert's w1 / w3 tiles are read once per
   block of its tokens (once in all at decode sizes, where an expert gets at most ``BLOCK_M`` tokens).
3. ``_down_kernel``: per (block, tile of D): ``y = (h w2^T) * routing weight`` (fp32 accumulate), in sorted order.
4. ``_combine_kernel``: ``out[t] = sum_k y[dest[t, k]]`` by ascending expert id, in the model dtype (the
   reference's order).

Intermediates are rounded to the model dtype where the reference op rounds them, so bf16 runs track the
reference's rounding too (fp32 runs are unaffected).

One token (a batch-1 decode step) takes ``moe_experts_one_token``: two one-row kernels by expert id, no align and
no combine: two launches instead of four.

Prefill (bf16, more than ``GROUPED_GEMM_MIN_PER_EXPERT`` assignments per expert) replaces steps 2-3 by CUTLASS grouped
GEMMs (``moe_experts_grouped``: ``torch._grouped_mm`` over the same sorted layout, then ``_swiglu_kernel``; the
routing weight moves into the combine), whose wgmma / tcgen05 tiles run prefill sizes far faster than the Triton
tiles.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from deepinfer_core.ops import reference as ref
from deepinfer_nvidia_sm100.kernels import gemv, pdl
from deepinfer_nvidia_sm100.kernels.compiled import opaque_under_compile, reference_under_compile

ALIGN_KERNEL_MAX_EXPERTS = 256  # the align kernels hold per-expert counters in registers
ALIGN_ONE_PROGRAM_MAX_ASSIGN = 128  # one program loops over them (beyond this, its serial loop gets slow)
ALIGN_CHUNKED_MAX_ASSIGN = 8192  # chunks of them in parallel, three launches; torch ops beyond (prefill)
ALIGN_CHUNK_CELLS = 4096  # assignments x experts one program of the chunked kernels holds


def align(ids: torch.Tensor, num_experts: int, block_m: int):
    """Sorted, padded assignment layout. ``ids``: ``[T, k]`` physical expert ids.

    Returns ``sorted_assign [P]`` (flat assignment index t * k + j, or -1 for padding), ``block_expert
    [P // block_m]`` (-1 past the end) and ``dest [T * k]`` (row of each assignment in the sorted layout).
    Up to ``ALIGN_KERNEL_MAX_EXPERTS`` experts: one launch of ``_align_kernel`` up to
    ``ALIGN_ONE_PROGRAM_MAX_ASSIGN`` assignments, the three chunked kernels up to ``ALIGN_CHUNKED_MAX_ASSIGN``;
    otherwise ``align_torch`` (~20 small torch ops, a sort among them).
    """
    flat = ids.reshape(-1)
    n = flat.numel()
    rows = _aligned_rows(n, num_experts, block_m)
    if n > ALIGN_CHUNKED_MAX_ASSIGN or num_experts > ALIGN_KERNEL_MAX_EXPERTS:
        return align_torch(ids, num_experts, block_m)
    sorted_assign = torch.empty(rows, dtype=torch.long, device=flat.device)
    block_expert = torch.empty(rows // block_m, dtype=torch.long, device=flat.device)
    dest = torch.empty_like(flat)
    e_p2 = triton.next_power_of_2(num_experts)
    if n <= ALIGN_ONE_PROGRAM_MAX_ASSIGN:
        chunk = min(64, max(16, triton.next_power_of_2(n)))  # [chunk, E_P2] tiles: small at decode batches
        _align_kernel[(1,)](flat, sorted_assign, block_expert, dest, n, num_experts, rows, BLOCK_M=block_m,
                            E_P2=e_p2, CHUNK=chunk, num_warps=4, **pdl.launch())
        return sorted_assign, block_expert, dest
    chunk = max(16, ALIGN_CHUNK_CELLS // e_p2)
    chunks = triton.cdiv(n, chunk)
    counts = torch.empty(chunks, e_p2, dtype=torch.int32, device=flat.device)  # per chunk, then its base per expert
    pad_start = torch.empty(e_p2, dtype=torch.int32, device=flat.device)
    fill = triton.cdiv(rows, chunks)
    _align_count_kernel[(chunks,)](flat, counts, sorted_assign, n, rows, fill, CHUNK=chunk, E_P2=e_p2,
                                   FILL_P2=triton.next_power_of_2(fill), num_warps=4)
    _align_scan_kernel[(1,)](counts, pad_start, block_expert, chunks, num_experts, rows // block_m, BLOCK_M=block_m,
                             E_P2=e_p2, GROUP=chunk, num_warps=4)
    _align_place_kernel[(chunks,)](flat, counts, pad_start, sorted_assign, dest, n, CHUNK=chunk, E_P2=e_p2,
                                   num_warps=4)
    return sorted_assign, block_expert, dest


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, sorted_assign_ptr, n, rows, fill,
                        CHUNK: tl.constexpr, E_P2: tl.constexpr, FILL_P2: tl.constexpr):
    """Chunked ``align``, step 1 (a program per ``CHUNK`` assignments): this chunk's count per expert into
    ``counts [chunks, E_P2]``; and its share of the padding rows' -1 (``fill`` rows of ``sorted_assign``)."""
    c = tl.program_id(0)
    idx = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + idx, mask=idx < n, other=-1)
    experts = tl.arange(0, E_P2)
    tl.store(counts_ptr + c * E_P2 + experts, tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0))
    r = c * fill + tl.arange(0, FILL_P2)
    tl.store(sorted_assign_ptr + r, tl.full((FILL_P2,), -1, tl.int64), mask=(r < rows) & (r < (c + 1) * fill))


@triton.jit
def _align_scan_kernel(counts_ptr, pad_start_ptr, block_expert_ptr, chunks, num_experts, blocks,
                       BLOCK_M: tl.constexpr, E_P2: tl.constexpr, GROUP: tl.constexpr):
    """Chunked ``align``, step 2 (one program): each chunk's count becomes its base (the earlier chunks' assignments
    of each expert), each expert's run is padded to ``BLOCK_M`` (``pad_start``), and every block gets its expert."""
    experts = tl.arange(0, E_P2)
    total = tl.zeros((E_P2,), dtype=tl.int32)
    for start in range(0, chunks, GROUP):
        c = start + tl.arange(0, GROUP)
        at = counts_ptr + c[:, None] * E_P2 + experts[None, :]
        count = tl.load(at, mask=(c < chunks)[:, None], other=0)  # [GROUP, E_P2]
        tl.store(at, total[None, :] + tl.cumsum(count, axis=0) - count, mask=(c < chunks)[:, None])
        total += tl.sum(count, axis=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, axis=0)
    tl.store(pad_start_ptr + experts, pad_end - padded)
    for start in range(0, blocks, GROUP):  # block b belongs to the expert whose run holds row b * BLOCK_M
        b = start + tl.arange(0, GROUP)
        owner = tl.sum((pad_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int64), axis=1)
        tl.store(block_expert_ptr + b, tl.where(owner >= num_experts, -1, owner), mask=b < blocks)


@triton.jit
def _align_place_kernel(ids_ptr, base_ptr, pad_start_ptr, sorted_assign_ptr, dest_ptr, n,
                        CHUNK: tl.constexpr, E_P2: tl.constexpr):
    """Chunked ``align``, step 3 (a program per chunk): every assignment's row, ``pad_start[e]`` + its chunk's base
    for ``e`` + its rank among the chunk's assignments to ``e`` (stable: by expert, then by assignment index)."""
    c = tl.program_id(0)
    idx = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + idx, mask=idx < n, other=-1)
    experts = tl.arange(0, E_P2)
    one_hot = (e[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, E_P2]
    rank = tl.cumsum(one_hot, axis=0) - one_hot
    first = tl.load(pad_start_ptr + experts) + tl.load(base_ptr + c * E_P2 + experts)  # [E_P2]
    row = tl.sum(one_hot * (first[None, :] + rank), axis=1).to(tl.int64)  # [CHUNK]
    tl.store(dest_ptr + idx, row, mask=idx < n)
    tl.store(sorted_assign_ptr + row, idx.to(tl.int64), mask=idx < n)


def _aligned_rows(n: int, num_experts: int, block_m: int) -> int:
    """Rows of the padded layout: every expert's run rounded up to ``block_m`` (a static bound)."""
    rows = min(n * block_m, n + num_experts * (block_m - 1))
    return (rows + block_m - 1) // block_m * block_m


@triton.jit
def _align_kernel(ids_ptr, sorted_assign_ptr, block_expert_ptr, dest_ptr, n, num_experts, rows,
                  BLOCK_M: tl.constexpr, E_P2: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """``align`` in one program: count per expert, pad each run to ``BLOCK_M``, then place every assignment
    (stable: by expert, then by assignment index) in chunks of ``CHUNK`` assignments."""
    pdl.begin(PDL)
    experts = tl.arange(0, E_P2)  # [E_P2]
    lane = tl.arange(0, CHUNK)  # [CHUNK]
    counts = tl.zeros((E_P2,), dtype=tl.int32)
    for start in range(0, n, CHUNK):
        idx = start + lane
        e = tl.load(ids_ptr + idx, mask=idx < n, other=-1)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, axis=0)  # [E_P2]
    pad_start = pad_end - padded
    for start in range(0, rows, CHUNK):  # padding rows stay -1
        r = start + lane
        tl.store(sorted_assign_ptr + r, tl.full((CHUNK,), -1, tl.int64), mask=r < rows)
    for start in range(0, rows // BLOCK_M, CHUNK):  # block b belongs to the expert whose run holds row b * BLOCK_M
        b = start + lane
        owner = tl.sum((pad_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(owner >= num_experts, -1, owner).to(tl.int64), mask=b < rows // BLOCK_M)
    tl.debug_barrier()  # the -1 fill above lands before the placements below
    placed = tl.zeros((E_P2,), dtype=tl.int32)  # assignments of each expert placed by earlier chunks
    for start in range(0, n, CHUNK):
        idx = start + lane
        e = tl.load(ids_ptr + idx, mask=idx < n, other=-1)
        one_hot = (e[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, E_P2]
        rank = tl.cumsum(one_hot, axis=0) - one_hot  # earlier assignments of the same expert in this chunk
        row = tl.sum(one_hot * (pad_start + placed)[None, :] + one_hot * rank, axis=1).to(tl.int64)  # [CHUNK]
        tl.store(dest_ptr + idx, row, mask=idx < n)
        tl.store(sorted_assign_ptr + row, idx.to(tl.int64), mask=idx < n)
        placed += tl.sum(one_hot, axis=0)


def align_torch(ids: torch.Tensor, num_experts: int, block_m: int):
    """``align`` with torch ops (any size); the fused kernel's reference in the tests."""
    flat = ids.reshape(-1)
    n = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # no host sync (bincount would sync on CUDA)
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # assignments by expert, then by token
    sorted_e = flat[order]
    rank = torch.arange(n, device=device) - start[sorted_e]
    dest_sorted = pad_start[sorted_e] + rank
    rows = _aligned_rows(n, num_experts, block_m)
    sorted_assign = torch.full((rows,), -1, dtype=torch.long, device=device)
    sorted_assign[dest_sorted] = order
    dest = torch.empty_like(flat)
    dest[order] = dest_sorted
    block_start = torch.arange(0, rows, block_m, device=device)
    block_expert = torch.searchsorted(pad_end, block_start, right=True)
    block_expert = torch.where(block_expert >= num_experts, -1, block_expert)
    return sorted_assign, block_expert, dest


@triton.jit
def _block_tile(cols, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column tile) of this program: the 2-D grid's ids, or with ``GROUP_M`` a 1-D grid walked ``GROUP_M``
    row blocks at a time across the column tiles (their gathered rows stay in L2 while every column tile reads them,
    instead of each column tile sweeping all blocks; an order of work only)."""
    if GROUP_M:
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(cols, BLOCK_N)
        in_group = GROUP_M * tiles_n
        first_m = pid // in_group * GROUP_M
        group_m = tl.minimum(tl.num_programs(0) // tiles_n - first_m, GROUP_M)
        pid_m, pid_n = first_m + pid % in_group % group_m, pid % in_group // group_m
    else:  # 0 (None where a compile leaves the default out)
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    return pid_m, pid_n


@triton.jit
def sorted_block(block_expert_ptr, assign_ptr, pid_m, BLOCK_M: tl.constexpr):
    """Block ``pid_m`` of ``align``'s expert-sorted rows: ``(expert, rows [BM], assignments [BM], valid [BM])``; the
    expert is -1 for a block past the used ones (its program returns at once), padding rows' assignments -1."""
    expert = tl.load(block_expert_ptr + pid_m)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(assign_ptr + offs_m)
    return expert, offs_m, assign, assign >= 0


@triton.jit
def _up_kernel(x_ptr, w1_ptr, w3_ptr, h_ptr, assign_ptr, block_expert_ptr, D, I, top_k, limit,
               stride_xt, stride_we, stride_wi, stride_hm,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
               PDL: tl.constexpr = False, GROUP_M: tl.constexpr = 0):
    pdl.begin(PDL)
    pid_m, pid_n = _block_tile(I, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(assign_ptr + offs_m)
    valid = assign >= 0
    token = tl.where(valid, assign // top_k, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = expert.to(tl.int64) * stride_we
    for k0 in range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < D
        a = tl.load(x_ptr + token[:, None].to(tl.int64) * stride_xt + offs_k[None, :],
                    mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_off = w_base + offs_n[None, :].to(tl.int64) * stride_wi + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
        w_mask = n_mask[None, :] & k_mask[:, None]
        b1 = tl.load(w1_ptr + w_off, mask=w_mask, other=0.0)
        b3 = tl.load(w3_ptr + w_off, mask=w_mask, other=0.0)
        acc1 = tl.dot(a, b1, acc1, input_precision=PRECISION)
        acc3 = tl.dot(a, b3, acc3, input_precision=PRECISION)
    # Round where the reference op rounds (its linear outputs, silu and product are in the model dtype),
    # so low-precision runs follow the reference's rounding, not only its math.
    dt = h_ptr.dtype.element_ty
    h = _swiglu(acc1.to(dt).to(tl.float32), acc3.to(dt).to(tl.float32), limit, dt)
    tl.store(h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + offs_n[None, :], h.to(dt),
             mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(h_ptr, w2_ptr, y_ptr, weights_ptr, assign_ptr, block_expert_ptr, D, I,
                 stride_hm, stride_we, stride_wd, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 PDL: tl.constexpr = False, GROUP_M: tl.constexpr = 0):
    pdl.begin(PDL)
    pid_m, pid_n = _block_tile(D, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(assign_ptr + offs_m)
    valid = assign >= 0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output channels (D)
    n_mask = offs_n < D
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = expert.to(tl.int64) * stride_we
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < I
        a = tl.load(h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + offs_k[None, :],
                    mask=valid[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w2_ptr + w_base + offs_n[None, :].to(tl.int64) * stride_wd + offs_k[:, None],
                    mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    w = tl.load(weights_ptr + tl.where(valid, assign, 0), mask=valid, other=0.0)
    acc = acc.to(y_ptr.dtype.element_ty).to(tl.float32) * w.to(y_ptr.dtype.element_ty).to(tl.float32)[:, None]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc,
             mask=valid[:, None] & n_mask[None, :])


TILES = {
    # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) by the mean tokens per expert; close to the best of a sweep
    # (``benchmarks/sweep_moe_configs.py``). 16-row tiles run mma.sync (decode is weight-bandwidth bound);
    # 64-row tiles compile to wgmma on sm_90a and tcgen05 on sm_100a (tests/test_triton_compile.py).
    "decode": (16, 64, 128, 4),  # <= 16 tokens per expert
    "mid": (64, 64, 64, 4),  # <= 64
    "prefill": (64, 128, 64, 8),
}


def _config(num_assign: int, num_experts: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) by the mean tokens per expert (decode: GEMV-like)."""
    per_expert = num_assign / max(num_experts, 1)
    if per_expert <= 16:
        return TILES["decode"]
    if per_expert <= 64:
        return TILES["mid"]
    return TILES["prefill"]


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                w3: torch.Tensor, limit: float, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """Triton version of the reference op ``moe_experts`` (same arguments, same result within rounding).

    ``config`` = (BLOCK_M, BLOCK_N, BLOCK_K, num_warps[, GROUP_M]) fixes the tiles (and walks ``GROUP_M`` row blocks
    at a time: ``_block_tile``); by default they follow the mean tokens per expert (``_config``). A fixed config makes
    a token's result independent of the batch (every row of a tile is computed alike): the batch-invariant plugin
    passes one.
    """
    if config is None:
        return _moe_experts_default(x, ids, weights, w1, w2, w3, limit)
    return _moe_experts(x, ids, weights, w1, w2, w3, limit, config)


@opaque_under_compile("moe_experts", lambda x, ids, weights, w1, w2, w3, limit: x.new_empty(x.shape))
def _moe_experts_default(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                         w2: torch.Tensor, w3: torch.Tensor, limit: float) -> torch.Tensor:
    return _moe_experts(x, ids, weights, w1, w2, w3, limit, None)


def _moe_experts(x, ids, weights, w1, w2, w3, limit, config):
    T, top_k = ids.shape
    E, I, D = w1.shape
    if T == 0:
        return torch.zeros_like(x)
    if config is None and uses_grouped_gemm(x, T * top_k, E):
        return moe_experts_grouped(x, ids, weights, w1, w2, w3, limit)
    if config is None and T == 1 and top_k <= ONE_TOKEN_MAX_TOP_K:
        return moe_experts_one_token(x, ids, weights, w1, w2, w3, limit)
    x = x.contiguous()
    block_m, block_n, block_k, warps, *grouping = config or _config(T * top_k, E)
    group_m = grouping[0] if grouping else 0  # row blocks walked together (_block_tile); 0: the 2-D grid
    sorted_assign, block_expert, dest = align(ids, E, block_m)
    rows = sorted_assign.shape[0]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 runs exact fp32 products, no TF32
    stages = 2 if x.dtype == torch.float32 else 3
    h = torch.empty((rows, I), dtype=x.dtype, device=x.device)
    y = torch.empty((rows, D), dtype=x.dtype, device=x.device)
    w1c, w2c, w3c = w1.contiguous(), w2.contiguous(), w3.contiguous()  # views of the stacked weights: no copy
    flat_weights = weights.reshape(-1).contiguous()
    grid_up = _grid(rows // block_m, triton.cdiv(I, block_n), group_m)
    _up_kernel[grid_up](x, w1c, w3c, h, sorted_assign, block_expert, D, I, top_k, float(limit),
                        x.stride(0), w1c.stride(0), w1c.stride(1), h.stride(0),
                        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, num_warps=warps,
                        num_stages=stages, GROUP_M=group_m, **pdl.launch())
    grid_down = _grid(rows // block_m, triton.cdiv(D, block_n), group_m)
    _down_kernel[grid_down](h, w2c, y, flat_weights, sorted_assign, block_expert, D, I,
                            h.stride(0), w2c.stride(0), w2c.stride(1), y.stride(0),
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
                            num_warps=warps, num_stages=stages, GROUP_M=group_m, **pdl.launch())
    return _combine(y, ids, dest, x)


def _grid(blocks: int, tiles_n: int, group_m: int) -> tuple[int, ...]:
    """The grouped GEMMs' grid: (row blocks, column tiles), or one axis of both when ``group_m`` walks them grouped."""
    return (blocks * tiles_n,) if group_m else (blocks, tiles_n)


ONE_TOKEN_MAX_TOP_K = 16  # the down kernel ranks a token's picks in a [K_P2, K_P2] tile


def moe_experts_one_token(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                          w2: torch.Tensor, w3: torch.Tensor, limit: float) -> torch.Tensor:
    """``moe_experts`` for one token (a batch-1 decode step) in two launches, no ``align`` and no combine: its
    picks need no sorting (each expert's rows are read once per pick, as the grouped kernels read them), so
    ``_up_row_kernel`` reads every pick's ``w1`` / ``w3`` rows by its expert id, and ``_down_row_kernel`` reads
    each pick's ``w2`` rows and adds the weighted outputs in ascending expert order, rounded as ``_combine``. Both
    are one-row products like ``gemv._gemv_row_kernel`` (fp32 products summed once, no ``tl.dot``), with its
    launches for the same widths (``gemv.row_config``)."""
    top_k = ids.shape[1]
    _, I, D = w1.shape
    x, w1, w2, w3 = x.contiguous(), w1.contiguous(), w2.contiguous(), w3.contiguous()  # stacked views: no copy
    flat_ids = ids.reshape(-1).contiguous()
    h = torch.empty(top_k, I, dtype=x.dtype, device=x.device)
    up = gemv.row_config(I, D)
    _up_row_kernel[(triton.cdiv(I, up.block_n), top_k)](
        x, w1, w3, h, flat_ids, D, I, float(limit), w1.stride(0), w1.stride(1), BLOCK_N=up.block_n,
        BLOCK_K=up.block_k, EVEN=I % up.block_n == 0 and D % up.block_k == 0, num_warps=up.warps,
        num_stages=up.stages, **pdl.launch())
    out = torch.empty_like(x)
    down = gemv.row_config(D, I)
    _down_row_kernel[(triton.cdiv(D, down.block_n),)](
        h, w2, out, flat_ids, weights.reshape(-1).contiguous(), D, I, top_k, w2.stride(0), w2.stride(1),
        BLOCK_N=down.block_n, BLOCK_K=down.block_k, EVEN=D % down.block_n == 0 and I % down.block_k == 0,
        K_P2=triton.next_power_of_2(top_k), num_warps=down.warps, num_stages=down.stages, **pdl.launch())
    return out


@triton.jit
def _up_row_kernel(x_ptr, w1_ptr, w3_ptr, h_ptr, ids_ptr, D, I, limit, stride_we, stride_wi,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr = False):
    """Program (column block, pick j) of one token: ``h[j, n] = silu(min(x . w1[e, n], limit)) * clamp(x . w3[e, n])``
    for the pick's expert ``e = ids[j]``, rounded as ``_up_kernel``'s epilogue."""
    pdl.begin(PDL)
    pick = tl.program_id(1)
    expert = tl.load(ids_ptr + pick).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    in_n = cols < I
    rows = expert * stride_we + cols[:, None].to(tl.int64) * stride_wi  # [BN, 1]
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, D, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)  # [BK]
        xk = gemv.input_tile(x_ptr, ks, D, EVEN).to(tl.float32)[None, :]
        acc1 += gemv.weight_tile(w1_ptr + rows, ks, D, in_n, EVEN).to(tl.float32) * xk  # [BN, BK]
        acc3 += gemv.weight_tile(w3_ptr + rows, ks, D, in_n, EVEN).to(tl.float32) * xk
    dt = h_ptr.dtype.element_ty
    h = _swiglu(tl.sum(acc1, axis=1).to(dt).to(tl.float32), tl.sum(acc3, axis=1).to(dt).to(tl.float32), limit, dt)
    tl.store(h_ptr + pick * I + cols, h.to(dt), mask=in_n)  # [BN]


@triton.jit
def _down_row_kernel(h_ptr, w2_ptr, out_ptr, ids_ptr, weights_ptr, D, I, top_k, stride_we, stride_wd,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, K_P2: tl.constexpr,
                     PDL: tl.constexpr = False):
    """Program (column block) of one token: ``out[n] = sum_j weights[j] * (h[j] . w2[ids[j], n])``, each pick's
    product rounded, times its rounded weight, rounded, then added in ascending expert id (stable) and rounded after
    every addition: ``_down_kernel`` then ``_combine_kernel``'s arithmetic."""
    pdl.begin(PDL)
    j = tl.arange(0, K_P2)
    in_k = j < top_k
    rank = _expert_order(tl.load(ids_ptr + j, mask=in_k, other=0), in_k, K_P2)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    in_n = cols < D
    dt = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r in range(top_k):
        pick = tl.sum(tl.where((rank == r) & in_k, j, 0), axis=0)
        expert = tl.load(ids_ptr + pick).to(tl.int64)
        rows = expert * stride_we + cols[:, None].to(tl.int64) * stride_wd  # [BN, 1]
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k in range(0, I, BLOCK_K):
            ks = k + tl.arange(0, BLOCK_K)  # [BK]
            hk = gemv.input_tile(h_ptr + pick * I, ks, I, EVEN).to(tl.float32)[None, :]
            acc += gemv.weight_tile(w2_ptr + rows, ks, I, in_n, EVEN).to(tl.float32) * hk  # [BN, BK]
        w = tl.load(weights_ptr + pick).to(dt).to(tl.float32)
        part = (tl.sum(acc, axis=1).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)  # [BN]
        total = (total + part).to(dt).to(tl.float32)
    tl.store(out_ptr + cols, total.to(dt), mask=in_n)


GROUPED_GEMM_MIN_PER_EXPERT = 64  # mean assignments per expert from which prefill takes the grouped GEMM
GROUP_ALIGN = 16  # rows per expert run in the grouped layout are padded to this (TMA-friendly group starts)


def uses_grouped_gemm(x: torch.Tensor, num_assign: int, num_experts: int) -> bool:
    """Whether ``moe_experts`` runs through ``torch._grouped_mm`` (CUTLASS grouped GEMM on SM90 / SM100): bf16
    batches with more than ``GROUPED_GEMM_MIN_PER_EXPERT`` assignments per expert on average (prefill), where
    wgmma / tcgen05 tiles beat the Triton kernels'; decode sizes keep the Triton kernels."""
    return (x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and num_assign > GROUPED_GEMM_MIN_PER_EXPERT * num_experts)


def moe_experts_grouped(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                        w2: torch.Tensor, w3: torch.Tensor, limit: float, group_align: int = GROUP_ALIGN
                        ) -> torch.Tensor:
    """``moe_experts`` as three grouped GEMMs over the expert-sorted assignments (no host synchronisation, no
    weight copies: ``w.transpose(1, 2)`` is the column-major operand the grouped kernel reads in place).

    Rows are sorted by expert and each expert's run padded to ``group_align`` rows (``align``); padding rows
    compute on whatever token row 0 holds and are never read back. Same rounding as the reference op: each
    GEMM's output in the model dtype, the SwiGLU epilogue of ``_up_kernel`` (``_swiglu_kernel``), the routing
    weight applied and the picks added in ascending expert order (``_combine_kernel``).
    """
    tokens, offsets, dest = grouped_rows(ids, w1.shape[0], group_align)
    xs = x.contiguous().index_select(0, tokens)  # [P, D]
    gate = torch._grouped_mm(xs, w1.transpose(1, 2), offs=offsets)  # [P, I]
    up = torch._grouped_mm(xs, w3.transpose(1, 2), offs=offsets)  # [P, I]
    y = torch._grouped_mm(swiglu(gate, up, limit), w2.transpose(1, 2), offs=offsets)  # [P, D]
    return _combine(y, ids, dest, x, weights)


def grouped_rows(ids: torch.Tensor, num_experts: int, group_align: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The grouped GEMMs' layout of ``ids [T, top_k]`` (``align``, each expert's run padded to ``group_align``
    rows): the token each row reads ``[P]`` (token 0 for padding rows, never read back), the runs' cumulative row
    ends ``[E]`` (int32, the GEMMs' ``offs``) and each assignment's row ``dest [T * top_k]`` (for ``_combine``)."""
    sorted_assign, block_expert, dest = align(ids, num_experts, group_align)
    offsets = group_offsets(block_expert, num_experts, group_align)  # [E]
    tokens = torch.where(sorted_assign >= 0, sorted_assign // ids.shape[1], 0)  # [P]
    return tokens, offsets, dest


def group_offsets(block_expert: torch.Tensor, num_experts: int, block_m: int) -> torch.Tensor:
    """Cumulative row ends ``[E]`` (int32) of each expert's padded run, from ``align``'s ``block_expert``
    (non-decreasing expert ids, then -1 for the blocks past the end)."""
    owners = torch.where(block_expert < 0, num_experts, block_expert)  # [P // block_m], sorted
    experts = torch.arange(num_experts, device=block_expert.device)
    return (torch.searchsorted(owners, experts, right=True) * block_m).to(torch.int32)


SWIGLU_BLOCK = 2048


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` of ``gate`` / ``up [rows, I]`` (unit column stride;
    rows may be apart, as column blocks of one GEMM's output), in one pass."""
    rows, cols = gate.shape
    h = torch.empty(rows, cols, dtype=gate.dtype, device=gate.device)
    n = h.numel()
    if n:
        _swiglu_kernel[(triton.cdiv(n, SWIGLU_BLOCK),)](gate, up, h, n, float(limit), cols, gate.stride(0),
                                                         up.stride(0), BLOCK=SWIGLU_BLOCK, **pdl.launch())
    return h


@reference_under_compile(ref.swiglu_mlp)
def swiglu_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, limit: float) -> torch.Tensor:
    """``reference.swiglu_mlp`` (the shared expert): where ``w3`` follows ``w1`` in memory (the model allocates them
    as one tensor), one GEMM for both, then ``swiglu`` over its two column blocks, then ``w2``: three launches
    instead of seven, and one pass over the ``[T, I]`` intermediates instead of four (one-row products through
    ``gemv.linear``). Otherwise the reference."""
    both = _rows_together(w1, w3)
    if both is None or x.dim() != 2:
        return ref.swiglu_mlp(x, w1, w2, w3, limit)
    inter = w1.shape[0]
    linear = gemv.linear if gemv.enabled() else F.linear  # one row: the GEMV kernel, not cuBLAS's split-K pair
    gate_up = linear(x, both)  # [T, 2 I]
    return linear(swiglu(gate_up[:, :inter], gate_up[:, inter:], limit), w2)


def _rows_together(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor | None:
    """``[w1; w3]`` as one ``[2 I, D]`` view when ``w3``'s rows directly follow ``w1``'s in one storage, else None
    (two allocations that merely lie side by side are not one storage)."""
    if (w1.shape != w3.shape or w1.dtype != w3.dtype or w1.device != w3.device or not w1.is_contiguous()
            or not w3.is_contiguous() or w3.data_ptr() != w1.data_ptr() + w1.numel() * w1.element_size()
            or w1.untyped_storage().data_ptr() != w3.untyped_storage().data_ptr()):
        return None
    return w1.as_strided((2 * w1.shape[0], w1.shape[1]), (w1.shape[1], 1))


@triton.jit
def _swiglu_kernel(gate_ptr, up_ptr, h_ptr, n, limit, cols, gate_stride, up_stride, BLOCK: tl.constexpr,
                   PDL: tl.constexpr = False):
    """``h [rows, cols] = silu(min(gate, limit)) * clamp(up, -limit, limit)``, rounded as ``_up_kernel``'s epilogue;
    ``gate`` / ``up`` rows ``gate_stride`` / ``up_stride`` elements apart (column blocks of one GEMM's output)."""
    pdl.begin(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    row, col = offs // cols, offs % cols
    dt = h_ptr.dtype.element_ty
    gate = tl.load(gate_ptr + row * gate_stride + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * up_stride + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(h_ptr + offs, _swiglu(gate, up, limit, dt).to(dt), mask=mask)


@triton.jit
def _swiglu(gate, up, limit, dt: tl.constexpr):
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` of fp32 ``gate`` / ``up`` that hold ``dt`` values, the
    silu rounded to ``dt`` as the reference rounds it; fp32 (the caller rounds the product)."""
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return (gate * tl.sigmoid(gate)).to(dt).to(tl.float32) * up


COMBINE_BLOCK_D = 1024


def _combine(y: torch.Tensor, ids: torch.Tensor, dest: torch.Tensor, x: torch.Tensor,
             weights: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's ``top_k`` rows of ``y [P, D]`` (``dest [T * k]``) added in ascending expert order into a tensor
    like ``x``, each times its routing weight first when ``weights`` is given (``_combine_kernel``)."""
    T, top_k = ids.shape
    D = y.shape[-1]
    out = torch.empty_like(x)
    flat_weights = None if weights is None else weights.reshape(-1).contiguous()
    _combine_kernel[(T, triton.cdiv(D, COMBINE_BLOCK_D))](y, ids, dest, out, D, top_k, y.stride(0), out.stride(0),
                                                          flat_weights, WEIGHTED=weights is not None,
                                                          K_P2=triton.next_power_of_2(top_k), BLOCK_D=COMBINE_BLOCK_D,
                                                          **pdl.launch())
    return out


@triton.jit
def _combine_kernel(y_ptr, ids_ptr, dest_ptr, out_ptr, D, top_k, stride_ym, stride_ot, weights_ptr=None,
                    WEIGHTED: tl.constexpr = False, K_P2: tl.constexpr = 8, BLOCK_D: tl.constexpr = 1024,
                    PDL: tl.constexpr = False):
    """``out[t] = sum_k y[dest[t, k]]`` (``WEIGHTED``: ``y[dest[t, k]] * weights[t, k]``, the product rounded to the
    model dtype), added in ascending expert id (stable) and rounded to the model dtype after every addition: the
    reference's order (it adds experts one after another into a zeroed output)."""
    pdl.begin(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    j = tl.arange(0, K_P2)
    in_k = j < top_k
    rank = _expert_order(tl.load(ids_ptr + token * top_k + j, mask=in_k, other=0), in_k, K_P2)
    dest = tl.load(dest_ptr + token * top_k + j, mask=in_k, other=0)
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for r in range(top_k):
        row = tl.sum(tl.where((rank == r) & in_k, dest, 0), axis=0)
        part = tl.load(y_ptr + row * stride_ym + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        if WEIGHTED:
            pick = tl.sum(tl.where((rank == r) & in_k, j, 0), axis=0)
            w = tl.load(weights_ptr + token * top_k + pick).to(dt).to(tl.float32)
            part = (part * w).to(dt).to(tl.float32)
        acc = (acc + part).to(dt).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + offs_d, acc.to(dt), mask=d_mask)


@triton.jit
def _expert_order(ids, in_k, K_P2: tl.constexpr):
    """Each of a token's picks ``ids [K_P2]`` (``in_k``: the real ones) by its place in ascending expert order,
    stable (equal ids by pick index): the order the reference adds the experts' outputs in."""
    j = tl.arange(0, K_P2)
    before = (ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None]) & (j[None, :] < j[:, None]))  # [K, K]
    return tl.sum((before & in_k[None, :]).to(tl.int32), axis=1)

"""Triton kernels with fixed configurations for the batch-invariant CUDA ops (``cuda_ops``).

The rule every kernel here follows: the reduction that produces one output element runs in an order that
depends only on that element's own row (token, window, query) and on shapes fixed by the model (hidden
size, head count, head dim, weight shape), never on the number of rows, their order or the batch's
padding. Concretely:

* one fixed configuration per kernel and model shape (block sizes, ``num_warps``, ``num_stages``): no
  autotuning, no K split that follows the row count; the row count ``M`` is not specialised
  (``do_not_specialize``), so one compiled kernel serves every batch;
* a row's reduction runs inside one program, over blocks of a length fixed by the model; a matmul row's
  K loop is the same for every row of every tile (``tl.dot`` computes each output element from its own
  row and column only), its K splits are set by the weight's shape and added in split order. The GEMM has three
  launches (``LAUNCHES``), picked by the row count, that do the same arithmetic element by element (split-K in
  two tile sizes with the partials added by each tile's last program, and wide tiles adding the splits in
  registers: same BLOCK_K, same splits);
* attention reduces over each query's *own* visible keys, compacted in key order and split in fixed
  ``KV_CHUNK`` chunks from the first of them, so the batch's padding of the key axis never moves a chunk
  boundary (the same rule as ``cpu_ops.sink_attention``).

No launcher synchronises with the host (no ``.item()``, ``.tolist()``, ``nonzero`` or data-dependent
shapes), so the ops can be captured in CUDA graphs.

The kernels also run under Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors, which is how CI
checks their logic (indexing, masking, chunking, loop bounds, fold orders). The interpreter's ``tl.dot`` is
NumPy's BLAS matmul, whose result for a row changes with the row's place in the tile (measured), and it
computes bf16 operands wrongly (Triton 3.9). So under the interpreter ``_dot`` is an explicit fp32
multiply-and-sum over K in index order (``EMULATE``); on a GPU it is ``tl.dot`` (tensor cores for bf16 /
fp16, exact fp32 FMA for fp32), whose per-element result does not depend on the rest of the tile: that
property is checked by the tests marked ``nvidia``, not by the interpreter.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from deepinfer_batch_invariant import envs
from deepinfer_batch_invariant.primitives import KV_CHUNK
from deepinfer_core import envs as core_envs
from deepinfer_core.envs import Variable
from deepinfer_core.tile_counters import TileCounters

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_EMULATE = INTERPRET

# GEMM tiles (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by operand dtype, never by the row count.
# bf16 / fp16: 64-row tiles (one Hopper wgmma M); fp32 (exact fp32 FMA products: the model's mHC mixing GEMMs,
# N <= 24 and K = hc * hidden): small tiles, since an FMA tile's cost grows with its padded rows.
MM_CONFIGS = {torch.bfloat16: (64, 64, 64, 4, 3), torch.float16: (64, 64, 64, 4, 3),
              torch.float32: (16, 32, 32, 4, 2)}
# The same product in prefill-sized tiles: 128 x 128 tiles on two warpgroups, the same BLOCK_K (so the same ``tl.dot``
# steps along K, in the same order), each program running every K split of its tile one after the other and folding
# them in split order in registers: the split-K launch's arithmetic, element by element, without its fp32 partials in
# memory (``splits x M x N`` floats: a GiB per projection at 16,384 rows). Four stages: a program that folds splits
# holds two accumulators, so one program fills an SM's registers anyway (``ONE_SPLIT_STAGES`` otherwise).
MM_WIDE_CONFIGS = {torch.bfloat16: (128, 128, 64, 8, 4), torch.float16: (128, 128, 64, 8, 4)}
# The serial launch in 64 x 128 tiles on one warpgroup: twice the programs of the 128 x 128 tile at a given row count.
MM_SHORT_CONFIGS = {torch.bfloat16: (64, 128, 64, 4, 4), torch.float16: (64, 128, 64, 4, 4)}
# The split-K launch with the operands swapped (``out^T = W x^T``): 64 weight rows a tile on the left of the product,
# at most 16 activation rows on the right, so a decode step's few rows are not padded to a 64-row tile.
MM_SWAP_CONFIGS = {torch.bfloat16: (16, 64, 64, 4, 4), torch.float16: (16, 64, 64, 4, 4)}

ONE_SPLIT_STAGES = 3
"""Pipeline stages of a serial 128 x 128 program over an unsplit weight (one accumulator): at three stages two such
programs share an SM's shared memory, so one's epilogue overlaps the other's loads."""


class Launch(NamedTuple):
    """A GEMM launch: its tiles by dtype, whether a program sums its tile's splits itself (``serial``), whether the
    weight tile is the product's left operand (``swap``), and the pipeline stages over an unsplit weight where they
    differ from the tile's (``unsplit_stages``)."""

    configs: dict
    serial: bool
    swap: bool = False
    unsplit_stages: int | None = None


LAUNCHES = {  # every launch gives an element the same bits (same splits, K in order)
    "split": Launch(MM_CONFIGS, False),  # a program per tile and K split, the partials added by the tile's last program
    "split_swap": Launch(MM_SWAP_CONFIGS, False, swap=True),  # the same, weights on the left, 16-row activation tiles
    "split_wide": Launch(MM_WIDE_CONFIGS, False),  # the same in 128 x 128 tiles
    # a program per tile, its splits one after the other (``WIDE_GROUP_M``)
    "wide": Launch(MM_WIDE_CONFIGS, True, unsplit_stages=ONE_SPLIT_STAGES),
    "wide_short": Launch(MM_SHORT_CONFIGS, True),  # the same in 64 x 128 tiles
}
WIDE_MIN_ROWS = 256  # the default row launches' last bound (``ROW_LAUNCHES``)
ROW_LAUNCHES = ((WIDE_MIN_ROWS, "wide"), (128, "split_wide"), (17, "split"), (0, "split_swap"))
"""(fewest rows, launch) of a 16-bit GEMM, largest bound first (``DEEPINFER_BATCH_INVARIANT_GEMM_LAUNCHES`` replaces
it): the split-K launch keeps a decode step's weight read spread over the GPU, up to 16 rows with the weights on the
left of the product (one 16-row activation tile, not a 64-row one), in 128 x 128 tiles from 128 rows; from
256 rows the serial launch, whose programs sum their splits in registers (no partials in memory), in 64-row tiles where
128-row ones would leave the GPU short of programs (``WIDE_MIN_PROGRAMS``). All give a row the same bits
(``test_cuda.py`` checks them against each other on the GPU), so the choice may follow the row count and the weight's
shape (docs/batch-invariant.md has the timings behind it)."""
WIDE_MIN_PROGRAMS = 264
"""Fewest 128 x 128 programs (two per SM of an H200) for the ``wide`` launch to keep its tile; fewer take
``wide_short``."""
WIDE_GROUP_M = 8
"""Row tiles a wide launch walks together (``_grouped_tile``): at 16,384 rows x 4,096 a projection's activations are
read from HBM once per 8 row tiles' sweep of the columns instead of once per column tile."""
ROW_BLOCK_MAX = 4096
"""Largest block of a row reduction; longer rows are reduced block by block in a fixed loop."""
ATTN_BLOCK_H = {torch.bfloat16: 64, torch.float16: 64, torch.float32: 16}
"""Query heads per attention program by dtype (``tl.dot`` needs M >= 16; fewer heads are masked): the heads of a
query share its keys (one latent KV head), so 16-bit runs take 64 heads a program and read each key once per query
(Hopper's wgmma M); fp32 operands keep 16, their ``[heads, head_dim]`` tile being twice as large. With fewer such
programs than ``ATTN_FEW_PROGRAMS`` (decode of small batches) a program takes ``ATTN_FEW_BLOCK_H`` heads instead: every
sum over keys is a ``tl.dot`` along the keys in order (the probabilities' row sum too), which gives an element the
same bits whatever the tile's height, so the choice may follow the number of queries."""
ATTN_FEW_BLOCK_H = 16
ATTN_FEW_PROGRAMS: int | None = None
"""Fewest (query, ``ATTN_BLOCK_H`` heads) programs for the 64-head tile
(``DEEPINFER_BATCH_INVARIANT_ATTENTION_FEW_PROGRAMS`` replaces it); None: the GPU's SM count (132 on an H200, also the
count for CPU tensors under the interpreter). Fewer, as in a decode step of up to 131 queries of 64 heads on an H200,
take ``ATTN_FEW_BLOCK_H`` heads a program, four times the programs."""


def _precision(dtype: torch.dtype) -> str:
    """fp32 operands: exact fp32 products (``ieee``), as the CPU path; no TF32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _row_block(n: int) -> int:
    return max(16, min(triton.next_power_of_2(max(n, 1)), ROW_BLOCK_MAX))


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(max(n, 1)))


def _pdl() -> dict:
    """Launch arguments of programmatic dependent launch (SM90+; the NVIDIA backend's switch
    ``DEEPINFER_NVIDIA_PDL``, read through the core's declarations, as the backend's own kernels): a kernel may be
    scheduled while its predecessor on the stream finishes and waits (``_begin``) before touching memory. Off under
    Triton's interpreter."""
    return {"PDL": True, "launch_pdl": True} if not INTERPRET and _pdl_variable().read() else {"PDL": False}


@functools.cache
def _pdl_variable() -> Variable:
    for group in core_envs.declarations():
        if PDL_VARIABLE in group:
            return group[PDL_VARIABLE]
    return Variable(PDL_VARIABLE, bool, False, "no backend declares it: off")


PDL_VARIABLE = "DEEPINFER_NVIDIA_PDL"


@triton.jit
def _begin(PDL: tl.constexpr):
    """A kernel's first statement: with ``PDL``, wait until the previous kernel's writes are visible, then let the next
    one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """``acc + a @ b`` (``a [M, K]``, ``b [K, N]``, fp32 ``acc``): ``tl.dot``, or under the interpreter an
    explicit multiply-and-sum over K."""
    if EMULATE:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


# ----------------------------------------------------------------------------- matmul
SPLIT_K_PROGRAMS = 256
"""Split-K target: (groups x N tiles x K splits) programs per row tile, about two per SM of an H200 (132 SMs), so a
decode-sized GEMM (one row tile) reads its weight with the whole GPU. The split count is a function of the weight's
shape and dtype only (``split_k``), never of the row count: each output element is the same fixed-order fold of the
same partial sums whatever the batch (prefill-sized GEMMs add them in registers: ``MM_WIDE_CONFIGS``)."""
MIN_SPLIT_BLOCKS = 8
"""Fewest BLOCK_K steps per K split."""


def split_k(n: int, k: int, block_n: int, block_k: int, groups: int = 1) -> int:
    """K splits for a ``[groups * n, k]`` weight (``groups`` blocks of ``[n, k]``): enough programs to fill the GPU
    from one row tile, each split at least ``MIN_SPLIT_BLOCKS`` K blocks long. The plugin's variables
    ``DEEPINFER_BATCH_INVARIANT_SPLIT_K_PROGRAMS`` and ``DEEPINFER_BATCH_INVARIANT_MIN_SPLIT_BLOCKS`` replace either
    (other splits, other bits, as invariant; set them before the engine starts)."""
    programs = envs.get("DEEPINFER_BATCH_INVARIANT_SPLIT_K_PROGRAMS") or SPLIT_K_PROGRAMS
    min_blocks = envs.get("DEEPINFER_BATCH_INVARIANT_MIN_SPLIT_BLOCKS") or MIN_SPLIT_BLOCKS
    n_tiles = triton.cdiv(n, block_n) * groups
    longest = max(1, k // (min_blocks * block_k))
    return max(1, min(longest, programs // n_tiles))


@triton.jit
def _split_product(x_ptr, w_ptr, rm, rn, m_mask, n_mask, k_start, k_end, sxm, sxk, swn, swk,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, EMULATE: tl.constexpr, SWAP: tl.constexpr = False):
    """``x[rm, k_start:k_end] @ w[rn, k_start:k_end].T`` in fp32, ``BLOCK_K`` at a time from ``k_start``, from zero;
    with ``SWAP`` as ``(w @ x.T).T``: the same products, summed along K in the same order."""
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # [BLOCK_N, BLOCK_M]: the product transposed
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < k_end
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * sxm + rk[None, :] * sxk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(w_ptr + rn[None, :].to(tl.int64) * swn + rk[:, None] * swk,
                    mask=n_mask[None, :] & k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        if SWAP:
            acc = _dot(tl.trans(b), tl.trans(a), acc, PRECISION, EMULATE)
        else:
            acc = _dot(a, b, acc, PRECISION, EMULATE)
    if SWAP:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    return acc


@triton.jit
def _grouped_tile(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Tile ``pid`` of a ``tiles_m x tiles_n`` grid walked ``GROUP_M`` row tiles at a time: (row tile, column tile)."""
    in_group = GROUP_M * tiles_n
    first_m = pid // in_group * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + pid % in_group % group_m, pid % in_group // group_m


@triton.jit(do_not_specialize=["M"])
def _matmul_nt_kernel(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, M, N, K, K_SPLIT, SPLITS, sxm, sxk, swn, swk, som,
                      son, sos, sxg, swg, sog, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SERIAL: tl.constexpr, FOLD: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
                      EMULATE: tl.constexpr, PDL: tl.constexpr = False, SWAP: tl.constexpr = False):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``x @ w.T`` for one group (its operands and outputs ``sxg`` / ``swg`` /
    ``sog`` elements on), fp32 accumulation, K in ``SPLITS`` ranges ``K_SPLIT`` long.

    Serial launch (``SERIAL``; ``program_id(2)`` = group): the program sums the splits one after the other, each from
    zero, adds them in split order and writes ``out`` in its dtype. Split-K launch (``program_id(2)`` = group * SPLITS
    + split): the split's fp32 sum goes to ``part`` at offset ``split * sos``; then either ``_fold_splits_kernel``
    adds them, or (``FOLD``) the tile's last program to finish, counted in ``count`` (one int32 per tile, zero before
    and reset after), adds them in split order into ``out``. Every launch adds the same numbers in the same order.
    ``GROUP_M`` (serial launch): ``program_id(0)`` numbers the tiles ``GROUP_M`` row tiles at a time, column tile by
    column tile, so the programs running together share their rows and columns in L2 (an order of work only).
    ``SWAP``: the weight tile on the left of each product (``_split_product``)."""
    _begin(PDL)
    if GROUP_M > 0:
        pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    if SERIAL:
        group = tl.program_id(2).to(tl.int64)
        split = 0
    else:
        group = (tl.program_id(2) // SPLITS).to(tl.int64)
        split = tl.program_id(2) % SPLITS
    x_ptr += group * sxg
    w_ptr += group * swg
    out_ptr += group * sog
    part_ptr += group * sog
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    k_start = split * K_SPLIT
    acc = _split_product(x_ptr, w_ptr, rm, rn, m_mask, n_mask, k_start, tl.minimum(k_start + K_SPLIT, K),
                         sxm, sxk, swn, swk, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, EMULATE, SWAP)
    at = rm[:, None].to(tl.int64) * som + rn[None, :] * son  # [BLOCK_M, BLOCK_N]
    mask = m_mask[:, None] & n_mask[None, :]
    if SERIAL:
        for later in range(1, SPLITS):  # ((s0 + s1) + s2) + ...: _fold_splits_kernel's order
            k_start = later * K_SPLIT
            acc += _split_product(x_ptr, w_ptr, rm, rn, m_mask, n_mask, k_start, tl.minimum(k_start + K_SPLIT, K),
                                  sxm, sxk, swn, swk, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, EMULATE, SWAP)
        tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + split.to(tl.int64) * sos + at, acc, mask=mask)
        if FOLD:
            tl.debug_barrier()  # every thread's partial is stored before the count releases them
            tile = (tl.program_id(2) // SPLITS) * tl.num_programs(0) * tl.num_programs(1) + pid_m * tl.num_programs(1)
            tile += pid_n
            if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                total = tl.load(part_ptr + at, mask=mask, other=0.0, cache_modifier=".cg")
                for later in range(1, SPLITS):  # _fold_splits_kernel's order
                    total += tl.load(part_ptr + later * sos + at, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["SIZE"])
def _fold_splits_kernel(part_ptr, out_ptr, SIZE, SPLITS, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """``out = ((part[0] + part[1]) + part[2]) + ...`` element by element, in split order (fp32), cast to out."""
    _begin(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < SIZE
    ptrs = part_ptr + offs
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for _ in range(1, SPLITS):
        ptrs += SIZE  # pointer arithmetic: no int32 overflow of split * SIZE
        acc += tl.load(ptrs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def matmul_nt(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for ``x [..., K]``, ``weight [N, K]`` (same dtype), fp32 accumulation, result in
    ``x.dtype``. One fixed tile per dtype (``MM_CONFIGS``) and a K split fixed by the weight's shape
    (``split_k``): partial sums in fp32, folded in split order. Nothing depends on the row count."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, 1, k)  # [M, 1, K] (a view where possible)
    return _grouped_matmul(rows, weight, 1).reshape(*lead, weight.shape[0])


def grouped_matmul_nt(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """Block-diagonal ``x [M, G, K]`` times ``weight [G * N, K]`` -> ``[M, G, N]`` (group ``g``: ``x[:, g] @
    weight[g * N:(g + 1) * N].T``) in one launch; each group as ``matmul_nt`` computes it (the split by the
    ``[N, K]`` block's shape)."""
    return _grouped_matmul(x, weight, groups)


def row_launches() -> tuple[tuple[int, str], ...]:
    """``ROW_LAUNCHES``, or ``DEEPINFER_BATCH_INVARIANT_GEMM_LAUNCHES`` (``rows:launch`` pairs separated by commas,
    e.g. ``0:split,128:split_wide,512:wide``) parsed, largest bound first; a malformed value raises ``ValueError``."""
    raw = envs.get("DEEPINFER_BATCH_INVARIANT_GEMM_LAUNCHES")
    if not raw:
        return ROW_LAUNCHES
    pairs = []
    for item in raw.split(","):
        rows, _, name = item.strip().partition(":")
        if not rows.strip().isdigit() or name.strip() not in LAUNCHES:
            raise ValueError(f"DEEPINFER_BATCH_INVARIANT_GEMM_LAUNCHES={raw!r}: {item!r} is not rows:launch with a "
                             f"launch among {sorted(LAUNCHES)}")
        pairs.append((int(rows), name.strip()))
    if 0 not in (rows for rows, _ in pairs):
        raise ValueError(f"DEEPINFER_BATCH_INVARIANT_GEMM_LAUNCHES={raw!r}: no launch from 0 rows")
    return tuple(sorted(pairs, reverse=True))


def launch_for(m: int, dtype: torch.dtype, n: int, groups: int = 1) -> str:
    """The GEMM launch of ``m`` rows by a ``[groups * n, K]`` weight (``row_launches``; ``wide`` as ``wide_short`` where
    its 128 x 128 tiles number fewer than ``WIDE_MIN_PROGRAMS``); fp32 always the split-K launch (its own small
    tiles)."""
    if dtype not in MM_WIDE_CONFIGS:
        return "split"
    name = next(name for rows, name in row_launches() if m >= rows)
    block_m, block_n = MM_WIDE_CONFIGS[dtype][:2]
    if name == "wide" and triton.cdiv(m, block_m) * triton.cdiv(n, block_n) * groups < WIDE_MIN_PROGRAMS:
        return "wide_short"
    return name


def _grouped_matmul(x: torch.Tensor, weight: torch.Tensor, groups: int, launch: str | None = None,
                    fused_fold: bool | None = None, tile: tuple[int, ...] | None = None) -> torch.Tensor:
    """``x [M, G, K]`` (any strides), ``weight [G * N, K]`` -> ``[M, G, N]`` in ``x.dtype`` (docstrings above).

    ``launch``: one of ``LAUNCHES`` (16-bit operands), by default ``launch_for``'s. ``fused_fold`` False: the split-K
    launches' partials folded by ``_fold_splits_kernel`` rather than by each tile's last program (``_fold_counts``).
    ``tile``: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) in place of the launch's (bench_gemm.py's sweep).
    All compute the same splits and add them in the same order."""
    if x.dtype != weight.dtype:
        raise TypeError(f"matmul_nt: x is {x.dtype}, weight is {weight.dtype}")
    m, _, k = x.shape
    n = weight.shape[0] // groups
    out = torch.empty(m, groups, n, dtype=x.dtype, device=x.device)  # [M, G, N]
    if m == 0 or n == 0:
        return out
    k_split, splits = _k_splits(n, k, x.dtype, groups)
    configs, serial_launch, swap, unsplit_stages = LAUNCHES[launch or launch_for(m, x.dtype, n, groups)]
    block_m, block_n, block_k, warps, stages = tile or configs[x.dtype]
    if splits == 1 and unsplit_stages and tile is None:
        stages = unsplit_stages
    serial = serial_launch or splits == 1
    size = m * groups * n
    group_m = WIDE_GROUP_M if serial_launch else 0
    tiles = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    grid = (tiles[0] * tiles[1], 1, groups) if group_m else (*tiles, groups if serial else splits * groups)
    part = out if serial else torch.empty(splits, m, groups, n, dtype=torch.float32, device=x.device)
    counts = None if serial or fused_fold is False else _fold_counts(x.device, grid[0] * grid[1] * groups)
    _matmul_nt_kernel[grid](x, weight, out, part, part if counts is None else counts, m, n, k, k_split, splits,
                            x.stride(0), x.stride(2), weight.stride(0), weight.stride(1), groups * n, 1, size,
                            x.stride(1), n * weight.stride(0), n,
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SERIAL=serial, FOLD=counts is not None,
                            GROUP_M=group_m, PRECISION=_precision(x.dtype), EMULATE=_EMULATE, num_warps=warps,
                            num_stages=stages, SWAP=swap, **_pdl())
    if not serial and counts is None:  # [S, M, G, N] partials, folded in split order
        _fold_splits_kernel[(triton.cdiv(size, 1024),)](part, out, size, splits, BLOCK=1024, num_warps=4, **_pdl())
    return out


FOLD_COUNTS = TileCounters(16384)
"""The split-K launches' tile counts for their fused fold (a launch of more tiles takes ``_fold_splits_kernel``)."""


def _fold_counts(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The zeroed int32 tile counts for a split-K launch's fused fold on the current stream (``FOLD_COUNTS``), or
    None (then the fold kernel runs: the same sums): with ``DEEPINFER_BATCH_INVARIANT_FUSED_FOLD=0``, beyond its
    slots, and while a CUDA graph is captured before any eager launch made the buffer."""
    if not envs.get("DEEPINFER_BATCH_INVARIANT_FUSED_FOLD"):
        return None
    return FOLD_COUNTS.get(device, tiles)


def _k_splits(n: int, k: int, dtype: torch.dtype, groups: int) -> tuple[int, int]:
    """(K_SPLIT, splits) of a ``[groups * n, k]`` weight: ``split_k`` at the split-K launch's tile (``MM_CONFIGS``),
    whichever launch runs, each split a whole number of BLOCK_K steps and none empty."""
    _, block_n, block_k, _, _ = MM_CONFIGS[dtype]
    splits = split_k(n, k, block_n, block_k, groups)
    k_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    return k_split, triton.cdiv(k, k_split)


@triton.jit(do_not_specialize=["SIZE"])
def _swiglu_kernel(gate_ptr, up_ptr, out_ptr, SIZE, COLS, s_gate, s_up, limit, BLOCK: tl.constexpr,
                   PDL: tl.constexpr = False):
    """``out = silu(min(gate, limit)) * clamp(up, -limit, limit)`` element by element over ``[rows, COLS]`` (``gate``
    / ``up`` rows ``s_gate`` / ``s_up`` apart), rounded as ``forms.InvariantOps.swiglu_mlp``: the clamps in the
    model dtype, the silu in fp32 (``x / (1 + exp(-x))``) rounded to it, the product rounded once."""
    _begin(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < SIZE
    row, col = offs // COLS, offs % COLS
    dt = out_ptr.dtype.element_ty
    gate = tl.minimum(tl.load(gate_ptr + row * s_gate + col, mask=mask, other=0.0).to(tl.float32), limit)
    up = tl.load(up_ptr + row * s_up + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + offs, (silu * up).to(dt), mask=mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` of ``gate`` / ``up [rows, I]`` (unit column stride; rows
    may be apart: column blocks of one GEMM's output) in one elementwise pass: ``[rows, I]`` in their dtype."""
    rows, cols = gate.shape
    out = torch.empty(rows, cols, dtype=gate.dtype, device=gate.device)
    if out.numel():
        _swiglu_kernel[(triton.cdiv(out.numel(), 1024),)](gate, up, out, out.numel(), cols, gate.stride(0),
                                                          up.stride(0), float(limit), BLOCK=1024, num_warps=4, **_pdl())
    return out


# ----------------------------------------------------------------------------- rope
@triton.jit(do_not_specialize=["SIZE"])
def _rope_cos_sin_kernel(pos_ptr, freq_ptr, cos_ptr, sin_ptr, SIZE, HALF, scaling, BLOCK: tl.constexpr,
                         EMULATE: tl.constexpr, PDL: tl.constexpr = False):
    """``cos / sin (position * inv_freq) * scaling`` element by element over ``[positions, HALF]``: fp32 angles,
    libdevice's accurate sine and cosine (angles reach the context length); under the interpreter (``EMULATE``, which
    has no libdevice) ``tl.cos`` / ``tl.sin``."""
    _begin(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < SIZE
    position = tl.load(pos_ptr + offs // HALF, mask=mask, other=0).to(tl.float32)
    angle = position * tl.load(freq_ptr + offs % HALF, mask=mask, other=0.0)  # [BLOCK]
    if EMULATE:
        cos, sin = tl.cos(angle), tl.sin(angle)
    else:
        cos, sin = libdevice.cos(angle), libdevice.sin(angle)
    tl.store(cos_ptr + offs, (cos * scaling).to(cos_ptr.dtype.element_ty), mask=mask)
    tl.store(sin_ptr + offs, (sin * scaling).to(sin_ptr.dtype.element_ty), mask=mask)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    """Reference ``rope_cos_sin`` in one elementwise launch: ``[*positions.shape, rope_dim // 2]`` each, in
    ``dtype``."""
    freqs = inv_freq.to(device=positions.device, dtype=torch.float32).contiguous()  # [rope_dim // 2]
    flat = positions.reshape(-1).contiguous()  # [P]
    cos = torch.empty(*positions.shape, freqs.numel(), dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if cos.numel():
        _rope_cos_sin_kernel[(triton.cdiv(cos.numel(), 1024),)](flat, freqs, cos, sin, cos.numel(), freqs.numel(),
                                                                float(scaling), BLOCK=1024, EMULATE=_EMULATE,
                                                                num_warps=4, **_pdl())
    return cos, sin


# ----------------------------------------------------------------------------- row reductions
@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, sx, so, eps,
                     HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    _begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for n0 in range(0, N, BLOCK):
        x = tl.load(x_ptr + row * sx + n0 + cols, mask=n0 + cols < N, other=0.0).to(tl.float32)
        acc += x * x
    scale = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
    dt = out_ptr.dtype.element_ty
    if not HAS_WEIGHT:
        scale = scale.to(dt).to(tl.float32)  # the reference scales in x's dtype
    for n0 in range(0, N, BLOCK):
        mask = n0 + cols < N
        x = tl.load(x_ptr + row * sx + n0 + cols, mask=mask, other=0.0).to(tl.float32)
        y = x * scale
        if HAS_WEIGHT:
            y = tl.load(w_ptr + n0 + cols, mask=mask, other=0.0).to(tl.float32) * y
        tl.store(out_ptr + row * so + n0 + cols, y.to(dt), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()  # [rows, N]


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    rows = _rows(x)
    out = torch.empty_like(rows)
    n = rows.shape[1]
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, rows if weight is None else weight, out, n, rows.stride(0),
                                           out.stride(0), float(eps), HAS_WEIGHT=weight is not None,
                                           BLOCK=_row_block(n), num_warps=4, **_pdl())
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference ``rms_norm``: one program per row, the sum of squares over fixed blocks of the row."""
    return _rms(x, weight, eps)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference ``unweighted_rms_norm`` (scale rounded to ``x.dtype`` first), one program per row."""
    return _rms(x, None, eps)


@triton.jit
def _row_sum_kernel(x_ptr, out_ptr, N, sx, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    _begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for n0 in range(0, N, BLOCK):
        acc += tl.load(x_ptr + row * sx + n0 + cols, mask=n0 + cols < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty))


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis, keeping it (``x.sum(-1, keepdim=True)``), one program per row, fp32 accumulate."""
    rows = _rows(x)
    out = torch.empty(rows.shape[0], dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _row_sum_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0), BLOCK=_row_block(rows.shape[1]),
                                          **_pdl())
    return out.view(*x.shape[:-1], 1)


# ----------------------------------------------------------------------------- small-axis folds
@triton.jit
def _weighted_fold_kernel(w_ptr, x_ptr, out_ptr, L, B, swa, swl, swb, sxa, sxl, sxb,
                          ROUND: tl.constexpr, BLOCK_B: tl.constexpr, PDL: tl.constexpr = False):
    _begin(PDL)
    a = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    mask = cols < B
    acc = tl.zeros((BLOCK_B,), dtype=tl.float32)
    for l in range(L):  # a left fold in slot order
        w = tl.load(w_ptr + a * swa + l * swl + cols * swb, mask=mask, other=0.0)
        x = tl.load(x_ptr + a * sxa + l * sxl + cols * sxb, mask=mask, other=0.0)
        if ROUND:  # the product in the inputs' dtype (as the reference multiplies in it)
            p = (w.to(tl.float32) * x.to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)
        else:
            p = w.to(tl.float32) * x.to(tl.float32)
        acc += p
    tl.store(out_ptr + a * B + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def weighted_fold(w: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype, round_product: bool) -> torch.Tensor:
    """``sum_l w[a, l, b] * x[a, l, b]`` over ``l`` in index order, fp32 accumulation: ``[A, L, B] -> [A, B]``.

    ``w`` may broadcast (a stride-0 axis). ``round_product`` rounds each product to ``x.dtype`` first.
    """
    w = w.expand_as(x)
    A, L, B = x.shape
    out = torch.empty(A, B, dtype=out_dtype, device=x.device)
    if A and B:
        block = min(_pow2(B), 1024)
        _weighted_fold_kernel[(A, triton.cdiv(B, block))](w, x, out, L, B, *w.stride(), *x.stride(),
                                                          ROUND=round_product, BLOCK_B=block, num_warps=4, **_pdl())
    return out


# ----------------------------------------------------------------------------- compressor pooling
@triton.jit
def _pool_kernel(kv_ptr, gate_ptr, out_ptr, L, C, sk_n, sk_l, sg_n, sg_l,
                 BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):
    _begin(PDL)
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    slots = tl.arange(0, BLOCK_L)
    mask = (slots[:, None] < L) & (cols[None, :] < C)
    gate = tl.load(gate_ptr + n * sg_n + slots[:, None] * sg_l + cols[None, :], mask=mask,
                   other=float("-inf")).to(tl.float32)  # [BLOCK_L, BLOCK_C]
    e = tl.exp(gate - tl.max(gate, axis=0)[None, :])
    weights = e / tl.sum(e, axis=0)[None, :]
    dt = out_ptr.dtype.element_ty
    kv = tl.load(kv_ptr + n * sk_n + slots[:, None] * sk_l + cols[None, :], mask=mask, other=0.0)
    prod = (kv.to(tl.float32) * weights.to(dt).to(tl.float32)).to(dt).to(tl.float32)  # in kv's dtype
    prod = tl.where(mask, prod, 0.0)
    tl.store(out_ptr + n * C + cols, tl.sum(prod, axis=0).to(dt), mask=cols < C)


def pool(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``(kv * softmax_slots(gate).to(kv.dtype)).sum(slots)``: ``[N, slots, d] -> [N, d]``, one program per
    (window, channel block); the softmax and the sum reduce over the window's slots only."""
    kv, gate = kv.contiguous(), gate.contiguous()
    N, L, C = kv.shape
    out = torch.empty(N, C, dtype=kv.dtype, device=kv.device)
    if N and C:
        block_c = 64 if L > 64 else 128
        _pool_kernel[(N, triton.cdiv(C, block_c))](kv, gate, out, L, C, kv.stride(0), kv.stride(1), gate.stride(0),
                                                   gate.stride(1), BLOCK_L=_pow2(L, 2), BLOCK_C=block_c,
                                                   num_warps=4, **_pdl())
    return out


# ----------------------------------------------------------------------------- mHC Sinkhorn
# ----------------------------------------------------------------------------- attention
@triton.jit
def _sink_attention_kernel(q_ptr, kv_ptr, idx_ptr, count_ptr, sink_ptr, out_ptr, Lq, H, D, scale,
                           sq_s, sq_q, sq_h, sk_s, sk_k, si_q, so_s, so_q, so_h,
                           BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
                           PRECISION: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr = False):
    _begin(PDL)
    pid = tl.program_id(0).to(tl.int64)  # s * Lq + t
    s = pid // Lq
    t = pid % Lq
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    h_mask = heads < H
    d_mask = dims < D
    q = tl.load(q_ptr + s * sq_s + t * sq_q + heads[:, None] * sq_h + dims[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    count = tl.load(count_ptr + pid)  # this query's visible keys
    m = tl.load(sink_ptr + heads, mask=h_mask, other=0.0).to(tl.float32)  # running max, started at the sink
    sink = m
    denom = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    ones = tl.full((CHUNK, 16), 1.0, dtype=q.dtype)  # the row sum as a product: every column is the sum
    chunk = tl.arange(0, CHUNK)
    for c0 in range(0, count, CHUNK):  # this query's own keys, CHUNK at a time, in key order
        valid = c0 + chunk < count
        key = tl.load(idx_ptr + pid * si_q + c0 + chunk, mask=valid, other=0).to(tl.int64)
        k = tl.load(kv_ptr + s * sk_s + key[:, None] * sk_k + dims[None, :],
                    mask=valid[:, None] & d_mask[None, :], other=0.0)  # [CHUNK, BLOCK_D]
        zero = tl.zeros((BLOCK_H, CHUNK), dtype=tl.float32)
        scores = _dot(q, tl.trans(k), zero, PRECISION, EMULATE) * scale  # [BLOCK_H, CHUNK]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None]).to(k.dtype)  # [BLOCK_H, CHUNK]
        sums = _dot(p, ones, tl.zeros((BLOCK_H, 16), dtype=tl.float32), PRECISION, EMULATE)  # [BLOCK_H, 16]
        denom = denom * alpha + tl.max(sums, axis=1)  # the columns are equal: max picks the sum exactly
        acc = _dot(p, k, acc * alpha[:, None], PRECISION, EMULATE)
        m = m_new
    denom = denom + tl.exp(sink - m)  # the sink's mass is in the denominator only
    out = acc / denom[:, None]
    tl.store(out_ptr + s * so_s + t * so_q + heads[:, None] * so_h + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["Lk"])
def _compact_kernel(vis_ptr, idx_ptr, count_ptr, Lk, s_vis, s_idx, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program = one query row: the indices of its visible keys in key order into ``idx``, their number into
    ``count`` (integers only)."""
    _begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    found = 0
    for start in range(0, Lk, BLOCK):
        keys = start + tl.arange(0, BLOCK)  # [BLOCK]
        seen = tl.load(vis_ptr + row * s_vis + keys, mask=keys < Lk, other=0).to(tl.int32)
        place = found + tl.cumsum(seen, axis=0) - 1
        tl.store(idx_ptr + row * s_idx + place, keys, mask=seen > 0)
        found += tl.sum(seen, axis=0)
    tl.store(count_ptr + row, found)


def compact_visible(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's visible key indices in key order, and their number, without host synchronisation: one launch.

    ``visible [S, Lq, Lk]`` -> ``idx [S * Lq, Lk + 1]`` int32 (entries past a query's count are junk) and
    ``counts [S * Lq]`` int32.
    """
    S, Lq, Lk = visible.shape
    flat = visible.reshape(S * Lq, Lk).contiguous().view(torch.uint8)  # [S * Lq, Lk]
    idx = torch.empty(S * Lq, Lk + 1, dtype=torch.int32, device=visible.device)
    counts = torch.empty(S * Lq, dtype=torch.int32, device=visible.device)
    if S * Lq:
        _compact_kernel[(S * Lq,)](flat, idx, counts, Lk, flat.stride(0), idx.stride(0), BLOCK=1024, num_warps=4,
                                   **_pdl())
    return idx, counts


def attention_block_h(queries: int, heads: int, dtype: torch.dtype, device: torch.device | None = None) -> int:
    """Heads per attention program for ``queries`` query rows on ``device`` (``ATTN_BLOCK_H``, ``ATTN_FEW_BLOCK_H``)."""
    block_h = ATTN_BLOCK_H[dtype]
    few = envs.get("DEEPINFER_BATCH_INVARIANT_ATTENTION_FEW_PROGRAMS")
    if few is None:
        few = ATTN_FEW_PROGRAMS if ATTN_FEW_PROGRAMS is not None else _sm_count(device)
    return ATTN_FEW_BLOCK_H if queries * triton.cdiv(heads, block_h) < few else block_h


@functools.cache
def _sm_count(device: torch.device | None) -> int:
    """Streaming multiprocessors of a CUDA ``device``; 132 (an H200's) for other devices."""
    if device is None or device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def sink_attention(q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Reference ``sink_attention`` over each query's own visible keys in fixed ``KV_CHUNK`` chunks.

    ``q [S, Lq, H, d]``, ``kv [S, Lk, d]``, ``visible [S, Lq, Lk]``, ``sinks [H]``; returns ``[S, Lq, H, d]`` in
    ``q.dtype``. One program per (query, block of ``ATTN_BLOCK_H[dtype]`` heads, or ``ATTN_FEW_BLOCK_H`` with fewer
    programs than ``ATTN_FEW_PROGRAMS``: the same bits) runs an online softmax over the
    query's chunks in order (the running max starts at the sink logit; a query without keys gets 0).
    """
    S, Lq, H, d = q.shape
    q = q.contiguous()
    kv = kv.to(q.dtype).contiguous()
    out = torch.empty_like(q)
    if S * Lq == 0:
        return out
    idx, counts = compact_visible(visible)
    block_h = attention_block_h(S * Lq, H, q.dtype, q.device)
    grid = (S * Lq, triton.cdiv(H, block_h))
    _sink_attention_kernel[grid](q, kv, idx, counts, sinks.contiguous(), out, Lq, H, d, float(scale),
                                 q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), idx.stride(0),
                                 out.stride(0), out.stride(1), out.stride(2),
                                 BLOCK_H=block_h, BLOCK_D=_pow2(d), CHUNK=KV_CHUNK,
                                 PRECISION=_precision(q.dtype), EMULATE=_EMULATE,
                                 num_warps=4 if d <= 128 else 8, num_stages=2, **_pdl())
    return out


# ----------------------------------------------------------------------------- indexer
@triton.jit
def _indexer_kernel(q_ptr, k_ptr, w_ptr, out_ptr, Lq, E, Hi, Di, scale,
                    sq_s, sq_q, sq_h, sk_s, sk_e, sw_s, sw_q, so_s, so_q,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, EMULATE: tl.constexpr,
                    PDL: tl.constexpr = False):
    _begin(PDL)
    pid = tl.program_id(0).to(tl.int64)  # s * Lq + t
    s = pid // Lq
    t = pid % Lq
    ents = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    h_mask = heads < Hi
    e_mask = ents < E
    d_mask = dims < Di
    q = tl.load(q_ptr + s * sq_s + t * sq_q + heads[:, None] * sq_h + dims[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    k = tl.load(k_ptr + s * sk_s + ents[:, None] * sk_e + dims[None, :],
                mask=e_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)  # [BLOCK_E, BLOCK_D]
    w = tl.load(w_ptr + s * sw_s + t * sw_q + heads, mask=h_mask, other=0.0).to(tl.float32)
    dots = _dot(q, tl.trans(k), tl.zeros((BLOCK_H, BLOCK_E), dtype=tl.float32), "ieee", EMULATE)  # [BLOCK_H, BLOCK_E]
    terms = tl.maximum(dots, 0.0) * scale * w[:, None]
    tl.store(out_ptr + s * so_s + t * so_q + ents, tl.sum(terms, axis=0), mask=e_mask)


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference ``indexer_scores`` in fp32: one program per (query, block of 64 entries); an entry's score
    reduces over its own query's heads and dims only (no reduction runs along the padded entry axis)."""
    S, Lq, Hi, di = q.shape
    E = keys.shape[1]
    q, keys, head_weights = q.contiguous(), keys.contiguous(), head_weights.contiguous()
    out = torch.empty(S, Lq, E, dtype=torch.float32, device=q.device)
    if S * Lq == 0 or E == 0:
        return out
    grid = (S * Lq, triton.cdiv(E, KV_CHUNK))
    _indexer_kernel[grid](q, keys, head_weights, out, Lq, E, Hi, di, float(scale),
                          q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1),
                          head_weights.stride(0), head_weights.stride(1), out.stride(0), out.stride(1),
                          BLOCK_H=_pow2(Hi), BLOCK_D=_pow2(di), BLOCK_E=KV_CHUNK, EMULATE=_EMULATE,
                          num_warps=4, **_pdl())
    return out

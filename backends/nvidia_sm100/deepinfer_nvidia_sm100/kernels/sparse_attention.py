"""Ops ``sparse_sink_attention`` and ``visible_index`` as Triton kernels: top-k sparse CSA attention that reads each
query row's listed keys in place, as DeepSeek's FlashMLA sparse kernels do.

A CSA query row reads its sliding-window keys and the ``k`` compressed entries its indexer selected (``W + k`` = 640
for V4, whatever the context). The model lists them per row, ``index [S, Lq, N]`` (-1 for none): key ``j < Lk`` of the
step's window keys ``[S, Lk, d]``, key ``j >= Lk`` entry ``j - Lk`` of the layer's paged store (through the entries'
block and row ``[S, E]``, as ``gather_keys`` reads them), and:

1. ``_key_rows_kernel`` (with a store): one pass over the lists ``[B, N]`` writes each listed key's physical row,
   window key ``j`` of sequence ``s`` row ``s * Lk + j`` of the window keys, entry ``e`` row ``S * Lk + block *
   per_block + row`` (the store's rows numbered after the window keys'), -1 for none. The attention loop then loads
   each key tile with one gather, through a pointer chosen per key (the window keys or the store), index -> data as
   over a contiguous ``[S, Lk + E, d]``: the entries' block and row tables are read once per call, not by every head
   block of a row in its loop, and no tile is loaded twice (window and store) and merged. Its shared memory is the
   contiguous case's (``tile``), so 32 and 64 heads a program fit with two pipeline stages.
2. ``_sparse_split_kernel``: grid ``(H / BLOCK_H, splits, rows)`` (the head blocks of one row next to each other, so
   they share its keys in L2). A program loads ``BLOCK_N`` list places at a time, the keys they name (masked where
   -1), and runs the online softmax of ``kernels/decode_attention.py`` over them: base 2, fp32, the running max
   started at the sink logit, probabilities rounded to the model dtype before ``P @ V`` as the reference rounds them.
   No gathered copy, no mask over the sequence's keys. With one split the program writes the output; else partials
   that ``decode_attention._combine_kernel`` merges (a decode row: a few programs per row would leave most SMs idle).
   ``sparse_attention(..., tables=True)`` keeps the read before step 1 (the entries' tables loaded per tile, two
   masked gathers merged) for ``bench_sparse_attention.py``'s A/B; the op never takes it.
3. ``_visible_index_kernel``: one program per row of a bool mask ``[B, N]`` writes its first ``count`` visible places,
   ascending, then -1 (a prefix sum per chunk of the row): the sliding window's and the indexer's masks into the lists
   above, reading each mask once.

``covered`` inputs (a GPU, 16-bit or fp32, head count a multiple of ``BLOCK_H``, a power-of-two head width of at
least 16) take the kernels; others the reference ops. ``DEEPINFER_NVIDIA_SPARSE_ATTN_HEADS`` sets the heads a
program (by default 64 for prefill calls, 16 for decode rows: ``head_block``; ``bench_sparse_attention.py`` times
16, 32 and 64).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from deepinfer_core.errors import EnvironmentVariableError
from deepinfer_core.ops import reference as ref
from deepinfer_nvidia_sm100 import envs
from deepinfer_nvidia_sm100.kernels import gpu, pdl
from deepinfer_nvidia_sm100.kernels.compiled import opaque_under_compile
from deepinfer_nvidia_sm100.kernels.decode_attention import _combine_kernel, softmax_chunk, store_split

BLOCK_H = 16  # heads per program: one mma row tile
PREFILL_BLOCK_H = 64  # heads per program for calls of at least one query row per SM (``head_block``)
BLOCK_N = 64  # listed keys per loop iteration (``tile``: 32 at 64 heads a program)
SHARED_BYTES = 232_448  # shared memory a program may use on an H200 (and a B200)
BLOCKS_PER_SPLIT = 2  # key blocks a split takes at least
INDEX_CHUNK = 1024  # mask places per loop iteration of the index kernel
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROWS_CHUNK = 1024  # list places a program of the key-rows pass
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
NO_STORE: tl.constexpr = tl.constexpr(0)  # how the attention kernel reads keys: kv [S, Lk, d] alone
KEY_ROWS: tl.constexpr = tl.constexpr(1)  # physical rows of kv, then of the store (one gather a tile)
TABLES: tl.constexpr = tl.constexpr(2)  # entries through their block and row tables in the loop (the read before)


@triton.jit
def _key_rows_kernel(index_ptr, blocks_ptr, rows_ptr, out_ptr, total, N, queries, Lk, E, per_block, kv_rows,
                     BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (``BLOCK`` places of the lists ``[B, N]``): each listed key's physical row (module docstring, step 1):
    window key ``j`` of sequence ``s`` row ``s * Lk + j`` of the window keys, entry ``e`` row ``kv_rows + block *
    per_block + row`` (the store's rows after the window keys'), -1 for none."""
    pdl.begin(PDL)
    places = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [C]
    inside = places < total
    key = tl.load(index_ptr + places, mask=inside, other=-1).to(tl.int64)  # [C]
    seq = places // N // queries
    entry = key >= Lk
    at = seq * E + key - Lk  # [C]: the entry's place in the block and row tables
    block = tl.load(blocks_ptr + at, mask=entry, other=0).to(tl.int64)
    within = tl.load(rows_ptr + at, mask=entry, other=0).to(tl.int64)
    physical = tl.where(entry, kv_rows + block * per_block + within, seq * Lk + key)
    tl.store(out_ptr + places, tl.where(key >= 0, physical, -1).to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _sparse_split_kernel(q_ptr, kv_ptr, index_ptr, store_ptr, blocks_ptr, rows_ptr, sinks_ptr, out_ptr, opart_ptr,
                         mpart_ptr, lpart_ptr, queries, Lk, E, per_block, kv_rows, H, N, splits, scale_log2,
                         D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, WHOLE: tl.constexpr,
                         STORE: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    """Program (head block, split, row): the online softmax over this split's share of the row's listed keys (module
    docstring, step 2). ``STORE``: ``NO_STORE`` (``index`` names keys of ``kv [S, Lk, d]``), ``KEY_ROWS`` (``index``
    holds physical rows, ``_key_rows_kernel``'s: below ``kv_rows`` of ``kv``, from it of the store) or ``TABLES``
    (``index`` names keys, those from ``Lk`` on entries read through their block and row tables, per tile)."""
    pdl.begin(PDL)
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    split = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)
    seq = row // queries
    dims = tl.arange(0, D)  # [D]
    q = tl.load(q_ptr + (row * H + heads)[:, None] * D + dims[None, :])  # [BH, D]
    sink = tl.load(sinks_ptr + heads) * LOG2E  # [BH]
    m = sink  # the sink is a floor for the running max
    den = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    per_split = tl.cdiv(tl.cdiv(N, BLOCK_N), splits)
    first = split * per_split
    for i in range(per_split):
        places = (first + i) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        key = tl.load(index_ptr + row * N + places, mask=places < N, other=-1).to(tl.int64)  # [BN]
        listed = key >= 0
        if STORE == KEY_ROWS:  # one gather, each key's pointer into kv or the store
            entry = (key >= kv_rows)[:, None]  # [BN, 1]
            at = tl.where(entry, key[:, None] - kv_rows, key[:, None]) * D + dims[None, :]  # [BN, D]
            kv = tl.load(tl.where(entry, store_ptr + at, kv_ptr + at), mask=listed[:, None], other=0.0)
        elif STORE == TABLES:
            own = listed & (key < Lk)
            entry = listed & (key >= Lk)
            kv = tl.load(kv_ptr + (seq * Lk + key)[:, None] * D + dims[None, :], mask=own[:, None], other=0.0)
            at = seq * E + key - Lk  # [BN]: the entry's place in the block and row tables
            block = tl.load(blocks_ptr + at, mask=entry, other=0)
            place = block * per_block + tl.load(rows_ptr + at, mask=entry, other=0)
            stored = tl.load(store_ptr + place[:, None] * D + dims[None, :], mask=entry[:, None], other=0.0)
            kv = tl.where(entry[:, None], stored.to(kv.dtype), kv)  # [BN, D]
        else:
            kv = tl.load(kv_ptr + (seq * Lk + key)[:, None] * D + dims[None, :], mask=listed[:, None], other=0.0)
        m, den, acc = softmax_chunk(q, kv, listed, scale_log2, m, den, acc, PRECISION)
    store_split(acc, m, den, sink, out_ptr, opart_ptr, mpart_ptr, lpart_ptr, row, heads, dims, split, splits, H, D,
                WHOLE)


@triton.jit
def _visible_index_kernel(vis_ptr, out_ptr, N, count, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row): the row's first ``count`` visible places, ascending, then -1 (module docstring, step 3)."""
    pdl.begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    found = 0
    for start in range(0, N, CHUNK):
        places = start + tl.arange(0, CHUNK)  # [C]
        hit = (tl.load(vis_ptr + row * N + places, mask=places < N, other=0) != 0).to(tl.int32)
        slot = found + tl.cumsum(hit, axis=0) - 1
        tl.store(out_ptr + row * count + slot, places.to(tl.int32), mask=(hit > 0) & (slot < count))
        found += tl.sum(hit, axis=0)
    for start in range(0, count, CHUNK):
        slot = start + tl.arange(0, CHUNK)
        tl.store(out_ptr + row * count + slot, tl.full([CHUNK], -1, tl.int32), mask=(slot >= found) & (slot < count))


def covered(q: torch.Tensor, kv: torch.Tensor, store: torch.Tensor | None = None) -> bool:
    """Whether the attention kernel takes inputs of these shapes and dtypes: 16-bit or fp32 (q, kv and a store
    alike), head count a multiple of ``BLOCK_H``, a power-of-two head width of at least 16, some keys."""
    H, d = q.shape[-2:]
    return (q.dtype in _DTYPES and kv.dtype == q.dtype and (store is None or store.dtype == q.dtype)
            and H % BLOCK_H == 0 and d >= 16 and d & (d - 1) == 0 and (kv.shape[1] > 0 or store is not None))


def num_splits(rows: int, heads: int, listed: int, sms: int, block_h: int = BLOCK_H) -> int:
    """Splits of each row's listed keys: at least ``BLOCKS_PER_SPLIT`` blocks of ``BLOCK_N`` each, and at most one
    program per SM (of ``sms``) in all (``block_h`` heads a program): decode rows split, prefill rows (thousands of
    programs) do not."""
    blocks = max(1, math.ceil(listed / BLOCK_N))
    return max(1, min(math.ceil(blocks / BLOCKS_PER_SPLIT), sms // max(1, rows * (heads // block_h))))


def sparse_sink_attention(q: torch.Tensor, kv: torch.Tensor, index: torch.Tensor, sinks: torch.Tensor, scale: float,
                          store: torch.Tensor | None = None, entry_blocks: torch.Tensor | None = None,
                          entry_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Op ``sparse_sink_attention`` (``reference.sparse_sink_attention``): the kernel for ``covered`` GPU tensors,
    else the reference op."""
    if not (q.is_cuda and covered(q, kv, store)) or index.shape[-1] == 0:
        return ref.sparse_sink_attention(q, kv, index, sinks, scale, store, entry_blocks, entry_rows)
    S, Lq, H, _ = q.shape
    sms = gpu.sm_count(q.device.index or 0)
    block_h = head_block(H, S * Lq, sms)
    splits = num_splits(S * Lq, H, index.shape[-1], sms, block_h)
    return sparse_attention(q, kv, index, sinks, float(scale), splits, block_h, store, entry_blocks, entry_rows)


def head_block(heads: int, rows: int = 0, sms: int = 1) -> int:
    """Heads a program: ``DEEPINFER_NVIDIA_SPARSE_ATTN_HEADS`` (16, 32 or 64) where it divides ``heads``, else
    ``BLOCK_H``; 0 (the default): ``PREFILL_BLOCK_H`` for a call of at least ``sms`` query ``rows`` (each listed key
    then loaded once for all its heads, the rows filling the SMs), ``BLOCK_H`` for fewer (decode rows, whose keys are
    split across programs instead)."""
    wanted = envs.DEEPINFER_NVIDIA_SPARSE_ATTN_HEADS
    if wanted not in (0, 16, 32, 64):
        raise EnvironmentVariableError(f"DEEPINFER_NVIDIA_SPARSE_ATTN_HEADS must be 0 (by rows), 16, 32 or 64, got "
                                       f"{wanted}")
    if wanted == 0:
        wanted = PREFILL_BLOCK_H if rows >= sms else BLOCK_H
    return wanted if heads % wanted == 0 else BLOCK_H


def tile(block_h: int, tables: bool = False) -> tuple[int, int]:
    """``(BLOCK_N, pipeline stages)`` of the attention kernel at ``block_h`` heads a program, ``tables`` for the
    tables' read. Chosen so that bf16 at ``d`` = 512 needs at most ``SHARED_BYTES`` of shared memory with a margin,
    as Triton 3.6 and 3.9 compile it for sm_90a and sm_100a (``test_tiles_compile_within_shared_memory``): one gather a tile,
    16 heads (64, 2) 84,224 bytes, 32 heads (64, 2) 102,656, 64 heads (32, 2) 131,200 on sm_90a and 164,512 on sm_100a
    ((64, 2): 196,864 and 262,944); the tables' two gathers a tile, 16 heads (64, 2) 215,552, 32 heads (64, 1) 102,400
    ((64, 2): 233,984, which failed to launch on the H200), 64 heads (64, 1) 131,072 and 131,584."""
    if tables:
        return BLOCK_N, 2 if block_h <= 16 else 1
    return (BLOCK_N // 2 if block_h >= 64 else BLOCK_N), 2


def key_rows(index: torch.Tensor, Lk: int, entry_blocks: torch.Tensor, entry_rows: torch.Tensor, per_block: int,
             store_rows: int) -> torch.Tensor:
    """Each listed key of ``index [S, Lq, N]`` as a physical row ``[S * Lq, N]``: window key ``j < Lk`` of sequence
    ``s`` row ``s * Lk + j`` of the window keys ``[S, Lk, d]``, entry ``e = j - Lk`` row ``S * Lk + entry_blocks[s, e]
    * per_block + entry_rows[s, e]`` (the store's ``store_rows`` rows numbered after the window keys'), -1 stays -1;
    int32 where every row fits, else int64. One pass over the lists, no host sync."""
    S, Lq, N = index.shape
    kv_rows = S * Lk
    dtype = torch.int32 if kv_rows + store_rows < 2**31 else torch.int64
    keys = index.reshape(S * Lq, N).contiguous()  # [B, N]
    out = torch.empty(S * Lq, N, device=index.device, dtype=dtype)
    if keys.numel():
        _key_rows_kernel[(triton.cdiv(keys.numel(), ROWS_CHUNK),)](
            keys, entry_blocks.contiguous(), entry_rows.contiguous(), out, keys.numel(), N, Lq, Lk,
            entry_blocks.shape[1], per_block, kv_rows, BLOCK=ROWS_CHUNK, num_warps=4, **pdl.launch())
    return out


@opaque_under_compile("sparse_sink_attention",
                      lambda q, kv, index, sinks, scale, splits, block_h=BLOCK_H, store=None, entry_blocks=None,
                      entry_rows=None, tables=False: q.new_empty(q.shape))
def sparse_attention(q: torch.Tensor, kv: torch.Tensor, index: torch.Tensor, sinks: torch.Tensor, scale: float,
                     splits: int, block_h: int = BLOCK_H, store: torch.Tensor | None = None,
                     entry_blocks: torch.Tensor | None = None, entry_rows: torch.Tensor | None = None,
                     tables: bool = False) -> torch.Tensor:
    """``reference.sparse_sink_attention`` of ``covered`` inputs with ``splits`` splits of each row's keys and
    ``block_h`` heads a program (16, or 32 / 64 with 8 warps, where ``H`` is a multiple): ``q [S, Lq, H, d]``, ``kv
    [S, Lk, d]``, ``index [S, Lq, N]`` (int, -1 for none), ``sinks [H]``, the entries in ``store [blocks, rows, d]``
    at ``entry_blocks`` / ``entry_rows [S, E]`` or none -> ``[S, Lq, H, d]``. With a store, ``key_rows`` translates
    the lists first and the kernel gathers each tile once; ``tables``: the kernel reads the entries' tables per tile
    instead (the read before that pass, kept for ``bench_sparse_attention.py``'s A/B)."""
    S, Lq, H, d = q.shape
    Lk, N = kv.shape[1], index.shape[-1]
    rows = S * Lq
    keys = index.reshape(rows, N).to(torch.int32).contiguous()  # [B, N]: keys, or their rows (KEY_ROWS)
    if store is None:
        mode, blocks, places, E, per_block, store = NO_STORE.value, keys, keys, 0, 1, kv  # tables and store not read
    else:
        store, blocks, places = store.contiguous(), entry_blocks.contiguous(), entry_rows.contiguous()  # [S, E] each
        E, per_block = blocks.shape[1], store.shape[1]
        mode = TABLES.value if tables else KEY_ROWS.value
        if not tables:
            keys = key_rows(index, Lk, blocks, places, per_block, store.shape[0] * per_block)  # [B, N]
    qf = q.reshape(rows, H, d).contiguous()  # [B, H, d]
    out = torch.empty(rows, H, d, device=q.device, dtype=q.dtype)
    if splits > 1:
        opart = torch.empty(rows, splits, H, d, device=q.device, dtype=torch.float32)
        mpart = torch.empty(rows, splits, H, device=q.device, dtype=torch.float32)
        lpart = torch.empty_like(mpart)
    else:
        opart = mpart = lpart = out  # not written
    sinks = sinks.float().contiguous()
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32: ignored for 16-bit inputs
    block_n, stages = tile(block_h, mode == TABLES.value)
    _sparse_split_kernel[(H // block_h, splits, rows)](
        qf, kv.contiguous(), keys, store, blocks, places, sinks, out, opart, mpart, lpart, Lq, Lk, E, per_block,
        S * Lk, H, N, splits, scale * LOG2E.value, D=d, BLOCK_H=block_h, BLOCK_N=block_n, WHOLE=splits == 1,
        STORE=mode, PRECISION=precision, num_warps=4 if block_h <= 16 else 8, num_stages=stages,
        **pdl.launch())
    if splits > 1:
        _combine_kernel[(H // block_h, rows)](opart, mpart, lpart, sinks, out, H, splits, D=d, BLOCK_H=block_h,
                                              SPLITS_P2=triton.next_power_of_2(splits), num_warps=4, **pdl.launch())
    return out.view(S, Lq, H, d)


def visible_index(visible: torch.Tensor, count: int) -> torch.Tensor:
    """Op ``visible_index`` (``reference.visible_index``): the kernel on a GPU, else the reference op."""
    if not visible.is_cuda:
        return ref.visible_index(visible, count)
    return visible_places(visible, count)


@opaque_under_compile("visible_index",
                      lambda visible, count: visible.new_empty((*visible.shape[:-1], count), dtype=torch.int32))
def visible_places(visible: torch.Tensor, count: int) -> torch.Tensor:
    """``reference.visible_index`` of ``visible [..., N]`` bool: ``[..., count]`` int32, one program per row."""
    n = visible.shape[-1]
    flat = visible.reshape(math.prod(visible.shape[:-1]), n).contiguous().view(torch.uint8)  # [B, N]
    out = torch.empty(flat.shape[0], count, device=visible.device, dtype=torch.int32)
    if flat.shape[0] and count:
        _visible_index_kernel[(flat.shape[0],)](flat, out, n, count, CHUNK=INDEX_CHUNK, num_warps=4, **pdl.launch())
    return out.view(*visible.shape[:-1], count)

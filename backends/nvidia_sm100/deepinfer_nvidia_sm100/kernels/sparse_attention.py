"""Ops ``sparse_sink_attention`` and ``visible_index`` as Triton kernels: top-k sparse CSA attention that reads each
query row's listed keys in place, as DeepSeek's FlashMLA sparse kernels do.

A CSA query row reads its sliding-window keys and the ``k`` compressed entries its indexer selected (``W + k`` = 640
for V4, whatever the context). The model lists them per row, ``index [S, Lq, N]`` (-1 for none): key ``j < Lk`` of the
step's window keys ``[S, Lk, d]``, key ``j >= Lk`` entry ``j - Lk`` of the layer's paged store (through the entries'
block and row ``[S, E]``, as ``gather_keys`` reads them), and:

1. ``_sparse_split_kernel``: grid ``(H / BLOCK_H, splits, rows)`` (the head blocks of one row next to each other, so
   they share its keys in L2). A program loads ``BLOCK_N`` indices at a time, the keys they name (masked where -1),
   and runs the online softmax of ``kernels/decode_attention.py`` over them: base 2, fp32, the running max started at
   the sink logit, probabilities rounded to the model dtype before ``P @ V`` as the reference rounds them. No
   gathered copy, no mask over the sequence's keys. With one split the program writes the output; else partials
   that ``decode_attention._combine_kernel`` merges (a decode row: a few programs per row would leave most SMs idle).
2. ``_visible_index_kernel``: one program per row of a bool mask ``[B, N]`` writes its first ``count`` visible places,
   ascending, then -1 (a prefix sum per chunk of the row): the sliding window's and the indexer's masks into the lists
   above, reading each mask once.

``covered`` inputs (a GPU, 16-bit or fp32, head count a multiple of ``BLOCK_H``, a power-of-two head width of at
least 16) take the kernels; others the reference ops. ``DEEPINFER_NVIDIA_SPARSE_ATTN_HEADS`` sets the heads a
program (16 by default; ``bench_sparse_attention.py`` times 16, 32 and 64).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from deepinfer_core.errors import EnvironmentVariableError
from deepinfer_core.ops import reference as ref
from deepinfer_nvidia_sm100 import envs
from deepinfer_nvidia_sm100.kernels import pdl
from deepinfer_nvidia_sm100.kernels.compiled import opaque_under_compile
from deepinfer_nvidia_sm100.kernels.decode_attention import _combine_kernel

BLOCK_H = 16  # heads per program: one mma row tile
BLOCK_N = 64  # listed keys per loop iteration
BLOCKS_PER_SPLIT = 2  # key blocks a split takes at least
INDEX_CHUNK = 1024  # mask places per loop iteration of the index kernel
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _sparse_split_kernel(q_ptr, kv_ptr, index_ptr, store_ptr, blocks_ptr, rows_ptr, sinks_ptr, out_ptr, opart_ptr,
                         mpart_ptr, lpart_ptr, queries, Lk, E, per_block, H, N, splits, scale_log2, D: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, WHOLE: tl.constexpr, HAS_STORE: tl.constexpr,
                         PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    """Program (head block, split, row): the online softmax over this split's share of the row's listed keys (module
    docstring, step 1); ``HAS_STORE``: keys from ``Lk`` on are entries of the paged store."""
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
        key = tl.load(index_ptr + row * N + places, mask=places < N, other=-1)  # [BN]
        listed = key >= 0
        if HAS_STORE:
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
        scores = tl.dot(q, tl.trans(kv), input_precision=PRECISION)  # [BH, BN] fp32
        scores = tl.where(listed[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])  # [BH, BN]
        den = den * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=PRECISION)  # [BH, D]
        m = m_new
    if WHOLE:  # the combine of one split: the sink once, in the denominator
        scale = 1.0 / (den + tl.exp2(sink - m))
        tl.store(out_ptr + (row * H + heads)[:, None] * D + dims[None, :],
                 (acc * scale[:, None]).to(out_ptr.dtype.element_ty))
    else:
        part = (row * splits + split) * H + heads  # [BH]
        tl.store(opart_ptr + part[:, None] * D + dims[None, :], acc)
        tl.store(mpart_ptr + part, m)
        tl.store(lpart_ptr + part, den)


@triton.jit
def _visible_index_kernel(vis_ptr, out_ptr, N, count, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row): the row's first ``count`` visible places, ascending, then -1 (module docstring, step 2)."""
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


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sparse_sink_attention(q: torch.Tensor, kv: torch.Tensor, index: torch.Tensor, sinks: torch.Tensor, scale: float,
                          store: torch.Tensor | None = None, entry_blocks: torch.Tensor | None = None,
                          entry_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Op ``sparse_sink_attention`` (``reference.sparse_sink_attention``): the kernel for ``covered`` GPU tensors,
    else the reference op."""
    if not (q.is_cuda and covered(q, kv, store)) or index.shape[-1] == 0:
        return ref.sparse_sink_attention(q, kv, index, sinks, scale, store, entry_blocks, entry_rows)
    S, Lq, H, _ = q.shape
    block_h = head_block(H)
    splits = num_splits(S * Lq, H, index.shape[-1], _sm_count(q.device.index or 0), block_h)
    return sparse_attention(q, kv, index, sinks, float(scale), splits, block_h, store, entry_blocks, entry_rows)


def head_block(heads: int) -> int:
    """Heads a program: ``DEEPINFER_NVIDIA_SPARSE_ATTN_HEADS`` (16, 32 or 64) where it divides ``heads``, else
    ``BLOCK_H``."""
    wanted = envs.DEEPINFER_NVIDIA_SPARSE_ATTN_HEADS
    if wanted not in (16, 32, 64):
        raise EnvironmentVariableError(f"DEEPINFER_NVIDIA_SPARSE_ATTN_HEADS must be 16, 32 or 64, got {wanted}")
    return wanted if heads % wanted == 0 else BLOCK_H


def _stages(block_h: int) -> int:
    """Software pipeline depth: two key tiles in flight, one with 64 heads a program (two stages of 64 heads at
    ``d`` = 512 asked for 262,656 bytes of shared memory on an H200, whose limit is 232,448)."""
    return 1 if block_h >= 64 else 2


@opaque_under_compile("sparse_sink_attention",
                      lambda q, kv, index, sinks, scale, splits, block_h=BLOCK_H, store=None, entry_blocks=None,
                      entry_rows=None: q.new_empty(q.shape))
def sparse_attention(q: torch.Tensor, kv: torch.Tensor, index: torch.Tensor, sinks: torch.Tensor, scale: float,
                     splits: int, block_h: int = BLOCK_H, store: torch.Tensor | None = None,
                     entry_blocks: torch.Tensor | None = None, entry_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``reference.sparse_sink_attention`` of ``covered`` inputs with ``splits`` splits of each row's keys and
    ``block_h`` heads a program (16, or 32 / 64 with 8 warps, where ``H`` is a multiple): ``q [S, Lq, H, d]``, ``kv
    [S, Lk, d]``, ``index [S, Lq, N]`` (int, -1 for none), ``sinks [H]``, the entries in ``store [blocks, rows, d]``
    at ``entry_blocks`` / ``entry_rows [S, E]`` or none -> ``[S, Lq, H, d]``."""
    S, Lq, H, d = q.shape
    Lk, N = kv.shape[1], index.shape[-1]
    has_store = store is not None
    if has_store:
        store, blocks, places = store.contiguous(), entry_blocks.contiguous(), entry_rows.contiguous()  # [S, E] each
        E, per_block = blocks.shape[1], store.shape[1]
    else:
        store, blocks, places, E, per_block = kv, index, index, 0, 1  # not read
    rows = S * Lq
    qf = q.reshape(rows, H, d).contiguous()  # [B, H, d]
    keys = index.reshape(rows, N).to(torch.int32).contiguous()  # [B, N]
    out = torch.empty(rows, H, d, device=q.device, dtype=q.dtype)
    if splits > 1:
        opart = torch.empty(rows, splits, H, d, device=q.device, dtype=torch.float32)
        mpart = torch.empty(rows, splits, H, device=q.device, dtype=torch.float32)
        lpart = torch.empty_like(mpart)
    else:
        opart = mpart = lpart = out  # not written
    sinks = sinks.float().contiguous()
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32: ignored for 16-bit inputs
    _sparse_split_kernel[(H // block_h, splits, rows)](
        qf, kv.contiguous(), keys, store, blocks, places, sinks, out, opart, mpart, lpart, Lq, Lk, E, per_block, H, N,
        splits, scale * LOG2E.value, D=d, BLOCK_H=block_h, BLOCK_N=BLOCK_N, WHOLE=splits == 1, HAS_STORE=has_store,
        PRECISION=precision, num_warps=4 if block_h <= 16 else 8, num_stages=_stages(block_h), **pdl.launch())
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

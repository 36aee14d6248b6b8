"""Op ``sink_attention`` for decode rows (one query per sequence) as Triton kernels.

Matches ``deepinfer_core.ops.reference.sink_attention`` (shared-KV MQA with per-head sinks; see
``kernels/tl_attention.py`` for the math). A decode row is ``H`` query heads over at most a few hundred keys at the
bench's contexts (the window's 128 plus the compressed entries): the TileLang kernel, built for prefill's 64-head
wgmma tiles, runs one CTA per 64 heads there, and its fixed cost outweighs the few keys. Here a program takes
``BLOCK_H`` heads (16: one ``mma`` row tile) and a contiguous share of the row's visible key blocks
(``key_blocks.visible_blocks``), so a batch-1 row spreads over
``H / BLOCK_H x splits`` programs:

1. ``_split_kernel``: grid ``(splits, H / BLOCK_H, rows)``. Online softmax in base 2 in fp32, the running max
   started at the sink logit (so a split with no visible key leaves ``l = 0``, never NaN); the probabilities are
   rounded to the model dtype before ``P @ V`` (the reference rounds its probabilities too). With one split the
   program normalises and writes the output itself; else it writes partials ``O [rows, splits, H, d]`` and
   ``M`` / ``L [rows, splits, H]`` (fp32).
2. ``_combine_kernel`` (two or more splits): ``M = max_s m_s``, ``L = sum_s l_s 2^(m_s - M) + 2^(sink - M)`` (the
   sink in the denominator only), ``out = sum_s O_s 2^(m_s - M) / L``.

Decode steps of one sequence take it (the rows it is tuned for); prefill rows and larger batches
keep the fallback (the TileLang kernel where installed). ``DEEPINFER_NVIDIA_DECODE_ATTN=0`` turns it off;
``DEEPINFER_NVIDIA_DECODE_ATTN_MAX_ROWS`` raises the row limit.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100 import envs
from deepinfer_nvidia_sm100.kernels import gpu, pdl
from deepinfer_nvidia_sm100.kernels.compiled import opaque_under_compile
from deepinfer_nvidia_sm100.kernels.key_blocks import visible_blocks

BLOCK_H = 16  # heads per program: one mma row tile
BLOCK_N = 64  # keys per block (the visible-block lists' unit)
BLOCKS_PER_SPLIT = 2  # key blocks a split takes at least
_DTYPES = (torch.bfloat16, torch.float16)


def enabled() -> bool:
    """Whether ``DEEPINFER_NVIDIA_DECODE_ATTN`` puts the kernel in the op table (on by default)."""
    return envs.DEEPINFER_NVIDIA_DECODE_ATTN


LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # the kernels keep logits in base 2


@triton.jit
def _split_kernel(q_ptr, kv_ptr, vis_ptr, blocks_ptr, counts_ptr, sinks_ptr, out_ptr, opart_ptr, mpart_ptr,
                  lpart_ptr, queries, Lk, H, NB, splits, scale_log2, D: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_N: tl.constexpr, WHOLE: tl.constexpr, PDL: tl.constexpr = False):
    """Program (split, head block, row): the online softmax over this split's share of the row's visible key blocks
    (module docstring, step 1); ``WHOLE`` (one split): normalised into ``out``, no partials."""
    pdl.begin(PDL)
    split = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    row = tl.program_id(2).to(tl.int64)
    seq = row // queries
    dims = tl.arange(0, D)  # [D]
    q = tl.load(q_ptr + (row * H + heads)[:, None] * D + dims[None, :])  # [BH, D]
    sink = tl.load(sinks_ptr + heads) * LOG2E  # [BH]
    m = sink  # the sink is a floor for the running max
    den = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    n_blocks = tl.load(counts_ptr + row)
    per_split = tl.cdiv(n_blocks, splits)
    first = split * per_split
    count = tl.maximum(tl.minimum(per_split, n_blocks - first), 0)
    for i in range(count):
        block = tl.load(blocks_ptr + row * NB + first + i)
        keys = block * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        in_k = keys < Lk
        kv = tl.load(kv_ptr + (seq * Lk + keys)[:, None] * D + dims[None, :], mask=in_k[:, None], other=0.0)
        seen = tl.load(vis_ptr + row * Lk + keys, mask=in_k, other=0) != 0  # [BN]
        m, den, acc = softmax_chunk(q, kv, seen, scale_log2, m, den, acc, "tf32")
    store_split(acc, m, den, sink, out_ptr, opart_ptr, mpart_ptr, lpart_ptr, row, heads, dims, split, splits, H, D,
                WHOLE)


@triton.jit
def softmax_chunk(q, kv, valid, scale_log2, m, den, acc, PRECISION: tl.constexpr):
    """One key chunk of the online softmax: ``q [BH, D]`` against ``kv [BN, D]`` where ``valid [BN]``, logits in
    base 2 (``scale_log2``); returns the running max ``m``, denominator ``den [BH]`` and output ``acc [BH, D]``
    (fp32) updated."""
    scores = tl.dot(q, tl.trans(kv), input_precision=PRECISION)  # [BH, BN] fp32
    scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])  # [BH, BN]
    den = den * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=PRECISION)  # [BH, D]
    return m_new, den, acc


@triton.jit
def store_split(acc, m, den, sink, out_ptr, opart_ptr, mpart_ptr, lpart_ptr, row, heads, dims, split, splits, H,
                D: tl.constexpr, WHOLE: tl.constexpr):
    """A split's end: with ``WHOLE`` (one split) its output normalised with the sink once in the denominator, else
    its partials (``acc``, ``m``, ``den``) for ``_combine_kernel``."""
    if WHOLE:
        scale = 1.0 / (den + tl.exp2(sink - m))
        tl.store(out_ptr + (row * H + heads)[:, None] * D + dims[None, :],
                 (acc * scale[:, None]).to(out_ptr.dtype.element_ty))
    else:
        part = (row * splits + split) * H + heads  # [BH]
        tl.store(opart_ptr + part[:, None] * D + dims[None, :], acc)
        tl.store(mpart_ptr + part, m)
        tl.store(lpart_ptr + part, den)


@triton.jit
def _combine_kernel(opart_ptr, mpart_ptr, lpart_ptr, sinks_ptr, out_ptr, H, splits, D: tl.constexpr,
                    BLOCK_H: tl.constexpr, SPLITS_P2: tl.constexpr, PDL: tl.constexpr = False):
    """Program (head block, row): the splits' partials into the output (module docstring, step 2)."""
    pdl.begin(PDL)
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    row = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, SPLITS_P2)  # [SP]
    in_s = s < splits
    part = (row * splits + s)[:, None] * H + heads[None, :]  # [SP, BH]
    m = tl.load(mpart_ptr + part, mask=in_s[:, None], other=float("-inf"))
    den = tl.load(lpart_ptr + part, mask=in_s[:, None], other=0.0)
    sink = tl.load(sinks_ptr + heads) * LOG2E  # [BH]
    top = tl.maximum(tl.max(m, axis=0), sink)  # [BH]
    weight = tl.exp2(m - top[None, :])  # [SP, BH]: 0 past the splits
    total = tl.sum(den * weight, axis=0) + tl.exp2(sink - top)
    dims = tl.arange(0, D)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    for i in range(splits):
        w = tl.sum(tl.where(s[:, None] == i, weight, 0.0), axis=0)  # [BH]
        o = tl.load(opart_ptr + ((row * splits + i) * H + heads)[:, None] * D + dims[None, :])  # [BH, D]
        acc += o * w[:, None]
    out = (acc / total[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + (row * H + heads)[:, None] * D + dims[None, :], out)


def max_rows() -> int:
    """Most decode rows a call may have to take the kernel: ``DEEPINFER_NVIDIA_DECODE_ATTN_MAX_ROWS``, 1 by default
    (batch 1, the rows the kernel is tuned for; larger batches keep the fallback)."""
    return envs.DEEPINFER_NVIDIA_DECODE_ATTN_MAX_ROWS


def covered(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether the kernel takes inputs of these shapes and dtypes (on a GPU): decode rows (one query per sequence) of
    at most ``max_rows()`` sequences, 16-bit, head count a multiple of ``BLOCK_H``, a power-of-two head width of at
    least 16."""
    S, Lq, H, d = q.shape
    return (q.dtype in _DTYPES and kv.dtype == q.dtype and Lq == 1 and S <= max_rows() and H % BLOCK_H == 0
            and d >= 16 and d & (d - 1) == 0 and kv.shape[1] > 0)


def num_splits(rows: int, heads: int, lk: int, sms: int) -> int:
    """Key splits per row: at least ``BLOCKS_PER_SPLIT`` key blocks each, and at most one program per SM (of ``sms``)
    in all."""
    blocks = max(1, math.ceil(lk / BLOCK_N))
    programs = rows * (heads // BLOCK_H)
    return max(1, min(math.ceil(blocks / BLOCKS_PER_SPLIT), sms // programs))


def with_fallback(fallback: Callable) -> Callable:
    """Op ``sink_attention``: the kernel for ``covered`` GPU tensors, else ``fallback`` (same arguments)."""

    def sink_attention(q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor,
                       scale: float) -> torch.Tensor:
        if not (q.is_cuda and covered(q, kv)):
            return fallback(q, kv, visible, sinks, scale)
        return _attend(q, kv, visible, sinks, scale)

    sink_attention.__doc__ = f"Decode rows through ``decode_attention``, other rows through ``{fallback.__name__}``."
    sink_attention.fallback = fallback
    return sink_attention


def _attend(q, kv, visible, sinks, scale) -> torch.Tensor:
    blocks, counts = planned_blocks(visible)
    splits = num_splits(q.shape[0], q.shape[2], kv.shape[1], gpu.sm_count(q.device.index or 0))
    return decode_attention(q, kv, visible, blocks, counts, sinks, float(scale), splits)


_PLANS: dict[int, tuple] = {}
_MAX_PLANS = 64


def planned_blocks(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``key_blocks.visible_blocks`` (``BLOCK_N`` keys a block) of the mask ``visible [S, Lq, Lk]``, made once per
    mask: the layers of a step that share a mask (every sliding layer; the compressed layers of one ratio
    whose indexer selects every entry) share its block lists, as FlashInfer plans a step once for all its layers. An
    eager step's masks are fresh tensors, never written after they are made; a captured decode step rewrites its
    static masks at each replay, and the list kernel captured with the first layer that reads a mask rewrites its
    lists after them. A mask object that died is never matched (its weak reference is checked)."""
    if torch.compiler.is_compiling():
        return _mask_blocks(visible)
    plan = _PLANS.get(id(visible))
    if plan is not None and plan[0]() is visible:
        return plan[1]
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    made = _mask_blocks(visible)
    _PLANS[id(visible)] = (weakref.ref(visible), made)
    return made


def _mask_blocks(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return visible_blocks(_mask_bytes(visible), BLOCK_N)


def _mask_bytes(visible: torch.Tensor) -> torch.Tensor:
    """``visible [S, Lq, Lk]`` bool as ``[S * Lq, Lk]`` bytes (a view where it is contiguous)."""
    return visible.reshape(-1, visible.shape[-1]).contiguous().view(torch.uint8)


@opaque_under_compile("decode_sink_attention",
                      lambda q, kv, visible, blocks, counts, sinks, scale, splits: q.new_empty(q.shape))
def decode_attention(q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, blocks: torch.Tensor,
                     counts: torch.Tensor, sinks: torch.Tensor, scale: float, splits: int) -> torch.Tensor:
    """``reference.sink_attention`` of ``covered`` inputs with ``splits`` key splits per row: ``q [S, 1, H, d]``,
    ``kv [S, Lk, d]``, ``visible [S, 1, Lk]`` bool (its visible key blocks ``blocks [S, NB]`` / ``counts [S]``:
    ``planned_blocks``), ``sinks [H]`` -> ``[S, 1, H, d]``."""
    S, Lq, H, d = q.shape
    Lk = kv.shape[1]
    rows = S * Lq
    qf = q.reshape(rows, H, d).contiguous()  # [B, H, d]
    vis = _mask_bytes(visible)  # [B, Lk]
    out = torch.empty(rows, H, d, device=q.device, dtype=q.dtype)
    if splits > 1:
        opart = torch.empty(rows, splits, H, d, device=q.device, dtype=torch.float32)
        mpart = torch.empty(rows, splits, H, device=q.device, dtype=torch.float32)
        lpart = torch.empty_like(mpart)
    else:
        opart = mpart = lpart = out  # not written
    sinks = sinks.float().contiguous()
    _split_kernel[(splits, H // BLOCK_H, rows)](
        qf, kv.contiguous(), vis, blocks, counts, sinks, out, opart, mpart, lpart, Lq, Lk, H, blocks.shape[1], splits,
        float(scale) * LOG2E.value, D=d, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, WHOLE=splits == 1, num_warps=4,
        num_stages=2, **pdl.launch())
    if splits > 1:
        _combine_kernel[(H // BLOCK_H, rows)](opart, mpart, lpart, sinks, out, H, splits, D=d, BLOCK_H=BLOCK_H,
                                              SPLITS_P2=triton.next_power_of_2(splits), num_warps=4, **pdl.launch())
    return out.view(S, Lq, H, d)

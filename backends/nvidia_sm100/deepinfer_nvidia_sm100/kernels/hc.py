"""mHC mixing (op ``hc_pre``) with the sigmoid / softmax / Sinkhorn part as one Triton kernel.

``deepinfer_core.ops.reference.hc_pre`` is three parts: mixing logits (RMS norm + a small GEMM), the weights
(two sigmoids, a softmax, then ``sinkhorn_iters`` row / column normalisations of an ``hc x hc`` matrix per
token) and the collapse of the streams. Compiled by TorchInductor, the weights part still became one kernel
per normalisation (~39 launches per call, 16 calls per decode step of the bench preset: ~600 launches), because
each normalisation reduces along another axis. ``_hc_weights_kernel`` keeps each token's ``hc x hc`` matrix in
registers for the whole loop: one launch per call. The collapse (``_hc_collapse_kernel``) is Triton too.

The mixing logits: the row is split over many programs, each returning its share of the sum of squares and of
the ``fn`` dot products, and ``_hc_mix_finish_kernel`` adds the shares in a fixed order and scales by the norm (the
norm is a per-row scalar, so it can follow the dot products). For 16-bit streams (the served dtypes)
``_hc_mix_partial_kernel`` computes the shares on tensor cores in 64-token tiles (``TENSOR_CORES``), ``fn`` split
into three 16-bit parts so the products keep fp32 accuracy. fp32 streams take fp32 products up to
``MIX_KERNEL_MAX_TOKENS`` tokens and the compiled reference beyond (``benchmarks/bench_hc_mix.py`` times each form).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.ops import reference as ref
from deepinfer_nvidia_sm100 import envs
from deepinfer_nvidia_sm100.kernels import norm as _norm
from deepinfer_nvidia_sm100.kernels import pdl
from deepinfer_nvidia_sm100.kernels import streams as side
from deepinfer_nvidia_sm100.kernels.compiled import maybe_compile, opaque_under_compile, step_enabled

NORM_MAX_BLOCK_D = 8192  # hc_pre_normed: rows up to this wide are collapsed and normed in registers, in one pass
NORM_WARPS = 4  # warps of the finishing kernel that norms (bench_hc_norm.py times 4, 8 and 16)
MIX_KERNEL_MAX_TOKENS = 16  # fp32 streams above this take the compiled reference (faster there)
MIX_K_PER_SPLIT = 128  # row elements per program (128 programs for one token of V4-Flash)


@triton.jit
def _hc_mix_partial_kernel(x_ptr, fn_ptr, dots_ptr, squares_ptr, tokens, K, N, K_PER_SPLIT,
                           BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, N_P2: tl.constexpr,
                           TENSOR_CORES: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (token block, split): ``dots[split, t, n] = x[t, ks] . fn[n, ks]`` and ``squares[split, t]`` over
    the split's ``K_PER_SPLIT`` row elements ``ks``: fp32 element-wise products, summed; or, with ``TENSOR_CORES``
    (16-bit ``x``, ``BLOCK_T`` and ``N_P2`` at least 16), ``tl.dot`` tiles (wgmma / tcgen05). ``x`` then holds 16-bit
    floats exactly, so ``x . fn`` needs only ``fn`` in more precision: ``fn`` (fp32) is split into three parts of
    ``x``'s dtype (``hi + mid + lo`` carries its 24 mantissa bits; bf16 has 8), each multiplied with fp32
    accumulation: the fp32 product up to the order of the sums, with ``x`` read once at tensor-core speed."""
    pdl.begin(PDL)
    split = tl.program_id(1)
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    outs = tl.arange(0, N_P2)  # [NP]
    acc = tl.zeros([BLOCK_T, N_P2], dtype=tl.float32)
    squares = tl.zeros([BLOCK_T], dtype=tl.float32)
    start = split * K_PER_SPLIT
    for k in range(start, start + K_PER_SPLIT, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)  # [BK]
        in_k = ks < K
        x = tl.load(x_ptr + toks[:, None].to(tl.int64) * K + ks[None, :],
                    mask=(toks[:, None] < tokens) & in_k[None, :], other=0.0)  # [BT, BK]
        xf = x.to(tl.float32)
        squares += tl.sum(xf * xf, axis=1)
        if TENSOR_CORES:
            w = tl.load(fn_ptr + outs[None, :] * K + ks[:, None], mask=(outs[None, :] < N) & in_k[:, None],
                        other=0.0)  # [BK, NP] fp32
            hi = w.to(x.dtype)
            rest = w - hi.to(tl.float32)
            mid = rest.to(x.dtype)
            lo = (rest - mid.to(tl.float32)).to(x.dtype)
            acc = tl.dot(x, hi, acc)
            acc = tl.dot(x, mid, acc)
            acc = tl.dot(x, lo, acc)
        else:
            w = tl.load(fn_ptr + outs[:, None] * K + ks[None, :], mask=(outs[:, None] < N) & in_k[None, :],
                        other=0.0)  # [NP, BK]
            acc += tl.sum(xf[:, None, :] * w[None, :, :], axis=2)  # [BT, NP]
    row = split * tokens + toks  # [BT]
    tl.store(dots_ptr + row[:, None] * N_P2 + outs[None, :], acc, mask=toks[:, None] < tokens)
    tl.store(squares_ptr + row, squares, mask=toks < tokens)


@triton.jit
def _mix_row(dots_ptr, squares_ptr, token, tokens, K, splits, norm_eps, N_P2: tl.constexpr,
             SPLITS_P2: tl.constexpr):
    """A token's mixing logits ``[N_P2]``: the splits' shares added (one tree over the split axis, the same for every
    token and batch), scaled by ``rsqrt(mean(x^2) + eps)``."""
    outs = tl.arange(0, N_P2)
    split = tl.arange(0, SPLITS_P2)
    in_split = split < splits
    row = split * tokens + token  # [SP]
    dots = tl.sum(tl.load(dots_ptr + row[:, None] * N_P2 + outs[None, :], mask=in_split[:, None], other=0.0), axis=0)
    squares = tl.sum(tl.load(squares_ptr + row, mask=in_split, other=0.0), axis=0)
    return dots * (1.0 / tl.sqrt(squares / K + norm_eps))


@triton.jit
def _hc_mix_finish_kernel(dots_ptr, squares_ptr, out_ptr, tokens, K, N, splits, norm_eps,
                          N_P2: tl.constexpr, SPLITS_P2: tl.constexpr):
    """One program per token: ``_mix_row`` into ``out [T, N]``."""
    token = tl.program_id(0)
    outs = tl.arange(0, N_P2)
    mixed = _mix_row(dots_ptr, squares_ptr, token, tokens, K, splits, norm_eps, N_P2, SPLITS_P2)
    tl.store(out_ptr + token * N + outs, mixed, mask=outs < N)


MIX_DOT_BLOCK_T, MIX_DOT_BLOCK_K = 64, 128
MIX_DOT_PROGRAMS = 264  # two per SM of a 132-SM GPU (H100 / H200): the row's splits fill the GPU at any batch


def mix_kernel(streams: torch.Tensor) -> str:
    """Which mixing-logit kernel ``streams`` take by default (``hc_mix_logits``)."""
    tokens = streams.shape[0]
    return ("compiled" if tokens == 0 else "dot" if streams.dtype in (torch.bfloat16, torch.float16)
            else "split" if tokens <= MIX_KERNEL_MAX_TOKENS else "compiled")


INVARIANT_MIX_SPLITS = 128
"""Most K splits of the mixing logits in the batch-invariant launch (``hc_mix_logits(..., invariant=True)``): the
split count then follows the row length alone. 128 gives V4-Flash's 4 x 4,096 row one 128-wide K step a split, as the
fast path splits it for one token, so a decode step of few tokens spreads its weight read over the GPU."""


def invariant_mix_splits() -> int:
    """``DEEPINFER_NVIDIA_INVARIANT_MIX_SPLITS``, else ``INVARIANT_MIX_SPLITS``."""
    return envs.DEEPINFER_NVIDIA_INVARIANT_MIX_SPLITS or INVARIANT_MIX_SPLITS


def hc_mix_logits(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float, kernel: str | None = None,
                  partials: bool = False, invariant: bool = False):
    """``reference.hc_mix_logits``: ``[T, (2 + hc) * hc]`` fp32. 16-bit streams take the tensor-core kernel
    (``"dot"``; as fast as the split rows at 1 token, faster from 4 on); fp32 streams the split-row kernels
    (``"split"``) up to ``MIX_KERNEL_MAX_TOKENS`` tokens, else the compiled reference (``"compiled"``). ``kernel``
    forces one (``benchmarks/bench_hc_mix.py``). ``partials`` (split kernels only): the per-split shares before the
    finish, ``(dots, squares, splits, N_P2)``, for a kernel that finishes them itself. ``invariant``: one launch
    whatever the token count (16-bit: the tensor-core kernel, fp32: the split rows in 4-token blocks), the split count
    a function of the row length only (``INVARIANT_MIX_SPLITS``), so a token's logits do not depend on the others."""
    tokens = streams.shape[0]
    if invariant:
        kernel = "dot" if streams.dtype in (torch.bfloat16, torch.float16) else "split"
    kernel = kernel or mix_kernel(streams)
    if kernel == "compiled":
        return maybe_compile(ref.hc_mix_logits)(streams, fn, norm_eps)
    x = streams.reshape(tokens, -1).contiguous()  # [T, K]
    fn = fn.float().contiguous()  # [N, K]
    n, k = fn.shape
    n_p2 = triton.next_power_of_2(n)
    if kernel == "dot":
        n_p2 = max(16, n_p2)  # tl.dot needs N >= 16
        token_blocks = triton.cdiv(tokens, MIX_DOT_BLOCK_T)
        steps = triton.cdiv(k, MIX_DOT_BLOCK_K)
        splits = min(steps, invariant_mix_splits() if invariant else triton.cdiv(MIX_DOT_PROGRAMS, token_blocks))
        per_split = triton.cdiv(steps, splits) * MIX_DOT_BLOCK_K
        splits = triton.cdiv(k, per_split)
        dots, squares = _mix_partials(splits, tokens, n_p2, x.device)
        _hc_mix_partial_kernel[(token_blocks, splits)](
            x, fn, dots, squares, tokens, k, n, per_split, BLOCK_T=MIX_DOT_BLOCK_T, BLOCK_K=MIX_DOT_BLOCK_K,
            N_P2=n_p2, TENSOR_CORES=True, num_warps=4, **pdl.launch())
    else:
        block_t, per_split = 4 if invariant else min(4, triton.next_power_of_2(tokens)), MIX_K_PER_SPLIT
        block_k = per_split // max(1, block_t // 2)  # [block_t, n_p2, block_k] products: 64 registers a thread
        splits = triton.cdiv(k, per_split)
        dots, squares = _mix_partials(splits, tokens, n_p2, x.device)
        _hc_mix_partial_kernel[(triton.cdiv(tokens, block_t), splits)](
            x, fn, dots, squares, tokens, k, n, per_split, BLOCK_T=block_t, BLOCK_K=block_k, N_P2=n_p2, num_warps=4,
            **pdl.launch())
    if partials:
        return dots, squares, splits, n_p2
    out = torch.empty(tokens, n, dtype=torch.float32, device=x.device)
    _hc_mix_finish_kernel[(tokens,)](dots, squares, out, tokens, k, n, splits, norm_eps, N_P2=n_p2,
                                     SPLITS_P2=triton.next_power_of_2(splits), num_warps=4)
    return out


def _mix_partials(splits: int, tokens: int, n_p2: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-split shares the mixing-logit kernels write: dot products ``[splits, T, N_P2]``, squares ``[splits, T]``."""
    dots = torch.empty(splits, tokens, n_p2, dtype=torch.float32, device=device)
    return dots, torch.empty(splits, tokens, dtype=torch.float32, device=device)


@triton.jit
def _pre_weight(pre_logit, base_ptr, scale_ptr, hc_eps, HC: tl.constexpr, HC_P2: tl.constexpr):
    """One token's ``pre [HC_P2]`` (fp32) from its ``pre_logit [HC_P2]``: the sigmoid the collapse weighs with."""
    idx = tl.arange(0, HC_P2)
    return tl.sigmoid(pre_logit * tl.load(scale_ptr) + tl.load(base_ptr + idx, mask=idx < HC, other=0.0)) + hc_eps


@triton.jit
def _weights(pre_logit, post_logit, comb_logit, base_ptr, scale_ptr, sinkhorn_iters, hc_eps,
             HC: tl.constexpr, HC_P2: tl.constexpr):
    """One token's ``pre [HC_P2]``, ``post [HC_P2]`` and ``comb [HC_P2, HC_P2]`` (fp32) from its raw mixing logits
    (``pre_logit`` / ``post_logit [HC_P2]``, ``comb_logit [HC_P2, HC_P2]``): sigmoids, a row softmax, then Sinkhorn
    (``reference.hc_weights``)."""
    idx = tl.arange(0, HC_P2)  # [HC_P2]
    in_hc = idx < HC
    pre = _pre_weight(pre_logit, base_ptr, scale_ptr, hc_eps, HC, HC_P2)
    post = 2 * tl.sigmoid(post_logit * tl.load(scale_ptr + 1) + tl.load(base_ptr + HC + idx, mask=in_hc, other=0.0))
    rows, cols = idx[:, None], idx[None, :]  # [HC_P2, 1], [1, HC_P2]
    inside = (rows < HC) & (cols < HC)  # [HC_P2, HC_P2]
    logits = comb_logit * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * HC + rows * HC + cols, mask=inside,
                                                            other=0.0)
    logits = tl.where(inside, logits, float("-inf"))
    row_max = tl.where(in_hc, tl.max(logits, axis=1), 0.0)  # padded rows: no -inf - -inf
    exp = tl.where(inside, tl.exp(logits - row_max[:, None]), 0.0)
    row_sum = tl.where(in_hc, tl.sum(exp, axis=1), 1.0)
    comb = tl.where(inside, exp / row_sum[:, None] + hc_eps, 0.0)  # softmax over each row
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)  # columns
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)  # rows
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)  # columns
    return pre, post, comb


@triton.jit
def _mixed_logits(mixed, HC: tl.constexpr, HC_P2: tl.constexpr, N_P2: tl.constexpr):
    """A token's ``mixed [N_P2]`` row split into ``pre_logit``, ``post_logit [HC_P2]`` and ``comb_logit [HC_P2,
    HC_P2]`` (as ``reference.hc_weights`` slices it)."""
    outs = tl.arange(0, N_P2)
    idx = tl.arange(0, HC_P2)
    rows, cols = idx[:, None], idx[None, :]
    pick = mixed[None, :]
    pre_logit = tl.sum(tl.where(idx[:, None] == outs[None, :], pick, 0.0), axis=1)  # mixed[idx]
    post_logit = tl.sum(tl.where((HC + idx)[:, None] == outs[None, :], pick, 0.0), axis=1)
    at = 2 * HC + rows * HC + cols  # [HC_P2, HC_P2]
    comb_logit = tl.sum(tl.where(at[:, :, None] == outs[None, None, :], mixed[None, None, :], 0.0), axis=2)
    return pre_logit, post_logit, comb_logit


@triton.jit
def _store_weights(post_ptr, comb_ptr, token, post, comb, HC: tl.constexpr, HC_P2: tl.constexpr):
    idx = tl.arange(0, HC_P2)
    rows, cols = idx[:, None], idx[None, :]
    tl.store(post_ptr + token * HC + idx, post, mask=idx < HC)
    tl.store(comb_ptr + token * HC * HC + rows * HC + cols, comb, mask=(rows < HC) & (cols < HC))


@triton.jit
def _hc_weights_kernel(mixed_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, sinkhorn_iters, hc_eps,
                       HC: tl.constexpr, HC_P2: tl.constexpr):
    """One program per token: ``mixed [(2 + HC) * HC]`` -> ``pre [HC]``, ``post [HC]``, ``comb [HC, HC]`` (fp32)."""
    token = tl.program_id(0).to(tl.int64)
    row = mixed_ptr + token * (2 + HC) * HC
    idx = tl.arange(0, HC_P2)  # [HC_P2]
    in_hc = idx < HC
    rows, cols = idx[:, None], idx[None, :]
    pre_logit = tl.load(row + idx, mask=in_hc, other=0.0)
    post_logit = tl.load(row + HC + idx, mask=in_hc, other=0.0)
    comb_logit = tl.load(row + 2 * HC + rows * HC + cols, mask=(rows < HC) & (cols < HC), other=0.0)
    pre, post, comb = _weights(pre_logit, post_logit, comb_logit, base_ptr, scale_ptr, sinkhorn_iters, hc_eps, HC,
                               HC_P2)
    tl.store(pre_ptr + token * HC + idx, pre, mask=in_hc)
    _store_weights(post_ptr, comb_ptr, token, post, comb, HC, HC_P2)


@triton.jit
def _hc_finish_weights_collapse_kernel(dots_ptr, squares_ptr, base_ptr, scale_ptr, streams_ptr, post_ptr, comb_ptr,
                                       out_ptr, norm_w_ptr, tokens, K, splits, norm_eps, sinkhorn_iters, hc_eps, D,
                                       HC: tl.constexpr, HC_P2: tl.constexpr, N_P2: tl.constexpr,
                                       SPLITS_P2: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr,
                                       WEIGHTS: tl.constexpr = True, PDL: tl.constexpr = False):
    """``hc_pre`` after the mixing partials, in one launch. Program (token, channel block): the token's mixing
    logits (``_mix_row``), its weights (``_weights``; the channel block 0 stores ``post`` and ``comb``), then the
    collapse of its ``BLOCK_D`` channels with ``pre`` (``_hc_collapse_kernel``'s arithmetic). With ``NORM``
    (``hc_pre_normed``) one program per token collapses the row (in one block where ``BLOCK_D >= D``, else block by
    block, re-reading what it wrote) and RMS-norms it with ``norm_w [D]`` (``_rms_norm_kernel``'s arithmetic). Without
    ``WEIGHTS`` it computes ``pre`` alone (the Sinkhorn and ``post`` / ``comb`` are another kernel's)."""
    pdl.begin(PDL)
    token = tl.program_id(0)
    mixed = _mix_row(dots_ptr, squares_ptr, token, tokens, K, splits, norm_eps, N_P2, SPLITS_P2)  # [N_P2]
    pre_logit, post_logit, comb_logit = _mixed_logits(mixed, HC, HC_P2, N_P2)
    if WEIGHTS:
        pre, post, comb = _weights(pre_logit, post_logit, comb_logit, base_ptr, scale_ptr, sinkhorn_iters, hc_eps,
                                   HC, HC_P2)
        if tl.program_id(1) == 0:
            _store_weights(post_ptr, comb_ptr, token.to(tl.int64), post, comb, HC, HC_P2)
    else:  # post and comb come from _hc_mix_weights_kernel (hc_pre_normed_deferred)
        pre = _pre_weight(pre_logit, base_ptr, scale_ptr, hc_eps, HC, HC_P2)
    if NORM and BLOCK_D >= D:  # the whole row in one block: collapsed, normed and stored once
        collapsed = _collapse(pre, streams_ptr, out_ptr, token.to(tl.int64), 0, D, HC, HC_P2, BLOCK_D, STORE=False)
        scale = 1.0 / tl.sqrt(tl.sum(collapsed * collapsed, axis=0) / D + norm_eps)
        ds = tl.arange(0, BLOCK_D)
        w = tl.load(norm_w_ptr + ds, mask=ds < D, other=0.0).to(tl.float32)
        tl.store(out_ptr + token.to(tl.int64) * D + ds, (w * (collapsed * scale)).to(out_ptr.dtype.element_ty),
                 mask=ds < D)
    elif NORM:  # wider rows: collapse block by block, then norm the row written
        squares = 0.0
        for block in range(tl.cdiv(D, BLOCK_D)):
            collapsed = _collapse(pre, streams_ptr, out_ptr, token.to(tl.int64), block, D, HC, HC_P2, BLOCK_D)
            squares += tl.sum(collapsed * collapsed, axis=0)
        scale = 1.0 / tl.sqrt(squares / D + norm_eps)
        tl.debug_barrier()  # the collapsed row is in memory before any thread reads it back
        for block in range(tl.cdiv(D, BLOCK_D)):
            ds = block * BLOCK_D + tl.arange(0, BLOCK_D)
            row = out_ptr + token.to(tl.int64) * D + ds
            x = tl.load(row, mask=ds < D, other=0.0).to(tl.float32)
            w = tl.load(norm_w_ptr + ds, mask=ds < D, other=0.0).to(tl.float32)
            tl.store(row, (w * (x * scale)).to(out_ptr.dtype.element_ty), mask=ds < D)
    else:
        _collapse(pre, streams_ptr, out_ptr, token.to(tl.int64), tl.program_id(1), D, HC, HC_P2, BLOCK_D)


@triton.jit
def _hc_mix_weights_kernel(dots_ptr, squares_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, tokens, K, splits, norm_eps,
                           sinkhorn_iters, hc_eps, HC: tl.constexpr, HC_P2: tl.constexpr, N_P2: tl.constexpr,
                           SPLITS_P2: tl.constexpr):
    """One program per token: its mixing logits from the partials (``_mix_row``), then ``post [HC]`` and ``comb [HC,
    HC]`` (``_weights``): what the finishing kernel leaves out without ``WEIGHTS``."""
    token = tl.program_id(0)
    mixed = _mix_row(dots_ptr, squares_ptr, token, tokens, K, splits, norm_eps, N_P2, SPLITS_P2)  # [N_P2]
    pre_logit, post_logit, comb_logit = _mixed_logits(mixed, HC, HC_P2, N_P2)
    _, post, comb = _weights(pre_logit, post_logit, comb_logit, base_ptr, scale_ptr, sinkhorn_iters, hc_eps, HC, HC_P2)
    _store_weights(post_ptr, comb_ptr, token.to(tl.int64), post, comb, HC, HC_P2)


def hc_weights(mixed: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, sinkhorn_iters: int,
               hc_eps: float):
    """``reference.hc_weights`` in one launch: ``mixed [T, (2 + hc) * hc]`` -> ``pre``, ``post [T, hc]``, ``comb``."""
    tokens = mixed.shape[0]
    mixed = mixed.float().contiguous()
    pre = torch.empty(tokens, hc, dtype=torch.float32, device=mixed.device)
    post = torch.empty_like(pre)
    comb = torch.empty(tokens, hc, hc, dtype=torch.float32, device=mixed.device)
    if tokens:
        _hc_weights_kernel[(tokens,)](mixed, base.float().contiguous(), scale.float().contiguous(), pre, post, comb,
                                      sinkhorn_iters, hc_eps, HC=hc, HC_P2=triton.next_power_of_2(hc), num_warps=1)
    return pre, post, comb


@triton.jit
def _hc_post_kernel(streams_ptr, block_ptr, extra_ptr, post_ptr, comb_ptr, out_ptr, D,
                    HC: tl.constexpr, HC_P2: tl.constexpr, BLOCK_D: tl.constexpr, ADD: tl.constexpr = False,
                    PDL: tl.constexpr = False):
    """Program (token, channel block): ``out[k] = post[k] * block + sum_j comb[j, k] * streams[j]`` over ``BLOCK_D``
    channels, rounded where the reference rounds (``comb`` and ``post`` to the streams' dtype, the mixing sum
    once, the product, the sum). With ``ADD`` the block is ``block + extra``, rounded to the streams' dtype first
    (``hc_post_sum``)."""
    pdl.begin(PDL)
    token = tl.program_id(0).to(tl.int64)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD]
    in_d = ds < D
    hc = tl.arange(0, HC_P2)
    in_hc = hc < HC
    ty = out_ptr.dtype.element_ty
    streams = tl.load(streams_ptr + token * HC * D + hc[:, None] * D + ds[None, :],
                      mask=in_hc[:, None] & in_d[None, :], other=0.0).to(tl.float32)  # [j, BD]
    comb = tl.load(comb_ptr + token * HC * HC + hc[:, None] * HC + hc[None, :],
                   mask=in_hc[:, None] & in_hc[None, :], other=0.0).to(ty).to(tl.float32)  # [j, k]
    mixed = tl.sum(comb[:, :, None] * streams[:, None, :], axis=0).to(ty).to(tl.float32)  # [k, BD]
    post = tl.load(post_ptr + token * HC + hc, mask=in_hc, other=0.0).to(ty).to(tl.float32)  # [k]
    block = tl.load(block_ptr + token * D + ds, mask=in_d, other=0.0).to(tl.float32)  # [BD]
    if ADD:
        block = (block + tl.load(extra_ptr + token * D + ds, mask=in_d, other=0.0).to(tl.float32)).to(ty)
        block = block.to(tl.float32)
    scaled = (post[:, None] * block[None, :]).to(ty).to(tl.float32)  # [k, BD]
    tl.store(out_ptr + token * HC * D + hc[:, None] * D + ds[None, :], (scaled + mixed).to(ty),
             mask=in_hc[:, None] & in_d[None, :])


def _post(streams: torch.Tensor, block_out: torch.Tensor, extra: torch.Tensor | None, post: torch.Tensor,
          comb: torch.Tensor) -> torch.Tensor:
    """``_hc_post_kernel`` over every token and channel block; ``extra`` (or None) is added to ``block_out``."""
    _join_weights(comb)
    tokens, hc, dim = streams.shape
    out = torch.empty_like(streams)
    if tokens:
        block_d = 512
        block_out = block_out.to(streams.dtype).contiguous()
        _hc_post_kernel[(tokens, triton.cdiv(dim, block_d))](
            streams.contiguous(), block_out, block_out if extra is None else extra.to(streams.dtype).contiguous(),
            post.contiguous(), comb.contiguous(), out, dim, HC=hc, HC_P2=triton.next_power_of_2(hc), BLOCK_D=block_d,
            ADD=extra is not None, num_warps=4, **pdl.launch())
    return out


@opaque_under_compile("hc_post", lambda streams, block_out, post, comb: streams.new_empty(streams.shape))
def hc_post(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Op ``hc_post`` (``reference.hc_post``) in one launch: new streams ``[T, hc, D]`` from ``streams [T, hc, D]``,
    ``block_out [T, D]``, ``post [T, hc]`` and ``comb [T, hc, hc]``. (Compiled, the reference's batched
    ``hc x hc`` matmul stays a cuBLAS bmm of 4 x 4 tiles, slow on long prefill steps.)"""
    return _post(streams, block_out, None, post, comb)


@opaque_under_compile("hc_post_sum", lambda streams, block_a, block_b, post, comb: streams.new_empty(streams.shape))
def hc_post_sum(streams: torch.Tensor, block_a: torch.Tensor, block_b: torch.Tensor, post: torch.Tensor,
                comb: torch.Tensor) -> torch.Tensor:
    """Op ``hc_post_sum``: ``hc_post`` of ``block_a + block_b`` with the addition inside its kernel (the MoE's routed
    and shared outputs: one launch instead of two)."""
    return _post(streams, block_a, block_b, post, comb)


@triton.jit
def _collapse(pre, streams_ptr, out_ptr, token, block, D, HC: tl.constexpr, HC_P2: tl.constexpr,
              BLOCK_D: tl.constexpr, STORE: tl.constexpr = True):
    """Channels ``[block * BLOCK_D, +BLOCK_D)`` of ``out[token] = sum_k pre[k] * streams[token, k]`` (``pre
    [HC_P2]`` fp32) in fp32, rounded once; returns them as rounded (in fp32, 0 past ``D``)."""
    ds = block * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD]
    in_d = ds < D
    hc = tl.arange(0, HC_P2)
    streams = tl.load(streams_ptr + token * HC * D + hc[:, None] * D + ds[None, :],
                      mask=(hc < HC)[:, None] & in_d[None, :], other=0.0).to(tl.float32)  # [k, BD]
    out = tl.sum(tl.where((hc < HC)[:, None], pre[:, None], 0.0) * streams, axis=0).to(out_ptr.dtype.element_ty)
    if STORE:
        tl.store(out_ptr + token * D + ds, out, mask=in_d)
    return tl.where(in_d, out.to(tl.float32), 0.0)  # [BD]: the rounded values (stored unless not STORE)


@triton.jit
def _hc_collapse_kernel(pre_ptr, streams_ptr, out_ptr, D, HC: tl.constexpr, HC_P2: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    """Program (token, channel block): ``out = sum_k pre[k] * streams[k]`` in fp32, rounded once."""
    token = tl.program_id(0).to(tl.int64)
    hc = tl.arange(0, HC_P2)
    pre = tl.load(pre_ptr + token * HC + hc, mask=hc < HC, other=0.0)  # [k] fp32
    _collapse(pre, streams_ptr, out_ptr, token, tl.program_id(1), D, HC, HC_P2, BLOCK_D)


def hc_collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """``reference.hc_collapse``: ``[T, D]`` in the streams' dtype from ``pre [T, hc]`` (fp32) and ``streams
    [T, hc, D]``. (Compiled, this reduction over 4 strided rows is slow on long prefill steps.)"""
    tokens, hc, dim = streams.shape
    out = torch.empty(tokens, dim, dtype=streams.dtype, device=streams.device)
    if tokens:
        block_d = 1024
        _hc_collapse_kernel[(tokens, triton.cdiv(dim, block_d))](
            pre.float().contiguous(), streams.contiguous(), out, dim, HC=hc, HC_P2=triton.next_power_of_2(hc),
            BLOCK_D=block_d, num_warps=4)
    return out


def _hc_pre_fake(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps):
    tokens, hc, dim = streams.shape
    return (streams.new_empty(tokens, hc, dtype=torch.float32), streams.new_empty(tokens, hc, hc, dtype=torch.float32),
            streams.new_empty(tokens, dim))


@opaque_under_compile("hc_pre", _hc_pre_fake)
def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int,
           hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Op ``hc_pre`` (same contract as the reference op): the mixing partials, then the finish, the weights and the
    collapse in one kernel (two launches); where the compiled reference makes the mixing logits, the weights and
    collapse kernels after it."""
    return _pre(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, None)


@opaque_under_compile("hc_pre_normed", lambda streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, norm_weight:
                      _hc_pre_fake(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps))
def hc_pre_normed(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                  sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                  norm_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Op ``hc_pre_normed``: ``hc_pre`` whose finishing kernel also RMS-norms the collapsed row (a program per token:
    two launches, as ``hc_pre``, instead of three)."""
    return _pre(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, norm_weight)


def hc_pre_normed_deferred(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                           sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                           norm_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Op ``hc_pre_normed`` whose ``post`` and ``comb`` are computed on the side stream (``streams.fork``) while the
    block runs: the finishing kernel on the caller's stream computes ``pre`` alone, so the Sinkhorn (about a quarter
    of the op's time at one token) leaves the step's critical path. ``post``
    and ``comb`` are ready only once this module's ``hc_post`` / ``hc_post_sum`` has joined them: the backend puts
    this op in the table only where those two are its own (``defers_weights``)."""
    return _pre(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, norm_weight, defer=True)


_DEFERRED: dict[int, object] = {}
"""The forked weights of ``hc_pre_normed_deferred`` by ``id`` of their ``comb`` tensor, until ``_post`` joins them."""


def defers_weights(table) -> bool:
    """Whether ``table`` can take ``hc_pre_normed_deferred``: its ``hc_pre_normed``, ``hc_post`` and ``hc_post_sum``
    are this module's (nothing else reads ``post`` / ``comb`` before a join), decode steps are not compiled whole,
    and ``DEEPINFER_NVIDIA_HC_BESIDE`` is not 0."""
    ours = (table.hc_pre_normed is hc_pre_normed and table.hc_post is hc_post and table.hc_post_sum is hc_post_sum)
    return ours and envs.DEEPINFER_NVIDIA_HC_BESIDE and not step_enabled()


def _join_weights(comb: torch.Tensor) -> None:
    """The caller's stream waits for the weights kernel that writes ``comb`` (if one was forked for it)."""
    forked = _DEFERRED.pop(id(comb), None)
    if forked is not None:
        forked.join()


def _mix_weights(post, comb, dots, squares, base, scale, k, splits, norm_eps, sinkhorn_iters, hc_eps, n_p2):
    """``_hc_mix_weights_kernel`` into ``post`` and ``comb``, a program per token."""
    hc = post.shape[1]
    _hc_mix_weights_kernel[(post.shape[0],)](
        dots, squares, base, scale, post, comb, post.shape[0], k, splits, norm_eps, sinkhorn_iters, hc_eps, HC=hc,
        HC_P2=triton.next_power_of_2(hc), N_P2=n_p2, SPLITS_P2=triton.next_power_of_2(splits), num_warps=NORM_WARPS)


def _pre(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, norm_weight, defer=False, invariant=False):
    """``hc_pre``, then the RMS norm with ``norm_weight`` unless it is None; with ``defer`` (decode sizes) ``post`` and
    ``comb`` come from a kernel forked to the side stream (``hc_pre_normed_deferred``); ``invariant``: the mixing
    logits' batch-invariant launch (``hc_mix_logits``), then the same per-token finishing kernel."""
    if invariant and streams.shape[0] == 0:
        return _hc_pre_fake(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)
    if not invariant and mix_kernel(streams) == "compiled":
        mixed = hc_mix_logits(streams, fn, norm_eps)  # [T, (2 + hc) * hc] fp32
        pre, post, comb = hc_weights(mixed, base, scale, streams.shape[1], sinkhorn_iters, hc_eps)
        collapsed = hc_collapse(pre, streams)
        return post, comb, collapsed if norm_weight is None else _norm.rms_norm(collapsed, norm_weight, norm_eps)
    tokens, hc, dim = streams.shape
    dots, squares, splits, n_p2 = hc_mix_logits(streams, fn, norm_eps, partials=True, invariant=invariant)
    post = torch.empty(tokens, hc, dtype=torch.float32, device=streams.device)
    comb = torch.empty(tokens, hc, hc, dtype=torch.float32, device=streams.device)
    out = torch.empty(tokens, dim, dtype=streams.dtype, device=streams.device)
    base, scale = base.float().contiguous(), scale.float().contiguous()
    defer = defer and 0 < tokens <= side.MAX_ROWS
    if defer:  # post first: the fork judges the work's size by its first tensor's rows
        _DEFERRED[id(comb)] = side.fork(_mix_weights, post, comb, dots, squares, base, scale, fn.shape[1], splits,
                                        norm_eps, sinkhorn_iters, hc_eps, n_p2)
    normed = norm_weight is not None
    # normed: a program per token, the whole row in one block up to NORM_MAX_BLOCK_D channels
    block_d = min(triton.next_power_of_2(dim), NORM_MAX_BLOCK_D) if normed else 1024
    _hc_finish_weights_collapse_kernel[(tokens, 1 if normed else triton.cdiv(dim, block_d))](
        dots, squares, base, scale, streams.contiguous(), post, comb, out,
        norm_weight.contiguous() if normed else out, tokens, fn.shape[1], splits, norm_eps, sinkhorn_iters, hc_eps,
        dim, HC=hc, HC_P2=triton.next_power_of_2(hc), N_P2=n_p2, SPLITS_P2=triton.next_power_of_2(splits),
        BLOCK_D=block_d, NORM=normed, WEIGHTS=not defer, num_warps=NORM_WARPS if normed else 4, **pdl.launch())
    return post, comb, out

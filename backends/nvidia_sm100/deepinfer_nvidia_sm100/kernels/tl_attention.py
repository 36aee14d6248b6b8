"""TileLang sink attention (op ``sink_attention``): shared-KV MQA with per-head sinks, split-KV flash decoding.

Matches ``deepinfer_core.ops.reference.sink_attention``: ``q [S, Lq, H, d]``, ``kv [S, Lk, d]`` (key == value,
one KV head), ``visible [S, Lq, Lk]`` bool, ``sinks [H]``; each head's softmax runs over its visible keys plus
one sink logit whose probability mass is dropped; a row with nothing visible returns 0.

In V4 all H query heads of one token share the single KV head, so per (sequence, query row) the work is two
GEMMs with M = heads: ``S = Q [H, d] @ K^T [d, BN]`` and ``O += P [H, BN] @ V [BN, d]`` (d = 512). One CTA
takes 64 heads of one query row (M = 64: one wgmma warpgroup tile on SM90, the M64 tcgen05 atom on SM100)
and a contiguous split of the row's *visible* key blocks (``kernels/key_blocks.py`` lists them: a prefill row of
an 8K prompt sees ~35 of 160 blocks); the online softmax runs in base 2 in fp32.

Two kernels per call (both with dynamic sizes, so one compilation serves every batch / length / split count):

1. ``split``: grid ``(NS, H / 64 [* 2 on SM100], S * Lq)``. Each CTA keeps its running max ``m`` (started at the
   sink logit, so a fully masked split has ``l = 0`` and never produces NaN), its running sum ``l`` and its
   unnormalised ``O`` in fp32, and writes them as partials ``Opart [B, NS, H, d]``, ``Mpart / Lpart [B, NS, H]``.
2. ``combine``: ``M = max_s m_s``; ``L = sum_s l_s 2^(m_s - M) + 2^(sink - M)`` (the sink counts once, in the
   denominator only); ``out = sum_s Opart_s 2^(m_s - M) / L`` in the model dtype.

Arch variants (``arch`` = ``"sm_90a"`` or ``"sm_100a"``):

* SM90: 256 threads (two warpgroups), ``T.gemm`` on shared-memory operands with ``FullCol`` policy; TileLang
  lowers both GEMMs to ``wgmma`` (checked on the generated source by ``tests/test_tl_attention_compile.py``).
* SM100: 128 threads, ``T.tcgen05_gemm`` with fp32 accumulators in tensor memory (``T.alloc_tmem``) and an
  mbarrier per MMA; the score tile (64 x BN) and the PV tile (64 x 256) live in TMEM (320 of 512 columns), so
  each CTA produces one half of d (grid dimension doubled); ``O`` is rescaled and accumulated in registers.
  Compile-checked for tcgen05 only: no SM100 GPU has run it (docs/nvidia.md).

Only bf16 runs the kernel. fp32 does not (wgmma would use tf32, and tf32 cannot take V as an MN-major operand),
and fp16 never ran on hardware; ``sink_attention`` sends them, and any shape the kernel does not cover (H not a multiple of 64, d not 512,
CPU tensors), to the reference op. TileLang is imported lazily, inside the builders.
"""

# No `from __future__ import annotations`: TileLang evaluates the T.Tensor annotations of the prim_funcs.

import importlib.util
import math
from functools import cache

import torch

from deepinfer_core.ops import reference as ref
from deepinfer_nvidia_sm100 import envs
from deepinfer_nvidia_sm100.kernels import gpu
from deepinfer_nvidia_sm100.kernels.compiled import opaque_under_compile
from deepinfer_nvidia_sm100.kernels.key_blocks import visible_blocks, visible_blocks_torch

LOG2E = 1.4426950408889634
BLOCK_H = 64  # heads per CTA: the GEMM M
BLOCK_N = 64  # keys per block
HEAD_DIM = 512
SM100_DV = 256  # output columns per CTA on SM100 (TMEM budget: 64 score + 256 PV columns of 512)
_DTYPES = {torch.bfloat16: "bfloat16"}  # fp16 would build the same way, but it never ran on hardware: reference


def _pass_configs(arch: str) -> dict:
    import tilelang

    # SM100: the TileLang 0.1.15 tcgen05 path wants plain copies and no warp specialisation. SM90 uses TMA and a
    # warp-specialised producer.
    if arch == "sm_100a":
        return {tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
                tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}
    return {}


def split_kernel(arch: str, dtype: str, scale: float, dim: int = HEAD_DIM, block_n: int = BLOCK_N,
                 whole: bool = False):
    """The split-KV attention PrimFunc for ``arch``; sizes B (= S * Lq), S, Lk, H, NS are dynamic.

    Arguments: ``Q [B, H, dim]``, ``KV [S, Lk, dim]``, ``Vis [B, Lk]`` uint8, ``Blocks [B, NB]`` / ``Counts [B]``
    int32 (each row's visible key blocks, ``key_blocks.visible_blocks``), ``Sinks [H]`` fp32 (natural log
    units, like the logits), outputs ``Opart [B, NS, H, dim]``, ``Mpart [B, NS, H]``, ``Lpart [B, NS, H]`` fp32
    (``Mpart`` in base-2 units).

    ``whole=True`` (SM90 only): one split per row, normalised in the epilogue (the combine of one split), so the
    last argument is ``Out [B, H, dim]`` in ``dtype`` and no partials or combine pass are needed.
    """
    import tilelang.language as T

    if arch not in ("sm_90a", "sm_100a"):
        raise ValueError(f"arch must be sm_90a or sm_100a, got {arch!r}")
    if whole and arch != "sm_90a":
        raise ValueError("whole rows (no combine pass) are built for sm_90a only")
    accum = "float32"
    scale_log2 = float(scale) * LOG2E
    B, S, Lk, H, NS = T.dynamic("B"), T.dynamic("S"), T.dynamic("Lk"), T.dynamic("H"), T.dynamic("NS")
    NB = T.dynamic("NB")
    BH, BN = BLOCK_H, block_n

    if arch == "sm_90a":

        @T.macro
        def attend_sm90(Q, KV, Vis, Blocks, Counts, Sinks, num_splits, split, hb, b, acc_o, m, den):
            """Online softmax over this CTA's share of row ``b``'s visible key blocks: leaves the unnormalised
            ``acc_o [BH, dim]``, the running max ``m`` (base 2, floored at the sink) and the sum ``den``."""
            seq = b // (B // S)  # rows are (sequence, query) flattened: B = S * Lq
            Q_s = T.alloc_shared((BH, dim), dtype)
            KV_s = T.alloc_shared((BN, dim), dtype)
            P_s = T.alloc_shared((BH, BN), dtype)
            acc_s = T.alloc_fragment((BH, BN), accum)  # scores of this key block [heads, keys]
            m_prev = T.alloc_fragment((BH,), accum)
            alpha = T.alloc_fragment((BH,), accum)
            rowsum = T.alloc_fragment((BH,), accum)

            T.copy(Q[b, hb * BH:(hb + 1) * BH, :], Q_s)
            T.fill(acc_o, 0)
            T.fill(den, 0)
            for i in T.Parallel(BH):
                m[i] = Sinks[hb * BH + i] * LOG2E  # the sink is a floor for the running max
            n_blocks = Counts[b]  # this row's visible key blocks, listed in Blocks
            per_split = T.ceildiv(n_blocks, num_splits)
            first = split * per_split
            count = T.max(T.min(per_split, n_blocks - first), 0)
            for kb in T.Pipelined(count, num_stages=2):
                k0 = Blocks[b, first + kb] * BN
                T.copy(KV[seq, k0:k0 + BN, :], KV_s)
                T.gemm(Q_s, KV_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol, clear_accum=True)
                for i, j in T.Parallel(BH, BN):
                    acc_s[i, j] = T.if_then_else(
                        k0 + j < Lk and Vis[b, T.min(k0 + j, Lk - 1)] != 0, acc_s[i, j] * scale_log2, -T.infinity(accum))
                T.copy(m, m_prev)
                T.reduce_max(acc_s, m, dim=1, clear=False)
                for i in T.Parallel(BH):
                    alpha[i] = T.exp2(m_prev[i] - m[i])
                for i, j in T.Parallel(BH, BN):
                    acc_s[i, j] = T.exp2(acc_s[i, j] - m[i])
                T.reduce_sum(acc_s, rowsum, dim=1)
                for i in T.Parallel(BH):
                    den[i] = den[i] * alpha[i] + rowsum[i]
                T.copy(acc_s, P_s)
                for i, j in T.Parallel(BH, dim):
                    acc_o[i, j] *= alpha[i]
                T.gemm(P_s, KV_s, acc_o, policy=T.GemmWarpPolicy.FullCol)

        @T.prim_func
        def sink_attn_split_sm90(
            Q: T.Tensor((B, H, dim), dtype),
            KV: T.Tensor((S, Lk, dim), dtype),
            Vis: T.Tensor((B, Lk), "uint8"),
            Blocks: T.Tensor((B, NB), "int32"),
            Counts: T.Tensor((B,), "int32"),
            Sinks: T.Tensor((H,), accum),
            Opart: T.Tensor((B, NS, H, dim), accum),
            Mpart: T.Tensor((B, NS, H), accum),
            Lpart: T.Tensor((B, NS, H), accum),
        ):
            with T.Kernel(NS, T.ceildiv(H, BH), B, threads=256) as (split, hb, b):
                acc_o = T.alloc_fragment((BH, dim), accum)  # unnormalised output [heads, d]
                m = T.alloc_fragment((BH,), accum)
                den = T.alloc_fragment((BH,), accum)
                attend_sm90(Q, KV, Vis, Blocks, Counts, Sinks, NS, split, hb, b, acc_o, m, den)
                T.copy(acc_o, Opart[b, split, hb * BH:(hb + 1) * BH, :])
                T.copy(m, Mpart[b, split, hb * BH:(hb + 1) * BH])
                T.copy(den, Lpart[b, split, hb * BH:(hb + 1) * BH])

        @T.prim_func
        def sink_attn_sm90(
            Q: T.Tensor((B, H, dim), dtype),
            KV: T.Tensor((S, Lk, dim), dtype),
            Vis: T.Tensor((B, Lk), "uint8"),
            Blocks: T.Tensor((B, NB), "int32"),
            Counts: T.Tensor((B,), "int32"),
            Sinks: T.Tensor((H,), accum),
            Out: T.Tensor((B, H, dim), dtype),
        ):
            with T.Kernel(T.ceildiv(H, BH), B, threads=256) as (hb, b):
                acc_o = T.alloc_fragment((BH, dim), accum)  # unnormalised output [heads, d]
                m = T.alloc_fragment((BH,), accum)
                den = T.alloc_fragment((BH,), accum)
                attend_sm90(Q, KV, Vis, Blocks, Counts, Sinks, 1, 0, hb, b, acc_o, m, den)
                for i in T.Parallel(BH):  # the combine of one split: the sink once, in the denominator
                    den[i] = 1.0 / (den[i] + T.exp2(Sinks[hb * BH + i] * LOG2E - m[i]))
                for i, j in T.Parallel(BH, dim):
                    acc_o[i, j] *= den[i]
                T.copy(acc_o, Out[b, hb * BH:(hb + 1) * BH, :])

        return sink_attn_sm90 if whole else sink_attn_split_sm90

    DV = SM100_DV
    halves = dim // DV

    @T.prim_func
    def sink_attn_split_sm100(
        Q: T.Tensor((B, H, dim), dtype),
        KV: T.Tensor((S, Lk, dim), dtype),
        Vis: T.Tensor((B, Lk), "uint8"),
        Blocks: T.Tensor((B, NB), "int32"),
        Counts: T.Tensor((B,), "int32"),
        Sinks: T.Tensor((H,), accum),
        Opart: T.Tensor((B, NS, H, dim), accum),
        Mpart: T.Tensor((B, NS, H), accum),
        Lpart: T.Tensor((B, NS, H), accum),
    ):
        with T.Kernel(NS, T.ceildiv(H, BH) * halves, B, threads=128) as (split, hv, b):
            hb = hv // halves
            dh = hv % halves  # which DV-wide slice of the output this CTA produces
            seq = b // (B // S)
            Q_s = T.alloc_shared((BH, dim), dtype)
            K_s = T.alloc_shared((BN, dim), dtype)
            V_s = T.alloc_shared((BN, DV), dtype)
            P_s = T.alloc_shared((BH, BN), dtype)
            vis_s = T.alloc_shared((BN,), "uint8")
            S_tmem = T.alloc_tmem([BH, BN], accum)  # scores, fp32 in tensor memory
            PV_tmem = T.alloc_tmem([BH, DV], accum)  # this block's P @ V slice, fp32 in tensor memory
            mbar = T.alloc_barrier(1)
            acc_s = T.alloc_fragment((BH, BN), accum)
            pv = T.alloc_fragment((BH, DV), accum)
            acc_o = T.alloc_fragment((BH, DV), accum)
            m = T.alloc_fragment((BH,), accum)
            m_prev = T.alloc_fragment((BH,), accum)
            alpha = T.alloc_fragment((BH,), accum)
            rowsum = T.alloc_fragment((BH,), accum)
            den = T.alloc_fragment((BH,), accum)

            T.copy(Q[b, hb * BH:(hb + 1) * BH, :], Q_s)
            T.fill(acc_o, 0)
            T.fill(den, 0)
            for i in T.Parallel(BH):
                m[i] = Sinks[hb * BH + i] * LOG2E
            n_blocks = Counts[b]  # this row's visible key blocks, listed in Blocks
            per_split = T.ceildiv(n_blocks, NS)
            first = split * per_split
            count = T.max(T.min(per_split, n_blocks - first), 0)
            for kb in T.serial(count):
                k0 = Blocks[b, first + kb] * BN
                T.copy(KV[seq, k0:k0 + BN, :], K_s)
                T.copy(KV[seq, k0:k0 + BN, dh * DV:(dh + 1) * DV], V_s)
                for j in T.Parallel(BN):
                    vis_s[j] = T.if_then_else(k0 + j < Lk, Vis[b, k0 + j], T.uint8(0))
                # Two MMA completions per block on one barrier: phases 0 then 1, every block.
                T.tcgen05_gemm(Q_s, K_s, S_tmem, transpose_B=True, mbar=mbar, clear_accum=True)
                T.mbarrier_wait_parity(mbar, 0)
                T.copy(S_tmem, acc_s)
                for i, j in T.Parallel(BH, BN):
                    acc_s[i, j] = T.if_then_else(vis_s[j] != 0, acc_s[i, j] * scale_log2, -T.infinity(accum))
                T.copy(m, m_prev)
                T.reduce_max(acc_s, m, dim=1, clear=False)
                for i in T.Parallel(BH):
                    alpha[i] = T.exp2(m_prev[i] - m[i])
                for i, j in T.Parallel(BH, BN):
                    acc_s[i, j] = T.exp2(acc_s[i, j] - m[i])
                T.reduce_sum(acc_s, rowsum, dim=1)
                for i in T.Parallel(BH):
                    den[i] = den[i] * alpha[i] + rowsum[i]
                T.copy(acc_s, P_s)
                T.tcgen05_gemm(P_s, V_s, PV_tmem, mbar=mbar, clear_accum=True)
                T.mbarrier_wait_parity(mbar, 1)
                T.copy(PV_tmem, pv)
                for i, j in T.Parallel(BH, DV):
                    acc_o[i, j] = acc_o[i, j] * alpha[i] + pv[i, j]
            T.copy(acc_o, Opart[b, split, hb * BH:(hb + 1) * BH, dh * DV:(dh + 1) * DV])
            if dh == 0:
                T.copy(m, Mpart[b, split, hb * BH:(hb + 1) * BH])
                T.copy(den, Lpart[b, split, hb * BH:(hb + 1) * BH])

    return sink_attn_split_sm100


def combine_kernel(dtype: str, dim: int = HEAD_DIM):
    """The combine PrimFunc: partials ``Opart [B, NS, H, dim]``, ``Mpart / Lpart [B, NS, H]``, ``Sinks [H]`` ->
    ``Out [B, H, dim]`` in ``dtype``. One CTA of 128 threads per (head, row)."""
    import tilelang.language as T

    accum = "float32"
    B, H, NS = T.dynamic("B"), T.dynamic("H"), T.dynamic("NS")

    @T.prim_func
    def sink_attn_combine(
        Opart: T.Tensor((B, NS, H, dim), accum),
        Mpart: T.Tensor((B, NS, H), accum),
        Lpart: T.Tensor((B, NS, H), accum),
        Sinks: T.Tensor((H,), accum),
        Out: T.Tensor((B, H, dim), dtype),
    ):
        with T.Kernel(H, B, threads=128) as (h, b):
            o = T.alloc_fragment((dim,), accum)
            mx = T.alloc_var(accum)
            total = T.alloc_var(accum)
            w = T.alloc_var(accum)
            sink = Sinks[h] * LOG2E
            mx = sink
            for s in T.serial(NS):
                mx = T.max(mx, Mpart[b, s, h])
            total = T.exp2(sink - mx)  # the sink: denominator only
            for s in T.serial(NS):
                total += Lpart[b, s, h] * T.exp2(Mpart[b, s, h] - mx)
            T.fill(o, 0)
            for s in T.serial(NS):
                w = T.exp2(Mpart[b, s, h] - mx) / total
                for d in T.Parallel(dim):
                    o[d] += Opart[b, s, h, d] * w
            for d in T.Parallel(dim):
                Out[b, h, d] = o[d]

    return sink_attn_combine


# ----------------------------------------------------------------------------- CPU variant (CI runs the logic)
def split_kernel_cpu(dtype: str, scale: float, dim: int = HEAD_DIM, block_h: int = BLOCK_H, block_n: int = BLOCK_N):
    """The split kernel's algorithm for TileLang's CPU target (``target="c"``): same arguments, grid, masking,
    sink floor, online softmax and partial outputs as ``split_kernel``, with thread-private buffers, serial loops
    and TileLang's scalar CPU GEMM. CI runs it (with ``combine_kernel_cpu``) against the reference op; it is a
    check of the kernel logic, not a fast CPU path."""
    import tilelang.language as T

    accum = "float32"
    scale_log2 = float(scale) * LOG2E
    B, S, Lk, H, NS = T.dynamic("B"), T.dynamic("S"), T.dynamic("Lk"), T.dynamic("H"), T.dynamic("NS")
    NB = T.dynamic("NB")
    BH, BN = block_h, block_n

    @T.prim_func
    def sink_attn_split_cpu(
        Q: T.Tensor((B, H, dim), dtype),
        KV: T.Tensor((S, Lk, dim), dtype),
        Vis: T.Tensor((B, Lk), "uint8"),
        Blocks: T.Tensor((B, NB), "int32"),
        Counts: T.Tensor((B,), "int32"),
        Sinks: T.Tensor((H,), accum),
        Opart: T.Tensor((B, NS, H, dim), accum),
        Mpart: T.Tensor((B, NS, H), accum),
        Lpart: T.Tensor((B, NS, H), accum),
    ):
        with T.Kernel(NS, T.ceildiv(H, BH), B) as (split, hb, b):
            seq = b // (B // S)
            Q_s = T.alloc_local((BH, dim), dtype)
            KV_s = T.alloc_local((BN, dim), dtype)
            P_s = T.alloc_local((BH, BN), dtype)
            acc_s = T.alloc_local((BH, BN), accum)
            acc_o = T.alloc_local((BH, dim), accum)
            m = T.alloc_local((BH,), accum)
            m_prev = T.alloc_local((BH,), accum)
            alpha = T.alloc_local((BH,), accum)
            rowsum = T.alloc_local((BH,), accum)
            den = T.alloc_local((BH,), accum)

            T.copy(Q[b, hb * BH:(hb + 1) * BH, :], Q_s)
            T.fill(acc_o, 0)
            T.fill(den, 0)
            for i in T.serial(BH):
                m[i] = Sinks[hb * BH + i] * LOG2E
            n_blocks = Counts[b]  # this row's visible key blocks, listed in Blocks
            per_split = T.ceildiv(n_blocks, NS)
            first = split * per_split
            count = T.max(T.min(per_split, n_blocks - first), 0)
            for kb in T.serial(count):
                k0 = Blocks[b, first + kb] * BN
                for j, c in T.grid(BN, dim):  # zero-filled past Lk, like the GPU copies
                    KV_s[j, c] = T.if_then_else(k0 + j < Lk, KV[seq, T.min(k0 + j, Lk - 1), c], T.cast(0, dtype))
                T.gemm(Q_s, KV_s, acc_s, transpose_B=True, clear_accum=True)
                for i, j in T.grid(BH, BN):
                    acc_s[i, j] = T.if_then_else(
                        k0 + j < Lk and Vis[b, T.min(k0 + j, Lk - 1)] != 0, acc_s[i, j] * scale_log2, -T.infinity(accum))
                T.copy(m, m_prev)
                T.reduce_max(acc_s, m, dim=1, clear=False)
                for i in T.serial(BH):
                    alpha[i] = T.exp2(m_prev[i] - m[i])
                for i, j in T.grid(BH, BN):
                    acc_s[i, j] = T.exp2(acc_s[i, j] - m[i])
                T.reduce_sum(acc_s, rowsum, dim=1)
                for i in T.serial(BH):
                    den[i] = den[i] * alpha[i] + rowsum[i]
                T.copy(acc_s, P_s)
                for i, j in T.grid(BH, dim):
                    acc_o[i, j] *= alpha[i]
                T.gemm(P_s, KV_s, acc_o)
            T.copy(acc_o, Opart[b, split, hb * BH:(hb + 1) * BH, :])
            T.copy(m, Mpart[b, split, hb * BH:(hb + 1) * BH])
            T.copy(den, Lpart[b, split, hb * BH:(hb + 1) * BH])

    return sink_attn_split_cpu


def combine_kernel_cpu(dtype: str, dim: int = HEAD_DIM):
    """``combine_kernel`` for TileLang's CPU target (same arguments and math, serial loops)."""
    import tilelang.language as T

    accum = "float32"
    B, H, NS = T.dynamic("B"), T.dynamic("H"), T.dynamic("NS")

    @T.prim_func
    def sink_attn_combine_cpu(
        Opart: T.Tensor((B, NS, H, dim), accum),
        Mpart: T.Tensor((B, NS, H), accum),
        Lpart: T.Tensor((B, NS, H), accum),
        Sinks: T.Tensor((H,), accum),
        Out: T.Tensor((B, H, dim), dtype),
    ):
        with T.Kernel(H, B) as (h, b):
            o = T.alloc_local((dim,), accum)
            mx = T.alloc_var(accum)
            total = T.alloc_var(accum)
            w = T.alloc_var(accum)
            sink = Sinks[h] * LOG2E
            mx = sink
            for s in T.serial(NS):
                mx = T.max(mx, Mpart[b, s, h])
            total = T.exp2(sink - mx)
            for s in T.serial(NS):
                total += Lpart[b, s, h] * T.exp2(Mpart[b, s, h] - mx)
            T.fill(o, 0)
            for s in T.serial(NS):
                w = T.exp2(Mpart[b, s, h] - mx) / total
                for d in T.serial(dim):
                    o[d] += Opart[b, s, h, d] * w
            for d in T.serial(dim):
                Out[b, h, d] = o[d]

    return sink_attn_combine_cpu


@cache
def _compiled_cpu(dtype: str, scale: float, dim: int, block_h: int, block_n: int):
    import tilelang

    return (tilelang.compile(split_kernel_cpu(dtype, scale, dim, block_h, block_n), target="c"),
            tilelang.compile(combine_kernel_cpu(dtype, dim), target="c"))


def sink_attention_cpu(
    q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, scale: float,
    splits: int = 1, block_h: int | None = None, block_n: int = BLOCK_N,
) -> torch.Tensor:
    """Run the kernel logic on the CPU through TileLang's C target (``split_kernel_cpu`` + ``combine_kernel_cpu``).
    fp32 inputs; ``block_h`` defaults to H. For tests only (scalar loops: slow)."""
    S, Lq, H, d = q.shape
    Lk = kv.shape[1]
    B = S * Lq
    split, combine = _compiled_cpu("float32", float(scale), d, block_h or H, block_n)
    sk = sinks.float().contiguous()
    opart = torch.empty(B, splits, H, d)
    mpart = torch.empty(B, splits, H)
    lpart = torch.empty(B, splits, H)
    vis = visible.reshape(B, Lk).contiguous().view(torch.uint8)
    blocks, counts = visible_blocks_torch(vis, block_n)
    split(q.float().reshape(B, H, d).contiguous(), kv.float().contiguous(), vis, blocks, counts, sk, opart, mpart,
          lpart)
    out = torch.empty(B, H, d)
    combine(opart, mpart, lpart, sk, out)
    return out.view(S, Lq, H, d)


# ----------------------------------------------------------------------------- generated source / compile checks
def generated_source(arch: str, dtype: str = "bfloat16", which: str = "split") -> str:
    """Lower a kernel (``which``: ``split``, ``combine`` or ``whole``, the last SM90 only) for ``arch`` without a GPU
    and return the generated CUDA source (for the source checks)."""
    import tilelang
    from tvm.target import Target

    if which == "combine":
        func = combine_kernel(dtype)
    else:
        func = split_kernel(arch, dtype, scale=HEAD_DIM**-0.5, whole=which == "whole")
    target = Target({"kind": "cuda", "arch": arch})
    with tilelang.transform.PassContext(config=_pass_configs(arch)), target:
        return tilelang.lower(func, target=target).kernel_source


def compile_source(source: str, arch: str) -> bytes:
    """Compile generated source with nvcc (TileLang's own include paths) to a cubin for ``arch``."""
    from tilelang.contrib import nvcc

    return bytes(nvcc.compile_cuda(source, target_format="cubin", arch=[f"-arch={arch}"],
                                   options=nvcc.default_compile_options()))


# ----------------------------------------------------------------------------- runtime
def device_arch(device: torch.device) -> str:
    """``sm_90a`` / ``sm_100a`` from the device's compute capability."""
    major, _ = torch.cuda.get_device_capability(device)
    return "sm_100a" if major == 10 else "sm_90a"


@cache
def _compiled(arch: str, dtype: str, scale: float):
    import tilelang

    target = {"kind": "cuda", "arch": arch}
    split = tilelang.compile(split_kernel(arch, dtype, scale), target=target, pass_configs=_pass_configs(arch))
    combine = tilelang.compile(combine_kernel(dtype), target=target)
    return split, combine


@cache
def _compiled_whole(dtype: str, scale: float):
    """The SM90 kernel for rows of one split (``split_kernel(whole=True)``)."""
    import tilelang

    return tilelang.compile(split_kernel("sm_90a", dtype, scale, whole=True), target={"kind": "cuda", "arch": "sm_90a"},
                            pass_configs=_pass_configs("sm_90a"))


MAX_ROWS = 65535
"""Most query rows (sequences x queries) per launch: the split kernel's grid z is the row index."""


def num_splits(rows: int, lk: int, sms: int, block_n: int = BLOCK_N) -> int:
    """Key splits per row: at most one wave of CTAs (one CTA per SM: ~200 KB of shared memory each), at least two
    key blocks per split (``DEEPINFER_TL_ATTN_SPLITS`` fixes the count): a second, partial wave of CTAs
    costs more than the extra splits gain."""
    fixed = envs.DEEPINFER_TL_ATTN_SPLITS
    n_blocks = max(1, math.ceil(lk / block_n))
    if fixed is not None:
        return max(1, min(fixed, n_blocks))
    return max(1, min(sms // rows, math.ceil(n_blocks / 2)))


def available() -> bool:
    """TileLang importable (without importing it) and not switched off by ``DEEPINFER_NVIDIA_TILELANG=0``."""
    return envs.DEEPINFER_NVIDIA_TILELANG and importlib.util.find_spec("tilelang") is not None


def supported(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether the kernel covers these inputs (else the reference op runs)."""
    return (q.is_cuda and q.dtype in _DTYPES and kv.dtype == q.dtype and q.shape[-1] == HEAD_DIM
            and q.shape[2] % BLOCK_H == 0 and kv.shape[1] > 0)


def sink_attention(
    q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, scale: float,
    splits: int | None = None,
) -> torch.Tensor:
    """Drop-in for ``reference.sink_attention`` (see the module docstring); ``splits`` overrides the split count."""
    if not supported(q, kv):
        return ref.sink_attention(q, kv, visible, sinks, scale)
    S, Lq = q.shape[:2]
    if S * Lq > MAX_ROWS:  # the split kernel puts query rows on grid z (at most 65535): launch per group of sequences
        per = max(1, MAX_ROWS // Lq)
        return torch.cat([sink_attention(q[s:s + per], kv[s:s + per], visible[s:s + per], sinks, scale, splits)
                          for s in range(0, S, per)])
    return _launch(q, kv, visible, sinks, float(scale), splits)


@opaque_under_compile("tl_sink_attention", lambda q, kv, visible, sinks, scale, splits: q.new_empty(q.shape))
def _launch(q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, scale: float,
            splits: int | None) -> torch.Tensor:
    """The split and combine kernels on ``supported`` inputs of at most ``MAX_ROWS`` query rows; on SM90, rows of
    one split (prefill: more rows than SMs) take the whole-row kernel instead (no fp32 partials, no combine pass);
    ``DEEPINFER_TL_ATTN_WHOLE=0`` keeps split + combine there."""
    S, Lq, H, d = q.shape
    Lk = kv.shape[1]
    B = S * Lq
    arch = device_arch(q.device)
    ns = splits or num_splits(B, Lk, gpu.sm_count(q.device.index or 0))
    qf = q.reshape(B, H, d).contiguous()  # [B, H, d]
    vis = visible.reshape(B, Lk).contiguous().view(torch.uint8)  # [B, Lk]
    blocks, counts = visible_blocks(vis, BLOCK_N)  # [B, NB], [B]
    sk = sinks.float().contiguous()  # [H]
    out = torch.empty(B, H, d, device=q.device, dtype=q.dtype)
    if ns == 1 and arch == "sm_90a" and envs.DEEPINFER_TL_ATTN_WHOLE:
        _compiled_whole(_DTYPES[q.dtype], float(scale))(qf, kv.contiguous(), vis, blocks, counts, sk, out)
        return out.view(S, Lq, H, d)
    split, combine = _compiled(arch, _DTYPES[q.dtype], float(scale))
    opart = torch.empty(B, ns, H, d, device=q.device, dtype=torch.float32)
    mpart = torch.empty(B, ns, H, device=q.device, dtype=torch.float32)
    lpart = torch.empty_like(mpart)
    split(qf, kv.contiguous(), vis, blocks, counts, sk, opart, mpart, lpart)
    combine(opart, mpart, lpart, sk, out)
    return out.view(S, Lq, H, d)

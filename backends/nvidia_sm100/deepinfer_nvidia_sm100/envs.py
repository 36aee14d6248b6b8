"""The NVIDIA backend's environment variables (``deepinfer_core.envs`` explains the declarations and the values).

Most switch one of the backend's kernels off, back to the reference op (or cuBLAS), for A/B runs and profiles;
docs/nvidia.md says what each kernel covers. Read them as ``envs.DEEPINFER_NVIDIA_PDL`` (the value now).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deepinfer_core.envs import Variable, Variables

VARIABLES = Variables(
    "deepinfer-nvidia-sm100",
    Variable("DEEPINFER_NVIDIA_COMPILE", bool, True,
             "Fuse the small reference ops (norms, RoPE tables, `hc_head`, the compressor and decode index ops) "
             "with `torch.compile`; 0: run them eagerly."),
    Variable("DEEPINFER_NVIDIA_COMPILE_STEP", bool, False,
             "Compile whole decode steps with TorchInductor before their CUDA graphs are captured (needs "
             "`DEEPINFER_NVIDIA_COMPILE` on)."),
    Variable("DEEPINFER_NVIDIA_PDL", bool, True,
             "Launch the Triton kernels with programmatic dependent launch; 0 for per-kernel times in a profile."),
    Variable("DEEPINFER_NVIDIA_GEMV", bool, True,
             "Triton GEMV for one-row `linear` / `grouped_linear` (batch-1 decode); 0: cuBLAS."),
    Variable("DEEPINFER_NVIDIA_FP8_TC", bool, True,
             "fp8 block linears of at least `FP8_TC_MIN_ROWS` rows on fp8 tensor cores, activations "
             "quantized per token per block; 0: the weight-only kernels at every size (exact weights, activations "
             "unquantized)."),
    Variable("DEEPINFER_NVIDIA_FP8_SCALED_MM", bool, True,
             "fp8 block linears of at least `DEQUANT_MIN_ROWS` rows (prefill) with 128 x 128 blocks and bf16 "
             "activations through cuBLAS's blockwise fp8 `torch._scaled_mm` (activations quantized per token per "
             "128 inputs); 0: the weight decoded to bf16, then cuBLAS (exact)."),
    Variable("DEEPINFER_NVIDIA_FP8_SPLITS_MEET", bool, False,
             "fp8 block linears split along K (small decode batches: the split-K and tensor-core kernels) add their "
             "splits' float32 partials in the kernel, by the last split of each tile to finish (an arrival count "
             "per tile, the sums in split order: the same bits), instead of a second kernel launch. Off until run "
             "on a GPU (written 2026-12-04 without one; the batch-invariant plugin's GEMM folds its splits the "
             "same way)."),
    Variable("DEEPINFER_NVIDIA_MXFP4_FP8_MIN_PER_EXPERT", int, 256,
             "MXFP4 routed experts with bf16 activations and at least this many assignments per expert on average "
             "(prefill) take `moe_mxfp4_prefill`: the layer's experts converted to e4m3 rows for the call, "
             "activations quantized per row, CUTLASS's fp8 grouped GEMM (`torch._scaled_grouped_mm`); 0: never."),
    Variable("DEEPINFER_NVIDIA_MXFP4_DOT_SCALED", bool, True,
             "MXFP4 routed experts with bf16 activations through `tl.dot_scaled` in the grouped kernels (nibbles "
             "expanded to bf16 by the compiler, one product over contiguous inputs); 0: each tile decoded to "
             "float32 and multiplied as even / odd halves (the kernels before the rewrite)."),
    Variable("DEEPINFER_NVIDIA_MXFP4_DECODE_MAX_PER_EXPERT", int, 1024,
             "MXFP4 routed experts of 2+ tokens with at most this many assignments per expert on average take "
             "`moe_mxfp4_decode`'s kernels (the packed words expanded by inline PTX straight into the MMA's register "
             "operand, in fragment order; on an H200 2.0x faster than `moe_quant`'s grouped kernels at 16-256 "
             "tokens, 1.5x at 1,024, 1.05x at 8,192 on the v4-flash-8l64e-fp4 experts); 0: the grouped kernels of "
             "`moe_quant` at every size."),
    Variable("DEEPINFER_NVIDIA_ROW_PIPELINE", int, 3,
             "`moe_quant`'s fp8 one-row expert kernels (batch-1 decode: the shared expert, fp8 routed experts): "
             "their K loops software-pipelined over this many stages by Triton (weight slices, scales and inputs "
             "copied ahead into shared memory, across the picked experts in the down kernel); 0: each slice loaded "
             "when its products need it (the same sums either way). On the H200 the shared expert took 13.6 us "
             "pipelined against 29.6 us (2026-12-04); MXFP4 rows are never pipelined (4x slower)."),
    Variable("DEEPINFER_NVIDIA_ROW_PICKS_APART", bool, False,
             "One token's routed experts (batch-1 decode): the down products of the picked experts on programs of "
             "their own, side by side (a column block's last program adds them in expert order, the same bits), "
             "instead of one pick after another in each program. Off until timed on a GPU (written 2026-12-04 "
             "without one)."),
    Variable("DEEPINFER_NVIDIA_MXFP4_FP8_DECODE", bool, False,
             "MXFP4 routed experts at decode sizes (one token included, up to 32 assignments per expert) on fp8 "
             "tensor cores: codes expanded in registers to e4m3, activations quantized per 128 inputs, the SwiGLU "
             "output per 64 (`moe_mxfp4_fp8_decode.py`; an error against the reference op, docs/quantization.md). "
             "Off until timed "
             "on a GPU (written 2026-12-04 without one)."),
    Variable("DEEPINFER_NVIDIA_INVARIANT_MIX_SPLITS", int, None,
             "Batch-invariant mode: the most K splits of the mHC mixing logits (`hc.INVARIANT_MIX_SPLITS` when unset; "
             "the split count follows the row length only, so any value is invariant, with other bits). Set it before "
             "the engine starts."),
    Variable("DEEPINFER_NVIDIA_NORM", bool, True, "Triton RMS-norm kernels; 0: the compiled reference ops."),
    Variable("DEEPINFER_NVIDIA_GREEDY", bool, True, "Triton sampler for all-greedy steps; 0: the reference sampler."),
    Variable("DEEPINFER_NVIDIA_RADIX_TOPK", bool, True,
             "The indexer's top-k by a Triton radix select per query row (`DEEPINFER_NVIDIA_RADIX_TOPK_WIDE` says "
             "which); 0: order keys and `torch.topk` at every size."),
    Variable("DEEPINFER_NVIDIA_RADIX_TOPK_MIN_ROWS", int, 64,
             "With `DEEPINFER_NVIDIA_RADIX_TOPK_WIDE=0`: query rows from which an `indexer_topk` call takes the 4-bit "
             "radix select (one program per row); fewer rows (decode steps) take order keys and `torch.topk`."),
    Variable("DEEPINFER_NVIDIA_RADIX_TOPK_WIDE", bool, True,
             "The radix top-k by wider digits with the row held on chip (one read of the scores; needs Triton >= "
             "3.6, whose tl.histogram takes a mask): rows of up to 32,768 entries at any row count; index mode's "
             "selection of decode rows (and of prefill rows over 16,384 entries that `DEEPINFER_NVIDIA_TOPK_FILTER` "
             "leaves) in two stages (each 4,096-entry chunk's top-k, then the row's among them); the mask forms' "
             "rows over 32,768 by order keys and `torch.topk`; "
             "0: the 4-bit radix select (8 passes over memory and the write) from "
             "`DEEPINFER_NVIDIA_RADIX_TOPK_MIN_ROWS` rows."),
    Variable("DEEPINFER_NVIDIA_TOPK_FILTER", bool, True,
             "With `DEEPINFER_NVIDIA_RADIX_TOPK_WIDE`: index mode's selection of prefill rows (calls of at least 64 "
             "rows) over 16,384 entries by the filtered select (each row's 16-entry tiles' maxima, their 512th "
             "largest as a floor, one pass listing the entries at or above it, their top-k on chip) instead of the "
             "two-stage split; rows of up to 262,144 entries at top-512. 0: the split for those rows too."),
    Variable("DEEPINFER_NVIDIA_DECODE_ATTN", bool, True,
             "Triton `sink_attention` for decode rows; 0: the TileLang kernel (SM90, where installed) or the "
             "reference."),
    Variable("DEEPINFER_NVIDIA_DECODE_ATTN_MAX_ROWS", int, 1,
             "Most decode rows (sequences) a call may have to take the Triton decode attention kernel."),
    Variable("DEEPINFER_NVIDIA_SPARSE_ATTN_HEADS", int, 0,
             "Heads a program of the Triton `sparse_sink_attention` takes (16, 32 or 64; more share each listed key "
             "load among more heads, with 8 warps and fewer programs); 0: 64 for calls of at least one row per SM "
             "(prefill), 16 for fewer (decode, whose keys are split across programs instead); a head count it does "
             "not divide keeps 16."),
    Variable("DEEPINFER_NVIDIA_STREAMS", bool, True,
             "Run forked work (an attention layer's key path, the folds, the shared expert) on a second CUDA "
             "stream; 0: in place."),
    Variable("DEEPINFER_NVIDIA_HC_BESIDE", bool, True,
             "Compute the mHC `post` / `comb` weights (the Sinkhorn) on the side stream beside the block; 0: inline."),
    Variable("DEEPINFER_NVIDIA_TILELANG", bool, True,
             "TileLang `sink_attention` where `tilelang` is installed (SM90); 0: the reference."),
    Variable("DEEPINFER_TL_ATTN_SPLITS", int, None,
             "Key splits per row of the TileLang attention; unset: at most one wave of CTAs, two key blocks a split."),
    Variable("DEEPINFER_TL_ATTN_WHOLE", bool, True,
             "On SM90, rows of one key split take the whole-row TileLang kernel; 0: split kernel + combine."),
    Variable("DEEPINFER_TINY_CHECKPOINT", Path, None,
             "Checkpoint of the backend's GPU model tests; unset: `deepinfer_core/assets/tiny_v4`, else one "
             "written by the test."),
)


def get(name: str) -> Any:
    """The value of the backend's variable ``name``, read now."""
    return VARIABLES.get(name)


def __getattr__(name: str) -> Any:
    return VARIABLES.attribute(name)

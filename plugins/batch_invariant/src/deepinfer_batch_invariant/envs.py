"""The batch-invariant plugin's environment variables (``deepinfer_core.envs`` explains the declarations)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deepinfer_core.envs import Variable, Variables

VARIABLES = Variables(
    "deepinfer-batch-invariant",
    Variable("DEEPINFER_BATCH_INVARIANT", bool, False,
             "Batch-invariant mode for engines built without the `batch_invariant` option (the option wins)."),
    Variable("DEEPINFER_BATCH_INVARIANT_FUSED_FOLD", bool, True,
             "NVIDIA: a split-K GEMM's partial sums are added by each tile's last program (a count per tile) instead "
             "of a second kernel; the same sums in the same order. 0: the second kernel."),
    Variable("DEEPINFER_BATCH_INVARIANT_ATTENTION_FEW_PROGRAMS", int, None,
             "NVIDIA: below this many (query, 64 heads) attention programs a program takes 16 heads (the same bits); "
             "0: always 64; unset: `triton_kernels.ATTN_FEW_PROGRAMS`, else the GPU's SM count."),
    Variable("DEEPINFER_BATCH_INVARIANT_GEMM_LAUNCHES", str, None,
             "NVIDIA: the GEMM launch by row count as `rows:launch` pairs, e.g. "
             "`0:split_swap,17:split,128:split_wide,256:wide` (launches in `triton_kernels.LAUNCHES`; every one gives "
             "the same bits; `wide` runs as `wide_short` where its tiles would be too few, `WIDE_MIN_PROGRAMS`); "
             "unset: `ROW_LAUNCHES`."),
    Variable("DEEPINFER_BATCH_INVARIANT_SPLIT_K_PROGRAMS", int, None,
             "NVIDIA: the GEMM's K-split target, programs per row tile (`triton_kernels.SPLIT_K_PROGRAMS` when "
             "unset); the split follows the weight's shape only, so any value keeps invariance (other bits)."),
    Variable("DEEPINFER_BATCH_INVARIANT_MIN_SPLIT_BLOCKS", int, None,
             "NVIDIA: the fewest BLOCK_K-long K blocks per GEMM K split (`triton_kernels.MIN_SPLIT_BLOCKS` when unset)."),
    Variable("DEEPINFER_ENABLE_MTP_VARLEN", bool, None,
             "The reference engine's switch for deterministic sampling with speculative decoding: checked and "
             "logged, no effect yet (no speculative decoding)."),
)


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of the plugin's variable ``name`` in ``environ`` (default ``os.environ``), read now."""
    return VARIABLES.get(name, environ)


def __getattr__(name: str) -> Any:
    return VARIABLES.attribute(name)

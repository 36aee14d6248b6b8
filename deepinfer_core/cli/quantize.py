"""``deepinfer quantize``: write a bf16 / fp32 DeepSeek-V4 checkpoint in the quantized format DeepSeek ships.

Examples::

    deepinfer quantize ./v4-bf16 ./v4-fp4 --experts fp4 --linear fp8             # like V4-Flash: MXFP4 experts
    deepinfer quantize ./v4-bf16 ./v4-fp8 --experts fp8 --linear fp8             # like V4-Flash-Base
    deepinfer quantize ./v4-bf16 ./v4-b32 --experts fp4 --linear fp8 --block 32  # like V4.1-Flash's 32 x 32 blocks
"""

from __future__ import annotations

import argparse
import sys

HELP = "write a bf16/fp32 DeepSeek-V4 checkpoint as fp8 block weights with MXFP4 or fp8 experts"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``deepinfer quantize`` options."""
    from deepinfer_core.quant.writer import BLOCK_SIZES, EXPERT_FORMATS, LINEAR_FORMATS, SCALE_FORMATS

    parser.add_argument("src", help="checkpoint folder to read (bf16, fp16 or fp32 safetensors)")
    parser.add_argument("dst", help="folder to write (new or empty); tokenizer and other files are copied")
    parser.add_argument("--experts", choices=EXPERT_FORMATS, default="fp4",
                        help="routed experts: fp4 = MXFP4 (e2m1, ue8m0 scale per 32 inputs), fp8 = fp8 blocks "
                             "(default fp4)")
    parser.add_argument("--linear", choices=LINEAR_FORMATS, default="fp8",
                        help="every other linear weight (attention, compressors, indexer, shared expert): fp8 e4m3 "
                             "blocks, or none to keep them as stored (default fp8)")
    parser.add_argument("--block", type=int, choices=BLOCK_SIZES, default=128,
                        help="fp8 scale block, B x B (default 128; V4.1-Flash uses 32)")
    parser.add_argument("--scale-fmt", choices=SCALE_FORMATS,
                        help="fp8 block scales: ue8m0 powers of two or float32 (default: ue8m0 with fp4 experts, "
                             "float32 with fp8 experts, as DeepSeek ships them)")


def run(args: argparse.Namespace) -> int:
    """Quantize; print what was written. Exit 2 for a checkpoint or destination it cannot use."""
    from deepinfer_core.errors import DeepInferError
    from deepinfer_core.quant.writer import QuantRecipe, quantize_checkpoint

    try:
        recipe = QuantRecipe(args.experts, args.linear, args.block, args.scale_fmt)
        shards = quantize_checkpoint(args.src, args.dst, recipe)
    except (DeepInferError, FileNotFoundError) as exc:
        print(f"deepinfer quantize: error: {exc}", file=sys.stderr)
        return 2
    scales = "ue8m0" if recipe.ue8m0 else "float32"
    print(f"wrote {args.dst}: {len(shards)} shard(s); experts {recipe.experts}, linear {recipe.linear} in "
          f"{recipe.block}x{recipe.block} blocks with {scales} scales")
    return 0

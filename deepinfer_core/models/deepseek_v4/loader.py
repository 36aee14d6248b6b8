"""Build a DeepSeek-V4 model from a checkpoint folder, streaming weights shard by shard (or drawing random ones:
``load_format="dummy"``)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from deepinfer_core.checkpoint import CheckpointError, iter_checkpoint, plan_checkpoint
from deepinfer_core.engine_args import DUMMY, check_load_format
from deepinfer_core.models.deepseek_v4 import random_weights
from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config
from deepinfer_core.models.deepseek_v4.model import DeepseekV4Model
from deepinfer_core.ops.table import OpTable

logger = logging.getLogger("deepinfer")


def load_deepseek_v4(
    folder: str | Path,
    ops: OpTable,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    config: DeepseekV4Config | None = None,
    load_format: str = "auto",
) -> DeepseekV4Model:
    """Load config.json and the safetensors shards of ``folder`` into a new model.

    The checkpoint is validated from its headers first (missing / unexpected / mis-shaped tensors
    raise ``CheckpointError`` naming the tensor and the expected shape), then every tensor is copied
    into its parameter as it is read, so host memory stays around one shard. Quantized weights (fp8 blocks,
    MXFP4 experts: docs/quantization.md) are held as stored, with their scales.

    ``load_format="dummy"`` (vLLM's name) reads config.json only: the weights are drawn on ``device`` as the bench
    presets draw them (``random_weights.dummy_weights``), quantized as ``deepinfer quantize`` writes them
    where config.json declares a ``quantization_config``; for timing a model no checkpoint of which fits the disk.
    """
    check_load_format(load_format)
    folder = Path(folder)
    config = config or DeepseekV4Config.from_file(folder / "config.json")
    if load_format == DUMMY:
        quantized, tensors = random_weights.dummy_weights(config, dtype, device)
    else:
        plan = plan_checkpoint(folder, config)
        plan.raise_for_problems()
        quantized = plan.quantized
        tensors = iter_checkpoint(plan, dtype, device)
    model = DeepseekV4Model(config, ops, dtype=dtype, device=device, quantized=quantized)
    missing = model.missing_parameters(model.load_weights(tensors))
    if missing:
        raise CheckpointError(f"checkpoint {folder} left parameters unset: {missing[:10]}")
    source = "random weights (load_format='dummy')" if load_format == DUMMY else str(folder)
    logger.info("loaded %s: %s", source, model.held_bytes().describe())
    return model

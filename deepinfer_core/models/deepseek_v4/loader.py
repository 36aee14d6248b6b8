"""Build a DeepSeek-V4 model from a checkpoint folder, streaming weights shard by shard."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from deepinfer_core.checkpoint import CheckpointError, load_checkpoint, plan_checkpoint
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
) -> DeepseekV4Model:
    """Load config.json and the safetensors shards of ``folder`` into a new model.

    The checkpoint is validated from its headers first (missing / unexpected / mis-shaped tensors
    raise ``CheckpointError`` naming the tensor and the expected shape), then every tensor is copied
    into its parameter as it is read, so host memory stays around one shard. Quantized weights (fp8 blocks,
    MXFP4 experts: docs/quantization.md) are held as stored, with their scales.
    """
    folder = Path(folder)
    config = config or DeepseekV4Config.from_file(folder / "config.json")
    plan = plan_checkpoint(folder, config)
    plan.raise_for_problems()
    model = DeepseekV4Model(config, ops, dtype=dtype, device=device, quantized=plan.quantized)
    loaded: set[str] = set()

    def consume(name: str, tensor: torch.Tensor) -> None:
        loaded.update(model.load_weights([(name, tensor)]))

    load_checkpoint(folder, config, dtype, device, consume, plan=plan)
    missing = model.missing_parameters(loaded)
    if missing:
        raise CheckpointError(f"checkpoint {folder} left parameters unset: {missing[:10]}")
    logger.info("loaded %s: %s", folder, model.held_bytes().describe())
    return model

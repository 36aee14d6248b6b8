"""A tiny random DeepSeek-V4 model built from the core's own config (no HF, no checkpoint), for parity tests."""

from __future__ import annotations

import torch

from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config
from deepinfer_core.models.deepseek_v4.model import DeepseekV4Model

LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]


def tiny_config(scoring_func: str = "sigmoid", heads: int = 4) -> DeepseekV4Config:
    """Every layer type, one hash-routed MoE layer, CSA ratio 4, HCA ratio 8, window 8; D = 32, rope 8."""
    return DeepseekV4Config.from_dict({
        "model_type": "deepseek_v4", "vocab_size": 64, "hidden_size": 32, "moe_intermediate_size": 16,
        "num_hidden_layers": 3, "num_attention_heads": heads, "head_dim": 32, "q_lora_rank": 16,
        "num_experts_per_tok": 2, "n_routed_experts": 4, "o_groups": 2, "o_lora_rank": 8, "index_n_heads": 2,
        "index_head_dim": 16, "index_topk": 64, "sliding_window": 8, "layer_types": LAYER_TYPES,
        "mlp_layer_types": ["hash_moe", "moe", "moe"], "hc_mult": 2, "scoring_func": scoring_func,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "partial_rotary_factor": 0.25, "max_position_embeddings": 4096,
    })


def random_weights(model: DeepseekV4Model, seed: int = 0) -> dict[str, torch.Tensor]:
    """Non-trivial values for every parameter (norm weights near 1, tid2eid valid expert ids), on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    experts = model.config.n_routed_experts
    weights = {}
    for name, slot in model.parameters.items():
        if name.endswith("tid2eid"):
            rows = [torch.randperm(experts, generator=gen)[: slot.shape[1]] for _ in range(slot.shape[0])]
            weights[name] = torch.stack(rows)
        elif slot.dtype.is_floating_point:
            noise = torch.randn(slot.shape, generator=gen)
            weights[name] = 1 + 0.1 * noise if "norm" in name else noise * (0.5 if slot.dim() < 2 else 0.2)
        else:
            weights[name] = torch.zeros(slot.shape, dtype=slot.dtype)
    return weights


def build(config: DeepseekV4Config, ops, weights: dict[str, torch.Tensor], dtype: torch.dtype, device="cpu"):
    model = DeepseekV4Model(config, ops, dtype=dtype, device=device)
    model.load_weights((name, tensor.to(device)) for name, tensor in weights.items())
    return model


def run_prefill_then_decode(model: DeepseekV4Model, prompts: list[list[int]], decode_tokens: list[int]) -> torch.Tensor:
    """Prefill every prompt in one batch (all logits), then one batched decode step; returns fp32 logits."""
    device = model.device
    block = model.config.block_multiple
    tables = [[s * 16 + b for b in range(16)] for s in range(len(prompts))]
    state = model.new_state(num_slots=len(prompts), num_blocks=16 * len(prompts), block_size=block)
    slots = list(range(len(prompts)))
    prefill = ForwardBatch.build(prompts, [0] * len(prompts), slots, tables, logits="all", device=device)
    first = model.forward(prefill, state).logits
    decode = ForwardBatch.build([[t] for t in decode_tokens], [len(p) for p in prompts], slots, tables, device=device)
    second = model.forward(decode, state).logits
    return torch.cat([first, second]).float().cpu()


def prompts(lengths=(13, 21), vocab: int = 64, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]

"""A skewed routing trace for the balance tests: Zipf-like expert popularity, seeded, top-k without replacement."""

from __future__ import annotations

import torch


def zipf_trace(steps: int, layers: int, num_experts: int, tokens_per_step: int, top_k: int, exponent: float,
               seed: int) -> torch.Tensor:
    """Tokens per expert of every step and layer: ``[steps, layers, num_experts]`` int64.

    Expert popularity follows ``1 / rank ** exponent``, with a different random order of the experts in each
    layer (so the hot experts are not all on rank 0). Each token picks ``top_k`` distinct experts, sampled without
    replacement in proportion to popularity (the Gumbel-top-k trick).
    """
    g = torch.Generator().manual_seed(seed)
    popularity = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -exponent  # [num_experts]
    trace = torch.zeros(steps, layers, num_experts, dtype=torch.int64)
    for layer in range(layers):
        log_p = popularity.log()[torch.argsort(torch.randperm(num_experts, generator=g))]  # [num_experts], shuffled
        uniform = torch.rand(steps * tokens_per_step, num_experts, generator=g, dtype=torch.float64)
        gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-300)))  # [tokens, num_experts]
        picks = torch.topk(log_p + gumbel, top_k, dim=-1).indices  # [tokens, top_k]
        counts = torch.zeros(steps * tokens_per_step, num_experts, dtype=torch.int64)
        counts.scatter_(1, picks, 1)
        trace[:, layer] = counts.view(steps, tokens_per_step, num_experts).sum(1)  # [steps, num_experts]
    return trace

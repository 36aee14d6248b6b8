"""Print moe_lb on skewed routing traces: the README's table (``python plugins/eplb/measure_balance.py``).

64 experts over 8 ranks, 4 MoE layers, 256 tokens a step, Zipf-like popularity (a different random expert order
per layer), seeded. The placement is planned from steps 0-99 and measured on steps 100-199 (load it never saw).
"""

from __future__ import annotations

import sys
from pathlib import Path

from deepinfer_eplb import Placement, moe_lb, rebalance_experts

sys.path.insert(0, str(Path(__file__).parent / "tests"))
from eplb_trace import zipf_trace

LAYERS, EXPERTS, RANKS, TOKENS = 4, 64, 8, 256


def row(exponent: float, top_k: int) -> str:
    trace = zipf_trace(200, LAYERS, EXPERTS, TOKENS, top_k, exponent, seed=0)  # [steps, layers, experts]
    planned, unseen = trace[:100].sum(0), trace[100:].sum(0)  # [layers, experts] each
    without = moe_lb(unseen, Placement.identity(LAYERS, EXPERTS), RANKS)
    no_spares = moe_lb(unseen, rebalance_experts(planned, EXPERTS, 1, 1, RANKS), RANKS)
    spares = moe_lb(unseen, rebalance_experts(planned, EXPERTS + RANKS, 1, 1, RANKS), RANKS)
    return f"| {exponent} | {top_k} | {without:.3f} | {no_spares:.3f} | {spares:.3f} |"


def main() -> None:
    print("| Zipf exponent | top-k | without EPLB | EPLB, no redundant experts | EPLB, 1 redundant expert per rank |")
    print("|---|---|---|---|---|")
    for exponent in (0.6, 0.8, 1.0, 1.2):
        for top_k in (1, 6):
            print(row(exponent, top_k))


if __name__ == "__main__":
    main()

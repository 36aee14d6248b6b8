"""A decode step's weight budget, from a torch.profiler trace of its graph replays (``timeline.py``'s spans).

The step's kernels split into weight products (the routed and shared experts' kernels, the linears' and the head's,
with what serves them: K-split sums, activation quantization) and the rest. With every weight product at the HBM
floor of the weight bytes the step reads (``roofline``'s: the touched experts, the dense and shared weights, the head)
and the rest as it ran, the step would take at least ``span - weight products + floor``: faster weight kernels alone
cannot bring it below that, so ``bf16 step / bound`` caps what they can buy over another preset's step. The bound
assumes the weight products lie on the step's critical path (the main stream); where side-stream work hid behind
them, the real step with faster products is longer still.

    python weight_budget.py TRACE STEPS FLOOR_MS    (a saved trace: the split, and the bound for that floor)
"""

from __future__ import annotations

import sys
from collections import defaultdict

from timeline import device_spans, split_steps

# Kernel-name fragments by category; a kernel takes the first category one of whose fragments its name holds (the
# MoE's routing, alignment and combine kernels are the rest: they read no weights).
WEIGHT_PRODUCTS = {
    "experts": ("_up_row_kernel", "_down_row_kernel", "_down_pick_kernel", "_up_kernel", "_down_kernel", "_e4m3_rows",
                "grouped_mm"),
    "linears and head": ("_row_kernel", "_split_k_kernel", "_fp8_tc_kernel", "_weight_only_kernel",
                         "_sum_splits_kernel", "_quantize_rows_kernel", "_fp8_block_kernel", "gemv", "gemm", "nvjet",
                         "xmma", "cutlass"),
}
OTHER = "rest"


def category(name: str) -> str:
    """The ``WEIGHT_PRODUCTS`` category of a kernel name, else ``OTHER``."""
    return next((kind for kind, fragments in WEIGHT_PRODUCTS.items() if any(f in name for f in fragments)), OTHER)


def step_budget(step: list, floor_us: float) -> dict[str, float]:
    """One step's span, kernel time by category (microseconds), and ``bound``: the span with the weight products'
    time replaced by ``floor_us``."""
    times: dict[str, float] = defaultdict(float)
    for span in step:
        times[category(span.name)] += span.end - span.start
    span_us = max(s.end for s in step) - min(s.start for s in step)
    weights = sum(t for kind, t in times.items() if kind != OTHER)
    return {"span": span_us, **times, "weights": weights, "floor": floor_us,
            "bound": span_us - weights + floor_us}


def budget_report(trace_path: str, steps: int, floor_s: float) -> str:
    """The mean of ``steps`` consecutive steps' budgets (``step_budget``) in the trace at ``trace_path``, as text."""
    spans = device_spans(trace_path)
    if len(spans) < steps or steps < 1:
        return f"{len(spans)} device events in the trace: too few for {steps} steps"
    rows = [step_budget(step, floor_s * 1e6) for step in split_steps(spans, steps)]
    keys = ["span", *WEIGHT_PRODUCTS, OTHER, "weights", "floor", "bound"]
    mean = {k: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in keys}
    lines = ["| part | us a step |", "|---|---|"]
    lines += [f"| {k} | {mean[k]:.1f} |" for k in keys[:-3]]
    lines.append(f"| weight products: {mean['weights']:.1f} us against a floor of {mean['floor']:.1f} us "
                 f"({mean['floor'] / mean['weights']:.0%}) | |" if mean["weights"] else "| no weight products | |")
    lines.append(f"step with the weight products at the floor, the rest as it ran: at least {mean['bound']:.1f} us "
                 f"(the span is {mean['span']:.1f} us)")
    return "\n".join(lines)


if __name__ == "__main__":
    print(budget_report(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) / 1e3))

"""What the Ascend 950 backend declares it can do, importable without torch_npu (the probe quotes it).

Everything here is implemented against torch_npu's documented APIs and checked only on the CPU, against
plain-torch stand-ins of those documented semantics (tests/test_contract_*.py). No capability has been run
on an Ascend 950, so ``verified_on_hardware`` is empty.
"""

from __future__ import annotations

import torch

from deepinfer_core.backends.base import Capabilities

DECLARED = Capabilities(
    # bf16 / fp16 take the fused paths; fp32 works but attention falls back to the reference op
    # (npu_fused_infer_attention_score_v2 documents fp16 / bf16 queries only).
    dtypes=(torch.bfloat16, torch.float16, torch.float32),
    distributed_backend="hccl",
    device_graphs=True,  # ACL graphs: torch.npu.NPUGraph / torch.npu.graph exist in torch-npu 2.13.0 (read, not run)
    batch_invariant=False,
    fp8=False,
    verified_on_hardware=frozenset(),
)


def summary(capabilities: Capabilities = DECLARED) -> str:
    """One line for ``deepinfer env``: what is declared and how much of it was verified on hardware."""
    short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    dtypes = "/".join(short.get(d, str(d).removeprefix("torch.")) for d in capabilities.dtypes)
    declared = [dtypes, capabilities.distributed_backend]
    if capabilities.device_graphs:
        declared.append("ACL graphs")
    verified = sorted(capabilities.verified_on_hardware)
    state = f"verified on hardware: {', '.join(verified)}" if verified else "none verified on Ascend 950 hardware"
    return f"capabilities {', '.join(declared)} declared, {state}"

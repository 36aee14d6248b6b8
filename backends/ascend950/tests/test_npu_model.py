"""HARDWARE test (markers npu, ci_npu): the tiny DeepSeek-V4 model end to end on an Ascend 950 vs the CPU reference.

Skipped unless the ascend950 probe finds an Ascend 950 with CANN and torch_npu. NEVER RUN YET.
"""

from __future__ import annotations

import pytest
import torch
from hardware import hardware_marks
from model_factory import build, prompts, random_weights, run_prefill_then_decode, tiny_config

from deepinfer_core.ops.table import OpTable

pytestmark = hardware_marks()


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
def test_npu_model_matches_cpu_reference(scoring):
    from deepinfer_ascend950.backend import Ascend950Backend

    config = tiny_config(scoring)
    weights = random_weights(build(config, OpTable(), {}, torch.float32))
    want = run_prefill_then_decode(build(config, OpTable(), weights, torch.float32), prompts(), [5, 7])
    table = Ascend950Backend(0).make_op_table()
    got = run_prefill_then_decode(build(config, table, weights, torch.bfloat16, device="npu"), prompts(), [5, 7])
    row_error = (got - want).abs().amax(dim=-1) / want.abs().max()
    assert row_error.median() <= 0.03 and (row_error <= 0.05).float().mean() >= 0.9, row_error
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9

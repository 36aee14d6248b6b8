"""``move_experts`` and ``set_expert_placement`` in one process: a one-rank gloo group, so the expert-parallel op and
the moves run their real code paths without starting processes. Replicas and permutations leave the model's outputs
as they were; placements that do not fit the model are refused by name."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from deepinfer_eplb import Placement
from deepinfer_eplb.mover import move_experts

from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.models.deepseek_v4.expert_parallel import PlacementError
from deepinfer_core.models.deepseek_v4.loader import load_deepseek_v4
from deepinfer_core.models.resolve import resolve_model
from deepinfer_core.ops.table import OpTable

TOKENS = [5, 9, 3, 17, 22, 8, 41, 7, 7, 30, 2, 11, 60, 13, 4, 19, 25, 5, 5, 5]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model(one_rank):
    """The embedded tiny model, sharded over the one rank; the tests below change its placement in turn."""
    model = load_deepseek_v4(resolve_model(None), OpTable(), dtype=torch.float32)
    model.shard_experts(0, 1)
    return model


def _logits(model):
    state = model.new_state(num_slots=1, num_blocks=4, block_size=model.block_multiple)
    batch = ForwardBatch.build([TOKENS], [0], [0], [list(range(4))], logits="all")
    return model.forward(batch, state).logits


def test_replicas_and_permutations_keep_the_outputs(model):
    """4 experts into 7 slots (expert 2 three times, expert 0 twice), then back to 4 slots in another order."""
    layers = model.expert_parallel_layout().num_moe_layers
    before = _logits(model)
    old = Placement.identity(layers, 4)
    phy2log = torch.tensor([2, 0, 3, 2, 1, 0, 2]).repeat(layers, 1)
    replicas = Placement.from_slots(phy2log, torch.tensor([0, 0, 0, 1, 0, 1, 2]).repeat(layers, 1), 4)
    assert move_experts(model, model.expert_parallel_layout(), old, replicas) == 0  # one rank: all local copies
    assert model.expert_parallel_layout().slots_per_rank == 7 and model.expert_slots(0)[0].shape[0] == 7
    torch.testing.assert_close(_logits(model), before, atol=1e-5, rtol=0)
    permuted = Placement.from_slots(torch.tensor([3, 1, 0, 2]).repeat(layers, 1), torch.zeros(layers, 4,
                                                                                         dtype=torch.long), 4)
    move_experts(model, model.expert_parallel_layout(), replicas, permuted)
    torch.testing.assert_close(_logits(model), before, atol=1e-5, rtol=0)
    w1 = model.expert_slots(1)[0]  # slot 0 holds expert 3 now, under its checkpoint name too
    assert torch.equal(model.parameters["layers.1.ffn.experts.3.w1.weight"], w1[0])


def test_the_router_load_is_counted_and_handed_out_once(model):
    model.record_expert_load(True)
    _logits(model)
    load = model.expert_load()  # [layers, experts]
    assert load.shape == (model.expert_parallel_layout().num_moe_layers, 4)
    assert (load.sum(1) == len(TOKENS) * model.config.num_experts_per_tok).all()
    assert model.expert_load().sum() == 0  # zeroed by the first call


def test_placements_that_do_not_fit_are_refused(model):
    weights = model.expert_slots(0)
    identity = Placement.identity(1, 4)
    assert weights[0].shape[0] == 4
    with pytest.raises(PlacementError, match=r"expert weight 0 must be torch.float32 \[6, "):
        model.set_expert_placement(0, torch.tensor([0, 1, 2, 3, 0, 1]), identity.log2phy[0], identity.logcnt[0],
                                   weights)
    with pytest.raises(PlacementError, match="MoE layer 9 out of range"):
        model.set_expert_placement(9, identity.phy2log[0], identity.log2phy[0], identity.logcnt[0], weights)
    with pytest.raises(PlacementError, match=r"logcnt \[4\]"):
        model.set_expert_placement(0, identity.phy2log[0], identity.log2phy[0], torch.ones(3, dtype=torch.long),
                                   weights)


def test_fp8_experts_move_with_their_scales(one_rank, tmp_path):
    """fp8 block experts (e4m3 weights, float32 scales, the block size passed through) into 6 slots with replicas."""
    from deepinfer_core.quant.writer import QuantRecipe, quantize_checkpoint

    folder = tmp_path / "fp8"
    quantize_checkpoint(resolve_model(None), folder, QuantRecipe("fp8", "fp8", 32))
    model = load_deepseek_v4(folder, OpTable(), dtype=torch.float32)
    model.shard_experts(0, 1)
    assert model.layers[0].ffn.expert_weights[0].local_weights[0].dtype == torch.float8_e4m3fn
    layers = model.expert_parallel_layout().num_moe_layers
    before = _logits(model)
    phy2log = torch.tensor([3, 0, 1, 3, 2, 0]).repeat(layers, 1)
    replicas = Placement.from_slots(phy2log, torch.tensor([0, 0, 0, 1, 0, 1]).repeat(layers, 1), 4)
    move_experts(model, model.expert_parallel_layout(), Placement.identity(layers, 4), replicas)
    weights = model.expert_slots(0)
    assert [w.shape[0] for w in weights if isinstance(w, torch.Tensor)] == [6] * 6 and weights[-1] == (32, 32)
    torch.testing.assert_close(_logits(model), before, atol=1e-5, rtol=0)

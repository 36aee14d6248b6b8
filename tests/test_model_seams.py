"""Seams later features use: the expert map, per-expert token counts, hidden states of chosen layers."""

from __future__ import annotations

import pytest
import torch
from v4_factory import ALL_TYPES, tiny_hf_model

from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.models.deepseek_v4.loader import load_deepseek_v4
from deepinfer_core.models.deepseek_v4.model import ExpertMap
from deepinfer_core.ops.table import OpTable

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("seams") / "ckpt"
    tiny_hf_model(path, layer_types=ALL_TYPES, hc_mult=2)
    return path


def _forward(model, tokens, capture=()):
    state = model.new_state(num_slots=1, num_blocks=8, block_size=8)
    batch = ForwardBatch.build([tokens], [0], [0], [list(range(8))], logits="all")
    return model.forward(batch, state, capture_layers=capture)


TOKENS = [5, 9, 3, 17, 22, 8, 41, 7, 7, 30, 2, 11, 60, 13, 4, 19, 25]


def test_expert_map_relocates_experts_without_changing_outputs(folder):
    model = load_deepseek_v4(folder, OpTable())
    before = _forward(model, TOKENS).logits
    permutation = torch.tensor([2, 0, 3, 1])  # logical expert e lives in physical slot permutation[e]
    for layer in model.layers:
        moe = layer.ffn
        for stacked in (moe.w1, moe.w2, moe.w3):
            moved = stacked.clone()
            stacked[permutation] = moved  # physical slot permutation[e] <- logical expert e
        moe.expert_map.logical_to_physical = permutation.clone()
    torch.testing.assert_close(_forward(model, TOKENS).logits, before, atol=1e-6, rtol=0)


def test_wrong_expert_map_changes_outputs(folder):
    model = load_deepseek_v4(folder, OpTable())
    before = _forward(model, TOKENS).logits
    for layer in model.layers:
        layer.ffn.expert_map.logical_to_physical = torch.tensor([1, 0, 3, 2])  # weights not moved
    assert not torch.allclose(_forward(model, TOKENS).logits, before, atol=1e-4)


def test_the_identity_expert_map_costs_no_gather():
    expert_map = ExpertMap(4, torch.device("cpu"))
    ids = torch.tensor([[3, 1], [0, 2]])
    assert expert_map.to_physical(ids) is ids
    expert_map.logical_to_physical = torch.tensor([1, 0, 3, 2])
    assert torch.equal(expert_map.to_physical(ids), torch.tensor([[2, 0], [1, 3]]))
    expert_map.logical_to_physical = torch.arange(4)  # back to the identity
    assert expert_map.to_physical(ids) is ids


def test_replicas_take_an_experts_pairs_round_robin():
    """With replicas (EPLB's redundant experts) the j-th pair routed to expert e goes to replica
    (j + offset) % count[e]: deterministic, split evenly, an expert with one slot always to it."""
    expert_map = ExpertMap(3, torch.device("cpu"))
    log2phy = torch.tensor([[0, 3, 4], [1, -1, -1], [2, -1, -1]])  # expert 0 in slots 0, 3, 4
    expert_map.set_replicas(log2phy, torch.tensor([3, 1, 1]))
    ids = torch.tensor([[0, 1], [0, 2], [2, 0], [0, 1]])  # expert 0's pairs: 4, in rows 0 to 3
    assert expert_map.to_physical(ids).tolist() == [[0, 1], [3, 2], [2, 4], [0, 1]]
    expert_map.set_replicas(log2phy, torch.tensor([3, 1, 1]), offset=1)  # another rank starts one replica later
    assert expert_map.to_physical(ids)[:, 0].tolist() == [3, 4, 2, 3]
    assert expert_map.to_physical(ids)[2, 1].item() == 0
    expert_map.set_replicas(torch.tensor([[0], [1], [2]]), torch.ones(3, dtype=torch.long))  # no replicas: identity
    assert expert_map.to_physical(ids) is ids


def test_expert_load_counts_every_routed_token(folder):
    model = load_deepseek_v4(folder, OpTable())
    for layer in model.layers:
        layer.ffn.record_load = True
    _forward(model, TOKENS)
    top_k = model.config.num_experts_per_tok
    for layer in model.layers:
        load = layer.ffn.expert_load
        assert load.sum().item() == len(TOKENS) * top_k
        assert (load >= 0).all() and load.shape == (model.config.n_routed_experts,)
    hash_layer = model.layers[0].ffn
    expected = torch.bincount(hash_layer.tid2eid[torch.tensor(TOKENS)].reshape(-1), minlength=4)
    assert torch.equal(hash_layer.expert_load, expected)


def test_hidden_states_of_chosen_layers(folder):
    model = load_deepseek_v4(folder, OpTable())
    out = _forward(model, TOKENS, capture=(0, 2))
    assert sorted(out.hidden_states) == [0, 2]
    for streams in out.hidden_states.values():
        assert streams.shape == (len(TOKENS), model.config.hc_mult, model.config.hidden_size)
    assert not torch.allclose(out.hidden_states[0], out.hidden_states[2])
    assert _forward(model, TOKENS).hidden_states == {}


def test_input_projections_load_into_one_fused_weight(folder):
    """Each layer's projections of its input (wq_a, wkv, the compressors' wkv / wgate, the indexer's weights)
    are row blocks of one fused weight: every name loads into its block, and the fused GEMM's column blocks
    equal the separate projections."""
    model = load_deepseek_v4(folder, OpTable())
    x = torch.randn(5, model.config.hidden_size)
    for layer in model.layers:
        attn = layer.attn
        prefix = f"layers.{attn.layer_idx}.attn"
        names = [f"{prefix}.wq_a.weight", f"{prefix}.wkv.weight"]
        if attn.compressor is not None:
            names += [f"{prefix}.compressor.wkv.weight", f"{prefix}.compressor.wgate.weight"]
        if attn.indexer is not None:
            names += [f"{prefix}.indexer.compressor.wkv.weight", f"{prefix}.indexer.compressor.wgate.weight",
                      f"{prefix}.indexer.weights_proj.weight"]
        blocks = [model.parameters[n] for n in names]
        (run,) = attn.input_runs  # unquantized weights fuse into one run
        assert run.names == names
        assert all(b.untyped_storage().data_ptr() == run.weight.untyped_storage().data_ptr() for b in blocks)
        assert torch.equal(torch.cat(blocks), run.weight) and run.weight.abs().sum() > 0
        projected = attn.project(model.ops, x)
        for role, block in zip(attn.input_roles, blocks, strict=True):
            torch.testing.assert_close(projected[role], x @ block.T, atol=1e-5, rtol=1e-5)
        for compressor in ("compress", "index"):  # a compressor's kv and gate columns side by side, one view
            if f"{compressor}_kv" in projected:
                joined = torch.cat([projected[f"{compressor}_kv"], projected[f"{compressor}_gate"]], dim=-1)
                assert torch.equal(projected[compressor], joined)
                assert projected[compressor].data_ptr() == projected[f"{compressor}_kv"].data_ptr()


def test_quantized_input_projections_of_v4_flash_layers_are_one_run():
    """With V4-Flash's widths and 128 x 128 fp8 blocks, every attention layer's input projections are one fused run
    (one GEMM a step): the indexer's 64-row weights_proj, which fills no whole scale block, comes last."""
    from deepinfer_core.bench.presets import FLASH_FP4, PRESETS
    from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config
    from deepinfer_core.models.deepseek_v4.model import DeepseekV4Model
    from deepinfer_core.quant.writer import planned_quantization

    layers = {"num_hidden_layers": 3, "layer_types": ALL_TYPES, "mlp_layer_types": ["moe"] * 3, "n_routed_experts": 2,
              "vocab_size": 256}
    config = DeepseekV4Config.from_dict(PRESETS["v4-flash-8l64e"].config_dict(layers))
    model = DeepseekV4Model(config, OpTable(), dtype=torch.bfloat16, device="meta",
                            quantized=planned_quantization(FLASH_FP4, config))
    runs = [[name.split(".attn.")[1] for name in run.names] for layer in model.layers for run in layer.attn.input_runs]
    assert runs == [["wq_a.weight", "wkv.weight"],
                    ["wq_a.weight", "wkv.weight", "compressor.wkv.weight", "compressor.wgate.weight",
                     "indexer.compressor.wkv.weight", "indexer.compressor.wgate.weight", "indexer.weights_proj.weight"],
                    ["wq_a.weight", "wkv.weight", "compressor.wkv.weight", "compressor.wgate.weight"]]


def test_a_fused_block_refuses_another_shape():
    from deepinfer_core.models.deepseek_v4.model import ParameterRegistry

    registry = ParameterRegistry(torch.float32, torch.device("cpu"))
    (run,) = registry.add_fused({"a.weight": 3, "b.weight": 2}, 4)
    fused = run.weight
    assert registry.add("b.weight", (2, 4)).data_ptr() == fused[3:].data_ptr()
    with pytest.raises(ValueError, match="was allocated as"):
        registry.add("a.weight", (4, 4))

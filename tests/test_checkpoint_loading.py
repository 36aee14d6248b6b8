"""Checkpoint loading: three naming schemes, sharding, dtypes and every bad-input error."""

from __future__ import annotations

import json
import weakref

import pytest
import torch

from deepinfer_core import checkpoint
from deepinfer_core.checkpoint import CheckpointError, load_checkpoint, plan_checkpoint, write_checkpoint
from deepinfer_core.models.deepseek_v4.config import ConfigError, DeepseekV4Config
from deepinfer_core.models.deepseek_v4.weights import FP32, INT, WEIGHT, canonical_name, expected_tensors

TINY = {
    "vocab_size": 64, "hidden_size": 32, "moe_intermediate_size": 16, "num_hidden_layers": 3,
    "num_attention_heads": 4, "head_dim": 32, "q_lora_rank": 16, "num_experts_per_tok": 2, "n_routed_experts": 4,
    "o_groups": 2, "o_lora_rank": 8, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 64, "sliding_window": 8,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe"], "hc_mult": 2,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "partial_rotary_factor": 0.25,
}
CONFIG_DICT = {"model_type": "deepseek_v4", **TINY}
I = TINY["moe_intermediate_size"]


@pytest.fixture(scope="module")
def hf_model():
    """A tiny HF DeepseekV4ForCausalLM with every tensor (buffers included) randomised."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**TINY))
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("tid2eid"):
                tensor.copy_(torch.randint(0, TINY["n_routed_experts"], tensor.shape))
            else:
                tensor.normal_()
    return model


@pytest.fixture(scope="module")
def config() -> DeepseekV4Config:
    return DeepseekV4Config.from_dict(CONFIG_DICT)


@pytest.fixture(scope="module")
def canonical(hf_model, tmp_path_factory) -> dict[str, torch.Tensor]:
    """Canonical tensors, taken from what HF save_pretrained writes, renamed by hand (no loader code)."""
    folder = tmp_path_factory.mktemp("hf_saved")
    hf_model.save_pretrained(folder)
    from safetensors.torch import load_file

    saved = load_file(str(folder / "model.safetensors"))
    renames = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
               "hc_head.hc_scale": "hc_head_scale"}
    out = {}
    for name, tensor in saved.items():
        name = name.removeprefix("model.")
        out[renames.get(name, name)] = tensor
    return out


def _load(folder, config, dtype=torch.float32) -> tuple[dict[str, torch.Tensor], checkpoint.LoadReport]:
    got: dict[str, torch.Tensor] = {}

    def consume(name: str, tensor: torch.Tensor) -> None:
        assert name not in got, f"{name} delivered twice"
        got[name] = tensor

    report = load_checkpoint(folder, config, dtype, "cpu", consume)
    return got, report


def _write(tmp_path, tensors, name="ckpt", config_dict=CONFIG_DICT, **kwargs):
    folder = tmp_path / name
    write_checkpoint(folder, tensors, config_dict, **kwargs)
    return folder


# ----------------------------------------------------------------------------------------------- naming schemes
def test_canonical_names_cover_expected_tensors(canonical, config):
    expected = expected_tensors(config)
    assert set(canonical) == set(expected)
    for name, tensor in canonical.items():
        assert tuple(tensor.shape) == expected[name][0], name
    assert expected["layers.0.ffn.gate.tid2eid"][1] == INT
    assert expected["layers.1.attn.attn_sink"][1] == FP32
    assert expected["layers.1.attn.wq_a.weight"][1] == WEIGHT


def test_canonical_name_mapping_examples():
    assert canonical_name("model.embed_tokens.weight") == "embed.weight"
    assert canonical_name("lm_head.weight") == "head.weight"
    assert canonical_name("head.weight") == "head.weight"
    assert canonical_name("model.hc_head.hc_fn") == "hc_head_fn"
    assert canonical_name("model.layers.3.self_attn.compressor.indexer.scorer.weights_proj.weight") == (
        "layers.3.attn.indexer.weights_proj.weight"
    )
    assert canonical_name("model.layers.2.mlp.gate.e_score_correction_bias") == "layers.2.ffn.gate.bias"
    assert canonical_name("model.layers.2.ffn.gate.bias") == "layers.2.ffn.gate.bias"
    assert canonical_name("model.layers.0.attn_hc.fn") == "layers.0.hc_attn_fn"
    assert canonical_name("model.layers.0.mlp.experts.5.up_proj.weight") == "layers.0.ffn.experts.5.w3.weight"
    assert canonical_name("mtp.0.attn.wq_a.weight") is None


def test_three_naming_schemes_load_identically(hf_model, canonical, config, tmp_path):
    hf_saved = tmp_path / "hf_saved"
    hf_model.save_pretrained(hf_saved)
    deepseek = _write(tmp_path, canonical, "deepseek")
    in_memory = _write(tmp_path, hf_model.state_dict(), "in_memory")
    loaded = {scheme: _load(folder, config)[0] for scheme, folder in
              (("hf", hf_saved), ("deepseek", deepseek), ("memory", in_memory))}
    for scheme, tensors in loaded.items():
        assert set(tensors) == set(canonical), scheme
        for name, tensor in tensors.items():
            torch.testing.assert_close(tensor, canonical[name], rtol=0, atol=0, msg=f"{scheme}: {name}")


def test_fused_experts_split_into_gate_up_down(hf_model, config, tmp_path):
    loaded, _ = _load(_write(tmp_path, hf_model.state_dict()), config)
    experts = hf_model.model.layers[1].mlp.experts
    for e in range(TINY["n_routed_experts"]):
        assert torch.equal(loaded[f"layers.1.ffn.experts.{e}.w1.weight"], experts.gate_up_proj[e, :I].detach())
        assert torch.equal(loaded[f"layers.1.ffn.experts.{e}.w3.weight"], experts.gate_up_proj[e, I:].detach())
        assert torch.equal(loaded[f"layers.1.ffn.experts.{e}.w2.weight"], experts.down_proj[e].detach())
    attn = hf_model.model.layers[1].self_attn
    assert torch.equal(loaded["layers.1.attn.wq_a.weight"], attn.q_a_proj.weight.detach())
    assert torch.equal(loaded["layers.1.attn.indexer.compressor.ape"], attn.compressor.indexer.position_bias.detach())
    assert torch.equal(loaded["head.weight"], hf_model.lm_head.weight.detach())


def test_mtp_tensors_are_skipped_and_counted(canonical, config, tmp_path):
    tensors = {**canonical, "mtp.0.attn.wq_a.weight": torch.zeros(16, 32), "mtp.0.norm.weight": torch.ones(32)}
    loaded, report = _load(_write(tmp_path, tensors), config)
    assert report.skipped == 2
    assert not any(name.startswith("mtp") for name in loaded)
    assert report.loaded == len(canonical)


# ----------------------------------------------------------------------------------------------- sharding
def test_sharded_checkpoint_streams_one_shard_at_a_time(canonical, config, tmp_path, monkeypatch):
    folder = _write(tmp_path, canonical, max_shard_bytes=20_000)
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) >= 3

    state = {"open": 0, "max_open": 0, "current": None, "data_opens": []}
    real_open = checkpoint.safe_open

    class CountingOpen:
        def __init__(self, path, framework, **kwargs):
            self.inner, self.path = real_open(path, framework=framework, **kwargs), path

        def __enter__(self):
            state["open"] += 1
            state["max_open"] = max(state["max_open"], state["open"])
            state["current"] = self.path.name
            return self.inner.__enter__()

        def __exit__(self, *exc):
            state["open"] -= 1
            state["current"] = None
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(checkpoint, "safe_open", CountingOpen)
    arrivals: list[tuple[str, str]] = []
    alive: list[weakref.ref] = []

    def consume(name: str, tensor: torch.Tensor) -> None:
        assert sum(ref() is not None for ref in alive) == 0, "the loader kept an earlier tensor alive"
        arrivals.append((name, state["current"]))
        alive.append(weakref.ref(tensor))

    report = load_checkpoint(folder, config, torch.float32, "cpu", consume)
    assert state["max_open"] == 1
    assert report.shards == len(shards) and report.loaded == len(canonical)
    for name, shard in arrivals:
        assert weight_map[name] == shard, f"{name} arrived while {shard} was open"
    order = [shard for _, shard in arrivals]
    runs = [shard for i, shard in enumerate(order) if i == 0 or order[i - 1] != shard]
    assert runs == shards, "tensors must arrive grouped by shard, each shard once"


def test_several_safetensors_without_index_load(canonical, config, tmp_path):
    folder = _write(tmp_path, canonical, max_shard_bytes=20_000)
    (folder / "model.safetensors.index.json").unlink()
    loaded, report = _load(folder, config)
    assert report.shards >= 3 and set(loaded) == set(canonical)


def test_index_naming_tensor_missing_from_shard(canonical, config, tmp_path):
    folder = _write(tmp_path, canonical, max_shard_bytes=20_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["layers.0.attn.ghost.weight"] = next(iter(index["weight_map"].values()))
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.ghost\.weight.*re-download"):
        plan_checkpoint(folder, config)


# ----------------------------------------------------------------------------------------------- dtypes
def test_bf16_checkpoint_loads_as_bf16_and_as_fp32(canonical, config, tmp_path):
    bf16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v.to(torch.int32) for k, v in canonical.items()}
    folder = _write(tmp_path, bf16)
    expected = expected_tensors(config)
    as_bf16, _ = _load(folder, config, torch.bfloat16)
    for name, tensor in as_bf16.items():
        want = {WEIGHT: torch.bfloat16, FP32: torch.float32, INT: torch.int64}[expected[name][1]]
        assert tensor.dtype == want, name
        assert torch.equal(tensor.to(bf16[name].dtype), bf16[name]), name
    as_fp32, _ = _load(folder, config, torch.float32)
    assert as_fp32["layers.1.attn.wq_a.weight"].dtype == torch.float32
    assert torch.equal(as_fp32["layers.1.attn.wq_a.weight"], bf16["layers.1.attn.wq_a.weight"].float())
    assert as_fp32["layers.0.ffn.gate.tid2eid"].dtype == torch.int64


def test_fp16_checkpoint_loads(canonical, config, tmp_path):
    fp16 = {k: v.half() if v.is_floating_point() else v for k, v in canonical.items()}
    loaded, _ = _load(_write(tmp_path, fp16), config, torch.float16)
    assert loaded["embed.weight"].dtype == torch.float16
    assert torch.equal(loaded["embed.weight"], fp16["embed.weight"])


def test_float_tid2eid_is_refused(canonical, config, tmp_path):
    tensors = {**canonical, "layers.0.ffn.gate.tid2eid": canonical["layers.0.ffn.gate.tid2eid"].float()}
    with pytest.raises(CheckpointError, match=r"layers\.0\.ffn\.gate\.tid2eid.*integer"):
        plan_checkpoint(_write(tmp_path, tensors), config)


# ----------------------------------------------------------------------------------------------- bad inputs
def _never_called(name, tensor):
    raise AssertionError(f"tensor data read ({name}) although validation should have failed first")


def test_missing_tensor_names_tensor_and_shape(canonical, config, tmp_path):
    tensors = {k: v for k, v in canonical.items() if k != "layers.1.attn.wkv.weight"}
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(_write(tmp_path, tensors), config, torch.float32, "cpu", _never_called)
    assert "missing tensor: layers.1.attn.wkv.weight (expected shape (32, 32))" in str(err.value)
    assert "config.json" in str(err.value)  # says what to do


def test_unexpected_tensor_names_tensor_and_shard(canonical, config, tmp_path):
    tensors = {**canonical, "layers.0.attn.bogus.weight": torch.zeros(3)}
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(_write(tmp_path, tensors), config, torch.float32, "cpu", _never_called)
    assert "unexpected tensor: layers.0.attn.bogus.weight in model.safetensors" in str(err.value)


def test_shape_mismatch_names_expected_and_found(canonical, config, tmp_path):
    tensors = {**canonical, "layers.2.attn.compressor.ape": torch.zeros(4, 32)}
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(_write(tmp_path, tensors), config, torch.float32, "cpu", _never_called)
    message = str(err.value)
    assert "layers.2.attn.compressor.ape expected shape (8, 32), found (4, 32) in model.safetensors" in message
    assert "missing tensor: layers.2.attn.compressor.ape" not in message


def test_fused_shape_mismatch_is_reported_once(hf_model, config, tmp_path):
    state = dict(hf_model.state_dict())
    state["model.layers.1.mlp.experts.down_proj"] = torch.zeros(4, 32, 8)
    plan = plan_checkpoint(_write(tmp_path, state), config)
    assert [m[:3] for m in plan.mismatched] == [("layers.1.ffn.experts.down_proj", (4, 32, 16), (4, 32, 8))]
    assert plan.missing == []


def test_checkpoint_for_other_config_lists_all_problems(canonical, tmp_path):
    bigger = DeepseekV4Config.from_dict({**CONFIG_DICT, "n_routed_experts": 5})
    plan = plan_checkpoint(_write(tmp_path, canonical), bigger)
    assert ("layers.0.ffn.experts.4.w1.weight", (16, 32)) in plan.missing
    gates = {f"layers.{i}.ffn.gate.weight" for i in range(3)} | {f"layers.{i}.ffn.gate.bias" for i in (1, 2)}
    assert {m[0] for m in plan.mismatched} == gates


def test_duplicate_tensor_from_mixed_schemes(canonical, config, tmp_path):
    tensors = {**canonical, "lm_head.weight": canonical["head.weight"].clone()}
    with pytest.raises(CheckpointError, match=r"head\.weight appears twice"):
        plan_checkpoint(_write(tmp_path, tensors), config)


def test_pickle_only_folder_is_refused(config, tmp_path):
    folder = tmp_path / "pickle"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG_DICT))
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="pickle checkpoints are not loaded; convert to safetensors"):
        load_checkpoint(folder, config, torch.float32, "cpu", _never_called)


def test_folder_without_safetensors(config, tmp_path):
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files"):
        plan_checkpoint(tmp_path, config)


def test_unknown_model_type_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG_DICT, "model_type": "llama"}))
    with pytest.raises(ConfigError, match="unknown model_type 'llama'"):
        DeepseekV4Config.from_file(tmp_path / "config.json")


def test_a_quantization_this_engine_does_not_read_is_refused(tmp_path):
    raw = {**CONFIG_DICT, "quantization_config": {"quant_method": "gptq", "bits": 4}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="quantization_config.quant_method is 'gptq'; this engine reads 'fp8'"):
        DeepseekV4Config.from_file(tmp_path / "config.json")


def test_tied_embeddings_feed_head(canonical, tmp_path):
    tied = DeepseekV4Config.from_dict({**CONFIG_DICT, "tie_word_embeddings": True})
    tensors = {k: v for k, v in canonical.items() if k != "head.weight"}
    loaded, _ = _load(_write(tmp_path, tensors), tied)
    assert torch.equal(loaded["head.weight"], canonical["embed.weight"])

"""``load_format="dummy"``: random weights drawn at load time, the same values the bench presets write to disk
(bf16 and quantized checkpoints, the target and its MTP draft layers), through the loader, ``LLM`` and the bench."""

from __future__ import annotations

import pytest
import torch
from v4_factory import SMALL_PRESET

from deepinfer_core.bench import presets, runner
from deepinfer_core.checkpoint import plan_checkpoint
from deepinfer_core.engine_args import EngineArgs, EngineArgsError
from deepinfer_core.models.deepseek_v4 import random_weights
from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config
from deepinfer_core.models.deepseek_v4.loader import load_deepseek_v4
from deepinfer_core.models.registry import ModelRegistry, UnknownModelTypeError
from deepinfer_core.ops.table import OpTable
from deepinfer_core.quant.writer import QuantRecipe


def _config_dict(**extra) -> dict:
    return {**presets.get_preset("tiny").config_dict(SMALL_PRESET), **extra}


def _both_ways(folder, dtype=torch.float32):
    """The model of ``folder`` loaded from its shards and with ``load_format="dummy"``."""
    return (load_deepseek_v4(folder, OpTable(), dtype=dtype),
            load_deepseek_v4(folder, OpTable(), dtype=dtype, load_format="dummy"))


def _assert_same_parameters(read: dict, drawn: dict) -> None:
    assert read.keys() == drawn.keys()
    different = [name for name in read if read[name].dtype != drawn[name].dtype
                 or not torch.equal(read[name].view(torch.uint8), drawn[name].view(torch.uint8))]
    assert not different, different[:5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dummy_weights_are_the_preset_checkpoints_bytes(tmp_path, dtype):
    folder = presets.write_random_checkpoint(tmp_path / "bf16", _config_dict())
    read, drawn = _both_ways(folder, dtype)
    _assert_same_parameters(read.parameters, drawn.parameters)
    assert drawn.held_bytes().describe() == read.held_bytes().describe()


@pytest.mark.parametrize("recipe", [QuantRecipe("fp4", "fp8", 32), QuantRecipe("fp8", "fp8", 32)],
                         ids=["fp4 experts, ue8m0", "fp8 experts, float32 scales"])
def test_dummy_weights_of_a_quantized_config_are_what_the_writer_stores(tmp_path, recipe):
    folder = presets.write_random_checkpoint(tmp_path / "quantized", _config_dict(), quantize=recipe)
    config = DeepseekV4Config.from_file(folder / "config.json")
    assert random_weights.dummy_quantization(config)[1] == plan_checkpoint(folder, config).quantized != {}
    read, drawn = _both_ways(folder)
    _assert_same_parameters(read.parameters, drawn.parameters)
    quantized = [name for name, t in drawn.parameters.items() if t.dtype in (torch.float8_e4m3fn, torch.uint8)]
    assert any(".ffn.experts." in name for name in quantized) and any(".attn." in name for name in quantized)


def test_dummy_draft_layers_are_the_mtp_presets(tmp_path):
    from deepinfer_core.models.deepseek_v4.mtp import load_mtp_draft

    folder = presets.write_random_checkpoint(tmp_path / "mtp", _config_dict(num_nextn_predict_layers=1),
                                             quantize=QuantRecipe("fp4", "fp8", 32))
    read, drawn = _both_ways(folder)
    from_disk, dummy = load_mtp_draft(folder, read), load_mtp_draft(folder, drawn, load_format="dummy")
    assert dummy.num_layers == from_disk.num_layers == 1 and not dummy.has_confidence_head
    _assert_same_parameters(from_disk.parameters, dummy.parameters)
    assert load_mtp_draft(folder, load_deepseek_v4(presets.write_random_checkpoint(tmp_path / "none", _config_dict()),
                                                   OpTable()), load_format="dummy") is None


def test_llm_with_dummy_weights_needs_no_shards_and_generates_as_the_checkpoint(tmp_path):
    from deepinfer_core.llm import LLM
    from deepinfer_core.sampling.params import SamplingParams

    overrides = {"num_hidden_layers": 2, "layer_types": SMALL_PRESET["layer_types"], "mlp_layer_types": SMALL_PRESET["mlp_layer_types"]}
    with_weights = presets.ensure_preset("tiny", tmp_path, overrides)
    config_only = presets.ensure_preset("tiny", tmp_path, overrides, weights=False)
    assert config_only != with_weights and not list(config_only.glob("*.safetensors"))
    assert (config_only / "tokenizer.json").is_file()
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = [[5, 9, 17, 33, 60], [100, 7, 7, 2]]
    outputs = [[o.outputs[0].token_ids for o in LLM(str(folder), max_num_seqs=2, **kwargs).generate(
        [{"prompt_token_ids": p} for p in prompts], params)]
        for folder, kwargs in ((with_weights, {}), (config_only, {"load_format": "dummy"}))]
    assert outputs[0] == outputs[1] and all(len(tokens) == 6 for tokens in outputs[0])


def test_bench_runs_a_config_only_preset_and_counts_the_quantized_bytes(tmp_path, monkeypatch):
    recipe = QuantRecipe("fp4", "fp8", 32)
    monkeypatch.setitem(presets.PRESETS, "tiny-fp4", presets.Preset("tiny-fp4", "tiny quantized",
                                                                    _config_dict(), quantize=recipe))
    config = runner.BenchConfig(preset="tiny-fp4", cache_dir=str(tmp_path), load_format="dummy", input_len=8,
                                output_len=4, num_prompts=2, max_num_seqs=2, warmup=0)
    result = runner.run_bench(config)
    folder = result["config"]["model_folder"]
    assert not list(presets.Path(folder).glob("*.safetensors"))
    assert result["engine"]["output_tokens"] == 8
    model_config = DeepseekV4Config.from_file(presets.Path(folder) / "config.json")
    stored = runner.stored_quantization(presets.Path(folder), model_config, "dummy")
    on_disk = presets.ensure_preset("tiny-fp4", tmp_path)
    assert stored == plan_checkpoint(on_disk, model_config).quantized != {}


@pytest.mark.parametrize("bad", [{"compare_hf": True}, {"seed": 3}])
def test_bench_refuses_dummy_weights_with_hf_or_another_seed(bad):
    with pytest.raises(ValueError, match="dummy"):
        runner.BenchConfig(preset="tiny", load_format="dummy", **bad).validate()


def test_unknown_or_pickle_load_formats_are_refused():
    with pytest.raises(EngineArgsError, match="pickle checkpoints are never loaded"):
        EngineArgs(load_format="pt")
    with pytest.raises(EngineArgsError, match="unknown load_format 'gguf'.*'dummy'"):
        EngineArgs(load_format="gguf")
    assert EngineArgs(load_format="dummy").load_format == "dummy"


def test_a_loader_without_load_format_is_refused_dummy_by_name(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "plain"}')
    registry = ModelRegistry()
    registry.register("plain", lambda folder, ops, dtype, device: object())
    with pytest.raises(UnknownModelTypeError, match="'plain' reads checkpoints only.*load_format='dummy'"):
        registry.load(folder, OpTable(), torch.float32, "cpu", load_format="dummy")

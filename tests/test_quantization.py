"""The quantized formats byte by byte (ue8m0, fp8 blocks, MXFP4), the writer's rounding and scales, the config
fields, and the loader's errors for bad quantized checkpoints (each names the tensor or field)."""

from __future__ import annotations

import json

import pytest
import torch
from v4_factory import SMALL_PRESET

from deepinfer_core.bench.presets import write_random_checkpoint
from deepinfer_core.checkpoint import CheckpointError, plan_checkpoint, write_checkpoint
from deepinfer_core.models.deepseek_v4.config import ConfigError, DeepseekV4Config
from deepinfer_core.models.deepseek_v4.loader import load_deepseek_v4
from deepinfer_core.ops.table import OpTable
from deepinfer_core.quant import fp8_block, mxfp4
from deepinfer_core.quant.scales import ue8m0_to_float
from deepinfer_core.quant.writer import QuantizeError, QuantRecipe, quantize_checkpoint

E2M1_BY_CODE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _bytes(values, dtype=torch.uint8):
    return torch.tensor(values, dtype=torch.uint8).view(dtype)


# ------------------------------------------------------------------------------------------------ decoding by hand
def test_ue8m0_bytes_decode_to_powers_of_two_including_the_extremes():
    got = ue8m0_to_float(_bytes([0, 1, 126, 127, 128, 200, 254, 255], torch.float8_e8m0fnu))
    want = [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**73, 2.0**127]
    assert got[:7].tolist() == want and got[0] > 0  # byte 0 is the fp32 subnormal 2^-127, not zero
    assert torch.isnan(got[7])
    every = _bytes(list(range(255)), torch.float8_e8m0fnu)
    assert torch.equal(ue8m0_to_float(every), every.float())  # torch's own decoding agrees on every finite byte


def test_all_16_e2m1_codes_and_the_nibble_order():
    # byte (high << 4) | low holds element 2i in its low nibble and element 2i+1 in its high nibble
    packed = _bytes([(hi << 4) | lo for lo, hi in zip(range(0, 16, 2), range(1, 16, 2), strict=True)]).view(1, 8)
    scale = _bytes([127], torch.float8_e8m0fnu).view(1, 1)  # 2^0
    values = mxfp4.dequantize(packed.repeat(1, 2), scale)  # [1, 32]: codes 0..15 twice
    assert values[0].tolist() == E2M1_BY_CODE * 2
    assert mxfp4.decode_codes(_bytes([0x9F])).tolist() == [0xF, 0x9]  # -6 then -0.5


def test_mxfp4_scale_per_32_inputs_and_extreme_scales():
    packed = torch.full((2, 32), 0x77, dtype=torch.uint8)  # every element code 7 = 6.0; 64 inputs per row
    scale = _bytes([0, 254, 127, 130], torch.float8_e8m0fnu).view(2, 2)
    got = mxfp4.dequantize(packed.view(torch.int8), scale)  # int8 storage reads the same bits
    assert got.shape == (2, 64)
    assert got[0, :32].eq(6 * 2.0**-127).all() and got[0, 32:].eq(6 * 2.0**127).all()
    assert got[1, :32].eq(6.0).all() and got[1, 32:].eq(48.0).all()


def test_fp8_block_dequantization_by_hand_with_partial_edge_blocks():
    weight = torch.tensor([[1.0, -2.0, 0.5], [448.0, 0.0, -0.015625], [3.0, 1.5, -1.0]]).to(torch.float8_e4m3fn)
    scale = _bytes([128, 125, 0, 254], torch.float8_e8m0fnu).view(2, 2)  # 2, 1/4, 2^-127, 2^127 on 2x2 blocks
    got = fp8_block.dequantize(weight, scale, (2, 2))
    want = torch.tensor([[2.0, -4.0, 0.125], [896.0, 0.0, -0.015625 / 4], [3 * 2.0**-127, 1.5 * 2.0**-127,
                                                                          -(2.0**127)]])
    assert torch.equal(got, want)
    float_scale = torch.tensor([[0.1, 3.0], [2.0, 1.0]])
    torch.testing.assert_close(fp8_block.dequantize(weight, float_scale, (2, 2))[0], torch.tensor([0.1, -0.2, 1.5]))


# ------------------------------------------------------------------------------------------------ the writer's rounding
def test_mxfp4_rounds_to_nearest_ties_to_even_with_power_of_two_scales():
    magnitudes = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.2, 0.3, 5.9]  # ties between neighbours, then non-ties
    row = torch.tensor(magnitudes + [-m for m in magnitudes] + [6.0] + [0.0] * 11)  # amax 6: scale 2^0
    packed, scale = mxfp4.quantize(row.view(1, 32))
    assert scale.view(torch.uint8).item() == 127
    got = mxfp4.dequantize(packed, scale)[0, :21].tolist()
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, 0.5, 6.0]
    assert got == want + [-w for w in want] + [6.0]


def test_quantized_scales_never_clip_and_round_trip_representable_values():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 64, generator=gen) * torch.logspace(-30, 30, 6).unsqueeze(1)
    packed, scale = mxfp4.quantize(w)
    group_amax = w.abs().view(6, 2, 32).amax(-1)
    scale_value = ue8m0_to_float(scale)
    assert (group_amax <= 6 * scale_value).all() and (group_amax > 3 * scale_value).all()  # smallest such power
    again = mxfp4.dequantize(packed, scale)
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(again)), again)  # representable values are kept exactly
    w = w.view(4, 96)[:, :80] * torch.tensor([1e-20, 1e-20, 1e20, 1.0]).unsqueeze(1)  # a partial edge block
    for ue8m0 in (True, False):
        q, s = fp8_block.quantize(w, (3, 32), ue8m0)
        assert s.dtype == (torch.float8_e8m0fnu if ue8m0 else torch.float32) and s.shape == (2, 3)
        assert (fp8_block.expand_scale(s, (4, 80), (3, 32)) * 448 >= w.abs()).all()  # nothing clipped
        back = fp8_block.dequantize(q, s, (3, 32))
        step = fp8_block.expand_scale(s, (4, 80), (3, 32)) * 2.0**-10  # half of e4m3's subnormal step
        assert ((back - w).abs() <= torch.maximum(w.abs() * 2**-4, step)).all()  # 3 mantissa bits, to nearest
        if ue8m0:
            assert torch.equal(fp8_block.dequantize(*fp8_block.quantize(back, (3, 32), True), (3, 32)), back)


# ------------------------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def source(tmp_path_factory):
    from deepinfer_core.bench.presets import PRESETS

    folder = tmp_path_factory.mktemp("src") / "bf16"
    write_random_checkpoint(folder, PRESETS["tiny"].config_dict(SMALL_PRESET), seed=3)
    return folder


@pytest.fixture(scope="module")
def fp4(source, tmp_path_factory):
    folder = tmp_path_factory.mktemp("q") / "fp4"
    quantize_checkpoint(source, folder, QuantRecipe("fp4", "fp8", 32))
    return folder


def _tensors(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _rewrite(folder, dst, change_tensors=None, change_config=None):
    tensors = _tensors(folder)
    config = json.loads((folder / "config.json").read_text())
    (change_tensors or (lambda t: None))(tensors)
    (change_config or (lambda c: None))(config)
    write_checkpoint(dst, tensors, config)
    return dst


def test_the_writer_stores_deepseeks_format(fp4):
    tensors = _tensors(fp4)
    config = json.loads((fp4 / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32],
                                             "scale_fmt": "ue8m0", "activation_scheme": "dynamic"}
    assert config["expert_dtype"] == "fp4"
    expert = "layers.1.ffn.experts.2.w2"
    assert tensors[f"{expert}.weight"].dtype == torch.int8 and tensors[f"{expert}.weight"].shape == (64, 16)
    assert tensors[f"{expert}.scale"].dtype == torch.float8_e8m0fnu and tensors[f"{expert}.scale"].shape == (64, 1)
    assert tensors["layers.1.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert tensors["layers.1.attn.wq_b.scale"].shape == (2, 1)  # [64, 32] in 32 x 32 blocks
    for kept in ("embed.weight", "head.weight", "layers.1.ffn.gate.weight"):
        assert tensors[kept].dtype == torch.bfloat16 and kept.replace("weight", "scale") not in tensors
    assert tensors["layers.1.attn_norm.weight"].dtype == torch.float32


def test_weights_stay_quantized_in_memory_and_the_log_says_the_bytes(fp4, source, caplog):
    with caplog.at_level("INFO", logger="deepinfer"):
        model = load_deepseek_v4(fp4, OpTable(), dtype=torch.bfloat16)
    ffn, attn = model.layers[1].ffn, model.layers[1].attn
    assert ffn.w1.packed.dtype == torch.uint8 and ffn.w1.packed.shape == (4, 32, 32)
    assert ffn.w1.scale.dtype == torch.float8_e8m0fnu and ffn.w1.scale.shape == (4, 32, 2)
    assert attn.wq_b.weight.dtype == torch.float8_e4m3fn and attn.wo_a.scale.dtype == torch.float8_e8m0fnu
    held = model.held_bytes()
    assert held.by_dtype["float8_e4m3fn"] > 0 and held.by_dtype["uint8"] == 2 * 3 * 4 * 32 * 32
    plain = load_deepseek_v4(source, OpTable(), dtype=torch.bfloat16).held_bytes()
    assert held.total < 0.75 * plain.total
    assert f"weights held: {held.describe().split(': ', 1)[1]}" in caplog.text and "uint8" in caplog.text


def test_model_prefixed_names_load_the_same(fp4, tmp_path):
    prefixed = tmp_path / "prefixed"
    tensors = {f"model.{k}": v for k, v in _tensors(fp4).items()}
    write_checkpoint(prefixed, tensors, json.loads((fp4 / "config.json").read_text()))
    a, b = load_deepseek_v4(fp4, OpTable()), load_deepseek_v4(prefixed, OpTable())
    assert a.parameters.keys() == b.parameters.keys()
    assert all(torch.equal(a.parameters[k].view(torch.uint8), b.parameters[k].view(torch.uint8))
               for k in a.parameters if a.parameters[k].dtype.itemsize == 1)


BAD = [
    ("a scale of the wrong shape", "layers.1.attn.wq_b.scale",
     lambda t: t.update({"layers.1.attn.wq_b.scale": t["layers.1.attn.wq_b.scale"][:1]}), None,
     r"scale layers.1.attn.wq_b.scale in model.safetensors has shape \(1, 1\).*needs \(2, 1\)"),
    ("a scale of the wrong dtype", "layers.1.attn.wo_b.scale",
     lambda t: t.update({"layers.1.attn.wo_b.scale": t["layers.1.attn.wo_b.scale"].float().half()}), None,
     r"scale layers.1.attn.wo_b.scale in model.safetensors has dtype F16"),
    ("an MXFP4 scale that is not ue8m0", "layers.0.ffn.experts.1.w3.scale",
     lambda t: t.update({"layers.0.ffn.experts.1.w3.scale": t["layers.0.ffn.experts.1.w3.scale"].float()}), None,
     r"scale layers.0.ffn.experts.1.w3.scale .* has dtype F32; an MXFP4 expert's scale is F8_E8M0"),
    ("a missing scale", "layers.0.attn.wkv.weight", lambda t: t.pop("layers.0.attn.wkv.scale"), None,
     r"tensor layers.0.attn.wkv.weight .* is F8_E4M3 but its scale layers.0.attn.wkv.scale is missing"),
    ("an unknown expert_dtype", "expert_dtype", None, lambda c: c.update(expert_dtype="int4"),
     r"config.json expert_dtype is 'int4'"),
    ("an unknown quant_method", "quant_method", None, lambda c: c["quantization_config"].update(quant_method="awq"),
     r"config.json quantization_config.quant_method is 'awq'"),
    ("an unknown scale_fmt", "scale_fmt", None, lambda c: c["quantization_config"].update(scale_fmt="e4m3"),
     r"config.json quantization_config.scale_fmt is 'e4m3'"),
    ("fp8 experts under expert_dtype fp4", "expert_dtype", None, lambda c: c.update(expert_dtype="fp8"),
     r"tensor layers.0.ffn.experts.0.w1.weight .* is a packed fp4 expert, but config.json's expert_dtype is 'fp8'"),
    ("no quantization_config", "quantization_config", None, lambda c: c.pop("quantization_config"),
     r"is F8_E4M3, a quantized dtype, but config.json has no quantization_config"),
    ("a scale beside a bf16 weight", "layers.1.ffn.gate.scale",
     lambda t: t.update({"layers.1.ffn.gate.scale": torch.ones(2, 2)}), None,
     r"scale layers.1.ffn.gate.scale .* sits beside layers.1.ffn.gate.weight, which is BF16"),
    ("packed fp4 outside the experts", "layers.1.attn.wq_b.weight",
     lambda t: t.update({"layers.1.attn.wq_b.weight": t["layers.1.attn.wq_b.weight"].view(torch.int8)}), None,
     r"tensor layers.1.attn.wq_b.weight .* packed fp4 \(MXFP4\) is read for routed experts .* only"),
]


@pytest.mark.parametrize("what,_,tensors,config,message", BAD, ids=[b[0] for b in BAD])
def test_bad_quantized_checkpoints_name_the_tensor(fp4, tmp_path, what, _, tensors, config, message):
    folder = _rewrite(fp4, tmp_path / "bad", tensors, config)
    with pytest.raises((CheckpointError, ConfigError), match=message):
        load_deepseek_v4(folder, OpTable())


def _tiny_config():
    from deepinfer_core.bench.presets import PRESETS

    return PRESETS["tiny"].config_dict()


def test_a_packed_expert_whose_input_width_is_not_a_multiple_of_32(tmp_path):
    narrow = {**SMALL_PRESET, "moe_intermediate_size": 48}  # w2's input width
    src = write_random_checkpoint(tmp_path / "src", json.loads(json.dumps({**_tiny_config(), **narrow})))
    with pytest.raises(QuantizeError, match=r"layers.0.ffn.experts.0.w2.weight has input width 48; MXFP4 needs a "
                                            "multiple of 32"):
        quantize_checkpoint(src, tmp_path / "q", QuantRecipe("fp4"))
    fp8 = tmp_path / "fp8"
    quantize_checkpoint(src, fp8, QuantRecipe("fp8", block=32))

    def pack_w2(tensors):  # what a checkpoint with packed 48-wide experts would hold
        for name in [n for n in tensors if n.endswith(".w2.weight") and ".experts." in n]:
            tensors[name] = torch.zeros(64, 24, dtype=torch.int8)
            tensors[name.replace("weight", "scale")] = torch.ones(64, 1).to(torch.float8_e8m0fnu)

    folder = _rewrite(fp8, tmp_path / "packed48", pack_w2, lambda c: c.update(expert_dtype="fp4"))
    with pytest.raises(CheckpointError, match=r"tensor layers.0.ffn.experts.0.w1.weight .* is an fp8 routed expert"):
        plan_checkpoint(folder, DeepseekV4Config.from_file(folder / "config.json"))

    def all_packed(tensors):
        pack_w2(tensors)
        for name in [n for n in tensors if n.endswith((".w1.weight", ".w3.weight")) and ".experts." in n]:
            tensors[name] = torch.zeros(48, 32, dtype=torch.int8)
            tensors[name.replace("weight", "scale")] = torch.ones(48, 2).to(torch.float8_e8m0fnu)

    folder = _rewrite(fp8, tmp_path / "all48", all_packed, lambda c: c.update(expert_dtype="fp4"))
    with pytest.raises(CheckpointError, match=r"tensor layers.0.ffn.experts.0.w2.weight in model.safetensors is a "
                                              r"packed fp4 expert of input width 48"):
        plan_checkpoint(folder, DeepseekV4Config.from_file(folder / "config.json"))


def test_the_writer_refuses_a_quantized_source_and_a_full_destination(fp4, source, tmp_path):
    with pytest.raises(QuantizeError, match="already quantized"):
        quantize_checkpoint(fp4, tmp_path / "again", QuantRecipe())
    with pytest.raises(QuantizeError, match="exists and is not empty"):
        quantize_checkpoint(source, fp4, QuantRecipe())
    with pytest.raises(QuantizeError, match="experts 'int4' is not a choice"):
        QuantRecipe("int4")


def test_deepinfer_quantize_then_generate_on_cpu(source, tmp_path, capsys):
    from deepinfer_core.cli.main import main

    dst = tmp_path / "cli-fp4"
    assert main(["quantize", str(source), str(dst), "--experts", "fp4", "--linear", "fp8", "--block", "32"]) == 0
    assert "experts fp4, linear fp8 in 32x32 blocks with ue8m0 scales" in capsys.readouterr().out
    assert json.loads((dst / "config.json").read_text())["expert_dtype"] == "fp4" and (dst / "tokenizer.json").exists()
    assert main(["generate", "--model", str(dst), "--max-tokens", "3", "--temperature", "0", "w5 w6 w7"]) == 0
    out = capsys.readouterr().out
    assert "--- completion (finish: length, 3 tokens):" in out
    assert main(["quantize", str(dst), str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert "deepinfer quantize: error:" in err and "is already quantized" in err


def test_quantized_presets_and_the_roofline_count_the_bytes_stored(tmp_path):
    from deepinfer_core.bench.presets import PRESETS
    from deepinfer_core.bench.roofline import model_bytes
    from deepinfer_core.quant.writer import planned_quantization

    recipe = QuantRecipe("fp4", "fp8", 32)
    config_dict = PRESETS["tiny"].config_dict(SMALL_PRESET)
    folder = write_random_checkpoint(tmp_path / "preset", config_dict, quantize=recipe)
    config = DeepseekV4Config.from_file(folder / "config.json")
    stored = plan_checkpoint(folder, config).quantized
    assert stored == planned_quantization(recipe, config)
    expert = model_bytes(config, torch.bfloat16, quantized=stored).expert_bytes
    assert expert == 3 * 32 * 64 * (0.5 + 1 / 32)  # MXFP4: half a byte per value plus a ue8m0 byte per 32

    def touched(name, batch):
        preset = PRESETS[name]
        cfg = DeepseekV4Config.from_dict(preset.config_dict())
        planned = planned_quantization(preset.quantize, cfg) if preset.quantize else None
        return model_bytes(cfg, torch.bfloat16, quantized=planned).weight_bytes_touched(batch)

    for batch, fewer in ((1, 2.0), (64, 3.2)):  # experts 3.8x smaller, fp8 linears 2x, the bf16 head unchanged
        assert touched("v4-flash-8l64e", batch) / touched("v4-flash-8l64e-fp4", batch) == pytest.approx(fewer, 0.02)

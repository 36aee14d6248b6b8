"""``deepinfer bench``: presets, the engine / HF runner, roofline floors, the table and JSON (tiny sizes, CPU)."""

from __future__ import annotations

import gc
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from deepinfer_core.bench import presets, roofline, runner
from deepinfer_core.bench.report import format_report
from deepinfer_core.cli import main
from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config

REPO = Path(__file__).resolve().parents[1]
SMALL = {"input_len": 8, "output_len": 4, "num_prompts": 2, "max_num_seqs": 2, "warmup": 1}

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bench_cache")


@pytest.fixture(scope="module")
def hf_result(cache_dir) -> dict:
    config = runner.BenchConfig(preset="tiny", cache_dir=str(cache_dir), compare_hf=True, **SMALL)
    return runner.run_bench(config)


# ------------------------------------------------------------------------------------------------ presets
def test_tiny_preset_has_the_embedded_default_shape():
    from transformers import DeepseekV4Config as HFConfig

    spec = importlib.util.spec_from_file_location("train_tiny", REPO / "tools" / "train_tiny.py")
    train_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_tiny)
    ours = {k: v for k, v in presets.get_preset("tiny").config_dict().items() if k not in ("architectures", "dtype")}
    assert HFConfig(**ours).to_dict() == HFConfig(**train_tiny.model_config_kwargs(4096)).to_dict()


def test_flash_preset_matches_benchmarks_md_without_building_it():
    config = presets.get_preset("v4-flash-8l64e").config_dict()
    assert round(presets.count_parameters(config) / 1e9, 2) == 15.08
    parsed = DeepseekV4Config.from_dict(config)
    assert parsed.layer_types == ["sliding_attention"] * 2 + ["compressed_sparse_attention",
                                                              "heavily_compressed_attention"] * 3
    assert parsed.mlp_layer_types == ["hash_moe"] + ["moe"] * 7
    assert (parsed.vocab_size, parsed.hidden_size, parsed.num_attention_heads, parsed.head_dim) == (129280, 4096, 64,
                                                                                                   512)
    assert (parsed.n_routed_experts, parsed.num_experts_per_tok, parsed.moe_intermediate_size) == (64, 6, 2048)
    assert (parsed.index_n_heads, parsed.index_head_dim, parsed.index_topk, parsed.hc_mult) == (64, 128, 512, 4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_gpu_only_preset_is_refused_on_cpu(tmp_path):
    with pytest.raises(presets.PresetError, match="needs a GPU"):
        presets.ensure_preset("v4-flash-8l64e", tmp_path)
    assert not any(tmp_path.iterdir())


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(presets.PresetError, match="known presets: tiny, tiny-mtp, v4-flash-20l-fp4, v4-flash-8l64e, "
                                                  "v4-flash-8l64e-1m, v4-flash-8l64e-fp4, v4-flash-8l64e-mtp"):
        presets.get_preset("huge")


def test_saved_names_are_what_hf_save_pretrained_writes(tmp_path):
    from safetensors import safe_open
    from v4_factory import tiny_checkpoint

    from deepinfer_core.models.deepseek_v4.weights import expected_tensors

    tiny_checkpoint(tmp_path)
    config = DeepseekV4Config.from_file(tmp_path / "config.json")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        on_disk = set(f.keys())
    assert {presets.hf_saved_name(name) for name in expected_tensors(config)} == on_disk


def test_preset_checkpoint_values_and_cache(cache_dir, hf_result):
    from safetensors.torch import load_file

    folder = Path(hf_result["config"]["model_folder"])
    assert (folder / presets.MARKER_FILE).is_file() and (folder / "tokenizer.json").is_file()
    tensors = load_file(str(folder / "model.safetensors"))
    assert tensors["model.layers.1.attn.wq_a.weight"].dtype == torch.bfloat16
    assert abs(tensors["model.layers.1.attn.wq_a.weight"].float().std().item() - 0.02) < 2e-3
    assert torch.all(tensors["model.layers.1.attn_norm.weight"] == 1)
    assert torch.all(tensors["model.layers.1.ffn.gate.bias"] == 0)
    tid2eid = tensors["model.layers.0.ffn.gate.tid2eid"]
    assert tid2eid.shape == (4096, 2) and torch.all(tid2eid[:, 0] != tid2eid[:, 1]) and tid2eid.max() < 4
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert presets.ensure_preset("tiny", cache_dir) == folder  # cached: not rewritten
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime


def test_preset_sharing_weights_links_the_base_files(tmp_path, monkeypatch):
    tiny = presets.get_preset("tiny")
    long_config = {**tiny.config_dict(), "max_position_embeddings": 8192}
    monkeypatch.setitem(presets.PRESETS, "tiny-long", presets.Preset("tiny-long", "tiny, longer", long_config,
                                                                     weights_of="tiny"))
    folder = presets.ensure_preset("tiny-long", tmp_path)
    base = presets.ensure_preset("tiny", tmp_path)
    assert folder != base
    assert (folder / "model.safetensors").samefile(base / "model.safetensors")
    assert (folder / "tokenizer.json").samefile(base / "tokenizer.json")
    assert json.loads((folder / "config.json").read_text())["max_position_embeddings"] == 8192
    assert json.loads((base / "config.json").read_text())["max_position_embeddings"] != 8192
    wider = {**tiny.config_dict(), "hidden_size": 2 * tiny.config["hidden_size"]}
    monkeypatch.setitem(presets.PRESETS, "tiny-wide", presets.Preset("tiny-wide", "tiny, wider", wider,
                                                                     weights_of="tiny"))
    with pytest.raises(presets.PresetError, match="tensor shapes differ"):
        presets.ensure_preset("tiny-wide", tmp_path)


def test_mtp_preset_links_the_target_and_writes_only_the_draft_layer(tmp_path):
    """``tiny-mtp`` (as ``v4-flash-8l64e-mtp`` on the GPU): the base preset's files hard-linked, the draft layer in
    one extra shard with an index over both; the same tensors as the whole checkpoint written in one go; the draft
    layer loads through the engine's MTP loader."""
    from safetensors import safe_open

    from deepinfer_core.checkpoint import INDEX_FILE, read_headers
    from deepinfer_core.llm import LLM
    from deepinfer_core.models.deepseek_v4.mtp import load_mtp_draft

    folder = presets.ensure_preset("tiny-mtp", tmp_path)
    base = presets.ensure_preset("tiny", tmp_path)
    assert (folder / "model.safetensors").samefile(base / "model.safetensors")
    assert not (base / INDEX_FILE).exists() and not (base / presets.DRAFT_SHARD).exists()
    shards = read_headers(folder)
    assert set(shards) == {"model.safetensors", presets.DRAFT_SHARD}
    assert all(name.startswith("model.mtp.0.") for name in shards[presets.DRAFT_SHARD])
    config = presets.get_preset("tiny-mtp").config_dict()
    assert sum(math.prod(shape) for shape, _ in shards[presets.DRAFT_SHARD].values()) == presets.count_parameters(
        config, draft=True) > 0
    whole = presets.write_random_checkpoint(tmp_path / "whole", config)  # target and draft layer in one file
    with safe_open(str(whole / "model.safetensors"), "pt") as f:
        names = f.keys()
        expected = {name: f.get_tensor(name) for name in names}
    found = {}
    for shard, names in shards.items():
        with safe_open(str(folder / shard), "pt") as f:
            found.update({name: f.get_tensor(name) for name in names})
    assert found.keys() == expected.keys() and all(torch.equal(found[k], expected[k]) for k in expected)
    llm = LLM(str(folder), max_num_seqs=2)
    draft = load_mtp_draft(folder, llm.model)
    assert draft.num_layers == 1 and not draft.has_confidence_head
    flash = presets.get_preset("v4-flash-8l64e-mtp")
    assert flash.weights_of == "v4-flash-8l64e" and flash.config["num_nextn_predict_layers"] == 1
    assert presets.count_parameters(flash.config) == presets.count_parameters(
        presets.get_preset("v4-flash-8l64e").config)
    assert round(presets.count_parameters(flash.config, draft=True) / 1e9, 2) == 1.78


# ------------------------------------------------------------------------------------------------ runner
def _check_metrics(metrics: dict, output_tokens: int, steps_timed: bool = True) -> None:
    assert set(metrics) == set(runner.result_keys()["metrics"])
    assert metrics["output_tokens"] == output_tokens and metrics["num_requests"] == SMALL["num_prompts"]
    assert metrics["output_throughput"] > 0 and metrics["total_throughput"] > metrics["output_throughput"]
    assert 0 < metrics["ttft_s"]["mean"] <= metrics["latency_s"]["max"] <= metrics["total_time_s"] * (1 + 1e-9)
    assert metrics["tpot_s"]["mean"] > 0 and metrics["steps"] >= SMALL["output_len"]
    pauses = metrics["gc_pauses"]
    assert pauses["count"] >= pauses["full"] >= 0 and pauses["total_s"] >= pauses["max_s"] >= 0
    assert metrics["iteration_first_token_s"][0] > 0
    step_times = metrics["step_times_s"]  # the engine's steps one by one; HF's generate is not split
    if not steps_timed:
        assert step_times == []
        return
    assert len(step_times) == metrics["steps"] and min(step_times) > 0
    assert abs(sum(step_times) - metrics["total_time_s"]) < 1e-6


def test_gc_pauses_are_recorded_with_their_generation_inside_the_block_only():
    pauses: list[tuple[int, float]] = []
    with runner.recording_gc_pauses(pauses):
        gc.collect()
        gc.collect(0)
    gc.collect()
    assert [generation for generation, _ in pauses] == [2, 0] and all(s >= 0 for _, s in pauses)


def test_bench_result_has_the_expected_keys_and_positive_numbers(hf_result):
    assert set(hf_result) == set(runner.result_keys()["result"])
    tokens = SMALL["num_prompts"] * SMALL["output_len"]
    _check_metrics(hf_result["engine"], tokens)
    _check_metrics(hf_result["hf"], tokens, steps_timed=False)
    assert hf_result["ratio"]["output_throughput"] == pytest.approx(
        hf_result["engine"]["output_throughput"] / hf_result["hf"]["output_throughput"])
    agreement = hf_result["agreement"]
    assert agreement["num_requests"] == 2 and 0 <= agreement["mean_prefix_fraction"] <= 1
    assert hf_result["roofline"] == {"engine": "n/a (CPU)", "hf": "n/a (CPU)"}
    assert hf_result["config"]["preset"] == "tiny" and hf_result["config"]["input_len"] == 8
    assert hf_result["config"]["max_num_batched_tokens"] == 2048  # unset: the CPU backend's default, as run
    assert hf_result["config"]["async_scheduling"] is False  # unset: the CPU backend's default, as run
    json.dumps(hf_result)  # JSON-able as is


def test_report_table_shows_engine_hf_and_ratio(hf_result):
    table = format_report(hf_result)
    for text in ("output tok/s", "TTFT mean (ms)", "TPOT mean (ms)", "engine/HF", "roofline (engine): n/a (CPU)",
                 "greedy agreement with HF"):
        assert text in table


def test_cli_bench_prints_the_table_and_writes_json(cache_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DEEPINFER_NVIDIA_PDL", "0")  # a backend knob: recorded with the run (no effect on CPU)
    path = tmp_path / "out.json"
    code = main(["bench", "--preset", "tiny", "--cache-dir", str(cache_dir), "--input-len", "8", "--output-len",
                     "3", "--num-prompts", "2", "--max-num-seqs", "2", "--warmup", "0", "--async-scheduling",
                     "--enable-mixed-chunk", "--num-iters", "3", "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "output tok/s" in out and "roofline (engine): n/a (CPU)" in out and "HF" not in out.split("metric")[1]
    assert "async scheduling on" in out and "mixed chunks on" in out and "3 timed runs (median shown" in out
    data = json.loads(path.read_text())
    assert data["hf"] is None and data["engine"]["output_tokens"] == 6
    assert data["config"]["async_scheduling"] is True and data["engine"]["steps"] >= 3
    assert data["config"]["enable_mixed_chunk"] is True and data["config"]["num_iters"] == 3
    assert data["config"]["environment"]["DEEPINFER_NVIDIA_PDL"] == "0" and "DEEPINFER_NVIDIA_PDL=0" in out
    sources = data["config"]["op_sources"]
    assert {"linear", "moe_experts", "hc_post_sum"} <= set(sources) and sources["hc_post_sum"] == "reference"
    totals = data["engine"]["iteration_total_times_s"]
    assert len(totals) == 3 and data["engine"]["total_time_s"] == sorted(totals)[1]
    assert len(data["engine"]["iteration_first_token_s"]) == 3 and "first tokens" in out and "GC max (ms)" in out


def test_cli_bench_bad_values_exit_2(capsys):
    assert main(["bench", "--preset", "tiny", "--num-prompts", "0"]) == 2
    assert "num_prompts must be a positive integer" in capsys.readouterr().err
    assert main(["bench", "--preset", "tiny", "--input-len", "8", "--output-len", "4", "--max-model-len", "11"]) == 2
    assert "max_model_len must be an integer of at least input_len + output_len (12), got 11" in capsys.readouterr().err


def test_cli_bench_max_model_len_reaches_the_engine(cache_dir, tmp_path, capsys):
    path = tmp_path / "result.json"
    code = main(["bench", "--preset", "tiny", "--cache-dir", str(cache_dir), "--input-len", "8", "--output-len", "3",
                 "--num-prompts", "1", "--max-num-seqs", "1", "--warmup", "0", "--max-model-len", "300",
                 "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 0 and "max_model_len 300" in out
    assert json.loads(path.read_text())["config"]["max_model_len"] == 300


def test_cli_bench_batch_invariant_flag_sets_the_plugin_option_and_refuses_a_contradiction(capsys):
    from deepinfer_core.cli.bench import with_batch_invariant

    assert with_batch_invariant({"x": 1}, None) == {"x": 1}
    assert with_batch_invariant({}, True) == {"batch_invariant": True}
    assert with_batch_invariant({"batch_invariant": False}, False) == {"batch_invariant": False}
    assert main(["bench", "--preset", "tiny", "--batch-invariant", "--option", "batch_invariant=false"]) == 2
    err = capsys.readouterr().err
    assert "--batch-invariant contradicts --option batch_invariant=False" in err and len(err.splitlines()) == 1


def test_compare_hf_without_transformers_fails_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed: `import transformers` fails
    cache = tmp_path / "cache"
    assert main(["bench", "--preset", "tiny", "--cache-dir", str(cache), "--compare-hf", "--input-len", "8",
                 "--output-len", "2", "--num-prompts", "1", "--max-num-seqs", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("deepinfer bench: error: --compare-hf needs HF transformers with DeepSeek-V4 (")
    assert "pip install 'transformers==5.23.*'" in captured.err and len(captured.err.splitlines()) == 1
    assert not cache.exists() and captured.out == ""  # no preset written, no engine run, no table


# ------------------------------------------------------------------------------------------------ prefix share
SHARED = {"output_len": 2, "num_prompts": 2, "max_num_seqs": 2, "warmup": 1}  # the tiny preset's blocks: 128 tokens


def test_no_prefix_share_keeps_todays_prompts_and_takes_nothing_from_the_cache(hf_result):
    expected = torch.randint(0, 4096, (2, 8), generator=torch.Generator().manual_seed(0)).tolist()
    assert runner.random_prompts(2, 8, 4096, 0) == expected
    engine = hf_result["engine"]
    assert engine["num_cached_tokens"]["max"] == 0 and engine["computed_prompt_tokens"] == engine["prompt_tokens"]
    assert engine["ttft_miss_s"] == engine["ttft_s"] and engine["ttft_hit_s"]["mean"] is None
    assert hf_result["config"]["prefix_share"] == 0 and hf_result["config"]["prefix_len"] == 0


def test_prefix_share_prompts_start_with_one_common_prefix():
    config = runner.BenchConfig(input_len=10, prefix_share=0.45)
    prefix = runner.common_prefix(config.prefix_len, 4096, seed=0)
    prompts = runner.random_prompts(3, 10, 4096, 0, prefix)
    assert config.prefix_len == 4 and all(p[:4] == prefix and len(p) == 10 for p in prompts)
    assert len({tuple(p[4:]) for p in prompts}) == 3
    assert runner.BenchConfig(input_len=10, prefix_share=0.99).prefix_len == 9  # one token of its own is kept
    assert runner.BenchConfig(input_len=10, prefix_share=1).prefix_len == 10  # a full hit: identical prompts
    assert runner.random_prompts(2, 10, 4096, 0, runner.common_prefix(10, 4096, seed=0)) == [
        runner.common_prefix(10, 4096, seed=0)] * 2


def test_prefix_share_makes_the_timed_run_hit_the_warmups_prefix(cache_dir):
    config = runner.BenchConfig(preset="tiny", cache_dir=str(cache_dir), input_len=320, prefix_share=0.5, **SHARED)
    result = runner.run_bench(config)
    engine = result["engine"]
    assert result["config"]["prefix_len"] == 160
    assert engine["num_cached_tokens"]["mean"] == 128 == engine["num_cached_tokens"]["min"]  # the prefix's one block
    # the exact rebuild's replay (4 layers x 128 + 2 x 128 tokens) reaches token 0: every prompt token is computed
    assert engine["computed_prompt_tokens"] == engine["prompt_tokens"] == 640
    assert engine["ttft_s"]["mean"] > 0
    assert engine["ttft_hit_s"] == engine["ttft_s"] and engine["ttft_miss_s"]["mean"] is None  # every prompt hit
    table = format_report(result)
    assert "the first 160 a common prefix, share 0.5" in table and "cached tok mean" in table
    assert "TTFT hit (ms)" in table and "TTFT miss (ms)" in table  # means


def test_prefix_share_with_swa_replay_adopts_part_of_the_hit_and_computes_less(cache_dir):
    pytest.importorskip("deepinfer_swa_replay")
    config = runner.BenchConfig(preset="tiny", cache_dir=str(cache_dir), input_len=512, prefix_share=0.75,
                                options={"enable_swa_replay": "true"}, **SHARED)
    result = runner.run_bench(config)
    engine = result["engine"]
    # 384 prefix tokens cached; adopted: (512 - 134) // 128 blocks = 256; recomputed from 256 - 128
    assert engine["num_cached_tokens"]["mean"] == 256
    assert engine["computed_prompt_tokens"] == 2 * (512 - 128)
    assert "1024 prompt tokens (768 computed)" in format_report(result)


def test_a_full_prefix_share_is_restored_from_the_warmups_state(cache_dir):
    """``prefix_share=1``: every prompt is the warm-up's; with the split on, the warm-up leaves its state at 255 (all
    but its last token) and each timed prompt is restored there and computes only its last token."""
    config = runner.BenchConfig(preset="tiny", cache_dir=str(cache_dir), input_len=256, prefix_share=1,
                                prefix_state_split_min_tokens=1, **SHARED)
    result = runner.run_bench(config)
    engine = result["engine"]
    assert result["config"]["prefix_len"] == 256
    assert engine["num_cached_tokens"]["min"] == 255 and engine["computed_prompt_tokens"] == 2 * 1


@pytest.mark.parametrize("share", ["1.5", "-0.1", "nan"])
def test_cli_bench_refuses_a_prefix_share_outside_0_to_1(share, tmp_path, capsys):
    cache = tmp_path / "cache"
    assert main(["bench", "--preset", "tiny", "--cache-dir", str(cache), f"--prefix-share={share}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("deepinfer bench: error: prefix_share must be a number in [0, 1] (the share of each prompt")
    assert f"got {float(share)!r}" in err and not cache.exists()


def test_stats_and_percentiles():
    s = runner.stats([float(i) for i in range(1, 101)])
    assert (s["mean"], s["p50"], s["p99"], s["min"], s["max"]) == (50.5, 50.0, 99.0, 1.0, 100.0)
    assert runner.stats([])["mean"] is None


# ------------------------------------------------------------------------------------------------ roofline
def test_roofline_matches_benchmarks_md_for_the_flash_preset():
    config = DeepseekV4Config.from_dict(presets.get_preset("v4-flash-8l64e").config_dict())
    mb = roofline.model_bytes(config, torch.bfloat16)
    peak = roofline.KNOWN_PEAKS["H200"]
    assert mb.weight_bytes_touched(1) / 1e9 == pytest.approx(5.8, abs=0.15)  # "~5.9 GB touched per step"
    assert mb.weight_bytes_touched(64) / peak.bandwidth * 1e3 == pytest.approx(6.85, abs=0.05)  # floor at batch 64
    assert mb.unique_experts(1) == pytest.approx(6) and mb.unique_experts(10_000) == pytest.approx(64)
    floors = roofline.run_floor(mb, peak, num_prompts=1, input_len=1024, output_len=2, batch=1)
    flops = 2 * mb.active_params * 1024 + mb.attention.prefill_flops(1024)  # FLOP-bound at 1024 tokens
    assert floors["prefill_floor_s"] == pytest.approx(flops / peak.flops)
    state = sum(mb.attention.state_bytes(1025).values()) / peak.bandwidth
    assert floors["decode_floor_s"] == pytest.approx(mb.weight_bytes_touched(1) / peak.bandwidth + state)
    assert math.isclose(floors["floor_s"], floors["prefill_floor_s"] + floors["decode_floor_s"])
    hit = roofline.run_floor(mb, peak, num_prompts=1, input_len=1024, output_len=2, batch=1, prefill_tokens=256)
    hit_bytes = mb.weight_bytes_touched(256) + 256 * mb.state_bytes_per_token + mb.state_bytes_per_seq
    assert hit["prefill_floor_s"] == pytest.approx(hit_bytes / peak.bandwidth)  # 256 tokens: bound by the weights
    assert hit["prefill_tokens"] == 256
    assert hit["decode_floor_s"] == floors["decode_floor_s"] and floors["prefill_tokens"] == 1024


def test_a_quantized_preset_gets_a_floor_with_its_quantized_products_at_the_fp8_peak():
    """The fp4 preset's 8K prefill: the same FLOPs as bf16's, of which the quantized weights' (the active parameters
    but the bf16 head's and a few small matrices') run at the fp8 peak in the second floor; a bf16 model's floor
    stays as it is."""
    from deepinfer_core.quant.writer import planned_quantization

    preset = presets.get_preset("v4-flash-8l64e-fp4")
    config = DeepseekV4Config.from_dict(preset.config_dict())
    mb = roofline.model_bytes(config, torch.bfloat16, quantized=planned_quantization(preset.quantize, config))
    plain = roofline.model_bytes(config, torch.bfloat16)
    peak = roofline.KNOWN_PEAKS["H200"]
    assert mb.active_params == plain.active_params and plain.quantized_active_params == 0
    head = config.vocab_size * config.hidden_size
    assert mb.quantized_active_params == pytest.approx(mb.active_params - head, rel=0.01)  # + small bf16 matrices
    assert mb.quantized_active_params <= mb.active_params - head
    tokens, attention = 8192, mb.attention.prefill_flops(8192)
    quantized = 2 * mb.quantized_active_params * tokens
    want = (2 * mb.active_params * tokens - quantized + attention) / peak.flops + quantized / peak.fp8_flops
    assert roofline.prefill_wave_floor(mb, peak, 1, 8192, 8192, fp8=True) == pytest.approx(want)
    assert roofline.prefill_wave_floor(mb, peak, 1, 8192, 8192) == pytest.approx(
        (2 * mb.active_params * tokens + attention) / peak.flops)
    assert roofline.prefill_wave_floor(plain, peak, 1, 8192, 8192, fp8=True) == roofline.prefill_wave_floor(
        plain, peak, 1, 8192, 8192)


def test_the_report_prints_the_fp8_floor_of_a_quantized_run():
    value = {"fraction": 0.406, "device": "NVIDIA H200", "floor_s": 0.0627, "prefill_floor_s": 0.0627,
             "prefill_tokens": 8192, "decode_floor_s": 0.0, "fp8_fraction": 0.3, "fp8_floor_s": 0.0463,
             "fp8_prefill_floor_s": 0.0463}
    from deepinfer_core.bench.report import _roofline_lines

    lines = _roofline_lines({"engine": value})
    assert lines[0].startswith("roofline (engine): 40.6% of the NVIDIA H200 floor (62.70 ms")
    assert lines[1] == ("roofline (engine) with the quantized weights' products at the fp8 peak: 30.0% (46.30 ms: "
                        "prefill 46.30 ms)")
    assert len(_roofline_lines({"engine": {k: v for k, v in value.items() if not k.startswith("fp8")}})) == 1


def test_roofline_is_not_applicable_on_cpu():
    config = DeepseekV4Config.from_dict(presets.get_preset("tiny").config_dict())
    assert roofline.roofline(config, torch.float32, "cpu", 1.0, 1, 8, 4, 1) == "n/a (CPU)"

"""``deepinfer bench --json-schema FILE`` on the tiny preset (CPU): every request is constrained to the schema, the
preset runs with a byte-level tokenizer, and the result reports the token masks' host time and the share hidden."""

from __future__ import annotations

import json

from deepinfer_core.bench import runner
from deepinfer_core.bench.report import format_report
from deepinfer_core.cli import main

SCHEMA = {"type": "array", "minItems": 40, "items": {"type": "object", "additionalProperties": False,
                                                     "required": ["id", "ok"],
                                                     "properties": {"id": {"type": "integer"},
                                                                    "ok": {"type": "boolean"}}}}


def test_bench_with_a_json_schema_constrains_every_request(tmp_path):
    config = runner.BenchConfig(preset="tiny", cache_dir=str(tmp_path), input_len=8, output_len=24, num_prompts=3,
                                max_num_seqs=3, warmup=0, async_scheduling=True, json_schema=SCHEMA)
    result = runner.run_bench(config)
    assert set(result) == set(runner.result_keys()["result"])
    assert result["config"]["model_folder"].endswith("-bpe")
    assert result["engine"]["output_tokens"] == 3 * 24  # the schema's shortest document is longer: length ends it
    masks = result["structured_output"]
    assert masks["rows"] == 3 * 24 and masks["prepare_s"] > 0 and 0 <= masks["hidden_share"] <= 1
    assert masks["wait_s"] <= masks["prepare_s"] + 1e-3
    assert "structured output: token masks" in format_report(result)
    assert "JSON schema" in format_report(result)


def test_cli_json_schema_errors_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert main(["bench", "--preset", "tiny", "--json-schema", str(bad)]) == 2
    assert "a schema is a JSON object, got list" in capsys.readouterr().err
    assert main(["bench", "--preset", "tiny", "--json-schema", str(tmp_path / "missing.json")]) == 2
    assert "cannot read it" in capsys.readouterr().err
    good = tmp_path / "schema.json"
    good.write_text(json.dumps(SCHEMA))
    assert main(["bench", "--preset", "tiny", "--json-schema", str(good), "--compare-hf"]) == 2
    assert "leave out --compare-hf" in capsys.readouterr().err

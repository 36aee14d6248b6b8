"""Structured output on the embedded tiny model (CPU): every output satisfies its constraint, greedy and seeded
sampling, and ends (finish_reason "stop") when the grammar completes; a bad constraint refuses its request alone;
requests without constraints keep their tokens."""

from __future__ import annotations

import json
import re

import pytest

from deepinfer_core import LLM, SamplingParams, StructuredOutputsParams
from deepinfer_core.engine.input_processor import InputProcessor, RequestRejectedError
from deepinfer_core.plugins import get_plugin_manager

PROMPTS = ["hello", "def f(x):"]

NESTED = {"type": "object", "additionalProperties": False, "required": ["user", "ok"],
          "properties": {"user": {"type": "object", "additionalProperties": False, "required": ["id", "tag"],
                                  "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                 "tag": {"type": "string", "maxLength": 5}}},
                         "ok": {"type": "boolean"}}}
ARRAY = {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "minItems": 2, "maxItems": 4}
ENUM = {"type": "object", "additionalProperties": False, "required": ["color"],
        "properties": {"color": {"enum": ["red", "green", "blue"]}}}
NUMBER = {"type": "object", "additionalProperties": False, "required": ["x", "flag"],
          "properties": {"x": {"type": "number", "minimum": 0, "maximum": 10}, "flag": {"type": "boolean"}}}
STRING = {"type": "object", "additionalProperties": False, "required": ["code"],
          "properties": {"code": {"type": "string", "minLength": 2, "maxLength": 6, "pattern": "^[a-z]+[0-9]?$"}}}


def check_schema(value, schema) -> None:
    """A small validator for the keywords the schemas above use (the venv has no jsonschema)."""
    if "enum" in schema:
        assert value in schema["enum"]
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict)
        assert set(schema["required"]) <= set(value) <= set(schema["properties"])
        for key, item in value.items():
            check_schema(item, schema["properties"][key])
    elif kind == "array":
        assert isinstance(value, list) and schema["minItems"] <= len(value) <= schema["maxItems"]
        for item in value:
            check_schema(item, schema["items"])
    elif kind in ("integer", "number"):
        assert not isinstance(value, bool) and isinstance(value, int if kind == "integer" else (int, float))
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value)
    elif kind == "boolean":
        assert isinstance(value, bool)
    elif kind == "string":
        assert isinstance(value, str)
        assert schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value))
        if "pattern" in schema:
            assert re.search(schema["pattern"], value), (value, schema["pattern"])
    else:
        raise AssertionError(f"unexpected schema {schema}")


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=8, enforce_eager=True)


SAMPLINGS = [{"temperature": 0}, {"temperature": 1.0, "seed": 7}]


def _params(sampling, constraint, **kw):
    return SamplingParams(max_tokens=64, structured_outputs=constraint, **sampling, **kw)


def test_the_plugin_is_loaded():
    record = get_plugin_manager().records["structured_output"]
    assert record.status == "loaded", record.traceback


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
def test_json_schemas_give_valid_json_and_stop_when_complete(llm, sampling):
    schemas = [NESTED, ARRAY, ENUM, NUMBER, STRING]
    params = [_params(sampling, StructuredOutputsParams(json=s, disable_any_whitespace=True)) for s in schemas]
    prompts = [PROMPTS[i % 2] for i in range(len(schemas))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for schema, output in zip(schemas, outputs):
        completion = output.outputs[0]
        assert output.error is None
        assert completion.finish_reason == "stop", (schema, completion.text)
        check_schema(json.loads(completion.text), schema)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
def test_regex_and_choice(llm, sampling):
    regex = r"(ab|cd)[0-9]{2,3}-[xyz]{1,4};"
    choices = ["alpha", "beta", "gamma delta"]
    outputs = llm.generate(PROMPTS, [_params(sampling, StructuredOutputsParams(regex=regex)),
                                     _params(sampling, StructuredOutputsParams(choice=choices))], use_tqdm=False)
    assert re.fullmatch(regex, outputs[0].outputs[0].text)
    assert outputs[1].outputs[0].text in choices
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs)


def test_grammar_json_object_and_json_string(llm):
    lark = 'start: "(" num ("+" num)? ")"\nnum: /[1-9]/'
    outputs = llm.generate(PROMPTS * 2, [
        _params(SAMPLINGS[1], StructuredOutputsParams(grammar=lark)),
        _params(SAMPLINGS[0], StructuredOutputsParams(json_object=True, disable_any_whitespace=True)),
        _params(SAMPLINGS[0], StructuredOutputsParams(json=json.dumps(ENUM), disable_any_whitespace=True)),
        _params(SAMPLINGS[1], StructuredOutputsParams(choice=["x"])),
    ], use_tqdm=False)
    texts = [o.outputs[0].text for o in outputs]
    assert [o.outputs[0].finish_reason for o in outputs[::2]] == ["stop", "stop"] and texts[3] == "x"
    assert re.fullmatch(r"\([1-9](\+[1-9])?\)", texts[0])
    if outputs[1].outputs[0].finish_reason == "stop":  # any object: its strings are unbounded, it may run to length
        assert isinstance(json.loads(texts[1]), dict)
    check_schema(json.loads(texts[2]), ENUM)
    assert texts[3] == "x"


def test_n_greater_than_one_and_async_scheduling():
    llm = LLM(max_num_seqs=8, enforce_eager=True, async_scheduling=True)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=64,
                            structured_outputs=StructuredOutputsParams(json=NESTED, disable_any_whitespace=True))
    (output,) = llm.generate(["hello"], params, use_tqdm=False)
    assert len(output.outputs) == 3
    for completion in output.outputs:
        assert completion.finish_reason == "stop"
        check_schema(json.loads(completion.text), NESTED)


def test_a_bad_constraint_refuses_only_its_request_and_others_keep_their_tokens(llm):
    plain = SamplingParams(temperature=0, max_tokens=8)
    (alone,) = llm.generate(["hello"], plain, use_tqdm=False)
    outputs = llm.generate(["hello"] * 5, [
        _params(SAMPLINGS[0], StructuredOutputsParams(json={"type": "foo"})),
        _params(SAMPLINGS[0], StructuredOutputsParams(regex="([a-")),
        _params(SAMPLINGS[0], StructuredOutputsParams(grammar="start: undefined_rule")),
        plain,
        _params(SAMPLINGS[0], StructuredOutputsParams(choice=["yes", "no"])),
    ], use_tqdm=False)
    assert "structured_outputs.json is invalid" in outputs[0].error and "foo" in outputs[0].error
    assert "structured_outputs.regex is invalid" in outputs[1].error
    assert "structured_outputs.grammar is invalid" in outputs[2].error
    assert outputs[3].error is None and outputs[3].outputs[0].token_ids == alone.outputs[0].token_ids
    assert outputs[4].error is None and outputs[4].outputs[0].text in ("yes", "no")


def test_ignore_eos_is_refused(llm):
    (output,) = llm.generate(["hello"], SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(
        choice=["a"])), use_tqdm=False)
    assert "ignore_eos" in output.error


def test_without_a_processor_the_engine_refuses_structured_outputs():
    class Everything:  # a processor that applies to every request, but does not enforce structured outputs
        def __call__(self, logits, rows):
            return logits

    checks = InputProcessor(max_model_len=64, block_size=16, num_blocks=8, vocab_size=100, tokenizer=None,
                            logits_processors=[Everything()])
    params = SamplingParams(structured_outputs={"regex": "a+"})
    with pytest.raises(RequestRejectedError, match="deepinfer-structured-output plugin: pip install"):
        checks.prepare([1, 2, 3], params)
    assert checks.prepare([1, 2, 3], SamplingParams()).needs_host_tokens is False

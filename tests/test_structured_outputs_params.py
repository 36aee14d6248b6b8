"""StructuredOutputsParams (vLLM's names) and SamplingParams.structured_outputs: exactly one constraint, checked
types; the core refuses a constrained request when no processor enforces it."""

from __future__ import annotations

import pytest

from deepinfer_core import SamplingParams, StructuredOutputsParams
from deepinfer_core.errors import DeepInferError


def test_exactly_one_constraint():
    for kwargs in ({}, {"json": {"type": "object"}, "regex": "a"}, {"choice": ["a"], "json_object": True}):
        with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object"):
            StructuredOutputsParams(**kwargs)
    assert StructuredOutputsParams(regex="a+").kind == "regex"
    assert StructuredOutputsParams(json_object=True).schema() == {"type": "object"}
    assert StructuredOutputsParams(json='{"type": "integer"}').schema() == {"type": "integer"}


@pytest.mark.parametrize("kwargs, message", [
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": 3}, "must be a JSON schema"),
    ({"json": "[1, 2]"}, "JSON schema object"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"grammar": 5}, "grammar must be a non-empty string"),
    ({"choice": "ab"}, "choice must be a list"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 1]}, "non-empty list"),
    ({"json_object": "yes"}, "json_object must be a bool"),
    ({"regex": "a", "disable_any_whitespace": 1}, "disable_any_whitespace must be a bool"),
])
def test_bad_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        StructuredOutputsParams(**kwargs)
    assert isinstance(info.value, DeepInferError)


def test_sampling_params_takes_an_instance_or_a_dict():
    constraint = StructuredOutputsParams(choice=["a", "b"])
    assert SamplingParams(structured_outputs=constraint).structured_outputs is constraint
    assert SamplingParams(structured_outputs={"regex": "x"}).structured_outputs == StructuredOutputsParams(regex="x")
    assert SamplingParams().structured_outputs is None
    with pytest.raises(ValueError, match="unknown fields"):
        SamplingParams(structured_outputs={"json_schema": {}})
    with pytest.raises(ValueError, match="must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="a+")
    assert SamplingParams(structured_outputs=constraint).clone().structured_outputs == constraint

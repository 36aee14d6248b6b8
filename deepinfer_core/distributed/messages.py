"""What crosses between the parent and its ranks, as plain data (dicts, lists, strings, numbers): engine keywords,
prompts, sampling parameters and request outputs. Objects that are not plain data (callables such as logits
processors) are refused with the keyword that holds them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from deepinfer_core.engine_args import EngineArgsError
from deepinfer_core.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer_core.sampling.params import SamplingParams

_SCALARS = (type(None), bool, int, float, str)


def is_plain(value: Any) -> bool:
    """Whether ``value`` is built of None, bools, numbers, strings, lists, tuples and dicts with such keys."""
    if isinstance(value, _SCALARS):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, _SCALARS) and is_plain(v) for k, v in value.items())
    return False


def plain_engine_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``LLM``'s keywords for the ranks it starts (a ``torch.dtype`` as its name)."""
    out = {}
    for name, value in kwargs.items():
        if isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        if not is_plain(value):
            raise EngineArgsError(f"{name}={value!r} cannot be sent to the ranks LLM(data_parallel_size=...) starts "
                                  "(only plain values can); launch with torchrun to pass objects")
        out[name] = value
    return out


def plain_prompt(prompt: str | Mapping[str, Any]) -> str | dict[str, Any]:
    if isinstance(prompt, str):
        return prompt
    out = dict(prompt)
    if not is_plain(out):
        raise TypeError(f"a prompt sent to the ranks must be text or a dict of plain values, got {prompt!r}")
    return out


def params_to_plain(params: SamplingParams) -> dict[str, Any]:
    out = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    bad = sorted(name for name, value in out.items() if not is_plain(value))
    if bad:
        raise TypeError(f"SamplingParams fields {bad} hold values that cannot be sent to the ranks; use plain values")
    return out


def params_from_plain(data: Mapping[str, Any]) -> SamplingParams:
    return SamplingParams(**data)


def output_to_plain(output: RequestOutput) -> dict[str, Any]:
    return dataclasses.asdict(output)


def output_from_plain(data: Mapping[str, Any]) -> RequestOutput:
    fields = dict(data)
    fields["prompt_logprobs"] = _logprob_list(fields["prompt_logprobs"])
    fields["outputs"] = [CompletionOutput(**{**c, "logprobs": _logprob_list(c["logprobs"])}) for c in fields["outputs"]]
    return RequestOutput(**fields)


def _logprob_list(positions: list | None) -> list | None:
    if positions is None:
        return None
    return [None if p is None else {int(t): Logprob(**lp) for t, lp in p.items()} for p in positions]

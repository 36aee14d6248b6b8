"""Sampling: per-request parameters and the pure, batch-invariant sampler."""

from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.sampler import (
    PromptLogprobsOutput,
    SamplerOutput,
    SamplingMetadata,
    compute_prompt_logprobs,
    request_seed,
    sample,
)

__all__ = [
    "PromptLogprobsOutput",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingParams",
    "compute_prompt_logprobs",
    "request_seed",
    "sample",
]

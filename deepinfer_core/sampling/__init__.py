"""Sampling: per-request parameters, logits processors and the pure, batch-invariant sampler."""

from deepinfer_core.sampling.logits_processor import LogitsProcessor, LogitsProcessorLike, LogitsRow
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.sampler import (
    PromptLogprobsOutput,
    SamplerOutput,
    SamplingMetadata,
    compute_prompt_logprobs,
    request_seed,
    sample,
)
from deepinfer_core.sampling.structured_outputs import StructuredOutputsParams

__all__ = [
    "LogitsProcessor",
    "LogitsProcessorLike",
    "LogitsRow",
    "PromptLogprobsOutput",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingParams",
    "StructuredOutputsParams",
    "compute_prompt_logprobs",
    "request_seed",
    "sample",
]

"""Speculative decoding: a proposer drafts tokens, the target model verifies them in one step, rejected ones are
rolled back (docs/speculative.md). ``proposer.py`` is the contract a draft method implements; ``config.py`` parses
vLLM's ``speculative_config``; ``ngram.py`` is the core's own method; ``verify.py`` the verification rule;
``speculator.py`` what the engine runs each step."""

from deepinfer_core.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from deepinfer_core.spec_decode.proposer import (
    NO_DRAFT,
    Draft,
    DraftBatch,
    DraftSequence,
    Proposer,
    ProposerError,
    ProposerRegistry,
)

__all__ = ["NO_DRAFT", "Draft", "DraftBatch", "DraftSequence", "Proposer", "ProposerError", "ProposerRegistry",
           "SpeculativeConfig", "SpeculativeConfigError"]

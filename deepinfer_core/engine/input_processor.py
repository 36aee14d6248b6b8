"""What the engine checks and prepares for a request before it is queued (vLLM's input processor).

A request the engine cannot run is refused here, whole and at once, with ``RequestRejectedError`` naming what is
wrong: an empty or too-long prompt, token ids outside the vocabulary (prompt, ``logit_bias``, ``allowed_token_ids``,
``bad_words``), a state budget too small for its longest sequence, a constraint a logits processor refuses, or
``structured_outputs`` that no processor enforces. What it prepares: ``bad_words`` as token ids, and whether the
request needs its latest token's id on the host before its next step is planned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from deepinfer_core.errors import DeepInferError
from deepinfer_core.sampling.bad_words import tokenize_bad_words
from deepinfer_core.sampling.logits_processor import applies_to, needs_latest_tokens, processor_name, validate_params
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.structured_outputs import PLUGIN_HINT


class RequestRejectedError(DeepInferError, ValueError):
    """A request the engine refuses before running it (too long, empty, bad token ids)."""


@dataclasses.dataclass(frozen=True)
class PreparedRequest:
    """What a checked request carries into the scheduler and the sampler."""

    bad_words_token_ids: list[list[int]]
    needs_host_tokens: bool  # penalties, multi-token bad words or a processor that needs the latest token


class InputProcessor:
    """Checks requests against the engine's sizes, vocabulary and logits processors."""

    def __init__(self, max_model_len: int, block_size: int, num_blocks: int, vocab_size: int, tokenizer,
                 logits_processors: Sequence[Callable] = ()):
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.logits_processors = list(logits_processors)

    def prepare(self, prompt_token_ids: list[int], params: SamplingParams) -> PreparedRequest:
        """Check a request (``RequestRejectedError`` when it cannot run) and prepare what it carries."""
        self._check_prompt(prompt_token_ids)
        self._check_token_ids(params)
        self._check_processors(params)
        self._check_budget(len(prompt_token_ids), params)
        bad_words = self._bad_words_token_ids(params)
        needs_host_tokens = (params.uses_penalties or any(len(word) > 1 for word in bad_words)
                             or any(needs_latest_tokens(p) and applies_to(p, params) for p in self.logits_processors))
        return PreparedRequest(bad_words, needs_host_tokens)

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise RequestRejectedError("the prompt is empty; give at least one token")
        if len(token_ids) > self.max_model_len:
            raise RequestRejectedError(
                f"the prompt has {len(token_ids)} tokens, longer than max_model_len={self.max_model_len}; "
                "shorten the prompt or raise max_model_len")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestRejectedError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    def _check_token_ids(self, params: SamplingParams) -> None:
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            outside = sorted(t for t in ids if t >= self.vocab_size)
            if outside:
                raise RequestRejectedError(f"{name} has token ids {outside[:5]} outside the vocabulary "
                                           f"[0, {self.vocab_size})")

    def _check_budget(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        longest = min(num_prompt_tokens + (params.max_tokens or self.max_model_len), self.max_model_len)
        blocks = -(-longest // self.block_size)
        if blocks > self.num_blocks:
            raise RequestRejectedError(
                f"a sequence of {longest} tokens needs {blocks} state blocks but the memory budget holds "
                f"{self.num_blocks}; raise kv_cache_memory_bytes or lower max_tokens / max_model_len")

    def _check_processors(self, params: SamplingParams) -> None:
        """Let each logits processor that applies to ``params`` refuse it (``validate_params``); refuse
        ``structured_outputs`` that no processor applies (one that says so with ``applies_structured_outputs``)."""
        applying = [p for p in self.logits_processors if applies_to(p, params)]
        if params.structured_outputs is not None and not any(
                getattr(p, "applies_structured_outputs", False) for p in applying):
            raise RequestRejectedError(PLUGIN_HINT)
        for processor in applying:
            try:
                validate_params(processor, params)
            except (ValueError, TypeError) as exc:
                raise RequestRejectedError(str(exc)) from exc
            except Exception as exc:  # a processor's bug refuses this request, named
                raise RequestRejectedError(f"logits processor {processor_name(processor)} raised "
                                           f"{type(exc).__name__} validating the request: {exc}") from exc

    def _bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """``params.bad_words`` tokenized with the engine's tokenizer (``sampling/bad_words.py``)."""
        if not params.bad_words:
            return []
        if self.tokenizer is None:
            raise RequestRejectedError("bad_words need a tokenizer, and this engine has none; ban token ids with "
                                       "allowed_token_ids or logit_bias instead")
        words = tokenize_bad_words(params.bad_words, lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        outside = sorted({t for word in words for t in word if t >= self.vocab_size})
        if outside:
            raise RequestRejectedError(f"bad_words {params.bad_words!r} tokenize to ids {outside[:5]} outside the "
                                       f"model's vocabulary [0, {self.vocab_size})")
        return words

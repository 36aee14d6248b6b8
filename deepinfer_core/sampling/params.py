"""Per-request sampling parameters, compatible with vLLM's ``SamplingParams``.

Every value is validated on construction; a bad value raises ``ValueError`` naming the parameter,
the value and the allowed range. Normalisations (all as vLLM does):

* ``top_k`` ``-1`` and ``0`` both mean "off" and are stored as ``0``.
* ``stop`` given as a single string becomes a one-element list; ``None`` becomes ``[]``.
* ``temperature == 0`` means greedy: ``top_p``, ``top_k`` and ``min_p`` are reset to their
  "off" values since they cannot change an argmax.
* ``seed`` may also be given as ``seq_seed`` (the reference engine's name); both are accepted,
  giving two different values is an error.
* ``logit_bias`` keys may be given as strings of digits (JSON objects have string keys); they are stored as ints.
  ``allowed_token_ids`` and ``bad_words`` become lists; an empty ``logit_bias`` / ``bad_words`` becomes ``None``.

Token ids in ``logit_bias`` and ``allowed_token_ids`` are checked against the model's vocabulary when the engine
takes the request (``RequestRejectedError``); ``bad_words`` are tokenized by the engine's tokenizer then.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from deepinfer_core.errors import DeepInferError
from deepinfer_core.sampling.structured_outputs import StructuredOutputsParams

_UNSET: Any = object()


class SamplingParamsTypeError(DeepInferError, TypeError, ValueError):
    """A sampling parameter of the wrong type (both a ``TypeError`` and a ``ValueError``)."""


def _check_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    """Raise unless ``value`` is an int (bools are rejected) or, if allowed, ``None``."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an int or None" if allow_none else "an int"
        raise SamplingParamsTypeError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")


def _check_number(name: str, value: Any) -> None:
    """Raise unless ``value`` is a real number (int or float, not bool, not NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingParamsTypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if math.isnan(value):
        raise ValueError(f"{name} must not be NaN, got {value!r}")


@dataclasses.dataclass(init=False, eq=True, repr=True)
class SamplingParams:
    """How to sample one request's completions (vLLM-compatible keyword arguments).

    Args:
        n: number of completions to return for the prompt (>= 1).
        temperature: softmax temperature (>= 0); 0 means greedy (argmax).
        top_p: nucleus sampling mass, in (0, 1]; 1 is off.
        top_k: keep the k most likely tokens; 0 or -1 is off (stored as 0), else >= 1.
        min_p: drop tokens whose probability is below ``min_p * max_prob``, in [0, 1]; 0 is off.
        repetition_penalty: > 0; 1 is off. Divides positive / multiplies negative logits of tokens
            seen in the prompt or the output.
        presence_penalty: in [-2, 2]; subtracted once from logits of tokens seen in the output.
        frequency_penalty: in [-2, 2]; subtracted per occurrence in the output.
        seed: per-request random seed (any int) or None; alias ``seq_seed``.
        stop: string(s) that end the completion when generated (not empty strings).
        stop_token_ids: token ids that end the completion when generated.
        ignore_eos: keep generating after the EOS token.
        max_tokens: maximum number of generated tokens (>= 1) or None for "up to the context length".
        min_tokens: EOS / stop ids / stop strings cannot end the completion before this many tokens (>= 0,
            <= max_tokens).
        logprobs: number of top log-probabilities to return per generated token (>= 0) or None.
        prompt_logprobs: number of top log-probabilities to return per prompt token (>= 0) or None.
        skip_special_tokens: drop special tokens from the detokenized text.
        spaces_between_special_tokens: accepted for vLLM compatibility (the ``tokenizers`` decoder
            decides spacing).
        include_stop_str_in_output: keep the matched stop string (or stop token text) in the text.
        detokenize: produce text; stop strings need it.
        logit_bias: token id -> a finite number added to that token's logit before sampling (vLLM's
            ``logit_bias``; greedy rows see it too), or None.
        allowed_token_ids: the only token ids that may be sampled (non-empty), or None for all.
        bad_words: words that are never completed: a word's last token is banned whenever the tokens before it
            in the word were just generated (single-token words are always banned). Each word is tokenized with
            and without a leading space, as vLLM does.
        extra_args: free-form JSON-like values for plugins and logits processors (str keys), or None; the core
            never reads it.
        structured_outputs: a ``StructuredOutputsParams`` (or a dict of its fields) constraining the output to a
            JSON schema, regex, choice or grammar, or None. A logits processor applies it (the
            ``deepinfer-structured-output`` plugin); an engine without one refuses the request.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    extra_args: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __init__(
        self,
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        seed: int | None = _UNSET,
        seq_seed: int | None = _UNSET,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        max_tokens: int | None = 16,
        min_tokens: int = 0,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        detokenize: bool = True,
        logit_bias: Mapping[int, float] | None = None,
        allowed_token_ids: Sequence[int] | None = None,
        bad_words: Sequence[str] | None = None,
        extra_args: Mapping[str, Any] | None = None,
        structured_outputs: StructuredOutputsParams | Mapping[str, Any] | None = None,
    ) -> None:
        self.n = n
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.min_p = min_p
        self.repetition_penalty = repetition_penalty
        self.presence_penalty = presence_penalty
        self.frequency_penalty = frequency_penalty
        self.seed = _merge_seed(seed, seq_seed)
        self.stop = _normalise_stop(stop)
        self.stop_token_ids = _normalise_stop_token_ids(stop_token_ids)
        self.ignore_eos = ignore_eos
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self.detokenize = detokenize
        self.logit_bias = _normalise_logit_bias(logit_bias)
        self.allowed_token_ids = _normalise_allowed_token_ids(allowed_token_ids)
        self.bad_words = _normalise_bad_words(bad_words)
        self.extra_args = _normalise_extra_args(extra_args)
        self.structured_outputs = StructuredOutputsParams.coerce(structured_outputs)
        self._validate()
        self._normalise()

    # ------------------------------------------------------------------ aliases / helpers

    @property
    def seq_seed(self) -> int | None:
        """The reference engine's name for ``seed``."""
        return self.seed

    @property
    def sampling_type(self) -> str:
        """``"greedy"`` when temperature is 0, else ``"random"`` (seeded or not)."""
        return "greedy" if self.temperature == 0 else "random"

    @property
    def uses_penalties(self) -> bool:
        """Whether a repetition, presence or frequency penalty is on (they need the ids generated so far)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def uses_logits_controls(self) -> bool:
        """Whether ``logit_bias``, ``allowed_token_ids`` or ``bad_words`` change this request's logits."""
        return self.logit_bias is not None or self.allowed_token_ids is not None or self.bad_words is not None

    def clone(self) -> SamplingParams:
        """A deep copy (lists are not shared with the original)."""
        return copy.deepcopy(self)

    def all_stop_token_ids(self, eos_token_id: int | None) -> set[int]:
        """Token ids that end a completion: ``stop_token_ids`` plus EOS unless ``ignore_eos``."""
        ids = set(self.stop_token_ids)
        if eos_token_id is not None and not self.ignore_eos:
            ids.add(eos_token_id)
        return ids

    # ------------------------------------------------------------------ validation

    def _validate(self) -> None:
        self._validate_sampling()
        self._validate_penalties()
        self._validate_lengths()
        self._validate_outputs()

    def _validate_sampling(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (off) or >= 1, got {self.top_k}")
        _check_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_int("seed", self.seed, allow_none=True)

    def _validate_penalties(self) -> None:
        _check_number("repetition_penalty", self.repetition_penalty)
        if not (self.repetition_penalty > 0 and self.repetition_penalty != float("inf")):
            raise ValueError(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")

    def _validate_lengths(self) -> None:
        _check_int("max_tokens", self.max_tokens, allow_none=True)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )

    def _validate_outputs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check_int(name, value, allow_none=True)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {value}")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output", "detokenize"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise SamplingParamsTypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
        if self.stop and not self.detokenize:
            raise ValueError(f"stop strings need detokenize=True, got stop={self.stop!r} with detokenize=False")

    def _normalise(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if self.temperature == 0:  # greedy: filters cannot change the argmax
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0


def _merge_seed(seed: Any, seq_seed: Any) -> int | None:
    """Resolve the ``seed`` / ``seq_seed`` aliases; error if both are given with different values."""
    if seed is _UNSET:
        return None if seq_seed is _UNSET else seq_seed
    if seq_seed is not _UNSET and seq_seed != seed:
        raise ValueError(f"seed and seq_seed are aliases but differ: seed={seed!r}, seq_seed={seq_seed!r}")
    return seed


def _normalise_stop(stop: Any) -> list[str]:
    """``None`` -> ``[]``; ``str`` -> ``[str]``; a sequence of non-empty strings -> list."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, Sequence):
        raise SamplingParamsTypeError(f"stop must be a str, a list of str or None, got {stop!r} ({type(stop).__name__})")
    out = list(stop)
    for s in out:
        if not isinstance(s, str):
            raise SamplingParamsTypeError(f"stop must contain only strings, got {s!r} ({type(s).__name__}) in {out!r}")
        if s == "":
            raise ValueError(f"stop must not contain an empty string, got {out!r}")
    return out


def _normalise_stop_token_ids(ids: Any) -> list[int]:
    """``None`` -> ``[]``; a sequence of non-negative ints -> list."""
    if ids is None:
        return []
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise SamplingParamsTypeError(f"stop_token_ids must be a list of int or None, got {ids!r} ({type(ids).__name__})")
    out = list(ids)
    for t in out:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"stop_token_ids must contain ints >= 0, got {t!r} in {out!r}")
    return out


def _normalise_logit_bias(bias: Any) -> dict[int, float] | None:
    """``None`` or ``{}`` -> ``None``; a mapping of token id (int, or a str of digits) to a finite number -> dict."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise SamplingParamsTypeError(f"logit_bias must be a dict of token id -> number or None, got {bias!r} "
                                      f"({type(bias).__name__})")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {key!r}")
        _check_number(f"logit_bias[{token}]", value)
        if math.isinf(value):
            raise ValueError(f"logit_bias[{token}] must be finite, got {value!r}; use bad_words or "
                             "allowed_token_ids to ban a token")
        out[token] = float(value)
    return out or None


def _normalise_allowed_token_ids(ids: Any) -> list[int] | None:
    """``None`` -> ``None``; a non-empty sequence of ids >= 0 -> list (vLLM refuses an empty list too)."""
    if ids is None:
        return None
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise SamplingParamsTypeError(f"allowed_token_ids must be a list of int or None, got {ids!r} "
                                      f"({type(ids).__name__})")
    out = list(ids)
    if not out:
        raise ValueError("allowed_token_ids must not be empty: no token could be sampled; pass None to allow all")
    for t in out:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"allowed_token_ids must contain ints >= 0, got {t!r} in {out!r}")
    return out


def _normalise_bad_words(words: Any) -> list[str] | None:
    """``None`` or ``[]`` -> ``None``; a sequence of non-blank strings -> list."""
    if words is None:
        return None
    if isinstance(words, str) or not isinstance(words, Sequence):
        raise SamplingParamsTypeError(f"bad_words must be a list of str or None, got {words!r} "
                                      f"({type(words).__name__})")
    out = list(words)
    for w in out:
        if not isinstance(w, str):
            raise SamplingParamsTypeError(f"bad_words must contain only strings, got {w!r} ({type(w).__name__})")
        if not w.strip():
            raise ValueError(f"bad_words must not contain a blank string, got {out!r}")
    return out or None


def _normalise_extra_args(extra: Any) -> dict[str, Any] | None:
    """``None`` -> ``None``; a mapping with str keys -> dict (values are not looked at)."""
    if extra is None:
        return None
    if not isinstance(extra, Mapping):
        raise SamplingParamsTypeError(f"extra_args must be a dict or None, got {extra!r} ({type(extra).__name__})")
    bad = [k for k in extra if not isinstance(k, str)]
    if bad:
        raise SamplingParamsTypeError(f"extra_args keys must be strings, got {bad[0]!r}")
    return dict(extra)

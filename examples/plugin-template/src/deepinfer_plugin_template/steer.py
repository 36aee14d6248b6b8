"""The plugin module the ``deepinfer.plugins`` entry point ``template_steer`` names: a logits processor.

It steers generation toward words by adding a bias to the logit of each word's first token:

* per request, through ``SamplingParams(extra_args={"steer": {"word": bias}})``: only that request changes;
* per engine, through the feature option ``steer`` (``LLM(steer={"word": bias})``,
  ``deepinfer generate --option 'steer={"word": 5}'``): every request of that engine changes.

The engine's decision lives in ``context.plugin_state``, so two engines in one process keep their own words. The
processor runs after the built-in sampling controls, only on the rows it applies to, so a request that asks for
nothing keeps its tokens bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

from deepinfer_core.engine_context import EngineContext
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.sampling import LogitsProcessor, LogitsRow, SamplingParams

DEEPINFER_HOOK_API_VERSION = 1

OPTION = "steer"  # the engine-wide option, and the key of a request's extra_args
STATE_KEY = "template_steer"  # our entry in context.plugin_state


def parse_words(value: object, where: str) -> dict[str, float]:
    """``{"word": bias}`` checked: non-empty strings to finite numbers; TypeError / ValueError naming ``where``
    otherwise."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{where} must be a mapping of word -> bias, e.g. {{\"import\": 5.0}}, got {value!r}")
    words = {}
    for word, bias in value.items():
        if not isinstance(word, str) or not word.strip():
            raise ValueError(f"{where}: {word!r} is not a word")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise ValueError(f"{where}: the bias of {word!r} must be a finite number, got {bias!r}")
        words[word] = float(bias)
    return words


class Steer(LogitsProcessor):
    """Adds each steered word's bias to the logit of the word's first token, row by row."""

    def __init__(self, encode: Callable[[str], list[int]], engine_words: Mapping[str, float]):
        self.encode = encode
        self.engine_words = dict(engine_words)

    def applies_to(self, params: SamplingParams) -> bool:
        return bool(self.engine_words) or OPTION in (params.extra_args or {})

    def words(self, params: SamplingParams) -> dict[str, float]:
        """The engine's words, then the request's own (a request's bias for a word replaces the engine's)."""
        own = parse_words((params.extra_args or {}).get(OPTION), f"extra_args[{OPTION!r}]")
        return {**self.engine_words, **own}

    def __call__(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        where, biases = [], []
        for i, row in enumerate(rows):
            for word, bias in self.words(row.params).items():
                token_ids = self.encode(word)
                if token_ids:
                    where.append((i, token_ids[0]))
                    biases.append(bias)
        if where:
            index = torch.tensor(where, dtype=torch.long, device=logits.device).T  # [2, k]: row, token id
            values = torch.tensor(biases, dtype=logits.dtype, device=logits.device)  # [k]
            logits.index_put_((index[0], index[1]), values, accumulate=True)  # [rows, vocab]
        return logits


@hookimpl
def deepinfer_feature_options() -> dict[str, str]:
    return {OPTION: 'steer every request toward words: {"word": bias}; a request steers itself with '
                    'extra_args={"steer": {...}}'}


@hookimpl
def deepinfer_configure(options: Mapping[str, object], context: EngineContext) -> None:
    """Check the engine's words and keep them for this engine."""
    context.plugin_state[STATE_KEY] = parse_words(options.get(OPTION), f"option {OPTION}")


@hookimpl
def deepinfer_logits_processors(context: EngineContext) -> list[Steer]:
    """One processor per engine, with that engine's tokenizer and words."""
    tokenizer = context.tokenizer
    if tokenizer is None:  # not an engine: nothing to tokenize with
        return []
    return [Steer(lambda text: tokenizer.encode(text, add_special_tokens=False), context.plugin_state.get(STATE_KEY, {}))]

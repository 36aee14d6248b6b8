"""The logits processor that enforces ``SamplingParams.structured_outputs`` with llguidance.

One ``llguidance.LLMatcher`` per request id, advanced with the row's output token ids (``needs_latest_tokens``: the
engine reads the token sampled in the step before first, as for penalties). Each step the processor computes the
row's token mask on the host, synchronously, and sets the disallowed logits to -inf; once the grammar is complete
only EOS is allowed, so the completion ends there (finish_reason "stop").

A matcher is a cache of the request's state, never the truth: a request the processor has not seen (or lost, after
a long preemption) gets a fresh matcher fed with all its output tokens, and fewer output tokens than the matcher
consumed (a rollback) roll it back.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer_core.sampling import LogitsProcessor, LogitsRow, SamplingParams
from deepinfer_core.sampling.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

# A matcher not used for this many processor calls is dropped (its request finished, or waits preempted: then it is
# rebuilt from the request's output tokens when the request samples again).
STALE_AFTER_CALLS = 256
GRAMMAR_CACHE_SIZE = 256


def grammar_of(constraint: StructuredOutputsParams) -> str:
    """The llguidance grammar (a string for ``LLMatcher``) of a constraint; ValueError naming what is wrong."""
    import llguidance

    kind = constraint.kind
    try:
        if kind in ("json", "json_object"):
            options = {"whitespace_flexible": False} if constraint.disable_any_whitespace else None
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(constraint.schema()), overrides=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(constraint.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", list(constraint.choice))
        return llguidance.grammar_from("grammar", constraint.grammar)  # Lark, or GBNF converted to Lark
    except Exception as exc:  # noqa: BLE001 - llguidance raises ValueError / RuntimeError for bad input
        raise ValueError(f"structured_outputs.{kind} is invalid: {exc}") from None


@dataclass
class _Entry:
    matcher: object  # llguidance.LLMatcher
    key: str  # the grammar it was built from
    num_tokens: int  # output tokens consumed
    last_call: int


class StructuredOutputProcessor(LogitsProcessor):
    """Masks each constrained row to the tokens its grammar allows next (EOS only once the grammar is complete)."""

    needs_latest_tokens = True
    applies_structured_outputs = True

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int | None):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._ll_tokenizer = None  # built on first use: engines without constrained requests pay nothing
        self._grammars: dict[str, str] = {}  # constraint key -> llguidance grammar
        self._entries: dict[str, _Entry] = {}
        self._calls = 0

    @classmethod
    def from_tokenizer(cls, tokenizer, model_dir: Path | None, vocab_size: int | None) -> StructuredOutputProcessor:
        """From the engine's tokenizer: the checkpoint's tokenizer.json (the fast tokenizer the engine loaded)."""
        path = Path(model_dir) / "tokenizer.json" if model_dir is not None else None
        if path is not None and path.is_file():
            text = path.read_text(encoding="utf-8")
        else:  # an engine whose tokenizer did not come from a folder: serialise the one it holds
            text = tokenizer._tok.to_str()
        eos = next(iter(tokenizer.eos_token_ids), None)
        return cls(text, max(int(vocab_size or 0), tokenizer.vocab_size), eos)

    # ------------------------------------------------------------------ the contract
    def applies_to(self, params: SamplingParams) -> bool:
        return getattr(params, "structured_outputs", None) is not None

    def validate_params(self, params: SamplingParams) -> None:
        """Compile the request's constraint against this engine's tokenizer; ValueError naming the problem."""
        import llguidance

        if self.eos_token_id is None:
            raise ValueError("structured_outputs needs a tokenizer with an EOS token to end the output")
        if params.ignore_eos:
            raise ValueError("structured_outputs cannot be combined with ignore_eos=True: the completion ends with "
                             "EOS when the grammar is complete")
        key, grammar = self._grammar(params.structured_outputs)
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer())
        if error:
            self._grammars.pop(key, None)
            raise ValueError(f"structured_outputs.{params.structured_outputs.kind} is invalid: {error.strip()}")

    def __call__(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

        self._calls += 1
        vocab = logits.shape[1]
        words = self._tokenizer().vocab_size
        bitmask = allocate_token_bitmask(len(rows), words)  # [rows, ceil(words / 32)] int32, all allowed
        eos_only = []
        for i, row in enumerate(rows):
            matcher = self._advance(row)
            if matcher.is_error() or matcher.is_stopped():
                if matcher.is_error():
                    logger.warning("request %s: the grammar matcher failed (%s); ending the output with EOS",
                                   row.request_id, matcher.get_error())
                eos_only.append(i)
                continue
            fill_next_token_bitmask(matcher, bitmask, i)
        shifts = torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [rows, 32 * ceil(words / 32)]
        allowed = allowed[:, :vocab]
        if allowed.shape[1] < vocab:  # logits wider than the tokenizer: the padding ids are never allowed
            allowed = torch.cat([allowed, allowed.new_zeros(len(rows), vocab - allowed.shape[1])], dim=1)
        if eos_only:
            index = torch.tensor(eos_only, dtype=torch.long)
            allowed[index] = False
            allowed[index, self.eos_token_id] = True
        self._evict_stale()
        return logits.masked_fill_(~allowed.to(logits.device, non_blocking=True), float("-inf"))

    # ------------------------------------------------------------------ matchers
    def _tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance

            self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                        eos_token=self.eos_token_id)
        return self._ll_tokenizer

    def _grammar(self, constraint: StructuredOutputsParams) -> tuple[str, str]:
        value = constraint.schema() if constraint.kind in ("json", "json_object") else getattr(constraint,
                                                                                             constraint.kind)
        key = f"{constraint.kind}:{int(constraint.disable_any_whitespace)}:{json.dumps(value, sort_keys=True)}"
        grammar = self._grammars.get(key)
        if grammar is None:
            grammar = grammar_of(constraint)
            if len(self._grammars) >= GRAMMAR_CACHE_SIZE:
                self._grammars.pop(next(iter(self._grammars)))
            self._grammars[key] = grammar
        return key, grammar

    def _advance(self, row: LogitsRow):
        """The row's matcher, having consumed exactly the row's output tokens."""
        import llguidance

        key, grammar = self._grammar(row.params.structured_outputs)
        entry = self._entries.get(row.request_id)
        if entry is None or entry.key != key:
            entry = _Entry(llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0), key, 0, self._calls)
            self._entries[row.request_id] = entry
        entry.last_call = self._calls
        output = row.output_token_ids
        if len(output) < entry.num_tokens:  # tokens taken back (a rejected draft, a recomputation)
            entry.matcher.rollback(entry.num_tokens - len(output))
            entry.num_tokens = len(output)
        if len(output) > entry.num_tokens:
            entry.matcher.consume_tokens(list(output[entry.num_tokens:]))
            entry.num_tokens = len(output)
        return entry.matcher

    def _evict_stale(self) -> None:
        if self._calls % 64:
            return
        oldest = self._calls - STALE_AFTER_CALLS
        for request_id in [r for r, e in self._entries.items() if e.last_call < oldest]:
            del self._entries[request_id]

    def forget(self, request_id: str) -> None:
        """Drop a request's matcher (it finished)."""
        self._entries.pop(request_id, None)


__all__ = ["StructuredOutputProcessor", "grammar_of"]

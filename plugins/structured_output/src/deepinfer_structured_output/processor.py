"""The logits processor that enforces ``SamplingParams.structured_outputs`` with llguidance.

A two-phase processor (``deepinfer_core.sampling.logits_processor``): ``prepare`` runs on the engine's host worker
thread while the device computes the step's forward pass. It advances one ``llguidance.LLMatcher`` per request id
with the row's output token ids and fills the rows' token masks, packed 32 tokens to an int32 word, with llguidance's
parallel executor (which releases the GIL). ``apply`` in the sampler moves the packed masks to the device and sets the
disallowed logits to -inf. Once the grammar is complete only EOS is allowed, so the completion ends there
(finish_reason "stop").

A matcher is a cache of the request's state, never the truth: a request the processor has not seen (or lost, after
a long preemption) gets a fresh matcher fed with all its output tokens, and fewer output tokens than the matcher
consumed (a rollback) roll it back.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer_core.sampling import LogitsRow, SamplingParams
from deepinfer_core.sampling.logits_processor import TwoPhaseLogitsProcessor
from deepinfer_core.sampling.structured_outputs import StructuredOutputsParams
from deepinfer_core.sampling.token_bitmask import apply_token_bitmask, bitmask_words

logger = logging.getLogger(__name__)

# A matcher not used for this many processor calls is dropped (its request finished, or waits preempted: then it is
# rebuilt from the request's output tokens when the request samples again).
STALE_AFTER_CALLS = 256
GRAMMAR_CACHE_SIZE = 256
ROLLBACK_WINDOW = 16  # trailing tokens compared with what a matcher consumed (rejected drafts are shorter)


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
    constraint: object  # the StructuredOutputsParams it was last used for (the key's source: skips recomputing it)
    consumed: list[int]  # the output tokens it consumed, in order
    last_call: int

    @property
    def num_tokens(self) -> int:
        return len(self.consumed)


class StructuredOutputProcessor(TwoPhaseLogitsProcessor):
    """Masks each constrained row to the tokens its grammar allows next (EOS only once the grammar is complete).

    ``prepare`` (the engine's worker thread) owns the matchers; ``validate_params`` (the engine's thread) shares only
    the grammar cache and the tokenizer, under a lock."""

    applies_structured_outputs = True

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int | None):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._ll_tokenizer = None  # built on first use: engines without constrained requests pay nothing
        self._ll_executor = None  # llguidance.LLExecutor: a batch's masks in parallel, without the GIL
        self._grammars: dict[str, str] = {}  # constraint key -> llguidance grammar
        self._shared = threading.Lock()  # the grammar cache and the tokenizer
        self._matchers = threading.Lock()  # the entries: prepare vs rollback / forget
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
            self._forget_grammar(key)
            raise ValueError(f"structured_outputs.{params.structured_outputs.kind} is invalid: {error.strip()}")

    def prepare(self, rows: Sequence[LogitsRow]) -> torch.Tensor:
        """Advance each row's matcher to the row's output tokens and fill the rows' packed token masks: int32
        ``[len(rows), ceil(vocab / 32)]`` on the host (pinned where CUDA is there), EOS alone for a matcher that has
        stopped or failed."""
        from llguidance.torch import fill_next_token_bitmask, fill_next_token_bitmask_par

        bitmask = torch.empty((len(rows), bitmask_words(self.vocab_size)), dtype=torch.int32,
                              pin_memory=torch.cuda.is_available())  # [rows, words]
        pending = []
        repeated = {r for r, n in Counter(row.request_id for row in rows).items() if n > 1}  # draft positions
        with self._matchers:
            self._calls += 1
            for i, row in enumerate(rows):
                matcher, whole = self._advance(row)
                if not whole or matcher.is_error() or matcher.is_stopped():  # not whole: a position not reached
                    if matcher.is_error():
                        logger.warning("request %s: the grammar matcher failed (%s); ending the output with EOS",
                                       row.request_id, matcher.get_error())
                    self._eos_only(bitmask[i])
                elif row.request_id in repeated:  # its next row advances this matcher: its mask now
                    fill_next_token_bitmask(matcher, bitmask, i)
                else:
                    pending.append((matcher, i))
            if pending:
                fill_next_token_bitmask_par(self._executor(), pending, bitmask)
            self._evict_stale()
        return bitmask

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow], handle: torch.Tensor) -> torch.Tensor:
        """Mask ``logits`` ``[len(rows), vocab]`` with the packed masks ``prepare`` filled (``handle``)."""
        del rows
        return apply_token_bitmask(logits, handle)

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Take back a request's last ``num_tokens`` consumed tokens (rejected speculative drafts). Not needed when
        the request's output shrinks between steps (``prepare`` rolls back to it), only between draft positions."""
        with self._matchers:
            entry = self._entries.get(request_id)
            if entry is None or num_tokens <= 0:
                return
            if num_tokens > entry.num_tokens:
                raise ValueError(f"request {request_id}: cannot roll back {num_tokens} tokens, its matcher consumed "
                                 f"{entry.num_tokens}")
            entry.matcher.rollback(num_tokens)
            del entry.consumed[-num_tokens:]

    # ------------------------------------------------------------------ matchers
    def _eos_only(self, row: torch.Tensor) -> None:
        row.zero_()
        word, bit = divmod(self.eos_token_id, 32)
        row[word] = (1 << bit) if bit < 31 else -(1 << 31)  # int32: bit 31 is the sign

    def _executor(self):
        if self._ll_executor is None:
            import llguidance

            self._ll_executor = llguidance.LLExecutor()
        return self._ll_executor

    def _tokenizer(self):
        with self._shared:
            if self._ll_tokenizer is None:
                import llguidance

                self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                            eos_token=self.eos_token_id)
            return self._ll_tokenizer

    def _grammar(self, constraint: StructuredOutputsParams) -> tuple[str, str]:
        value = constraint.schema() if constraint.kind in ("json", "json_object") else getattr(constraint,
                                                                                             constraint.kind)
        key = f"{constraint.kind}:{int(constraint.disable_any_whitespace)}:{json.dumps(value, sort_keys=True)}"
        with self._shared:
            grammar = self._grammars.get(key)
        if grammar is None:
            grammar = grammar_of(constraint)
            with self._shared:
                if len(self._grammars) >= GRAMMAR_CACHE_SIZE:
                    self._grammars.pop(next(iter(self._grammars)))
                self._grammars[key] = grammar
        return key, grammar

    def _forget_grammar(self, key: str) -> None:
        with self._shared:
            self._grammars.pop(key, None)

    def _advance(self, row: LogitsRow):
        """The row's matcher advanced to the row's output tokens, and whether it took them all: consumed tokens the
        row does not have (rejected speculative drafts: the row's tokens differ from some position on) are rolled back
        first. A token the grammar does not allow is not taken (a draft token the verification will reject; EOS after
        the grammar completed) and the matcher stays where it was."""
        import llguidance

        constraint = row.params.structured_outputs
        entry = self._entries.get(row.request_id)
        if entry is None or entry.constraint is not constraint:
            key, grammar = self._grammar(constraint)
            if entry is None or entry.key != key:
                entry = _Entry(llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0), key, constraint, [],
                               self._calls)
                self._entries[row.request_id] = entry
            entry.constraint = constraint
        entry.last_call = self._calls
        output = row.output_token_ids
        start = max(0, min(entry.num_tokens, len(output)) - ROLLBACK_WINDOW)  # outputs only ever change at their end
        tail = list(output[start:])  # one slice of the row's output: the part compared and the new tokens
        keep = start + _common_prefix(entry.consumed[start:], tail)
        if keep < entry.num_tokens:
            entry.matcher.rollback(entry.num_tokens - keep)
            del entry.consumed[keep:]
        new = tail[keep - start:]
        if new:
            taken = entry.matcher.try_consume_tokens(new)
            entry.consumed.extend(new[:taken])
            return entry.matcher, taken == len(new)
        return entry.matcher, True

    def _evict_stale(self) -> None:
        if self._calls % 64:
            return
        oldest = self._calls - STALE_AFTER_CALLS
        for request_id in [r for r, e in self._entries.items() if e.last_call < oldest]:
            del self._entries[request_id]

    def forget(self, request_id: str) -> None:
        """Drop a request's matcher (it finished)."""
        with self._matchers:
            self._entries.pop(request_id, None)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    shorter = min(len(a), len(b))
    if a[:shorter] == b[:shorter]:
        return shorter
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


__all__ = ["StructuredOutputProcessor", "grammar_of"]

"""Incremental detokenization, stop strings and the per-sequence finish check.

``IncrementalDetokenizer`` turns token ids into text one token at a time with vLLM's prefix / read
offsets: text is emitted only once the pending tokens decode without a trailing U+FFFD (a byte-level
BPE token can end in the middle of a UTF-8 character).

``SequenceDetokenizer`` drives one completion: for each new token it checks the token-level stop
conditions (``check_stop_token``), appends the decoded text, looks for stop strings across token
boundaries and returns the text that is safe to stream.

Stopping rules (as vLLM):

* EOS (unless ``ignore_eos``) and ``stop_token_ids`` give ``finish_reason="stop"``; ``stop_reason``
  is the stop token id (None for EOS). The stop token's text is left out of the output text unless
  ``include_stop_str_in_output``; its id stays in ``token_ids``.
* A stop string gives ``finish_reason="stop"``, ``stop_reason=`` the string; the text is cut before
  it (after it with ``include_stop_str_in_output``). If several stop strings complete in the same
  step, the one whose match *ends* first wins (ties: the longer one, then list order), which is the
  result character-by-character generation would give, whatever the tokenization.
* Nothing but length can end a completion at a token whose 1-based index is <= ``min_tokens``
  (the sampler masks stop ids for those tokens).
* ``max_tokens`` generated tokens (or ``max_model_len`` total tokens) give ``finish_reason="length"``
  unless the same token also stops it.
* While running, the longest suffix of the text that is a proper prefix of a stop string is held
  back, so streamed text never contains part of a stop string.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tokenizers import Tokenizer

from deepinfer_core.outputs import FINISH_LENGTH, FINISH_STOP
from deepinfer_core.sampling.params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded along with the first generated tokens so that decoders that depend on
# context (leading spaces, byte fallback) give the same text as decoding the whole sequence.
PROMPT_CONTEXT_TOKENS = 5


def decode_token(tokenizer: Tokenizer, token_id: int) -> str:
    """Text of a single token (for ``Logprob.decoded_token``); special tokens are kept."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


class IncrementalDetokenizer:
    """Token-by-token text of one sequence, with vLLM's prefix / read offsets.

    ``ids[prefix_offset:read_offset]`` is the already-emitted window that gives decoding context;
    ``ids[read_offset:]`` are tokens whose text is not emitted yet (an incomplete character).
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_token_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add(self, token_id: int) -> str:
        """Append a token; return the newly complete text (``""`` while a character is incomplete)."""
        self._ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """Return whatever is pending, even an incomplete character (as U+FFFD). Call at the end."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]


# ---------------------------------------------------------------------------------------------
# stop strings


def find_stop_string(text: str, stop: Sequence[str], new_from: int) -> tuple[int, int, str] | None:
    """The stop-string match ending earliest among those ending after ``new_from``.

    Only matches that end inside ``text[new_from:]`` are considered (earlier text was already
    searched). Returns ``(start, end, stop_string)`` or None; ties on the end go to the longer string,
    then to the earlier one in ``stop``.
    """
    best: tuple[int, int, str] | None = None
    for s in stop:
        start = text.find(s, max(0, new_from - len(s) + 1))
        if start == -1:
            continue
        end = start + len(s)
        if best is None or (end, start) < (best[1], best[0]):
            best = (start, end, s)
    return best


def stop_prefix_holdback(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for s in stop:
        for length in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:length]):
                longest = length
                break
    return longest


# ---------------------------------------------------------------------------------------------
# finish check


def check_stop_token(
    token_ids: Sequence[int],
    params: SamplingParams,
    eos_token_id: int | None,
    num_prompt_tokens: int = 0,
    max_model_len: int | None = None,
) -> tuple[str, int | None] | None:
    """Token-level finish check after the last token of ``token_ids`` (the generated ids so far).

    Returns ``(finish_reason, stop_reason)`` or None if the sequence goes on: EOS -> ("stop", None),
    a stop token id -> ("stop", id), max_tokens / max_model_len -> ("length", None). EOS and stop
    ids do not count at token indices <= ``min_tokens``.
    """
    num_output = len(token_ids)
    if num_output == 0:
        return None
    last = int(token_ids[-1])
    if num_output > params.min_tokens:
        if eos_token_id is not None and last == eos_token_id and not params.ignore_eos:
            return FINISH_STOP, None
        if last in params.stop_token_ids:
            return FINISH_STOP, last
    if reaches_length_limit(params, num_prompt_tokens, num_output, max_model_len):
        return FINISH_LENGTH, None
    return None


def reaches_length_limit(params: SamplingParams, num_prompt_tokens: int, num_output: int,
                         max_model_len: int | None) -> bool:
    """Whether ``num_output`` generated tokens end the sequence by length (``max_tokens`` or ``max_model_len``)."""
    return ((params.max_tokens is not None and num_output >= params.max_tokens)
            or (max_model_len is not None and num_prompt_tokens + num_output >= max_model_len))


@dataclasses.dataclass
class SequenceUpdate:
    """The result of adding one token to a ``SequenceDetokenizer``.

    Attributes:
        delta_text: new text that is safe to stream (never part of a stop string while running).
        finish_reason: ``"stop"`` / ``"length"`` if this token ended the sequence, else None.
        stop_reason: the stop string or stop token id that ended it, else None.
    """

    delta_text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        """Whether this token ended the sequence."""
        return self.finish_reason is not None


class SequenceDetokenizer:
    """Detokenization and stopping for one completion of a request.

    ``append(token_id)`` after each sampled token. ``token_ids`` holds every generated id;
    ``text`` the text so far (already cut at a stop string); ``output_text`` the part of it that is
    safe to show (all of it once finished).
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        params: SamplingParams,
        prompt_token_ids: Sequence[int] = (),
        eos_token_id: int | None = None,
        max_model_len: int | None = None,
    ) -> None:
        if params.detokenize and tokenizer is None:
            raise ValueError("detokenize=True needs a tokenizer, got None")
        self.params = params
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._emitted = 0
        self._deferred: list[int] = []  # tokens whose text append(defer_text=True) left for catch_up
        self._detok = (
            IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
            if params.detokenize
            else None
        )

    @property
    def finished(self) -> bool:
        """Whether the sequence has finished."""
        return self.finish_reason is not None

    @property
    def output_text(self) -> str:
        """Text safe to show now: all of ``text`` once finished, else without the held-back suffix."""
        return self.text if self.finished else self.text[: self._emitted]

    @property
    def has_deferred_text(self) -> bool:
        """Whether tokens wait for ``catch_up`` to add their text."""
        return bool(self._deferred)

    def append(self, token_id: int, defer_text: bool = False) -> SequenceUpdate:
        """Add one generated token; return the streamable new text and whether the sequence ended.

        ``defer_text``: when no stop string can end the sequence, only the token-level rules run now (they alone
        decide whether it ends) and the token's text waits for ``catch_up``; a token that ends the sequence
        catches up at once, so a finished sequence always has its whole text. The engine decodes the deferred
        text while the device computes the next step."""
        if self.finished:
            raise RuntimeError(f"sequence already finished ({self.finish_reason}); cannot append token {token_id}")
        self.token_ids.append(int(token_id))
        reason = check_stop_token(
            self.token_ids, self.params, self.eos_token_id, self.num_prompt_tokens, self.max_model_len
        )
        if self._detok is not None:
            if defer_text and reason is None and not self.params.stop:
                self._deferred.append(int(token_id))
                return SequenceUpdate("")
            self._add_deferred_text()
            reason = self._add_text(int(token_id), reason)
        if reason is not None:
            self.finish_reason, self.stop_reason = reason
        return SequenceUpdate(self._take_delta(), self.finish_reason, self.stop_reason)

    def catch_up(self) -> str:
        """Add the text of the tokens ``append(defer_text=True)`` deferred; returns the new streamable text."""
        self._add_deferred_text()
        return self._take_delta()

    def _add_deferred_text(self) -> None:
        deferred, self._deferred = self._deferred, []
        for token_id in deferred:  # never the last token, and no stop strings: text only, no finish
            self._add_text(token_id, None)

    def _add_text(self, token_id: int, reason: tuple[str, int | None] | None) -> tuple[str, int | str | None] | None:
        """Decode the token (unless it is an excluded stop token), then look for stop strings."""
        stopped_by_token = reason is not None and reason[0] == FINISH_STOP
        new = "" if stopped_by_token and not self.params.include_stop_str_in_output else self._detok.add(token_id)
        if reason is not None:
            new += self._detok.flush()
        searched = len(self.text)
        self.text += new
        if not new or not self.params.stop or len(self.token_ids) <= self.params.min_tokens:
            return reason
        match = find_stop_string(self.text, self.params.stop, searched)
        if match is None:
            return reason
        start, end, stop_str = match
        self.text = self.text[: end if self.params.include_stop_str_in_output else start]
        return FINISH_STOP, stop_str

    def _take_delta(self) -> str:
        """Text between what was already streamed and what may be streamed now."""
        if self.finished or self.params.include_stop_str_in_output:
            visible = len(self.text)
        else:
            visible = len(self.text) - stop_prefix_holdback(self.text, self.params.stop)
        delta = self.text[self._emitted : visible] if visible > self._emitted else ""
        self._emitted = max(self._emitted, visible)
        return delta

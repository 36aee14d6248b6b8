"""Incremental detokenization and stop strings of one completion.

``IncrementalDetokenizer`` turns token ids into text one token at a time with vLLM's prefix / read
offsets: text is emitted only once the pending tokens decode without a trailing U+FFFD (a byte-level
BPE token can end in the middle of a UTF-8 character).

``SequenceDetokenizer`` drives one completion's text: for each new token (and the token-level stop decision
``engine/stop.py`` made for it) it appends the decoded text, looks for stop strings across token boundaries and
returns the text that is safe to stream.

Text rules (as vLLM):

* A token that stops the request by id (EOS or a stop token id) leaves its text out of the output unless
  ``include_stop_str_in_output``; its id stays in ``token_ids``.
* A stop string gives ``finish_reason="stop"``, ``stop_reason=`` the string; the text is cut before
  it (after it with ``include_stop_str_in_output``). If several stop strings complete in the same
  step, the one whose match *ends* first wins (ties: the longer one, then list order), which is the
  result character-by-character generation would give, whatever the tokenization. Stop strings do not
  count inside the first ``min_tokens`` tokens.
* A stop string completed by the token that also reaches the length limit wins over the length.
* While running, the longest suffix of the text that is a proper prefix of a stop string is held
  back, so streamed text never contains part of a stop string.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tokenizers import Tokenizer

from deepinfer_core.engine.stop import StopDecision
from deepinfer_core.outputs import FINISH_STOP
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
    """Text and stop strings of one completion.

    ``append(token_id, token_stop)`` after each generated token, with ``engine/stop.py``'s decision for it;
    ``text`` is the text so far (already cut at a stop string), ``output_text`` the part of it that is safe to
    show (all of it once finished).
    """

    def __init__(self, tokenizer: Tokenizer | None, params: SamplingParams, prompt_token_ids: Sequence[int] = ()):
        if params.detokenize and tokenizer is None:
            raise ValueError("detokenize=True needs a tokenizer, got None")
        self.params = params
        self.num_tokens = 0
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

    def append(self, token_id: int, token_stop: StopDecision | None = None, defer_text: bool = False
               ) -> SequenceUpdate:
        """Add one generated token (``token_stop``: whether its id or the length limit ends the sequence); return
        the streamable new text and whether the sequence ended, by the token or by a stop string.

        ``defer_text``: when no stop string can end the sequence and the token does not, the token's text waits
        for ``catch_up`` (the engine decodes it while the device computes the next step); a finished sequence
        always has its whole text."""
        if self.finished:
            raise RuntimeError(f"sequence already finished ({self.finish_reason}); cannot append token {token_id}")
        self.num_tokens += 1
        reason = token_stop
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

    def _add_text(self, token_id: int, reason: StopDecision | None) -> StopDecision | None:
        """Decode the token (unless it is an excluded stop token), then look for stop strings."""
        stopped_by_token = reason is not None and reason[0] == FINISH_STOP
        new = "" if stopped_by_token and not self.params.include_stop_str_in_output else self._detok.add(token_id)
        if reason is not None:
            new += self._detok.flush()
        searched = len(self.text)
        self.text += new
        if not new or not self.params.stop or self.num_tokens <= self.params.min_tokens:
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

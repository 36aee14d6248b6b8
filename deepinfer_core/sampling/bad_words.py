"""``SamplingParams.bad_words`` (vLLM's semantics): tokenizing the words, and the ids a row may not sample next.

A word is banned as a whole: its last token is masked whenever the row's latest output tokens equal the word's other
tokens, so a single-token word is always masked and a longer word can start but never finish. Each word is tokenized
as written (leading spaces stripped) and with one leading space, the second kept only where it gives a different
first token and the same number of tokens (vLLM's rule: a word in the middle of a sentence is usually another token).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def tokenize_bad_words(words: Sequence[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """The token-id sequences to ban for ``words``; ``encode(text)`` tokenizes without special tokens."""
    sequences: list[list[int]] = []
    for word in words:
        plain = encode(word.lstrip())
        if plain:
            sequences.append(plain)
        spaced = encode(" " + word.lstrip())
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences


def banned_next_ids(word_ids: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> list[int]:
    """The ids the row may not sample next: the last token of each word whose other tokens end the output."""
    banned = []
    for word in word_ids:
        prefix = list(word[:-1])
        if len(prefix) > len(output_token_ids):
            continue
        if not prefix or list(output_token_ids[len(output_token_ids) - len(prefix):]) == prefix:
            banned.append(word[-1])
    return banned

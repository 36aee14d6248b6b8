"""A synthetic byte-level BPE tokenizer of a checkpoint's vocabulary size, for structured-output benchmarks.

The presets' word-level tokenizer (``w3 .. w{V-1}``) cannot spell JSON, so a grammar could allow no token. This one
is GPT-2's byte-level scheme: the 256 bytes as tokens, then seeded random merges, each a token so far followed by a
printable ASCII byte (at most ``MAX_TOKEN_BYTES`` bytes), until the vocabulary is full. A grammar library's mask
work grows with the number of tokens and how their bytes branch; this gives it the checkpoint's count of tokens
(129,280 for DeepSeek-V4) with natural-looking byte strings, though not a trained tokenizer's frequencies.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")
MAX_TOKEN_BYTES = 12
MARKER_FILE = ".byte_bpe_complete"


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to the printable character byte-level BPE writes it as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def write_byte_bpe_tokenizer(folder: str | os.PathLike, vocab_size: int, seed: int = 0) -> None:
    """Write ``tokenizer.json`` / ``tokenizer_config.json`` of exactly ``vocab_size`` ids into ``folder``: the special
    tokens (ids 0-2), the 256 bytes, then random merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if vocab_size < len(SPECIALS) + 256:
        raise ValueError(f"a byte-level tokenizer needs at least {len(SPECIALS) + 256} ids, got {vocab_size}")
    chars = byte_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    tokens = [chars[b] for b in range(256)]
    vocab.update({tok: len(SPECIALS) + i for i, tok in enumerate(tokens)})
    printable = [chars[b] for b in range(32, 127)]
    rng, merges = random.Random(seed), []
    while len(vocab) < vocab_size:
        left, right = rng.choice(tokens), rng.choice(printable)
        new = left + right
        if new in vocab or len(new) > MAX_TOKEN_BYTES:
            continue
        vocab[new] = len(vocab)
        tokens.append(new)
        merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    folder = Path(folder)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": SPECIALS[0], "eos_token": SPECIALS[1], "pad_token": SPECIALS[2], "add_bos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def with_byte_bpe_tokenizer(folder: str | os.PathLike, vocab_size: int) -> Path:
    """A sibling of checkpoint ``folder`` (``<name>-bpe``, written once) with the same files, hard-linked, and a
    byte-level BPE tokenizer of ``vocab_size`` ids in place of its own."""
    folder = Path(folder)
    target = folder.with_name(f"{folder.name}-bpe")
    if (target / MARKER_FILE).is_file():
        return target
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for path in folder.iterdir():
        if path.name in ("tokenizer.json", "tokenizer_config.json") or not path.is_file():
            continue
        try:
            os.link(path, tmp / path.name)
        except OSError:
            shutil.copy2(path, tmp / path.name)
    write_byte_bpe_tokenizer(tmp, vocab_size)
    (tmp / MARKER_FILE).write_text(json.dumps({"source": str(folder), "vocab_size": vocab_size}))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


__all__ = ["byte_to_unicode", "with_byte_bpe_tokenizer", "write_byte_bpe_tokenizer"]

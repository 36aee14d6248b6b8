"""The benchmarks' synthetic byte-level BPE tokenizer (``bench/byte_tokenizer.py``): exact vocabulary size, any text
round-trips, JSON's characters are single tokens, and a checkpoint's sibling folder shares its files."""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer

from deepinfer_core.bench.byte_tokenizer import (
    SPECIALS,
    byte_to_unicode,
    with_byte_bpe_tokenizer,
    write_byte_bpe_tokenizer,
)


def test_the_byte_map_covers_every_byte_once():
    chars = byte_to_unicode()
    assert sorted(chars) == list(range(256)) and len(set(chars.values())) == 256
    assert chars[ord("{")] == "{" and chars[ord(" ")] != " "  # printable bytes stand for themselves, space does not


def test_exact_vocabulary_and_round_trips(tmp_path):
    write_byte_bpe_tokenizer(tmp_path, 3000, seed=1)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 3000
    assert [tok.token_to_id(s) for s in SPECIALS] == [0, 1, 2]
    text = '{"id": 12, "name": "héllo wörld", "ok": true}\n\t[1.5e-3]'
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text and max(ids) < 3000
    assert all(tok.token_to_id(c) is not None for c in '{}[]":,')
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"] == SPECIALS[1]
    again = tmp_path / "again"
    again.mkdir()
    write_byte_bpe_tokenizer(again, 3000, seed=1)
    assert (again / "tokenizer.json").read_text() == (tmp_path / "tokenizer.json").read_text()  # seeded


def test_a_checkpoint_sibling_links_the_files_and_swaps_the_tokenizer(tmp_path):
    source = tmp_path / "ckpt"
    source.mkdir()
    (source / "config.json").write_text("{}")
    (source / "model.safetensors").write_bytes(b"weights")
    (source / "tokenizer.json").write_text("word-level")
    target = with_byte_bpe_tokenizer(source, 1000)
    assert target.name == "ckpt-bpe" and (target / "model.safetensors").read_bytes() == b"weights"
    assert os.path.samefile(target / "model.safetensors", source / "model.safetensors")
    assert Tokenizer.from_file(str(target / "tokenizer.json")).get_vocab_size() == 1000
    assert (source / "tokenizer.json").read_text() == "word-level"
    assert with_byte_bpe_tokenizer(source, 1000) == target  # written once

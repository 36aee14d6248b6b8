"""Packed token masks (``sampling/token_bitmask.py``) against a bit-by-bit reference in Python integers."""

import pytest
import torch

from deepinfer_core.sampling.token_bitmask import apply_token_bitmask, bitmask_words


def _reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    words = bitmask.tolist()
    for r in range(out.shape[0]):
        for t in range(out.shape[1]):
            if t >= 32 * len(words[r]) or not (words[r][t // 32] >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab, words", [(100, bitmask_words(100)), (96, 3), (80, 2)])
def test_apply_matches_the_bits(vocab, words):
    gen = torch.Generator().manual_seed(vocab)
    bitmask = torch.randint(-(2 ** 31), 2 ** 31, (5, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[0] = 0
    bitmask[1] = -1  # every bit, the sign bit too
    bitmask[2] = -(2 ** 31)  # the sign bit alone: token 32 * w + 31
    logits = torch.randn(5, vocab, generator=gen)
    expected = _reference(logits, bitmask)
    got = apply_token_bitmask(logits.clone(), bitmask)
    assert torch.equal(got, expected)  # 80 tokens from 2 words: tokens 64..79 disallowed (past the mask)
    assert torch.equal(apply_token_bitmask(logits.clone(), bitmask.T.contiguous().T), expected)  # not contiguous


def test_bad_bitmask_names_the_expected_shape():
    with pytest.raises(ValueError, match=r"int32 \[2, words\]"):
        apply_token_bitmask(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64))

"""Token masks packed 32 tokens to an int32 word (llguidance's and xgrammar's layout), applied to logits.

Bit ``j`` of word ``w`` of a row allows token ``32 * w + j``; a row is ``ceil(vocab / 32)`` words. A grammar library
fills such rows on the host (4 bytes per 32 tokens: 16 KB per row for a 129k vocabulary), the sampler moves them to
the logits' device and masks there with plain torch ops, no kernel of its own.
"""

from __future__ import annotations

import torch

from deepinfer_core.device_copy import to_device


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a packed mask over ``vocab_size`` tokens."""
    return -(-vocab_size // 32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set to ``-inf`` every logit whose bit is 0; in place, returns ``logits``.

    Args:
        logits: float ``[num_rows, vocab]`` on any device.
        bitmask: int32 ``[num_rows, words]`` (host or device); logits columns past ``32 * words`` are disallowed.
    """
    rows, vocab = logits.shape
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] != rows:
        raise ValueError(f"the token bitmask must be int32 [{rows}, words], got {bitmask.dtype} "
                         f"{tuple(bitmask.shape)}")
    words = to_device(bitmask, logits.device)  # [num_rows, words]; non-blocking from pinned memory
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)  # [num_rows, 32 * words]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))  # past the mask: disallowed
    return logits.masked_fill_(allowed[:, :vocab] == 0, float("-inf"))


__all__ = ["apply_token_bitmask", "bitmask_words"]

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
    words = to_device(bitmask.contiguous(), logits.device)  # [num_rows, words]; non-blocking from pinned memory
    # Byte b of word w holds the bits of tokens 32 * w + 8 * b + 0..7 (int32 is little-endian wherever torch runs):
    # one lookup per byte unpacks it, without a [num_rows, 32 * words] int32 intermediate.
    codes = words.view(torch.uint8).flatten().int()  # [num_rows * 4 * words]
    disallowed = _disallowed_bits(logits.device).index_select(0, codes).view(rows, -1)  # [num_rows, 32 * words]
    if disallowed.shape[1] < vocab:  # past the mask: disallowed
        disallowed = torch.nn.functional.pad(disallowed, (0, vocab - disallowed.shape[1]), value=True)
    return logits.masked_fill_(disallowed[:, :vocab], float("-inf"))


_DISALLOWED_BITS: dict[torch.device, torch.Tensor] = {}


def _disallowed_bits(device: torch.device) -> torch.Tensor:
    """bool ``[256, 8]`` on ``device``: whether bit ``j`` of byte value ``v`` is 0 (built once per device)."""
    table = _DISALLOWED_BITS.get(device)
    if table is None:
        values = torch.arange(256, dtype=torch.int32).unsqueeze(1)  # [256, 1]
        table = to_device(((values >> torch.arange(8, dtype=torch.int32)) & 1) == 0, device)  # [256, 8]
        _DISALLOWED_BITS[device] = table
    return table


__all__ = ["apply_token_bitmask", "bitmask_words"]

"""The key blocks each query row of ``sink_attention`` can see: the attention kernel reads and multiplies only these.

A prefill row sees its sliding window (two or three blocks of 64 keys) and its selected compressed entries, yet the
keys of a sequence are every token of the chunk: one 8K-token prompt has 160 key blocks per row, ~35 of them
visible. ``Blocks [B, NB]`` lists each row's visible blocks in ascending order (entries past ``Counts[b]`` are
unspecified) and ``Counts [B]`` how many there are. One Triton program per row; ``visible_blocks_torch`` is the
plain-torch statement of the same result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia_sm100.kernels import pdl

CHUNK_BLOCKS = 64  # key blocks per loop iteration of the kernel


@triton.jit
def _visible_blocks_kernel(vis_ptr, blocks_ptr, counts_ptr, Lk, NB, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
                           PDL: tl.constexpr = False):
    pdl.begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    found = 0
    for start in range(0, NB, CHUNK):
        block = start + tl.arange(0, CHUNK)  # [C]
        key = block[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # [C, BN]
        seen = tl.load(vis_ptr + row * Lk + key, mask=(key < Lk) & (block[:, None] < NB), other=0)
        hit = (tl.max(seen, axis=1) > 0).to(tl.int32)  # [C]
        place = found + tl.cumsum(hit, axis=0) - 1
        tl.store(blocks_ptr + row * NB + place, block, mask=hit > 0)
        found += tl.sum(hit, axis=0)
    tl.store(counts_ptr + row, found)


def visible_blocks(vis: torch.Tensor, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``vis [B, Lk]`` uint8 -> ``Blocks [B, ceil(Lk / block_n)]`` int32, ``Counts [B]`` int32 (module docstring)."""
    rows, lk = vis.shape
    nb = triton.cdiv(lk, block_n)
    blocks = torch.empty(rows, nb, dtype=torch.int32, device=vis.device)
    counts = torch.empty(rows, dtype=torch.int32, device=vis.device)
    if rows:
        _visible_blocks_kernel[(rows,)](vis, blocks, counts, lk, nb, BLOCK_N=block_n, CHUNK=CHUNK_BLOCKS, num_warps=4,
                                        **pdl.launch())
    return blocks, counts


def visible_blocks_torch(vis: torch.Tensor, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``visible_blocks`` in plain torch (past ``Counts[b]``: zeros)."""
    rows, lk = vis.shape
    nb = -(-lk // block_n)
    padded = torch.zeros(rows, nb * block_n, dtype=torch.bool, device=vis.device)
    padded[:, :lk] = vis != 0
    hit = padded.view(rows, nb, block_n).any(dim=-1)  # [B, NB]
    order = torch.sort((~hit).to(torch.int8), dim=1, stable=True).indices  # visible blocks first, ascending
    counts = hit.sum(dim=1).to(torch.int32)
    blocks = torch.where(torch.arange(nb, device=vis.device)[None, :] < counts[:, None], order, 0)
    return blocks.to(torch.int32), counts

"""What one model step computes: a flat batch of tokens from several sequences, no padding."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class ForwardBatch:
    """Flattened tokens of ``S`` sequences plus where each sequence's state lives.

    Sequence ``s`` contributes tokens ``input_ids[query_start[s]:query_start[s + 1]]`` at absolute
    positions ``context_lens[s] .. context_lens[s] + query_len - 1``; ``context_lens[s]`` tokens of it
    are already folded into its state. Its per-sequence state (sliding ring, compressor carry) is in
    slot ``slots[s]``; its paged state (compressed entries, indexer keys) in the blocks listed in
    ``block_tables[s]`` (block ``i`` covers tokens ``[i * block_size, (i + 1) * block_size)``).

    ``logits_rows`` picks the token rows whose logits the step returns (e.g. each sequence's last
    token, or every prompt token for prompt logprobs). ``compressed_write_start[s]`` (optional):
    compressed entries of windows that start before this position are read but not overwritten
    (used when a cached prefix is replayed to rebuild the sliding-window state).
    ``sliding_floor[s]`` (optional): sliding-window keys below this position are not read (the
    replay's first token; the ring holds nothing valid below it).
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    query_start: list[int]  # S + 1 offsets into the token axis
    context_lens: list[int]  # S
    slots: list[int]  # S
    block_tables: list[list[int]]  # S lists of block ids
    logits_rows: torch.Tensor  # [N] int64 rows of the token axis
    compressed_write_start: list[int] | None = None
    sliding_floor: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def query_lens(self) -> list[int]:
        return [self.query_start[s + 1] - self.query_start[s] for s in range(self.num_seqs)]

    @classmethod
    def build(
        cls,
        token_lists: list[list[int]],
        context_lens: list[int],
        slots: list[int],
        block_tables: list[list[int]],
        logits: str = "last",
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Convenience constructor; ``logits`` is ``"last"`` (one row per sequence) or ``"all"``."""
        query_start = [0]
        positions: list[int] = []
        for tokens, ctx in zip(token_lists, context_lens):
            query_start.append(query_start[-1] + len(tokens))
            positions.extend(range(ctx, ctx + len(tokens)))
        flat = [t for tokens in token_lists for t in tokens]
        rows = list(range(len(flat))) if logits == "all" else [end - 1 for end in query_start[1:]]
        return cls(
            input_ids=torch.tensor(flat, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            query_start=query_start,
            context_lens=list(context_lens),
            slots=list(slots),
            block_tables=[list(b) for b in block_tables],
            logits_rows=torch.tensor(rows, dtype=torch.long, device=device),
        )

"""The runner's side of draft verification: which rows a verifying step has, the model state its draft tokens
overwrite (saved before the forward, put back for rejected tokens after verification), the hidden states a proposer
reads, and the rows each request keeps once its draft is verified."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from deepinfer_core.device_copy import to_device


def first_rows(chunks: list, offset: int = 0) -> dict[int, int]:
    """``id(chunk)`` -> its first row among the stacked sampling rows (a chunk has one row, plus one per draft
    token it verifies), the first chunk's at ``offset``."""
    rows = {}
    for chunk in chunks:
        rows[id(chunk)] = offset
        offset += len(chunk.draft_token_ids) + 1
    return rows


def emitted_rows(output: Any, group_rows: list[int], num_emitted: list[int]) -> Any:
    """``output`` (a ``ModelRunnerOutput``) with only the rows each request keeps: of group ``g``'s
    ``group_rows[g]`` consecutive rows, the first ``num_emitted[g]`` (its accepted draft tokens and the target's
    next token)."""
    keep, start = [], 0
    for size, emitted in zip(group_rows, num_emitted, strict=True):
        keep.extend(range(start, start + emitted))
        start += size
    picked = {f.name: [getattr(output, f.name)[i] for i in keep] for f in dataclasses.fields(output)
              if f.name != "prompt_logprobs"}
    return dataclasses.replace(output, **picked)


@dataclasses.dataclass
class HiddenStates:
    """The target's hidden states of a step's eager tokens (``ModelOutput.final_hidden``, ``[T, ...]`` on the device)
    and where each request's rows start (request id -> (first row, its position))."""

    tensor: torch.Tensor
    starts: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, final_hidden: torch.Tensor | None, chunks: list, query_start: list[int]) -> HiddenStates | None:
        if final_hidden is None:
            return None
        starts = {c.request.request_id: (row, c.start) for c, row in zip(chunks, query_start)}
        return cls(final_hidden, starts)

    @classmethod
    def joined(cls, first: HiddenStates | None, second: HiddenStates | None) -> HiddenStates | None:
        """Both parts' rows (a static verification step's, then the eager forward's) as one."""
        if first is None or second is None:
            return first or second
        offset = first.tensor.shape[0]
        starts = {**first.starts, **{r: (row + offset, pos) for r, (row, pos) in second.starts.items()}}
        return cls(torch.cat([first.tensor, second.tensor]), starts)

    def rows(self, request_id: str, first_position: int, end_position: int) -> torch.Tensor | None:
        """Rows of positions ``[first_position, end_position)`` of a request (None: not computed eagerly here)."""
        if request_id not in self.starts:
            return None
        row, position = self.starts[request_id]
        return self.tensor[row + first_position - position:row + end_position - position]


@dataclasses.dataclass
class DraftRollback:
    """The model's save (``SpeculativeModel.save_draft_state``) of the state a step's draft positions overwrite, for
    the chunks that verify a draft (``chunk_ids`` in step order), to undo the rejected ones after verification."""

    saved: Any
    chunk_ids: list[int]

    @classmethod
    def save(cls, model, state, chunks: list) -> DraftRollback | None:
        drafted = [c for c in chunks if c.draft_token_ids]
        if not drafted:
            return None
        positions = [list(range(c.end - len(c.draft_token_ids), c.end)) for c in drafted]
        saved = model.save_draft_state(state, [c.request.slot for c in drafted], positions)
        return cls(saved, [id(c) for c in drafted])

    def rollback(self, model, state, sampling_chunks: list, num_emitted: torch.Tensor) -> None:
        """Put back the state of every draft position past the tokens each chunk kept (``num_emitted [chunks]`` on the
        device: accepted draft tokens + 1), without a host sync."""
        index = {id(c): i for i, c in enumerate(sampling_chunks)}
        chunks = [sampling_chunks[index[chunk_id]] for chunk_id in self.chunk_ids]
        host = torch.tensor([[index[id(c)] for c in chunks], [c.end - len(c.draft_token_ids) - 1 for c in chunks]],
                            dtype=torch.long)  # [2, drafted]: the chunk's row among num_emitted, its first draft - 1
        rows, base = to_device(host, num_emitted.device).unbind(0)
        model.rollback_draft_state(state, self.saved, base + num_emitted[rows])  # [drafted] first rejected position

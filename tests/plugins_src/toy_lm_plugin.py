"""A second architecture, registered by a plugin: a toy causal LM whose state is a running sum of embeddings.

It satisfies ``deepinfer_core.models.interface.CausalLM`` and ``SpeculativeModel`` (no static steps), so the engine
runs it eagerly and can verify draft tokens with it: each forward keeps every position's running sum of the step, so
a rollback sets a slot's state back to the sum at its last accepted position.
The hidden state of position ``p`` is the mean of the embeddings of tokens ``0..p``; the logits are that times
``head.weight``. Its only state is per sequence (the running sum and count in the sequence's slot), so a prefix-cache
hit must recompute from the start (``prefix_replay_span`` covers every position).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from deepinfer_core.hookspecs import HOOK_API_VERSION, hookimpl
from deepinfer_core.models.interface import ModelOutput, StateBytes

DEEPINFER_HOOK_API_VERSION = HOOK_API_VERSION


class ToyState:
    """Per-slot running sums ``[slots, hidden]`` and counts ``[slots]``."""

    def __init__(self, num_slots: int, hidden: int, block_size: int, device: torch.device):
        self.block_size = block_size
        self.sums = torch.zeros(num_slots, hidden, device=device)
        self.counts = torch.zeros(num_slots, device=device)
        self.last_step: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}  # slot -> (first position, sums, counts)


class ToyLM:
    def __init__(self, config: dict, weights: dict[str, torch.Tensor], ops, dtype, device):
        self.ops, self.dtype, self.device = ops, dtype, torch.device(device)
        self.config = config
        self.embed = weights["embed.weight"].to(self.device, torch.float32)  # [V, D]
        self.head = weights["head.weight"].to(self.device, torch.float32)  # [V, D]

    vocab_size = property(lambda self: self.config["vocab_size"])
    max_position_embeddings = property(lambda self: self.config["max_position_embeddings"])
    block_multiple = 1
    sliding_window = 0

    def state_bytes(self, block_size: int, dtype: torch.dtype) -> StateBytes:
        return StateBytes(per_block=0, per_slot=4 * (self.embed.shape[1] + 1))

    def new_state(self, num_slots: int, num_blocks: int, block_size: int) -> ToyState:
        return ToyState(num_slots, self.embed.shape[1], block_size, self.device)

    def prefix_replay_span(self) -> int:
        return self.max_position_embeddings

    def forward(self, batch, state: ToyState, layout=None, return_hidden: bool = False) -> ModelOutput:
        hidden = []
        for s, slot in enumerate(batch.slots):
            tokens = batch.input_ids[batch.query_start[s]:batch.query_start[s + 1]]  # [L]
            if batch.context_lens[s] == 0:
                state.sums[slot] = 0
                state.counts[slot] = 0
            sums = state.sums[slot] + torch.cumsum(self.embed[tokens], dim=0)  # [L, D]
            counts = state.counts[slot] + torch.arange(1, len(tokens) + 1, device=self.device)  # [L]
            state.sums[slot], state.counts[slot] = sums[-1], counts[-1]
            state.last_step[slot] = (batch.context_lens[s], sums, counts)
            hidden.append(sums / counts[:, None])
        every = torch.cat(hidden)  # [T, D]
        rows = every[batch.logits_rows]  # [N, D]
        return ModelOutput(rows @ self.head.T, final_hidden=every if return_hidden else None)

    max_draft_tokens = 8

    def save_draft_state(self, state: ToyState, slots: list[int], positions: list[list[int]]) -> list[int]:
        return list(slots)  # the forward keeps each position's sums (ToyState.last_step)

    def rollback_draft_state(self, state: ToyState, saved: list[int], keep_until: torch.Tensor) -> None:
        for slot, keep in zip(saved, keep_until.tolist()):
            first, sums, counts = state.last_step[slot]
            state.sums[slot], state.counts[slot] = sums[keep - 1 - first], counts[keep - 1 - first]


def load_toy_lm(folder, ops, dtype, device) -> ToyLM:
    config = json.loads((Path(folder) / "config.json").read_text())
    return ToyLM(config, load_file(Path(folder) / "model.safetensors"), ops, dtype, device)


@hookimpl
def deepinfer_register_models(registry) -> None:
    registry.register("toy_lm", load_toy_lm)

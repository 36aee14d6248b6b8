"""Explicit per-sequence state of a DeepSeek-V4 model, laid out so an allocator can page it.

A V4 layer's state is not one KV tensor. Four cache groups, each with its own geometry:

========== ============ ============================================ ======================
group      addressed by rows                                          layers
========== ============ ============================================ ======================
swa        slot         ring of ``sliding_window`` token KVs (pos % W) every layer
compressed block        ``block_size / ratio`` entries per block      CSA and HCA layers
index_keys block        ``block_size / ratio`` indexer keys per block CSA layers
carry      slot         raw compressor inputs of the last ``span``    CSA and HCA layers
                        tokens (pos % span; span = 2 * ratio for CSA,
                        whose windows overlap, ratio for HCA)
========== ============ ============================================ ======================

Paged groups are addressed through a sequence's block table; a block covers ``block_size`` tokens
and ``block_size`` is a multiple of every compression ratio, so block boundaries are window
boundaries and full blocks can be shared between sequences (prefix caching). Slot groups hold the
live, per-sequence part (the sliding ring and the compressor carry) that is rebuilt, not shared.
"""

from __future__ import annotations

import dataclasses

import torch

from deepinfer_core.device_copy import to_device
from deepinfer_core.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config


@dataclasses.dataclass(frozen=True)
class CacheGroup:
    """Geometry of one cache group: how many rows of what width, per block or per slot."""

    name: str
    layers: tuple[int, ...]
    paged: bool  # True: per block (shareable); False: per sequence slot
    rows: int  # rows per block (paged) or per slot
    row_width: int  # elements per row, all tensors of the group together
    tokens_per_row: int

    def bytes_per_unit(self, dtype: torch.dtype) -> int:
        """Bytes one block (paged) or one slot (per sequence) of this group takes, over all its layers."""
        return len(self.layers) * self.rows * self.row_width * torch.empty((), dtype=dtype).element_size()


def carry_span(layer_type: str, ratio: int) -> int:
    """How many trailing tokens' raw compressor inputs a layer must keep between steps."""
    return 2 * ratio if layer_type == CSA else ratio


def cache_groups(config: DeepseekV4Config, block_size: int) -> list[CacheGroup]:
    """The cache groups of ``config`` for a given block size (a multiple of every ratio)."""
    if block_size % config.block_multiple:
        raise ValueError(
            f"block_size {block_size} must be a multiple of every compression ratio (lcm {config.block_multiple})"
        )
    hd, ihd = config.head_dim, config.index_head_dim
    layers = range(config.num_hidden_layers)
    csa = tuple(i for i in layers if config.layer_types[i] == CSA)
    hca = tuple(i for i in layers if config.layer_types[i] == HCA)
    groups = [CacheGroup("swa", tuple(layers), False, config.sliding_window, hd, 1)]
    for kind, members in ((CSA, csa), (HCA, hca)):
        if not members:
            continue
        ratio = config.compress_rates[kind]
        groups.append(CacheGroup(f"{kind}:compressed", members, True, block_size // ratio, hd, ratio))
        carry_width = 2 * (2 * hd + 2 * ihd) if kind == CSA else 2 * hd
        groups.append(CacheGroup(f"{kind}:carry", members, False, carry_span(kind, ratio), carry_width, 1))
        if kind == CSA:
            groups.append(CacheGroup(f"{kind}:index_keys", members, True, block_size // ratio, ihd, ratio))
    return groups


class CompressorCarry:
    """Raw (pre-pooling) kv / gate projections of a compressor's last ``span`` tokens per slot, side by side in
    ``rows [slots, span, 2 * width]`` (kv, then gate: the order of their columns in the layer's fused projection, so
    one write keeps both); ``kv`` and ``gate`` are its halves (views ``[slots, span, width]``)."""

    def __init__(self, num_slots: int, span: int, width: int, dtype: torch.dtype, device: torch.device):
        self.span = span
        self.rows = torch.zeros(num_slots, span, 2 * width, dtype=dtype, device=device)
        self.kv, self.gate = self.rows[..., :width], self.rows[..., width:]


class DeepseekV4State:
    """The state pools of every layer; sequences address them by slot and block table."""

    def __init__(
        self,
        config: DeepseekV4Config,
        num_slots: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.config = config
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.groups = cache_groups(config, block_size)
        hd, ihd = config.head_dim, config.index_head_dim
        self.swa: dict[int, torch.Tensor] = {}
        self.compressed: dict[int, torch.Tensor] = {}
        self.index_keys: dict[int, torch.Tensor] = {}
        self.carry: dict[int, CompressorCarry] = {}
        self.index_carry: dict[int, CompressorCarry] = {}
        for layer, layer_type in enumerate(config.layer_types):
            self.swa[layer] = torch.zeros(num_slots, config.sliding_window, hd, dtype=dtype, device=device)
            if layer_type == SLIDING:
                continue
            ratio = config.compress_rates[layer_type]
            span = carry_span(layer_type, ratio)
            self.compressed[layer] = torch.zeros(num_blocks, block_size // ratio, hd, dtype=dtype, device=device)
            width = 2 * hd if layer_type == CSA else hd
            self.carry[layer] = CompressorCarry(num_slots, span, width, dtype, device)
            if layer_type == CSA:
                self.index_keys[layer] = torch.zeros(num_blocks, block_size // ratio, ihd, dtype=dtype, device=device)
                self.index_carry[layer] = CompressorCarry(num_slots, span, 2 * ihd, dtype, device)

    @staticmethod
    def bytes_per_block(config: DeepseekV4Config, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block across every paged group (what prefix caching keeps per block)."""
        return sum(g.bytes_per_unit(dtype) for g in cache_groups(config, block_size) if g.paged)

    @staticmethod
    def bytes_per_slot(config: DeepseekV4Config, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one running sequence's slot state (sliding rings and compressor carry)."""
        return sum(g.bytes_per_unit(dtype) for g in cache_groups(config, block_size) if not g.paged)

    def slot_views(self, slot: int) -> list[torch.Tensor]:
        """Views of one slot's state in a fixed order: every layer's sliding ring (``[window, head_dim]``), then every
        compressor carry (``[span, 2 * width]``). After a step that ends on a block boundary they are the whole
        per-sequence state there (what a host copy keeps to restore a prefix hit exactly); copying them back into
        another slot restores it."""
        carries = (*self.carry.values(), *self.index_carry.values())
        return [ring[slot] for ring in self.swa.values()] + [carry.rows[slot] for carry in carries]

    def block_views(self, block: int) -> list[torch.Tensor]:
        """Views of one paged block's state in a fixed order: every layer's compressed entries (``[block_size / ratio,
        head_dim]``), then every indexer's keys (``[block_size / ratio, index_head_dim]``). Entries of positions a
        sequence has not computed yet hold stale values that no query reads (an entry is read once complete)."""
        return [rows[block] for rows in self.compressed.values()] + [keys[block] for keys in self.index_keys.values()]

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy one sequence's slot state into another slot (n > 1 samples sharing a prompt)."""
        for ring in self.swa.values():
            ring[dst] = ring[src]
        for carry in (*self.carry.values(), *self.index_carry.values()):
            carry.rows[dst] = carry.rows[src]

    def slot_rings(self) -> list[tuple[torch.Tensor, int]]:
        """Every per-sequence ring as ``(tensor [slots, rows, width], rows)``: a position ``p`` lives in row
        ``p % rows`` (sliding-window rings, compressor carries)."""
        rings = [(ring, ring.shape[1]) for ring in self.swa.values()]
        return rings + [(carry.rows, carry.span) for carry in (*self.carry.values(), *self.index_carry.values())]

    def save_positions(self, slots: list[int], positions: list[list[int]]) -> SavedRows:
        """Copy the ring rows that computing ``positions[i]`` in slot ``slots[i]`` will overwrite."""
        seq = [i for i, pos in enumerate(positions) for _ in pos]
        host = torch.tensor([seq, [slots[i] for i in seq], [p for pos in positions for p in pos]], dtype=torch.long)
        return self.save_rows(*to_device(host, self.device).unbind(0))

    def save_rows(self, seq: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> SavedRows:
        """``save_positions`` from device tensors (``[M]`` each: the sequence of each position, its slot, the
        position): device ops of fixed shapes only, so a captured graph can save them."""
        saved = [(ring, positions % rows, ring[slots, positions % rows].clone()) for ring, rows in self.slot_rings()]
        return SavedRows(seq, slots, positions, saved)

    def restore_positions(self, saved: SavedRows, keep_until: torch.Tensor) -> None:
        """Put back the saved rows of positions ``>= keep_until[i]`` (``[num_seqs]``, sequence ``i`` of the save)."""
        rejected = (saved.positions >= keep_until[saved.seq])[:, None]  # [M, 1]
        for ring, index, values in saved.rows:
            ring[saved.slots, index] = torch.where(rejected, values, ring[saved.slots, index])  # [M, width]

    @property
    def device(self) -> torch.device:
        return next(iter(self.swa.values())).device


@dataclasses.dataclass
class SavedRows:
    """Ring rows saved before a step with draft tokens: per saved position its sequence, slot and position (``[M]``
    each), and per ring ``(ring, row index [M], values [M, width])``."""

    seq: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

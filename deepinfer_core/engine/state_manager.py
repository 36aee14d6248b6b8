"""Paged model state: slots for running sequences, blocks for shareable state, prefix caching.

Two pools (see ``models/deepseek_v4/state.py`` for what is in them):

* **slots** - one per running sequence: the sliding-window ring and compressor carry of every layer.
  They are live state, never shared; a slot is taken on admission and given back on finish or
  preemption.
* **blocks** - ``block_size`` tokens' worth of compressed entries and indexer keys of every layer.
  A full block is identified by a hash chain over all tokens up to its end, so sequences with the
  same prefix share it (prefix caching). Blocks nobody references stay cached in LRU order and are
  evicted (oldest first) when a fresh block is needed.

Handles given to the scheduler are plain lists of block ids on the request.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from deepinfer_core.engine.request import Request


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """Hash of each full block: ``h_i = H(h_{i-1} || tokens of block i)``."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(b",".join(str(t).encode() for t in token_ids[start:start + block_size]))
        parent = digest.digest()
        hashes.append(parent)
    return hashes


class StateManager:
    """Allocator for slots and blocks, with a prefix cache over full blocks (see module docstring)."""

    def __init__(self, num_blocks: int, num_slots: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or num_slots < 1:
            raise ValueError(f"need at least one block and one slot, got {num_blocks} blocks, {num_slots} slots")
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.refcount = [0] * num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU first
        self.block_hash: dict[int, bytes] = {}
        self.cached: dict[bytes, int] = {}
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.hits = 0
        self.queries = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        """New blocks ``request`` needs to hold ``num_tokens`` computed tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(request.block_ids))

    def can_admit(self, cached_blocks: list[int], num_tokens: int) -> bool:
        """Whether a slot and the blocks for ``num_tokens`` tokens are free, given its cached prefix.

        Cached blocks nobody references sit in the free list: taking them uses up free blocks too.
        """
        new = max(0, -(-num_tokens // self.block_size) - len(cached_blocks))
        revived = sum(1 for b in cached_blocks if self.refcount[b] == 0)
        return bool(self.free_slots) and new + revived <= self.num_free_blocks

    def reuses_prefix(self, request: Request) -> bool:
        """Whether ``request`` may start from cached state: prefix caching is on and it wants no prompt logprobs
        (those need every prompt row computed)."""
        return self.enable_prefix_caching and request.params.prompt_logprobs is None

    def match_prefix(self, request: Request) -> list[int]:
        """Cached blocks covering the longest prefix of the request (leaving >= 1 token to compute)."""
        if not self.reuses_prefix(request):
            return []
        tokens = request.all_token_ids
        usable = (len(tokens) - 1) // self.block_size
        matched = []
        for digest in chain_hashes(tokens[: usable * self.block_size], self.block_size):
            block = self.cached.get(digest)
            if block is None:
                break
            matched.append(block)
        self.queries += 1
        self.hits += bool(matched)
        return matched

    # ------------------------------------------------------------------ allocation
    def admit(self, request: Request, cached_blocks: list[int]) -> None:
        """Give ``request`` a slot and take references on its cached prefix blocks."""
        request.slot = self.free_slots.pop()
        for block in cached_blocks:
            self._ref(block)
        request.block_ids = list(cached_blocks)
        request.block_hashes = [self.block_hash[b] for b in cached_blocks]

    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Grow the request's block list to hold ``num_tokens`` tokens; False (nothing taken) if short."""
        needed = self.blocks_needed(request, num_tokens)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            block, _ = self.free_blocks.popitem(last=False)
            self._uncache(block)
            self.refcount[block] = 1
            request.block_ids.append(block)
        return True

    def commit(self, request: Request, num_computed: int) -> None:
        """Register the request's full blocks among its first ``num_computed`` tokens (those a finished step
        computed) in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = num_computed // self.block_size
        if full <= len(request.block_hashes):
            return
        parent = request.block_hashes[-1] if request.block_hashes else b""
        tokens = request.token_slice(len(request.block_hashes) * self.block_size, full * self.block_size)
        for index, digest in enumerate(chain_hashes(tokens, self.block_size, parent), len(request.block_hashes)):
            request.block_hashes.append(digest)
            block = request.block_ids[index]
            if digest not in self.cached and block not in self.block_hash:
                self.cached[digest] = block
                self.block_hash[block] = digest

    def release(self, request: Request) -> None:
        """Drop the request's slot and block references; unreferenced blocks go to the LRU free list."""
        if request.slot is not None:
            self.free_slots.append(request.slot)
            request.slot = None
        for block in reversed(request.block_ids):  # tail blocks are evicted before the shared prefix
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                self.free_blocks[block] = None
        request.block_ids = []
        request.block_hashes = []

    def _ref(self, block: int) -> None:
        if self.refcount[block] == 0:
            del self.free_blocks[block]
        self.refcount[block] += 1

    def _uncache(self, block: int) -> None:
        digest = self.block_hash.pop(block, None)
        if digest is not None and self.cached.get(digest) == block:
            del self.cached[digest]

    def check_invariants(self, live: Sequence[Request]) -> None:
        """Assert allocator consistency (used by tests): refcounts equal owners, free list exact."""
        owners = [0] * self.num_blocks
        for request in live:
            for block in request.block_ids:
                owners[block] += 1
        assert owners == self.refcount, "block refcounts do not match the requests holding them"
        free = {b for b in range(self.num_blocks) if self.refcount[b] == 0}
        assert free == set(self.free_blocks), "free list does not hold exactly the unreferenced blocks"
        slots = [r.slot for r in live if r.slot is not None]
        assert len(slots) == len(set(slots)), "a slot is owned twice"
        assert not set(slots) & set(self.free_slots), "a slot is both owned and free"
        assert len(slots) + len(self.free_slots) == self.num_slots, "a slot leaked"
        for digest, block in self.cached.items():
            assert self.block_hash.get(block) == digest, "prefix cache maps to a block with another hash"

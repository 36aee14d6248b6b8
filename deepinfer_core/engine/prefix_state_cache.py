"""Per-sequence state at block boundaries and before a prompt's last token, kept so that a prefix hit continues
exactly without a rebuild.

A prefix-cache block keeps what a block of tokens leaves behind that can be shared (a V4 model: compressed entries
and indexer keys), not a sequence's live state (sliding-window rings, compressor carries), which the exact rebuild
recomputes from ``CausalLM.prefix_replay_span`` tokens before the hit. Here that state is copied instead: when a step
leaves a request's computed tokens on a block boundary (a chunk ending on one, the decode step that fills a block),
its slot (``SlotStateModel.slot_state_views``) is copied into an entry keyed by the prefix-cache hash of the block
ending there. A request admitted with a hit looks its boundaries up (longest first, down to the rebuild's start: below
it a restore computes more than the rebuild); the state found is written into its slot before its first step, which
computes from that boundary reading the restored window: the outputs equal exact reuse.

A full hit (the same prompt again) should compute only its last token. So a long prompt's miss is split one token
before its end (``first_chunk_end``: the last token then runs as a one-token row, a decode step's shape) and the state
after its first ``L - 1`` tokens is kept inside its last block: the slot and that block's shareable state
(``SlotStateModel.block_state_views``), under ``partial_key`` of the hash of the full blocks before it and the
block's tokens. A request whose first tokens match such an entry (the same prompt, a longer one starting with those
``L - 1`` tokens; also one without a block hit, inside its first block) is restored there: its slot, and the kept
block into its own new block at that place, and computes from ``L - 1``.

One implementation, two tiers:

* the **device tier** (the core, default on with prefix caching: ``EngineArgs.enable_prefix_state_cache``): entries
  in device memory within ``prefix_state_cache_bytes``, no TTL; states at block boundaries and inside a block;
  metrics ``deepinfer:prefix_state_cache_*``;
* the **host tier** (the ``deepinfer-swa-replay`` plugin's ``enable_swa_host_cache``): entries in (pinned) host
  memory with a TTL, looked up through ``deepinfer_restore_prefix_state`` when the device tier has none; states at
  block boundaries only (bound without block views; its split ends on the last block boundary).

``PrefixStateCache`` is the store (LRU within a byte cap, an optional TTL), ``PrefixStateKeeper`` the engine-side
work of one tier: noting the step's chunks to keep, copying them once the step has run (before the next step writes
the slot: ``before_step`` of the next step, or ``after_step`` when no later step was launched), looking hits up and
restoring them, and optionally splitting a prompt's first chunk so the same prompt again can be restored
(``first_chunk_end``). Entries outlive their sequences (finished and preempted ones), keyed by token hashes only: a
restore also needs the prefix cache to still hold the blocks before the entry, as any hit does. A chunk that
verifies draft tokens is not captured (speculative decoding's draft state is not part of the slot).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

import torch

from deepinfer_core.engine.request import Request
from deepinfer_core.engine.state_manager import chain_hashes
from deepinfer_core.metrics import Counter, Gauge, MetricsRegistry

#: ``EngineArgs.prefix_state_split_min_tokens``' default: a miss of a prompt this long runs its last token as a step
#: of its own (one decode-shaped row) so the same prompt again is restored before it and computes only that token;
#: shorter prompts are not split.
PREFIX_STATE_SPLIT_MIN_TOKENS = 256

COUNTERS = ("hits", "misses", "evictions", "expirations", "stores")

#: The device tier's metrics (``LLM.get_metrics()``): counter field -> (name, help).
DEVICE_METRICS = {
    "hits": ("deepinfer:prefix_state_cache_hits", "prefix hits whose sequence state was restored from device memory"),
    "misses": ("deepinfer:prefix_state_cache_misses", "prefix hits the device state cache held no state for"),
    "evictions": ("deepinfer:prefix_state_cache_evictions", "device state cache entries dropped for the size cap"),
    "expirations": ("deepinfer:prefix_state_cache_expirations", "device state cache entries dropped for a TTL"),
    "stores": ("deepinfer:prefix_state_cache_stores", "slot states copied into the device state cache"),
}
DEVICE_BYTES_METRIC = ("deepinfer:prefix_state_cache_bytes", "device memory the prefix state cache holds")


class PrefixStateStats:
    """One tier's counters (``deepinfer_core.metrics`` objects, each with a ``value``): hits, misses, evictions (size
    cap), expirations (TTL), stores, and the ``bytes`` gauge. Standalone until ``register`` moves them into an
    engine's metrics registry (``LLM.get_metrics()``), keeping the counts so far."""

    hits: Counter
    misses: Counter
    evictions: Counter
    expirations: Counter
    stores: Counter

    def __init__(self, names: Mapping[str, tuple[str, str]] = DEVICE_METRICS,
                 bytes_metric: tuple[str, str] = DEVICE_BYTES_METRIC):
        self.names = dict(names)
        self.bytes_metric = bytes_metric
        for field in COUNTERS:
            setattr(self, field, Counter(*self.names[field]))
        self.bytes = Gauge(*bytes_metric)

    def register(self, registry: MetricsRegistry) -> None:
        """Move every counter (and the bytes gauge) into ``registry``, keeping the counts so far."""
        for field in COUNTERS:
            counter = registry.counter(*self.names[field])
            counter.inc(getattr(self, field).value)
            setattr(self, field, counter)
        gauge = registry.gauge(*self.bytes_metric)
        gauge.set(self.bytes.value)
        self.bytes = gauge


@dataclasses.dataclass
class StateEntry:
    """One sequence's state after some tokens: copies of its slot (``slot_state_views`` order) and, for an entry
    inside a block (``partial``), of that block (``block_state_views`` order) after them."""

    tensors: list[torch.Tensor]
    nbytes: int
    used_at: float  # when stored or last found (a TTL counts from here)
    partial: tuple[bytes, int] | None = None  # inside a block: (hash of the full blocks before it, tokens in it)


def partial_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a state kept inside a block: the hash of the full blocks before it (``parent``; ``b""``: none)
    chained over the block's first ``tokens`` (fewer than a block; a full block's hash never equals it)."""
    digest = hashlib.blake2b(b"partial:" + parent, digest_size=16)
    digest.update(b",".join(str(t).encode() for t in tokens))
    return digest.digest()


class PrefixStateCache:
    """Slot states by block hash: least recently used first beyond ``capacity_bytes``, dropped ``ttl_s`` seconds after
    they were stored or last used (``math.inf``: never; ``clock``: ``time.monotonic``, injectable).

    ``host``: entries live in host memory (pinned when ``pin_memory``: the copies are then asynchronous, ordered on
    the device's stream); else on the device of the state they copy (a device-to-device copy on the stream)."""

    def __init__(self, capacity_bytes: int, ttl_s: float = math.inf, host: bool = False, pin_memory: bool = False,
                 clock: Callable[[], float] = time.monotonic, stats: PrefixStateStats | None = None):
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self.host = host
        self.pin_memory = pin_memory
        self.clock = clock
        self.stats = stats or PrefixStateStats()
        self.entries: OrderedDict[bytes, StateEntry] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.partial_lengths: dict[bytes, collections.Counter[int]] = {}  # parent hash -> tokens in the block of its entries

    def __len__(self) -> int:
        return len(self.entries)

    def store(self, key: bytes, views: Sequence[torch.Tensor],
              partial: tuple[bytes, int] | None = None) -> StateEntry | None:
        """Copy ``views`` (one slot's state, and a block's for an entry inside one: ``partial`` is then its parent hash
        and tokens in the block) under ``key``, replacing an entry there and evicting the least recently used ones to
        stay within the capacity; None (nothing kept) when one entry exceeds it."""
        nbytes = sum(v.numel() * v.element_size() for v in views)
        if nbytes > self.capacity_bytes:
            return None
        self._drop(key)
        self.expire()
        while self.nbytes + nbytes > self.capacity_bytes:
            self._drop(next(iter(self.entries)))
            self.stats.evictions.inc()
        entry = StateEntry([self._copy(v) for v in views], nbytes, self.clock(), partial)
        self.entries[key] = entry
        self.nbytes += nbytes
        if partial is not None:
            self.partial_lengths.setdefault(partial[0], collections.Counter())[partial[1]] += 1
        self.stats.stores.inc()
        self.stats.bytes.set(self.nbytes)
        return entry

    def find(self, keys: Sequence[bytes]) -> tuple[int, StateEntry] | None:
        """The first of ``keys`` that has a live entry, as (its index, the entry), marked used; None if none has."""
        self.expire()
        for index, key in enumerate(keys):
            entry = self.entries.get(key)
            if entry is not None:
                entry.used_at = self.clock()
                self.entries.move_to_end(key)
                return index, entry
        return None

    def expire(self) -> None:
        """Drop the entries not stored or used for ``ttl_s`` seconds (they sit first: least recently used)."""
        if self.ttl_s == math.inf:
            return
        now = self.clock()
        while self.entries:
            key, entry = next(iter(self.entries.items()))
            if now - entry.used_at < self.ttl_s:
                break
            self._drop(key)
            self.stats.expirations.inc()

    @staticmethod
    def restore(entry: StateEntry, views: Sequence[torch.Tensor]) -> None:
        """Write an entry back into a slot's ``views`` (ordered on the stream; asynchronous from pinned memory)."""
        for view, kept in zip(views, entry.tensors, strict=True):
            view.copy_(kept, non_blocking=kept.is_pinned() or kept.device == view.device)

    def _copy(self, view: torch.Tensor) -> torch.Tensor:
        if not self.host:
            return view.clone()  # [rows, width] on the state's device
        kept = torch.empty(view.shape, dtype=view.dtype, device="cpu", pin_memory=self.pin_memory)
        kept.copy_(view, non_blocking=self.pin_memory)
        return kept

    def _drop(self, key: bytes) -> None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return
        self.nbytes -= entry.nbytes
        self.stats.bytes.set(self.nbytes)
        if entry.partial is not None:
            lengths = self.partial_lengths[entry.partial[0]]
            lengths[entry.partial[1]] -= 1
            if not lengths[entry.partial[1]]:
                del lengths[entry.partial[1]]
            if not lengths:
                del self.partial_lengths[entry.partial[0]]


@dataclasses.dataclass
class Capture:
    """A slot to copy once its step has run: ``request``'s state after its first ``end`` tokens (a block boundary,
    or inside ``block`` for a partial capture); the hashes there chain from ``parent`` (the hash at ``hashed``) over
    the tokens ``[hashed, end)``."""

    request: Request
    slot: int
    end: int
    hashed: int
    parent: bytes
    block: int | None = None  # the block id holding position ``end`` when ``end`` is inside it


class PrefixStateKeeper:
    """One tier's engine-side work around a ``PrefixStateCache`` (see module docstring).

    ``bind`` gives it the engine's geometry (block size, the exact rebuild's span, the slot views and, for states
    inside a block, the block views) when the engine starts; until then it does nothing. ``split_min_tokens``: an
    admitted chunk of at least that many tokens that finishes its request is split (``first_chunk_end``): with block
    views, one token before the end (the last token then runs as a one-token row, a decode step's shape: the state
    after all tokens but the last is kept, and the same tokens again compute only the last); without, on the last
    block boundary at least ``min_chunk`` tokens (the model's shortest static prefill chunk) before the end, when the
    first part keeps ``min_chunk`` tokens too; 0 never splits."""

    def __init__(self, cache: PrefixStateCache, split_min_tokens: int = 0):
        self.cache = cache
        self.split_min_tokens = split_min_tokens
        self.block_size = 0
        self.replay_span = 0
        self.min_chunk = 1
        self.slot_views: Callable[[int], list[torch.Tensor]] | None = None
        self.block_views: Callable[[int], list[torch.Tensor]] | None = None
        self.pending_restores: dict[str, tuple[int, StateEntry]] = {}  # by request id
        self.looked_up: set[str] = set()  # counted since their admission was planned
        self.captures: list[Capture] = []  # of the step launched last

    @property
    def stats(self) -> PrefixStateStats:
        return self.cache.stats

    def bind(self, slot_views: Callable[[int], list[torch.Tensor]], block_size: int, replay_span: int,
             min_chunk: int = 1, registry: MetricsRegistry | None = None,
             block_views: Callable[[int], list[torch.Tensor]] | None = None) -> None:
        """Start working for an engine: its slots' state views, block size, exact replay span and shortest static
        chunk, and its blocks' state views (None: states are kept at block boundaries only); the counters move into
        ``registry`` when given."""
        self.slot_views = slot_views
        self.block_views = block_views
        self.block_size = block_size
        self.replay_span = replay_span
        self.min_chunk = max(1, min_chunk)
        if registry is not None:
            self.stats.register(registry)

    def lookup(self, request: Request, num_cached_tokens: int, block_hashes: Sequence[bytes]) -> int:
        """Tokens of a hit (``num_cached_tokens``, blocks ``block_hashes``; 0 and none: a request without a block hit,
        which may still match a state inside its first block) whose state this tier restores: the longest point above
        the exact rebuild's start with an entry (inside a block, or a boundary), else 0. A found entry is restored into
        the request's slot (and its own block there) before its first step (``before_step``)."""
        if self.slot_views is None:
            return 0
        lowest = num_cached_tokens - self.replay_span  # a restore at or below it computes more than the rebuild
        points = [p for p in self._points(request, block_hashes, lowest) if p[0] > lowest]
        found = self.cache.find([key for _, key in points])
        if not num_cached_tokens and found is None:  # no hit at all: nothing to count
            self.pending_restores.pop(request.request_id, None)
            return 0
        first_look = request.request_id not in self.looked_up  # an admission retried (no room yet) counts once
        self.looked_up.add(request.request_id)
        if found is None:
            self.stats.misses.inc(first_look)
            self.pending_restores.pop(request.request_id, None)
            return 0
        self.stats.hits.inc(first_look)
        restored = points[found[0]][0]
        self.pending_restores[request.request_id] = (restored, found[1])
        return restored

    def _points(self, request: Request, block_hashes: Sequence[bytes], lowest: int) -> list[tuple[int, bytes]]:
        """(tokens, key) of every point a state of ``request`` may be kept at, longest first: inside block ``k`` (by
        the lengths kept after its parent, leaving one token to compute), then block ``k``'s boundary, for ``k`` from
        the hit's last block down to the last one with a point above ``lowest`` (a long hit's lookup stays short)."""
        points = []
        last = request.num_tokens - 1
        for k in range(len(block_hashes), -1, -1):
            start = k * self.block_size
            if start + self.block_size - 1 <= lowest:  # this block's points, and every earlier block's, are below
                break
            parent = block_hashes[k - 1] if k else b""
            lengths = self.cache.partial_lengths.get(parent, ()) if self.block_views is not None else ()
            for length in sorted((n for n in lengths if start + n <= last), reverse=True):
                points.append((start + length, partial_key(parent, request.token_slice(start, start + length))))
            if k:
                points.append((start, parent))
        return points

    def first_chunk_end(self, request: Request, start: int, end: int) -> int | None:
        """Where an admitted request's first chunk ``[start, end)`` ends when this tier splits it, else None."""
        if (self.slot_views is None or not self.split_min_tokens or end != request.num_tokens
                or end - start < self.split_min_tokens):
            return None
        if self.block_views is not None:  # the last token alone: a decode-shaped row (none for prompt logprobs)
            return end - 1 if end - 1 > start and request.params.prompt_logprobs is None else None
        boundary = (end - self.min_chunk) // self.block_size * self.block_size  # the tail: >= min_chunk tokens
        return boundary if boundary - start >= self.min_chunk else None

    def before_step(self, chunks: Sequence) -> None:
        """Before a step of ``chunks`` (``ScheduledChunk``) is launched: copy the states the last step left to keep,
        write restored states into the slots (and blocks) of requests starting from one, and note this step's chunks
        that end on a boundary or, split before their request's last token, inside a block."""
        if self.slot_views is None:
            return
        self.flush()
        if self.looked_up or self.pending_restores:  # requests admitted since the last step
            for chunk in chunks:
                request = chunk.request
                self.looked_up.discard(request.request_id)
                pending = self.pending_restores.pop(request.request_id, None)
                if pending is not None and pending[0] == chunk.start:
                    self.cache.restore(pending[1], self._views(request.slot, request.block_ids, chunk.start))
        self.captures = [self._capture(chunk) for chunk in chunks if self._keeps(chunk)]

    def after_step(self, step_in_flight: bool) -> None:
        """After a step's results were read: copy its states to keep now when no later step was launched (else the
        next step's ``before_step`` does, before that step runs)."""
        if self.slot_views is not None and not step_in_flight:
            self.flush()

    def flush(self) -> None:
        """Store every noted capture under the hash of its boundary block, or of its tokens inside its block (tokens
        the host does not have: skipped)."""
        captures, self.captures = self.captures, []
        for capture in captures:
            tokens = capture.request.token_slice(capture.hashed, capture.end)
            if len(tokens) != capture.end - capture.hashed:
                continue
            hashes = chain_hashes(tokens, self.block_size, capture.parent)
            parent = hashes[-1] if hashes else capture.parent
            if capture.block is None:
                self.cache.store(parent, self.slot_views(capture.slot))
                continue
            inside = tokens[len(hashes) * self.block_size:]
            views = self.slot_views(capture.slot) + self.block_views(capture.block)
            self.cache.store(partial_key(parent, inside), views, (parent, len(inside)))

    def _keeps(self, chunk) -> bool:
        """Whether the state after ``chunk`` is kept: it ends on a block boundary, or (with block views) it is a split
        that leaves its request's last token to a step of its own; never a chunk verifying draft tokens."""
        if chunk.draft_token_ids:
            return False
        if chunk.end % self.block_size == 0:
            return True
        return self.block_views is not None and not chunk.samples and chunk.end == chunk.request.num_tokens - 1

    def _views(self, slot: int, block_ids: Sequence[int], end: int) -> list[torch.Tensor]:
        """The slot's state views, and for a point inside a block the views of the block holding it."""
        views = self.slot_views(slot)
        if end % self.block_size:
            views = views + self.block_views(block_ids[end // self.block_size])
        return views

    def _capture(self, chunk) -> Capture:
        request = chunk.request
        hashed = len(request.block_hashes) * self.block_size
        parent = request.block_hashes[-1] if request.block_hashes else b""
        block = request.block_ids[chunk.end // self.block_size] if chunk.end % self.block_size else None
        return Capture(request, request.slot, chunk.end, hashed, parent, block)

"""Op ``indexer_topk`` (the lightning indexer's selection) without a sort.

``deepinfer_core.ops.reference.indexer_topk`` sorts every query row's masked scores ``[S, Lq, E]`` (fp32 values and
int64 indices, stable, descending) and scatters the first ``k``: O(E log E) per row and about 24 bytes of
temporaries per score; at 1M context (E = 262,144 entries, a 16K-token prefill chunk) that is more than the GPU.

Both forms here order entries by a key that follows the reference's tie rule exactly: the fp32 score's bits made
order-preserving as an integer (negative floats flip their magnitude bits), then the entry index (lower first among
equal scores). Scores that compare equal as floats but differ in bits are made one first: ``-0.0`` becomes ``+0.0``
and every NaN the positive quiet NaN (the sort puts NaN first, as the largest, and ties NaNs by index); invisible
entries are ``-inf`` as in the reference, and only visible entries stay selected.

Which form a call takes (``_radix_form``, chosen from ``bench_indexer_topk.py``'s timings):

* ``wide_topk`` / ``wide_topk_index`` / ``wide_topk_index_counts`` (``DEEPINFER_NVIDIA_RADIX_TOPK_WIDE``, the
  default), rows of at most ``HELD_ROW`` (32,768) entries at any row count: one Triton program per row reads the row
  once into registers (up to 32 keys a thread at 32 warps), finds its ``k``-th largest key by an MSB-first radix
  select there (4 passes of 8-bit digits, a ``tl.histogram`` each, counting only the keys that match the digits found
  so far), and writes the selection (keys above it, then the keys equal to it in index order until ``k``) from
  registers up to ``HELD_WRITE_ROW`` (16,384; longer rows read again for the write, from L2). Invisible entries are
  the ``-inf`` key, left out of each histogram and counted apart.
* ``split_topk_index_counts`` (the counted op, index mode's selection: calls of fewer than ``SPLIT_MAX_ROWS`` rows,
  i.e. decode steps, and, with ``DEEPINFER_NVIDIA_TOPK_FILTER=0``, rows over ``HELD_WRITE_ROW`` entries): each row cut
  into chunks of ``SPLIT_CHUNK`` (4,096) entries or more (``split_chunk``: at most ``SPLIT_CANDIDATES`` candidates a
  row), each chunk's top-k selected held on chip by a program of its own and written as candidates (order keys and
  entry indices), then the row's top-k among its candidates by one program holding them: a decode row takes many
  programs instead of one.
* ``filtered_topk_index_counts`` (``DEEPINFER_NVIDIA_TOPK_FILTER``, the default: the counted op's prefill calls of
  rows over ``HELD_WRITE_ROW`` entries, 1M-context rows included, in place of the split): the ``k``-th largest of a
  row's ``FILTER_TILE``-entry tiles' maxima is a floor at least ``k`` entries reach; one pass lists the entries at or
  above it (about ``k`` for independent scores) and the row's top-k is selected among them on chip.
* ``keyed_topk`` (the mask ops' rows over ``HELD_ROW`` entries; ``DEEPINFER_NVIDIA_RADIX_TOPK=0``): one
  Triton pass writes 64-bit keys (score key << 32 | ``E - 1 - index``), all distinct per row, and ``torch.topk`` on
  them picks exactly the entries the stable sort puts first; 8 bytes per score.
* ``radix_topk`` / ``radix_topk_index`` / ``radix_topk_index_counts`` (``DEEPINFER_NVIDIA_RADIX_TOPK_WIDE=0``, calls
  of at least ``DEEPINFER_NVIDIA_RADIX_TOPK_MIN_ROWS`` rows): the same select in 8 passes of 4-bit digits over
  memory and the write, 9 reads of the row, no temporaries; slower than the wide form at every shape timed.

The caller (``Indexer.select``) bounds how many scores one call sees.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer_core.ops import reference as ref
from deepinfer_nvidia_sm100 import envs
from deepinfer_nvidia_sm100.kernels.compiled import opaque_under_compile

BLOCK = 1024
QUIET_NAN_BITS = 0x7FC00000  # the positive quiet NaN torch's sort and topk treat as larger than +inf
_NAN_BITS = tl.constexpr(QUIET_NAN_BITS)
_NEG_INF_KEY = tl.constexpr(0x007FFFFF)  # -inf's order key (the high half), the least key there is


@triton.jit
def _order_keys_kernel(scores_ptr, visible_ptr, keys_ptr, numel, E, BLOCK: tl.constexpr):
    """Program (block of the flattened ``[R, E]`` scores): ``keys[r, e] = ordered(masked score) << 32 | (E - 1 -
    e)`` with ``masked = visible ? score : -inf`` (``scores`` fp32, ``visible`` as uint8, ``keys`` int64, all
    contiguous)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [B]
    inside = offs < numel
    score = tl.load(scores_ptr + offs, mask=inside, other=0.0)  # [B] fp32
    seen = tl.load(visible_ptr + offs, mask=inside, other=0)  # [B] uint8
    score = tl.where(seen != 0, score, float("-inf"))
    bits = score.to(tl.int32, bitcast=True)
    bits = tl.where(score == 0.0, 0, bits)  # -0.0 -> +0.0
    bits = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, _NAN_BITS, bits)  # every NaN -> one NaN
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed order == float order
    index = offs % E
    keys = (ordered.to(tl.int64) << 32) | (E - 1 - index)
    tl.store(keys_ptr + offs, keys, mask=inside)


def order_keys_torch(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The keys of ``_order_keys_kernel`` with torch ops (CPU tensors): ``[R, E]`` fp32 scores and bool visibility ->
    ``[R, E]`` int64."""
    E = scores.shape[-1]
    masked = scores.float().masked_fill(~visible, float("-inf"))  # [R, E]
    bits = masked.view(torch.int32)
    bits = torch.where(masked == 0.0, 0, bits)
    bits = torch.where(masked.isnan(), QUIET_NAN_BITS, bits)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # [R, E] int32
    index = torch.arange(E, device=scores.device)  # [E]
    return (ordered.long() << 32) | (E - 1 - index)


def order_keys(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Order keys ``[R, E]`` int64 of fp32 ``scores [R, E]`` under ``visible [R, E]``: the Triton kernel on CUDA (and
    under ``TRITON_INTERPRET=1``), else ``order_keys_torch``."""
    if scores.device.type != "cuda" and not _interpreted():
        return order_keys_torch(scores, visible)
    scores = scores.float().contiguous()
    seen = visible.contiguous().view(torch.uint8)
    keys = torch.empty(scores.shape, dtype=torch.int64, device=scores.device)
    numel = scores.numel()
    _order_keys_kernel[(triton.cdiv(numel, BLOCK),)](scores, seen, keys, numel, scores.shape[-1], BLOCK=BLOCK,
                                                     num_warps=4)
    return keys


@triton.jit
def _radix_keys(scores_ptr, visible_ptr, offs, inside, COUNTED: tl.constexpr = False):
    """The order keys' high half as uint32 in unsigned order (masked score, ``-0.0`` -> ``+0.0``, one NaN, above
    ``+inf``) and the visibility of entries ``offs`` (``COUNTED``: every entry ``inside`` is visible, the row's
    visible prefix; ``visible_ptr`` unread). Invisible entries' scores are not read: each score load waits on its
    visibility, so the two are not in registers at once."""
    if COUNTED:
        seen = inside
        score = tl.where(seen, tl.load(scores_ptr + offs, mask=inside, other=0.0), float("-inf"))
    else:
        seen = tl.load(visible_ptr + offs, mask=inside, other=0) != 0
        score = tl.load(scores_ptr + offs, mask=seen, other=float("-inf"))
    bits = score.to(tl.uint32, bitcast=True)
    bits = tl.where(score == 0.0, 0, bits)
    bits = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, _NAN_BITS, bits)
    return bits ^ tl.where((bits >> 31) != 0, 0xFFFFFFFF, 0x80000000), seen


@triton.jit
def _visible_count(counts_ptr, row, E):
    """How many entries row ``row`` sees: its count at ``counts_ptr``, clamped to ``0 .. E``."""
    return tl.minimum(tl.maximum(tl.load(counts_ptr + row).to(tl.int32), 0), E)


@triton.jit
def _radix_threshold(scores_ptr, visible_ptr, base, E, k, BLOCK: tl.constexpr, COUNTED: tl.constexpr = False):
    """The row's (at ``base``) ``k``-th largest key ``T`` by an MSB-first radix select, 4 bits a pass (8 passes over
    the row's first ``E`` entries, counting only keys that match the digits found so far), and ``need``: how many
    keys equal to ``T`` the selection takes."""
    bins = tl.arange(0, 16)  # [16]
    prefix = tl.full((), 0, tl.uint32)
    known = tl.full((), 0, tl.uint32)
    need = tl.full((), 0, tl.int32) + k
    for p in tl.static_range(8):
        shift = 28 - 4 * p
        counts = tl.zeros([16], dtype=tl.int32)
        for start in range(0, E, BLOCK):
            offs = start + tl.arange(0, BLOCK)  # [B]
            inside = offs < E
            keys, _ = _radix_keys(scores_ptr, visible_ptr, base + offs, inside, COUNTED)
            match = inside & ((keys & known) == prefix)
            digit = ((keys >> shift) & 15).to(tl.int32)  # [B]
            counts += tl.sum(((digit[:, None] == bins[None, :]) & match[:, None]).to(tl.int32), axis=0)  # [16]
        at_least = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts  # [16]: keys with digit >= d
        d = tl.max(tl.where(at_least >= need, bins, -1), axis=0)
        need -= tl.sum(tl.where(bins > d, counts, 0), axis=0)
        prefix = prefix | (d.to(tl.uint32) << shift)
        known = known | (tl.full((), 15, tl.uint32) << shift)
    return prefix, need


@triton.jit
def _write_index(scores_ptr, visible_ptr, base, n, k, prefix, need, out_ptr, row, BLOCK: tl.constexpr,
                 COUNTED: tl.constexpr):
    """One pass over the row's (at ``base``) first ``n`` entries: the keys above ``prefix`` and, of those equal to
    it, the first ``need`` in index order (visible entries only), written as indices ``[k]`` int32 at ``out_ptr + row
    * k``, ascending, then -1."""
    taken = tl.full((), 0, tl.int32)
    found = tl.full((), 0, tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < n
        keys, seen = _radix_keys(scores_ptr, visible_ptr, base + offs, inside, COUNTED)
        tie = inside & (keys == prefix)
        rank = taken + tl.cumsum(tie.to(tl.int32), axis=0)  # [B]: 1-based among the row's ties so far
        chosen = (inside & ((keys > prefix) | (tie & (rank <= need))) & seen).to(tl.int32)
        taken += tl.sum(tie.to(tl.int32), axis=0)
        slot = found + tl.cumsum(chosen, axis=0) - 1  # [B]: the entry's place in the row's list
        tl.store(out_ptr + row * k + slot, offs.to(tl.int32), mask=chosen > 0)
        found += tl.sum(chosen, axis=0)
    _fill_index(out_ptr, row, k, found, BLOCK)


@triton.jit
def _write_mask(scores_ptr, visible_ptr, base, E, prefix, need, out_ptr, BLOCK: tl.constexpr):
    """One pass over the row's (at ``base``) ``E`` entries: the keys above ``prefix`` and, of those equal to it, the
    first ``need`` in index order (lower entry index wins), visible entries only, written as uint8 at ``out_ptr +
    base``."""
    taken = tl.full((), 0, tl.int32)
    for start in range(0, E, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < E
        keys, seen = _radix_keys(scores_ptr, visible_ptr, base + offs, inside)
        tie = inside & (keys == prefix)
        rank = taken + tl.cumsum(tie.to(tl.int32), axis=0)  # [B]: 1-based among the row's ties so far
        chosen = inside & ((keys > prefix) | (tie & (rank <= need))) & seen
        taken += tl.sum(tie.to(tl.int32), axis=0)
        tl.store(out_ptr + base + offs, chosen.to(tl.uint8), mask=inside)


@triton.jit
def _write_mask_cut(scores_ptr, visible_ptr, E, prefix, last, out_ptr, BLOCK: tl.constexpr):
    """``_write_mask`` of a row (at ``scores_ptr``, ``visible_ptr``, ``out_ptr``) whose ties taken are known: those at
    places up to ``last``; entry by entry, no scan."""
    for start in range(0, E, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < E
        keys, seen = _radix_keys(scores_ptr, visible_ptr, offs, inside)
        chosen = inside & ((keys > prefix) | ((keys == prefix) & (offs <= last))) & seen
        tl.store(out_ptr + offs, chosen.to(tl.uint8), mask=inside)


@triton.jit
def _radix_topk_kernel(scores_ptr, visible_ptr, out_ptr, E, k, BLOCK: tl.constexpr):
    """Program (query row): the row's ``k``-th largest key ``T`` (``_radix_threshold``), then one pass that selects
    keys above ``T`` and, of those equal to ``T``, the first ``need`` in index order (``_write_mask``), and writes the
    row's selection (visible entries only) as uint8. Needs ``E > k``."""
    base = tl.program_id(0).to(tl.int64) * E
    prefix, need = _radix_threshold(scores_ptr, visible_ptr, base, E, k, BLOCK)
    _write_mask(scores_ptr, visible_ptr, base, E, prefix, need, out_ptr, BLOCK)


@triton.jit
def _radix_topk_index_kernel(scores_ptr, visible_ptr, out_ptr, E, k, BLOCK: tl.constexpr):
    """Program (query row): ``_radix_topk_kernel``'s selection written as the entries' indices ``[k]`` int32,
    ascending, then -1 (visible entries only). Needs ``E > k``."""
    row = tl.program_id(0).to(tl.int64)
    base = row * E
    prefix, need = _radix_threshold(scores_ptr, visible_ptr, base, E, k, BLOCK)
    _write_index(scores_ptr, visible_ptr, base, E, k, prefix, need, out_ptr, row, BLOCK, False)


@triton.jit
def _radix_topk_counts_kernel(scores_ptr, counts_ptr, out_ptr, E, k, BLOCK: tl.constexpr):
    """Program (query row): ``_radix_topk_index_kernel`` where the row sees its first ``counts[row]`` entries (at most
    ``E``): the radix select runs over that prefix only (every entry past it is invisible, ``-inf`` and of a higher
    index, so it ranks after each visible one), and a row of at most ``k`` visible entries lists them all unscored.
    Indices ``[k]`` int32, ascending, then -1."""
    row = tl.program_id(0).to(tl.int64)
    base = row * E
    n = _visible_count(counts_ptr, row, E)
    if n > k:
        prefix, need = _radix_threshold(scores_ptr, scores_ptr, base, n, k, BLOCK, True)
    else:  # every visible entry: keys are never 0 (-inf's is 0x007FFFFF), so all are above the threshold 0
        prefix = tl.full((), 0, tl.uint32)
        need = tl.full((), 0, tl.int32)
    _write_index(scores_ptr, scores_ptr, base, n, k, prefix, need, out_ptr, row, BLOCK, True)


@triton.jit
def _take_digit(counts, bins, shift, prefix, need):
    """One radix pass's choice from its histogram ``counts [bins]`` of the digit at ``shift`` among the keys matching
    ``prefix``: the digit holding the ``need``-th largest key, added to ``prefix``, and ``need`` less the keys of
    higher digits."""
    at_least = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts  # [bins]: keys with digit >= d
    d = tl.max(tl.where(at_least >= need, bins, -1), axis=0)
    need -= tl.sum(tl.where(bins > d, counts, 0), axis=0)
    return prefix | (d.to(tl.uint32) << shift), need


@triton.jit
def _add_lows(counts, bins, prefix, known, lows, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """``counts [bins]`` of a pass that left the ``-inf`` keys out (all in one bin: atomics on one address) with the
    ``lows`` ``-inf`` keys that count added to their bin, if ``-inf`` matches ``prefix`` on the ``known`` bits."""
    low_bin = (_NEG_INF_KEY >> SHIFT) & ((1 << BITS) - 1)
    return counts + tl.where((bins == low_bin) & ((known & _NEG_INF_KEY) == prefix), lows, 0)


@triton.jit
def _histogram_mask(keys, digit, prefix, known, SHIFT: tl.constexpr, BITS: tl.constexpr, FIRST: tl.constexpr):
    """The keys a pass's histogram counts: those matching ``prefix`` on the ``known`` bits, but the ``-inf`` keys,
    counted apart (``_add_lows``; in one bin they pile atomics on one address). ``FIRST``: every key but ``-inf``;
    later passes leave out ``-inf``'s digit where ``-inf`` matches ``prefix``: past the first digit no valid key
    shares ``-inf``'s bin (keys below ``-inf``'s are unused), and ``digit`` differs pass to pass, so no predicate is
    held over the passes."""
    if FIRST:
        counted = keys != _NEG_INF_KEY
    else:
        skip = tl.where((known & _NEG_INF_KEY) == prefix, (_NEG_INF_KEY >> SHIFT) & ((1 << BITS) - 1), -1)
        counted = ((keys & known) == prefix) & (digit != skip)
    return counted


@triton.jit
def _held_pass(keys, prefix, known, need, lows, SHIFT: tl.constexpr, BITS: tl.constexpr,
               FIRST: tl.constexpr = False):
    """One radix pass over the on-chip ``keys [ROW]``: the ``BITS``-bit digit at ``SHIFT`` of the keys matching
    ``prefix`` on the ``known`` bits, counted by ``tl.histogram`` (the ``-inf`` keys, the row's padding and
    invisible entries among them, left out and the ``lows`` that count added to their bin), and ``_take_digit``'s
    choice."""
    bins = tl.arange(0, 1 << BITS)  # [2^BITS]
    digit = ((keys >> SHIFT) & ((1 << BITS) - 1)).to(tl.int32)  # [ROW]
    counts = tl.histogram(digit, 1 << BITS, mask=_histogram_mask(keys, digit, prefix, known, SHIFT, BITS, FIRST))
    counts = _add_lows(counts, bins, prefix, known, lows, SHIFT, BITS)
    prefix, need = _take_digit(counts, bins, SHIFT, prefix, need)
    return prefix, known | (tl.full((), (1 << BITS) - 1, tl.uint32) << SHIFT), need


@triton.jit
def _radix_select_held(keys, n, k, WIDE: tl.constexpr):
    """The ``k``-th largest of the first ``n`` on-chip ``keys [ROW]`` and ``need`` (how many keys equal to it the
    selection takes), by MSB-first passes of ``WIDE``-bit digits (12: 12, 12 and 8 bits; 8: four of 8), with no
    memory read. Keys past ``n`` hold the ``-inf`` key, the least there is: no pass counts them
    (``lows``: the ``-inf`` keys among the first ``n``)."""
    prefix = tl.full((), 0, tl.uint32)
    known = tl.full((), 0, tl.uint32)
    need = tl.full((), 0, tl.int32) + k
    lows = tl.sum((keys == _NEG_INF_KEY).to(tl.int32), axis=0) - (keys.shape[0] - n)
    if WIDE == 12:
        prefix, known, need = _held_pass(keys, prefix, known, need, lows, 20, 12, True)
        prefix, known, need = _held_pass(keys, prefix, known, need, lows, 8, 12)
        prefix, known, need = _held_pass(keys, prefix, known, need, lows, 0, 8)
    else:
        tl.static_assert(WIDE == 8)
        prefix, known, need = _held_pass(keys, prefix, known, need, lows, 24, 8, True)
        for p in tl.static_range(1, 4):
            prefix, known, need = _held_pass(keys, prefix, known, need, lows, 24 - 8 * p, 8)
    return prefix, need


@triton.jit
def _fill_index(out_ptr, row, k, found, BLOCK: tl.constexpr):
    """-1 in the row's index list ``[k]`` (at ``out_ptr + row * k``) from place ``found`` on."""
    for start in range(0, k, BLOCK):
        slot = start + tl.arange(0, BLOCK)
        tl.store(out_ptr + row * k + slot, tl.full([BLOCK], -1, tl.int32), mask=(slot >= found) & (slot < k))


@triton.jit
def _held_choice(keys, inside, prefix, need):
    """The selection of the on-chip ``keys [ROW]`` (entries ``inside`` the row) by one scan, where every tie is
    visible: ``above`` (keys above ``prefix``), ``taken`` (of the keys equal to it the first ``need`` in index order)
    and ``before``, the scan's inclusive counts packed (keys above in the low 16 bits, ties in the high 16)."""
    tl.static_assert(keys.shape[0] <= 16384)  # the packed scan: up to 16,384 ties in the high half of an int32
    above = inside & (keys > prefix)
    tie = inside & (keys == prefix)
    before = tl.cumsum(above.to(tl.int32) | (tie.to(tl.int32) << 16), axis=0)  # [ROW]: inclusive counts, packed
    return above, tie & ((before >> 16) <= need), before


@triton.jit
def _held_prefix_choice(keys, inside, n, k, WIDE: tl.constexpr):
    """The selection of the on-chip ``keys [ROW]`` whose first ``n`` are ``inside`` (a visible prefix): ``chosen``,
    ``_held_choice``'s packed scan ``before`` and ``need``. The radix select where more than ``k`` are visible, else
    every visible key (keys are never 0, ``-inf``'s is 0x007FFFFF: all lie above the threshold 0)."""
    prefix = tl.full((), 0, tl.uint32)
    need = tl.full((), 0, tl.int32)
    if n > k:
        prefix, need = _radix_select_held(keys, n, k, WIDE)
    above, taken, before = _held_choice(keys, inside, prefix, need)
    return above | taken, before, need


@triton.jit
def _held_write_index(chosen, before, need, out_ptr, row, k, BLOCK: tl.constexpr, entries):
    """A held selection ``chosen [ROW]`` written as the row's indices ``[k]`` int32 (ascending, then -1): the chosen
    places' ``entries [ROW]`` (the places themselves, or the entries they stand for), each at its place in the list
    from ``_held_choice``'s packed scan ``before`` (keys above before it and ties taken up to it)."""
    tl.store(out_ptr + row * k + _held_places(before, need), entries, mask=chosen)
    _fill_index(out_ptr, row, k, tl.sum(chosen.to(tl.int32), axis=0), BLOCK)


@triton.jit
def _held_places(before, need):
    """Each chosen key's place in the selection list from ``_held_choice``'s packed scan ``before``."""
    return (before & 0xFFFF) + tl.minimum(before >> 16, need) - 1


@triton.jit
def _radix_topk_counts_held_kernel(scores_ptr, counts_ptr, out_ptr, E, k, ROW: tl.constexpr, BLOCK: tl.constexpr,
                                   WRITE_HELD: tl.constexpr, WIDE: tl.constexpr):
    """``_radix_topk_counts_kernel`` for rows of at most ``ROW`` entries held on chip: one read of the row's visible
    prefix into registers and the passes of ``WIDE``-bit digits there (``_radix_select_held``); then ``WRITE_HELD``
    (``ROW <= 16,384``) the write from registers too (``_held_choice``, ``_held_write_index``), else
    ``_write_index``'s pass over the row just read."""
    row = tl.program_id(0).to(tl.int64)
    n = _visible_count(counts_ptr, row, E)
    offs = tl.arange(0, ROW)  # [ROW]
    if WRITE_HELD:
        inside = offs < n
        keys, _ = _radix_keys(scores_ptr, scores_ptr, row * E + offs, inside, True)  # [ROW] uint32
        chosen, before, need = _held_prefix_choice(keys, inside, n, k, WIDE)
        _held_write_index(chosen, before, need, out_ptr, row, k, BLOCK, offs)
    else:
        prefix = tl.full((), 0, tl.uint32)  # n <= k: every visible entry, as in _radix_topk_counts_kernel
        need = tl.full((), 0, tl.int32)
        if n > k:
            keys, _ = _radix_keys(scores_ptr, scores_ptr, row * E + offs, offs < n, True)  # [ROW] uint32
            prefix, need = _radix_select_held(keys, n, k, WIDE)
        _write_index(scores_ptr, scores_ptr, row * E, n, k, prefix, need, out_ptr, row, BLOCK, True)


@triton.jit
def _split_chunk_kernel(scores_ptr, counts_ptr, cand_ptr, entry_ptr, E, k, CK, CHUNK: tl.constexpr,
                        WIDE: tl.constexpr):
    """Program (query row, chunk ``c``) of the split select's first stage: the row's entries ``[c CHUNK, (c + 1)
    CHUNK)`` within its visible prefix, held on chip, and their top ``k`` (all of them where at most ``k`` are
    visible), written as candidates at places ``c k + j`` of the row's ``CK = C k``: their order keys (int32 bits)
    to ``cand_ptr`` and entry indices to ``entry_ptr``, ascending. A full chunk writes ``k``, the last visible one
    ``min(n, k)``, later ones none, so the row's written candidates are a prefix of its ``CK`` places."""
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * CHUNK
    n = _visible_count(counts_ptr, row, E)
    n = tl.minimum(tl.maximum(n - start, 0), CHUNK)
    offs = tl.arange(0, CHUNK)  # [CHUNK]
    inside = offs < n
    keys, _ = _radix_keys(scores_ptr, scores_ptr, row * E + start + offs, inside, True)  # [CHUNK] uint32
    chosen, before, need = _held_prefix_choice(keys, inside, n, k, WIDE)
    place = row * CK + tl.program_id(1) * k + _held_places(before, need)  # [CHUNK]
    tl.store(cand_ptr + place, keys.to(tl.int32, bitcast=True), mask=chosen)
    tl.store(entry_ptr + place, start + offs, mask=chosen)


@triton.jit
def _split_merge_kernel(cand_ptr, entry_ptr, counts_ptr, out_ptr, E, k, CK, CHUNK: tl.constexpr, ROW: tl.constexpr,
                        BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """Program (query row) of the split select's second stage: the row's ``m`` candidates (``k`` a full visible
    chunk, ``min(n, k)`` the last; a prefix of its ``CK`` places, in entry order) held on chip, their top ``k``
    selected as ``_radix_topk_counts_held_kernel`` selects (ties: lower place, so lower entry, first), written as
    the entries' indices ``[k]`` int32, ascending, then -1."""
    row = tl.program_id(0).to(tl.int64)
    n = _visible_count(counts_ptr, row, E)
    full = n // CHUNK
    _select_listed(cand_ptr + row * CK, entry_ptr + row * CK, full * k + tl.minimum(n - full * CHUNK, k), out_ptr,
                   row, k, ROW, BLOCK, WIDE)


@triton.jit
def _select_listed(key_ptr, entry_ptr, m, out_ptr, row, k, ROW: tl.constexpr, BLOCK: tl.constexpr,
                   WIDE: tl.constexpr):
    """The top ``k`` of ``m`` listed entries (at most ``ROW``; order keys as int32 bits at ``key_ptr``, entry indices
    at ``entry_ptr``, in entry order) held on chip, ties to the lower place, written as the row's indices ``[k]``
    int32, ascending, then -1."""
    offs = tl.arange(0, ROW)  # [ROW]
    inside = offs < m
    keys = tl.load(key_ptr + offs, mask=inside, other=0).to(tl.uint32, bitcast=True)
    keys = tl.where(inside, keys, tl.full([ROW], _NEG_INF_KEY, tl.uint32))  # [ROW]: past them, the least key
    chosen, before, need = _held_prefix_choice(keys, inside, m, k, WIDE)
    entries = tl.load(entry_ptr + offs, mask=chosen, other=-1)  # [ROW]: the chosen ones' only
    _held_write_index(chosen, before, need, out_ptr, row, k, BLOCK, entries)


@triton.jit
def _tie_cut(tie, need):
    """The place of the ``need``-th of the on-chip ``tie [ROW]`` (``ROW`` of 256 to 32,768 entries) in index order,
    by a radix select of the places (two histograms: the high bits, then the low 7 of the places in the bin found),
    not a scan of the row (a 32,768-entry scan spills at 32 warps)."""
    ROW: tl.constexpr = tie.shape[0]
    later = ROW - 1 - tl.arange(0, ROW)  # [ROW]: larger for earlier places, so the select takes the largest
    bins = tl.arange(0, ROW >> 7)
    prefix = tl.full((), 0, tl.uint32)
    counts = tl.histogram(later >> 7, ROW >> 7, mask=tie)  # [ROW / 128]
    prefix, need = _take_digit(counts, bins, 7, prefix, need)
    fine = tl.arange(0, 128)
    counts = tl.histogram(later & 127, 128, mask=tie & ((later >> 7) == (prefix >> 7).to(tl.int32)))  # [128]
    prefix, need = _take_digit(counts, fine, 0, prefix, need)
    return ROW - 1 - prefix.to(tl.int32)


@triton.jit
def _radix_topk_held_kernel(scores_ptr, visible_ptr, out_ptr, E, k, ROW: tl.constexpr, BLOCK: tl.constexpr,
                            WRITE_HELD: tl.constexpr, WIDE: tl.constexpr, INDEX: tl.constexpr):
    """``_radix_topk_kernel`` (``INDEX``: ``_radix_topk_index_kernel``) for rows of at most ``ROW`` entries held on
    chip: one read of the row's scores and visibility into registers (invisible entries as the ``-inf`` key), the
    passes of ``WIDE``-bit digits there (``_radix_select_held``); then ``WRITE_HELD`` (``ROW <= 16,384``) the write
    from registers too, else a pass over the row just read. Only ties at ``-inf`` (rows of fewer than ``k`` visible
    finite scores) can be invisible: the mask reads their visibility again, the indices take the pass over memory.
    Needs ``E > k``."""
    row = tl.program_id(0).to(tl.int64)
    base = row * E
    offs = tl.arange(0, ROW)  # [ROW]
    inside = offs < E
    keys, _ = _radix_keys(scores_ptr + base, visible_ptr + base, offs, inside)  # [ROW] uint32
    prefix, need = _radix_select_held(keys, E, k, WIDE)
    if WRITE_HELD and not INDEX:
        above, taken, _ = _held_choice(keys, inside, prefix, need)
        low = tl.where(prefix == _NEG_INF_KEY, taken, False)  # ties at -inf (where rather than &: the interpreter)
        taken = taken & (tl.load(visible_ptr + base + offs, mask=low, other=1) != 0)
        tl.store(out_ptr + base + offs, (above | taken).to(tl.uint8), mask=inside)
    elif WRITE_HELD:
        if prefix == _NEG_INF_KEY:
            _write_index(scores_ptr, visible_ptr, base, E, k, prefix, need, out_ptr, row, BLOCK, False)
        else:
            above, taken, before = _held_choice(keys, inside, prefix, need)
            _held_write_index(above | taken, before, need, out_ptr, row, k, BLOCK, offs)
    elif INDEX:
        _write_index(scores_ptr, visible_ptr, base, E, k, prefix, need, out_ptr, row, BLOCK, False)
    else:
        last = _tie_cut(inside & (keys == prefix), need)
        _write_mask_cut(scores_ptr + base, visible_ptr + base, E, prefix, last, out_ptr + base, BLOCK)


@triton.jit
def _order_keys_counts_kernel(scores_ptr, counts_ptr, keys_ptr, numel, E, BLOCK: tl.constexpr):
    """``_order_keys_kernel`` where row ``r`` of the flattened ``[R, E]`` scores sees its first ``counts[r]``
    entries."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [B]
    inside = offs < numel
    score = tl.load(scores_ptr + offs, mask=inside, other=0.0)  # [B] fp32
    index = offs % E
    count = tl.load(counts_ptr + offs // E, mask=inside, other=0)  # [B]
    score = tl.where(index < count, score, float("-inf"))
    bits = score.to(tl.int32, bitcast=True)
    bits = tl.where(score == 0.0, 0, bits)  # -0.0 -> +0.0
    bits = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, _NAN_BITS, bits)  # every NaN -> one NaN
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed order == float order
    keys = (ordered.to(tl.int64) << 32) | (E - 1 - index)
    tl.store(keys_ptr + offs, keys, mask=inside)


def radix_topk_index_counts(scores: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
    """The selection's entry indices ``[R, k]`` int32 (ascending, then -1) of fp32 ``scores [R, E]`` where row ``r``
    sees its first ``counts [R]`` entries, by ``_radix_topk_counts_kernel`` (no mask read or made)."""
    scores = scores.float().contiguous()
    counts = counts.to(torch.int32).contiguous()
    R, E = scores.shape
    out = torch.empty(R, k, dtype=torch.int32, device=scores.device)
    _radix_topk_counts_kernel[(R,)](scores, counts, out, E, k, BLOCK=BLOCK, num_warps=4)
    return out


HELD_ROW = 32768  # longest rows held on chip: 32 keys a thread at 32 warps, 64 registers on sm_90a, no spills
HELD_WRITE_ROW = 16384  # longest rows written from registers too (16 keys a thread at 32 warps, 61 registers)
HELD_DIGIT = 8  # digit bits of the held select: 4 passes (12-bit digits spill at 16K-entry rows and up)


def held_warps(row: int) -> int:
    """Warps of a program holding ``row`` keys on chip: 16 keys a thread, within 4 to 32 warps (fewer keys a thread
    below 2,048, more above 16,384)."""
    return min(32, max(4, row // 512))


def held_launch(E: int) -> dict:
    """``_radix_topk_counts_held_kernel``'s (and ``_radix_topk_held_kernel``'s) meta-parameters for rows of ``E <=
    HELD_ROW`` entries: the row as a power of two of at least 1,024 entries, 8 to 32 keys a thread (4 to 32 warps); a
    write over memory in blocks of 8,192 (8 entries a thread: 4 dependent scans of a 32,768-entry row, not 32)."""
    row = max(triton.next_power_of_2(E), 1024)
    held = row <= HELD_WRITE_ROW
    return {"ROW": row, "BLOCK": 1024 if held else 8192, "WRITE_HELD": held, "WIDE": HELD_DIGIT,
            "num_warps": held_warps(row)}


def wide_topk_index_counts(scores: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
    """``radix_topk_index_counts`` (same bits) with wider digits for rows of ``E <= HELD_ROW`` entries, by
    ``_radix_topk_counts_held_kernel``: one read of each row's visible prefix from memory (rows over
    ``HELD_WRITE_ROW`` read again for the write, from L2)."""
    scores = scores.float().contiguous()
    counts = counts.to(torch.int32).contiguous()
    R, E = scores.shape
    _check_held(E)
    out = torch.empty(R, k, dtype=torch.int32, device=scores.device)
    _radix_topk_counts_held_kernel[(R,)](scores, counts, out, E, k, **held_launch(E))
    return out


def _check_held(E: int) -> None:
    if E > HELD_ROW:
        raise ValueError(f"the held radix select takes rows of at most HELD_ROW ({HELD_ROW}) entries, got {E}: "
                         "longer rows take split_topk_index_counts or keys + torch.topk")


SPLIT_CHUNK = 4096  # fewest entries of a row a first-stage program of the split select holds (8 warps)
SPLIT_MAX_ROWS = 64  # calls of fewer query rows (decode steps) take the split select: more programs than rows
SPLIT_CANDIDATES = 8192  # most candidates a row's second stage holds with their entries (no spills at 16 warps)


def split_chunk(E: int, k: int) -> int | None:
    """The chunk a row of ``E`` entries splits into for a top-``k``: ``SPLIT_CHUNK``, or larger (a power of two) so
    that a chunk holds more than ``k`` and the ``C k`` candidates of ``C`` chunks stay within
    ``SPLIT_CANDIDATES``; None where no chunk of at most ``HELD_WRITE_ROW`` entries does."""
    fewest = triton.next_power_of_2(triton.cdiv(E * k, SPLIT_CANDIDATES))  # chunks for at most SPLIT_CANDIDATES
    chunk = max(SPLIT_CHUNK, triton.next_power_of_2(2 * k), fewest)
    return chunk if chunk <= HELD_WRITE_ROW and triton.cdiv(E, chunk) * k <= SPLIT_CANDIDATES else None


def split_topk_index_counts(scores: torch.Tensor, counts: torch.Tensor, k: int,
                            chunk: int | None = None) -> torch.Tensor:
    """``wide_topk_index_counts`` (same bits) in two stages, for calls of few rows (one program a row would leave
    most SMs idle) or long rows: each row of ``scores [R, E]`` (row ``r`` sees its first ``counts[r]`` entries) cut
    into chunks (``split_chunk``, or ``chunk``), each chunk's top ``k`` selected on chip by a program of its own
    (``_split_chunk_kernel``); then each row's top ``k`` among its chunks' candidates (``_split_merge_kernel``). An
    entry among a row's top ``k`` is among its chunk's, and the candidates keep entry order, so the second stage's
    tie rule (lower place first) is the reference's (lower entry first). Returns ``[R, k]`` int32, ascending, then
    -1."""
    scores = scores.float().contiguous()
    counts = counts.to(torch.int32).contiguous()
    R, E = scores.shape
    C, first, second = split_launch(E, k, chunk)
    cand = torch.empty(R, C * k, dtype=torch.int32, device=scores.device)  # [R, C k]: order keys
    entries = torch.empty_like(cand)  # [R, C k]: entry indices
    out = torch.empty(R, k, dtype=torch.int32, device=scores.device)
    _split_chunk_kernel[(R, C)](scores, counts, cand, entries, E, k, C * k, **first)
    _split_merge_kernel[(R,)](cand, entries, counts, out, E, k, C * k, **second)
    return out


def split_launch(E: int, k: int, chunk: int | None = None) -> tuple[int, dict, dict]:
    """The split select's chunks a row of ``E`` entries (``split_chunk``, or ``chunk`` of at least ``2 k``) and the
    meta-parameters of its two kernels: 4 to 32 warps as the held kernels take them (``held_launch``)."""
    chunk = split_chunk(E, k) if chunk is None else max(chunk, triton.next_power_of_2(2 * k))
    if chunk is None or chunk > HELD_WRITE_ROW or triton.cdiv(E, chunk) * k > SPLIT_CANDIDATES:
        raise ValueError(f"split_topk_index_counts: rows of {E} entries do not split for a top-{k} into chunks of at "
                         f"most {HELD_WRITE_ROW} entries and at most {SPLIT_CANDIDATES} candidates")
    C = triton.cdiv(E, chunk)
    row = max(triton.next_power_of_2(C * k), 1024)
    first = {"CHUNK": chunk, "WIDE": HELD_DIGIT, "num_warps": held_warps(chunk)}
    second = {"CHUNK": chunk, "ROW": row, "BLOCK": 1024, "WIDE": HELD_DIGIT, "num_warps": held_warps(row)}
    return C, first, second


FILTER_TILE = 16  # entries a tile maximum of the filtered select stands for
FILTER_TILES = 16384  # most tile maxima of a row the filtered select's threshold is chosen among, held on chip
FILTER_CAP = 8192  # most entries at or above its threshold a row's exact select holds; more: passes over memory
LIST_BLOCK, LIST_WARPS = 1024, 4  # the listing pass's entries a step and warps (its scan adds every warp's sum)
TILE_MAX_TILES = 256  # tiles a program of the tile-maxima stage reduces


@triton.jit
def _tile_max_kernel(scores_ptr, counts_ptr, max_ptr, E, T, TILE: tl.constexpr, TILES: tl.constexpr):
    """Program (query row, ``TILES`` tiles) of the filtered select's first stage: each ``TILE``-entry tile's largest
    order key within the row's visible prefix (the ``-inf`` key past it), as int32 bits at ``max_ptr + row * T +
    tile``."""
    row = tl.program_id(0).to(tl.int64)
    n = _visible_count(counts_ptr, row, E)
    tiles = tl.program_id(1) * TILES + tl.arange(0, TILES)  # [TILES]
    offs = tiles[:, None] * TILE + tl.arange(0, TILE)[None, :]  # [TILES, TILE]
    keys, _ = _radix_keys(scores_ptr, scores_ptr, row * E + offs, offs < n, True)  # [TILES, TILE] uint32
    tl.store(max_ptr + row * T + tiles, tl.max(keys, axis=1).to(tl.int32, bitcast=True), mask=tiles < T)


@triton.jit
def _floor_kernel(counts_ptr, max_ptr, floor_ptr, E, T, k, TILE: tl.constexpr, T_ROW: tl.constexpr,
                  WIDE: tl.constexpr):
    """Program (query row) of the filtered select's second stage: the ``k``-th largest of the row's tile maxima, a
    floor for its ``k``-th largest key (at least ``k`` entries reach it), so every selected entry, ties included, is
    at or above it; written as int32 bits at ``floor_ptr + row``. A row of at most ``k`` tiles gets 0, below every
    key: all its visible entries."""
    row = tl.program_id(0).to(tl.int64)
    n = _visible_count(counts_ptr, row, E)
    tiles = tl.cdiv(n, TILE)
    t = tl.arange(0, T_ROW)  # [T_ROW]
    maxima = tl.load(max_ptr + row * T + t, mask=t < tiles, other=0).to(tl.uint32, bitcast=True)
    maxima = tl.where(t < tiles, maxima, tl.full([T_ROW], _NEG_INF_KEY, tl.uint32))  # [T_ROW]
    floor = tl.full((), 0, tl.uint32)
    if tiles > k:
        floor, _ = _radix_select_held(maxima, tiles, k, WIDE)
    tl.store(floor_ptr + row, floor.to(tl.int32, bitcast=True))


@triton.jit
def _list_kernel(scores_ptr, counts_ptr, floor_ptr, key_ptr, entry_ptr, listed_ptr, E, CAP: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Program (query row) of the filtered select's third stage: one pass over the visible prefix listing the entries
    at or above the row's floor, in entry order: their order keys (int32 bits) at ``key_ptr + row * CAP`` and
    indices at ``entry_ptr + row * CAP``, the first ``CAP`` of them, and how many there are at ``listed_ptr +
    row``. Few warps: the list's places are a scan of each block."""
    row = tl.program_id(0).to(tl.int64)
    n = _visible_count(counts_ptr, row, E)
    floor = tl.load(floor_ptr + row).to(tl.uint32, bitcast=True)
    found = tl.full((), 0, tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)  # [B]
        keys, _ = _radix_keys(scores_ptr, scores_ptr, row * E + offs, offs < n, True)  # [B]
        kept = (offs < n) & (keys >= floor)
        place = found + tl.cumsum(kept.to(tl.int32), axis=0) - 1  # [B]
        tl.store(key_ptr + row * CAP + place, keys.to(tl.int32, bitcast=True), mask=kept & (place < CAP))
        tl.store(entry_ptr + row * CAP + place, offs, mask=kept & (place < CAP))
        found += tl.sum(kept.to(tl.int32), axis=0)
    tl.store(listed_ptr + row, found)


@triton.jit
def _listed_select_kernel(key_ptr, entry_ptr, listed_ptr, out_ptr, k, CAP: tl.constexpr, BLOCK: tl.constexpr,
                          WIDE: tl.constexpr):
    """Program (query row) of the filtered select's last stage, for a row that listed at most ``CAP`` entries: their
    top ``k`` held on chip (``_select_listed``, as ``_split_merge_kernel`` selects its candidates)."""
    row = tl.program_id(0).to(tl.int64)
    m = tl.load(listed_ptr + row)
    if m <= CAP:
        _select_listed(key_ptr + row * CAP, entry_ptr + row * CAP, m, out_ptr, row, k, CAP, BLOCK, WIDE)


@triton.jit
def _listed_overflow_kernel(scores_ptr, counts_ptr, listed_ptr, out_ptr, E, k, CAP: tl.constexpr,
                            BLOCK: tl.constexpr):
    """Program (query row) of the filtered select's last stage, for a row that listed more than ``CAP`` entries
    (scores far from independent, e.g. its largest in a few tiles): ``_radix_topk_counts_kernel``'s passes over the
    row's visible prefix (a kernel of its own: beside the held select its registers would spill)."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(listed_ptr + row) > CAP:
        n = _visible_count(counts_ptr, row, E)
        prefix, need = _radix_threshold(scores_ptr, scores_ptr, row * E, n, k, BLOCK, True)
        _write_index(scores_ptr, scores_ptr, row * E, n, k, prefix, need, out_ptr, row, BLOCK, True)


def filter_fits(E: int, k: int) -> bool:
    """Whether the filtered select takes rows of ``E`` entries for a top-``k``: at most ``FILTER_TILES`` tiles, and a
    row that reaches no more than ``k`` tiles (every visible entry listed) lists at most ``FILTER_CAP``."""
    return triton.cdiv(E, FILTER_TILE) <= FILTER_TILES and k * FILTER_TILE <= FILTER_CAP


def filtered_topk_index_counts(scores: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
    """``wide_topk_index_counts`` (same bits) for long rows by a floor: each row's ``FILTER_TILE``-entry tiles' maxima
    (``_tile_max_kernel``), then per row the ``k``-th largest of them as a floor (``_floor_kernel``) and one pass
    listing the entries at or above it (``_list_kernel``), and the top ``k`` of those (``_listed_select_kernel``;
    rows that listed more than ``FILTER_CAP``: ``_listed_overflow_kernel``). Reads each score twice whatever ``k``
    and selects among about ``k`` entries rather than a row's every entry; its lists take ``R x FILTER_CAP x 8``
    bytes. ``scores [R, E]``, row ``r`` sees its first ``counts[r]`` entries; returns ``[R, k]`` int32, ascending,
    then -1."""
    scores = scores.float().contiguous()
    counts = counts.to(torch.int32).contiguous()
    R, E = scores.shape
    if not filter_fits(E, k):
        raise ValueError(f"filtered_topk_index_counts: rows of {E} entries exceed {FILTER_TILES} tiles of "
                         f"{FILTER_TILE}, or a top-{k} lists more than {FILTER_CAP} entries")
    T = triton.cdiv(E, FILTER_TILE)
    maxima = torch.empty(R, T, dtype=torch.int32, device=scores.device)  # [R, T]: order keys
    listed_keys = torch.empty(R, FILTER_CAP, dtype=torch.int32, device=scores.device)  # [R, CAP]: order keys
    listed_entries = torch.empty_like(listed_keys)  # [R, CAP]: entry indices
    floors = torch.empty(R, dtype=torch.int32, device=scores.device)  # [R]: order keys
    listed = torch.empty_like(floors)  # [R]
    out = torch.empty(R, k, dtype=torch.int32, device=scores.device)
    _tile_max_kernel[(R, triton.cdiv(T, TILE_MAX_TILES))](scores, counts, maxima, E, T, TILE=FILTER_TILE,
                                                          TILES=TILE_MAX_TILES, num_warps=8)
    t_row = max(triton.next_power_of_2(T), 1024)
    _floor_kernel[(R,)](counts, maxima, floors, E, T, k, TILE=FILTER_TILE, T_ROW=t_row, WIDE=HELD_DIGIT,
                        num_warps=held_warps(t_row))
    _list_kernel[(R,)](scores, counts, floors, listed_keys, listed_entries, listed, E, CAP=FILTER_CAP,
                       BLOCK=LIST_BLOCK, num_warps=LIST_WARPS)
    _listed_select_kernel[(R,)](listed_keys, listed_entries, listed, out, k, CAP=FILTER_CAP, BLOCK=1024,
                                WIDE=HELD_DIGIT, num_warps=held_warps(FILTER_CAP))
    _listed_overflow_kernel[(R,)](scores, counts, listed, out, E, k, CAP=FILTER_CAP, BLOCK=1024, num_warps=4)
    return out


def order_keys_counts(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``order_keys`` where row ``r`` of ``scores [R, E]`` sees its first ``counts [R]`` entries: the Triton kernel on
    CUDA (and under ``TRITON_INTERPRET=1``), else ``order_keys_torch`` of the mask they stand for."""
    E = scores.shape[-1]
    if scores.device.type != "cuda" and not _interpreted():
        return order_keys_torch(scores, torch.arange(E, device=scores.device) < counts[:, None])
    scores = scores.float().contiguous()
    keys = torch.empty(scores.shape, dtype=torch.int64, device=scores.device)
    numel = scores.numel()
    _order_keys_counts_kernel[(triton.cdiv(numel, BLOCK),)](scores, counts.to(torch.int32).contiguous(), keys, numel,
                                                            E, BLOCK=BLOCK, num_warps=4)
    return keys


def keyed_topk_index_counts(scores: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
    """``keyed_topk_index`` where row ``r`` of ``scores [R, E]`` sees its first ``counts [R]`` entries (``E > k``)."""
    E = scores.shape[-1]
    index = torch.topk(order_keys_counts(scores, counts), k, dim=-1, sorted=False).indices  # [R, k]
    index = torch.where(index < counts[:, None], index, E).sort(dim=-1).values  # the visible ones first, ascending
    return torch.where(index < E, index, -1).to(torch.int32)


RADIX_MIN_ROWS = None  # with the wide form off: calls of fewer rows take keys and torch.topk instead of the 4-bit
# radix select; None: ``DEEPINFER_NVIDIA_RADIX_TOPK_MIN_ROWS`` (64)


def radix_topk(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """The selection ``[R, E]`` bool of fp32 ``scores [R, E]`` under ``visible [R, E]`` by ``_radix_topk_kernel``
    (``E > k``)."""
    scores = scores.float().contiguous()
    seen = visible.contiguous().view(torch.uint8)
    out = torch.empty(scores.shape, dtype=torch.bool, device=scores.device)
    R, E = scores.shape
    _radix_topk_kernel[(R,)](scores, seen, out.view(torch.uint8), E, k, BLOCK=BLOCK, num_warps=4)
    return out


def radix_topk_index(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """The selection's entry indices ``[R, k]`` int32 (ascending, then -1) of fp32 ``scores [R, E]`` under ``visible
    [R, E]`` by ``_radix_topk_index_kernel`` (``E > k``)."""
    scores = scores.float().contiguous()
    seen = visible.contiguous().view(torch.uint8)
    R, E = scores.shape
    out = torch.empty(R, k, dtype=torch.int32, device=scores.device)
    _radix_topk_index_kernel[(R,)](scores, seen, out, E, k, BLOCK=BLOCK, num_warps=4)
    return out


def _wide_launch(scores: torch.Tensor, visible: torch.Tensor, out: torch.Tensor, k: int, index: bool) -> None:
    """``_radix_topk_held_kernel`` for rows of at most ``HELD_ROW`` entries, writing the selection (``index``: its
    indices) of ``scores`` under ``visible`` to ``out``."""
    R, E = scores.shape
    _check_held(E)
    _radix_topk_held_kernel[(R,)](scores, visible, out, E, k, INDEX=index, **held_launch(E))


def wide_topk(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """``radix_topk`` (same bits) with wider digits, as ``wide_topk_index_counts`` selects: rows of at most
    ``HELD_ROW`` entries held on chip (one read of each row's scores and visibility; over ``HELD_WRITE_ROW`` read
    again for the write, from L2). ``E > k``."""
    scores = scores.float().contiguous()
    out = torch.empty(scores.shape, dtype=torch.bool, device=scores.device)
    _wide_launch(scores, visible.contiguous().view(torch.uint8), out.view(torch.uint8), k, False)
    return out


def wide_topk_index(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """``radix_topk_index`` (same bits) with ``wide_topk``'s wider digits: indices ``[R, k]`` int32, ascending, then
    -1. ``E > k``."""
    scores = scores.float().contiguous()
    out = torch.empty(scores.shape[0], k, dtype=torch.int32, device=scores.device)
    _wide_launch(scores, visible.contiguous().view(torch.uint8), out, k, True)
    return out


def keyed_topk_index(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """The selection's entry indices ``[R, k]`` int32 (ascending, then -1) by order keys and ``torch.topk`` (``E >
    k``)."""
    E = scores.shape[-1]
    index = torch.topk(order_keys(scores, visible), k, dim=-1, sorted=False).indices  # [R, k]
    index = torch.where(visible.gather(-1, index), index, E).sort(dim=-1).values  # the visible ones first, ascending
    return torch.where(index < E, index, -1).to(torch.int32)


def keyed_topk(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """The selection ``[R, E]`` bool by order keys and ``torch.topk`` (``E > k``)."""
    keys = order_keys(scores, visible)  # [R, E] int64
    index = torch.topk(keys, k, dim=-1, sorted=False).indices  # [R, k]
    del keys
    selected = torch.zeros_like(visible)  # [R, E]
    selected.scatter_(-1, index, visible.gather(-1, index))
    return selected


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _radix_form(rows_scores: torch.Tensor, k: int, wide, four_bit, split=None, filtered=None):
    """The radix kernel an op call over ``rows_scores [R, E]`` takes; None (keys and ``torch.topk``) off Triton or
    with ``DEEPINFER_NVIDIA_RADIX_TOPK=0``. With ``DEEPINFER_NVIDIA_RADIX_TOPK_WIDE`` (the default): with
    ``DEEPINFER_NVIDIA_TOPK_FILTER``, ``filtered`` (the counted op's, where given) for calls of at least
    ``SPLIT_MAX_ROWS`` rows over ``HELD_WRITE_ROW`` entries that it takes; ``split`` (the counted op's two-stage
    form, where given) for calls of fewer than ``SPLIT_MAX_ROWS`` rows of more than one chunk and for rows over
    ``HELD_WRITE_ROW`` entries (which the held kernel reads twice), as far as its candidates fit; else ``wide`` for
    rows of at most ``HELD_ROW`` entries at any row count; longer rows keys and ``torch.topk``. Without it:
    ``four_bit`` from ``RADIX_MIN_ROWS`` rows."""
    on_triton = rows_scores.device.type == "cuda" or _interpreted()
    if not (on_triton and envs.DEEPINFER_NVIDIA_RADIX_TOPK):
        return None
    R, E = rows_scores.shape
    if envs.DEEPINFER_NVIDIA_RADIX_TOPK_WIDE:
        long_prefill = R >= SPLIT_MAX_ROWS and E > HELD_WRITE_ROW
        if filtered is not None and envs.DEEPINFER_NVIDIA_TOPK_FILTER and long_prefill and filter_fits(E, k):
            return filtered
        chunk = split_chunk(E, k)
        splits = split is not None and chunk is not None and chunk < E
        if splits and (R < SPLIT_MAX_ROWS or E > HELD_WRITE_ROW):
            return split
        return wide if E <= HELD_ROW else None
    min_rows = envs.DEEPINFER_NVIDIA_RADIX_TOPK_MIN_ROWS if RADIX_MIN_ROWS is None else RADIX_MIN_ROWS
    return four_bit if R >= min_rows else None


def _topk_fake(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    return torch.empty_like(visible)


@opaque_under_compile("indexer_topk", _topk_fake)
def indexer_topk(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """Op ``indexer_topk`` (same contract and tie rule as the reference op): ``scores [S, Lq, E]``, ``visible [S, Lq,
    E]`` bool -> bool ``[S, Lq, E]``, up to ``k`` visible entries per query row."""
    E = scores.shape[-1]
    if E <= k or visible.numel() == 0:  # every entry fits the budget: the visible ones
        return visible.clone()
    rows_scores, rows_visible = scores.reshape(-1, E), visible.reshape(-1, E)  # [R, E] each
    form = _radix_form(rows_scores, k, wide_topk, radix_topk)
    if form is not None:
        return form(rows_scores, rows_visible, k).view(visible.shape)
    return keyed_topk(rows_scores, rows_visible, k).view(visible.shape)


def _topk_index_fake(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    return visible.new_empty((*visible.shape[:-1], k), dtype=torch.int32)


@opaque_under_compile("indexer_topk_index", _topk_index_fake)
def indexer_topk_index(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """Op ``indexer_topk_index`` (the reference's selection as indices): ``scores [S, Lq, E]``, ``visible [S, Lq, E]``
    bool -> ``[S, Lq, k]`` int32, each row's selected entries ascending, then -1. Where every entry fits the budget,
    the visible ones."""
    E = scores.shape[-1]
    if E <= k or visible.numel() == 0:  # every entry fits the budget: the visible ones
        return ref.visible_index(visible, k)
    rows_scores, rows_visible = scores.reshape(-1, E), visible.reshape(-1, E)  # [R, E] each
    form = _radix_form(rows_scores, k, wide_topk_index, radix_topk_index)
    if form is not None:
        return form(rows_scores, rows_visible, k).view(*visible.shape[:-1], k)
    return keyed_topk_index(rows_scores, rows_visible, k).view(*visible.shape[:-1], k)


def _topk_counts_fake(scores: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
    return counts.new_empty((*counts.shape, k), dtype=torch.int32)


@opaque_under_compile("indexer_topk_index_counts", _topk_counts_fake)
def indexer_topk_index_counts(scores: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
    """Op ``indexer_topk_index_counts`` (the reference's selection where each row sees a prefix): ``scores [S, Lq,
    E]``, ``counts [S, Lq]`` int32 -> ``[S, Lq, k]`` int32, each row's selected entries ascending, then -1; reads the
    counts, makes no ``[S, Lq, E]`` mask. Where every entry fits the budget, each row's first ``counts`` entries."""
    E = scores.shape[-1]
    if E <= k or counts.numel() == 0:  # every entry fits the budget: the row's prefix
        places = torch.arange(k, device=counts.device)  # [k]
        return torch.where(places < counts.clamp(max=E)[..., None], places, -1).to(torch.int32)
    rows_scores, rows_counts = scores.reshape(-1, E), counts.reshape(-1)  # [R, E], [R]
    form = _radix_form(rows_scores, k, wide_topk_index_counts, radix_topk_index_counts,
                       split_topk_index_counts, filtered_topk_index_counts)
    if form is not None:
        return form(rows_scores, rows_counts, k).view(*counts.shape, k)
    return keyed_topk_index_counts(rows_scores, rows_counts, k).view(*counts.shape, k)

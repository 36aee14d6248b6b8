"""``indexer_topk`` (``kernels/indexer_topk.py``) against the reference op on long CPU-sized rows (issue #38 point 5):
thousands of entries, many ties, rows with nothing visible, rows with fewer visible entries than ``k``, ``-0.0`` beside
``+0.0``, infinities and NaNs. The selection must be the same bits as the reference's stable sort.

The order keys come from the Triton kernel on the GPU, and without one in a child pytest process under Triton's
interpreter (``TRITON_INTERPRET=1`` must be set before Triton is imported); the torch form of the keys (CPU tensors)
runs here too."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the test extra installs triton")
from deepinfer_nvidia_sm100.kernels import indexer_topk
from interpreted import DEVICE, INTERPRETED, kernel_runs_here, run_under_interpreter, starts_the_interpreter

from deepinfer_core.ops import reference as ref


@starts_the_interpreter
def test_kernel_under_triton_interpreter():
    run_under_interpreter(__file__, "compile or on_the_gpu")


def long_case(S: int, Lq: int, E: int, levels: int, seed: int, device: str = DEVICE):
    """Scores with ``levels`` distinct values (many ties; ``levels=0``: continuous), signed zeros, infinities and
    NaNs sprinkled in; causal-like visibility (query row ``t`` sees a prefix that grows with ``t``), one row that sees
    nothing and one that sees fewer entries than any ``k`` used here."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(S, Lq, E, generator=gen)
    if levels:
        scores = torch.randint(-levels // 2, levels - levels // 2, (S, Lq, E), generator=gen).float() * 0.25
    special = torch.rand(S, Lq, E, generator=gen)
    scores = torch.where(special < 0.05, -0.0, scores)
    scores = torch.where((special >= 0.05) & (special < 0.07), 0.0, scores)
    scores = torch.where((special >= 0.07) & (special < 0.072), float("inf"), scores)
    scores = torch.where((special >= 0.072) & (special < 0.074), float("-inf"), scores)
    scores = torch.where((special >= 0.074) & (special < 0.075), float("nan"), scores)
    scores = torch.where((special >= 0.075) & (special < 0.076), -float("nan"), scores)
    limit = torch.linspace(E // 8, E, Lq).long()  # [Lq]
    visible = torch.arange(E)[None, None, :] < limit[None, :, None]  # [1, Lq, E]
    visible = visible.expand(S, -1, -1).clone()
    visible &= torch.rand(S, Lq, E, generator=gen) > 0.1
    visible[:, 0] = False  # a row that sees nothing
    visible[:, 1] = False
    visible[:, 1, :7] = True  # a row with fewer visible entries than k
    return scores.to(device), visible.to(device)


CASES = [  # (S, Lq, E, levels, k)
    (1, 6, 4096, 5, 512),  # ties everywhere: five score values over 4,096 entries
    (2, 5, 5000, 0, 64),  # continuous scores, an E that is not a power of two
    (1, 4, 3000, 2, 2048),  # two levels, k most of the row
    (2, 3, 700, 40, 512),
]


@pytest.mark.parametrize(("S", "Lq", "E", "levels", "k"), CASES)
def test_torch_keys_select_what_the_reference_selects(S, Lq, E, levels, k):
    scores, visible = long_case(S, Lq, E, levels, seed=E, device="cpu")
    keys = indexer_topk.order_keys_torch(scores.reshape(-1, E), visible.reshape(-1, E))
    assert (keys.sort(dim=-1).values.diff(dim=-1) != 0).all()  # one key per entry: topk has no ties to break
    got = indexer_topk.indexer_topk(scores, visible, k)
    want = ref.indexer_topk(scores, visible, k)
    assert torch.equal(got, want)
    assert not (got & ~visible).any() and (got.sum(-1) <= k).all()
    assert (got.sum(-1) == k).any() and not got[:, 0].any() and (got[:, 1].sum(-1) <= 7).all()


def test_order_keys_order_as_the_stable_descending_sort():
    """Sorting the keys descending is the reference's stable descending sort of the masked scores, position for
    position: -0.0 ties +0.0 (lower index first), NaN above +inf, invisible at -inf."""
    scores, visible = long_case(1, 8, 1500, 7, seed=3, device="cpu")
    scores, visible = scores.reshape(-1, 1500), visible.reshape(-1, 1500)
    keys = indexer_topk.order_keys_torch(scores, visible)
    by_keys = keys.sort(dim=-1, descending=True).indices
    masked = scores.masked_fill(~visible, float("-inf"))
    by_sort = masked.sort(dim=-1, descending=True, stable=True).indices
    assert torch.equal(by_keys, by_sort)


def test_budget_covering_every_entry_selects_the_visible_ones():
    scores, visible = long_case(1, 4, 300, 3, seed=1, device="cpu")
    assert torch.equal(indexer_topk.indexer_topk(scores, visible, 300), visible)
    assert torch.equal(indexer_topk.indexer_topk(scores, visible, 299), ref.indexer_topk(scores, visible, 299))


KERNEL_CASES = [(1, 3, 4096, 5, 512), (1, 3, 5000, 0, 64), (1, 3, 1031, 3, 100), (1, 4, 2000, 0, 1999)]


@kernel_runs_here
@pytest.mark.parametrize(("S", "Lq", "E", "levels", "k"), KERNEL_CASES)
def test_kernel_keys_equal_the_torch_keys_and_select_as_the_reference(S, Lq, E, levels, k):
    scores, visible = long_case(S, Lq, E, levels, seed=E)
    keys = indexer_topk.order_keys(scores.reshape(-1, E), visible.reshape(-1, E))
    want_keys = indexer_topk.order_keys_torch(scores.reshape(-1, E).cpu(), visible.reshape(-1, E).cpu())
    assert torch.equal(keys.cpu(), want_keys)
    got = indexer_topk.keyed_topk(scores.reshape(-1, E), visible.reshape(-1, E), k)
    assert torch.equal(got.cpu(), ref.indexer_topk(scores.cpu(), visible.cpu(), k).reshape(-1, E))


@kernel_runs_here
@pytest.mark.parametrize(("S", "Lq", "E", "levels", "k"), KERNEL_CASES)
def test_kernel_keys_radix_select_as_the_reference(S, Lq, E, levels, k):
    """The radix-select kernel: ties at the k-th key (many levels), the k-th key inside one block or across blocks,
    every entry but one (k = E - 1), rows with nothing or less than k visible."""
    scores, visible = long_case(S, Lq, E, levels, seed=E + 1)
    got = indexer_topk.radix_topk(scores.reshape(-1, E), visible.reshape(-1, E), k)
    assert torch.equal(got.cpu(), ref.indexer_topk(scores.cpu(), visible.cpu(), k).reshape(-1, E))


@kernel_runs_here
@pytest.mark.parametrize(("S", "Lq", "E", "levels", "k"), KERNEL_CASES[:3])
def test_both_forms_write_the_selection_as_the_reference_indices(S, Lq, E, levels, k):
    """``indexer_topk_index``'s forms (the radix select writing indices, keys + ``torch.topk``) against the reference
    (the selection's entries ascending, then -1), and the op on both sides of ``RADIX_MIN_ROWS``."""
    scores, visible = long_case(S, Lq, E, levels, seed=E + 2)
    want = ref.indexer_topk_index(scores.cpu(), visible.cpu(), k).reshape(-1, k)
    for form in (indexer_topk.radix_topk_index, indexer_topk.keyed_topk_index):
        got = form(scores.reshape(-1, E), visible.reshape(-1, E), k)
        assert got.dtype == torch.int32 and torch.equal(got.cpu(), want), form.__name__
    assert torch.equal(indexer_topk.indexer_topk_index(scores, visible, k).cpu(), want.view(S, Lq, k))
    assert torch.equal(indexer_topk.indexer_topk_index(scores[..., :40], visible[..., :40], 64).cpu(),
                       ref.visible_index(visible[..., :40].cpu(), 64))  # every entry fits: the visible ones


@kernel_runs_here
def test_the_op_takes_the_radix_kernel_from_radix_min_rows(monkeypatch):
    """Both mask ops from ``RADIX_MIN_ROWS`` rows: ``DEEPINFER_NVIDIA_RADIX_TOPK_WIDE=1`` the wide form, ``0`` the
    4-bit one, ``DEEPINFER_NVIDIA_RADIX_TOPK=0`` keys + ``torch.topk``; the same bits each time."""
    monkeypatch.setattr(indexer_topk, "RADIX_MIN_ROWS", 4)  # 64 by default: fewer rows keep the interpreter quick
    monkeypatch.setenv("DEEPINFER_NVIDIA_RADIX_TOPK_WIDE", "1")
    scores, visible = long_case(1, 4, 600, 4, seed=5)
    want = ref.indexer_topk(scores.cpu(), visible.cpu(), 100)
    want_index = ref.indexer_topk_index(scores.cpu(), visible.cpu(), 100)
    taken = []
    for name in ("radix_topk", "wide_topk", "radix_topk_index", "wide_topk_index"):
        form = getattr(indexer_topk, name)
        monkeypatch.setattr(indexer_topk, name, lambda *a, n=name, f=form: taken.append(n) or f(*a))
    for _ in range(3):
        assert torch.equal(indexer_topk.indexer_topk(scores, visible, 100).cpu(), want)
        assert torch.equal(indexer_topk.indexer_topk_index(scores, visible, 100).cpu(), want_index)
        monkeypatch.setenv("DEEPINFER_NVIDIA_RADIX_TOPK" if taken[-1].startswith("radix") else
                           "DEEPINFER_NVIDIA_RADIX_TOPK_WIDE", "0")
    assert taken == ["wide_topk", "wide_topk_index", "radix_topk", "radix_topk_index"]


ROUTES = [  # (SPLIT_CHUNK, HELD_ROW, HELD_WRITE_ROW, SPLIT_MAX_ROWS), DEEPINFER_NVIDIA_TOPK_FILTER -> the counted
    # op's form, the mask op's form
    ((None, None, None, None), "1", ("wide_topk_index_counts", "wide_topk_index")),  # one chunk: held on chip
    ((256, None, None, None), "1", ("split_topk_index_counts", "wide_topk_index")),  # a decode row of 3 chunks
    ((256, None, None, 1), "1", ("wide_topk_index_counts", "wide_topk_index")),  # as many rows as a prefill call
    ((256, None, 512, 1), "1", ("filtered_topk_index_counts", "wide_topk_index")),  # long prefill rows: the filter
    ((256, None, 512, 1), "0", ("split_topk_index_counts", "wide_topk_index")),  # the same rows, the filter off
    ((256, 512, None, None), "1", ("split_topk_index_counts", "keyed_topk_index")),  # rows longer than HELD_ROW
]


@kernel_runs_here
@pytest.mark.parametrize(("sizes", "filtered", "forms"), ROUTES)
def test_the_wide_forms_take_rows_by_count_and_length(sizes, filtered, forms, monkeypatch):
    """With ``DEEPINFER_NVIDIA_RADIX_TOPK_WIDE`` (the default), a row of 600 entries (``ROUTES``, the sizes made
    small): of one chunk, the wide form; the counted op's filtered form for calls of at least ``SPLIT_MAX_ROWS`` rows
    over ``HELD_WRITE_ROW`` entries (with ``DEEPINFER_NVIDIA_TOPK_FILTER``, the default), its split form for fewer
    rows of more than one chunk and, the filter off, for rows over ``HELD_WRITE_ROW``; rows over ``HELD_ROW``: the
    split form (counted op) or keys + ``torch.topk`` (mask op). The same bits each time."""
    monkeypatch.delenv("DEEPINFER_NVIDIA_RADIX_TOPK_WIDE", raising=False)
    monkeypatch.setenv("DEEPINFER_NVIDIA_TOPK_FILTER", filtered)
    for name, size in zip(("SPLIT_CHUNK", "HELD_ROW", "HELD_WRITE_ROW", "SPLIT_MAX_ROWS"), sizes, strict=True):
        if size is not None:
            monkeypatch.setattr(indexer_topk, name, size)
    scores = long_case(1, 3, 600, 4, seed=6)[0][:, 2:]  # [1, 1, 600]: one row, ties, signed zeros, NaNs
    counts = torch.full((1, 1), 450, dtype=torch.int32, device=scores.device)  # the row sees its first 450 entries
    visible = torch.arange(600, device=scores.device) < counts[..., None]  # [1, 1, 600]
    want = ref.indexer_topk_index(scores.cpu(), visible.cpu(), 100)
    taken = []
    for name in ("wide_topk_index", "wide_topk_index_counts", "split_topk_index_counts", "filtered_topk_index_counts",
                 "keyed_topk_index"):
        form = getattr(indexer_topk, name)
        monkeypatch.setattr(indexer_topk, name, lambda *a, n=name, f=form: taken.append(n) or f(*a))
    assert torch.equal(indexer_topk.indexer_topk_index_counts(scores, counts, 100).cpu(), want)
    counted = taken[0]
    taken.clear()
    assert torch.equal(indexer_topk.indexer_topk_index(scores, visible, 100).cpu(), want)
    assert (counted, taken[0]) == forms


SPLIT_CASES = [  # (S, Lq, E, levels, k, chunk): chunks that cut ties, a last short chunk, rows of one chunk's count
    (1, 5, 3000, 4, 100, 256),
    (2, 5, 4096, 0, 512, 1024),
    (1, 6, 1031, 3, 130, 256),
]


@kernel_runs_here
@pytest.mark.parametrize(("S", "Lq", "E", "levels", "k", "chunk"), SPLIT_CASES)
def test_split_counted_form_selects_as_the_masked_reference(S, Lq, E, levels, k, chunk, monkeypatch):
    """``split_topk_index_counts`` (each chunk's top-k, then the row's among the candidates) selects what the
    reference selects from the counts' mask, ties at the k-th key across chunks included."""
    scores, counts, mask = counted_case(S, Lq, E, levels, k, seed=11)
    want = ref.indexer_topk_index(scores.cpu(), mask, k)
    got = indexer_topk.split_topk_index_counts(scores.reshape(-1, E), counts.reshape(-1), k, chunk)
    assert got.dtype == torch.int32 and torch.equal(got.cpu().view(S, Lq, k), want)
    monkeypatch.setattr(indexer_topk, "SPLIT_CANDIDATES", k)  # the candidates could not be held for the write
    with pytest.raises(ValueError, match="do not split"):
        indexer_topk.split_topk_index_counts(scores.reshape(-1, E), counts.reshape(-1), k, chunk)


@kernel_runs_here
def test_split_counted_form_takes_visible_infinities_in_entry_order():
    """Rows with fewer finite visible scores than ``k`` across several chunks: the split select takes every finite
    one, then the visible ``-inf`` entries of lowest index (the reference's stable order), never an invisible one."""
    gen = torch.Generator().manual_seed(12)
    scores = torch.full((3, 3000), float("-inf"))
    for r, finite in enumerate((40, 99, 300)):
        scores[r, torch.randperm(2000, generator=gen)[:finite]] = torch.randn(finite, generator=gen)
    counts = torch.tensor([2500, 1800, 90], dtype=torch.int32)  # the last row sees fewer entries than k
    want = ref.indexer_topk_index(scores[:, None], (torch.arange(3000) < counts[:, None])[:, None], 100)[:, 0]
    got = indexer_topk.split_topk_index_counts(scores.to(DEVICE), counts.to(DEVICE), 100, chunk=256)
    assert torch.equal(got.cpu(), want)


FILTER_CASES = [  # (S, Lq, E, levels, k, cap): floors over many tiles; few levels, so lists overflow a small cap
    (2, 5, 5000, 0, 64, 8192),  # continuous: about k entries listed a row
    (1, 6, 3001, 3, 100, 8192),  # three levels: the floor's ties listed too
    (1, 5, 5000, 2, 64, 1024),  # two levels: half a row at the floor, more than the cap: passes over memory
]


@kernel_runs_here
@pytest.mark.parametrize(("S", "Lq", "E", "levels", "k", "cap"), FILTER_CASES)
def test_filtered_form_selects_as_the_masked_reference(S, Lq, E, levels, k, cap, monkeypatch):
    """``filtered_topk_index_counts`` (a floor from the tile maxima, the entries at or above it listed, their top-k)
    selects what the reference selects, ties at the floor and at the k-th key included, through the held select and,
    where a row lists more than ``FILTER_CAP``, the passes over memory; the op takes it with
    ``DEEPINFER_NVIDIA_TOPK_FILTER`` for calls of ``SPLIT_MAX_ROWS`` rows over ``HELD_WRITE_ROW`` entries."""
    monkeypatch.setattr(indexer_topk, "FILTER_CAP", cap)
    scores, counts, mask = counted_case(S, Lq, E, levels, k, seed=E + 5)
    want = ref.indexer_topk_index(scores.cpu(), mask, k)
    got = indexer_topk.filtered_topk_index_counts(scores.reshape(-1, E), counts.reshape(-1), k)
    assert got.dtype == torch.int32 and torch.equal(got.cpu().view(S, Lq, k), want)
    taken = []
    form = indexer_topk.filtered_topk_index_counts
    monkeypatch.setattr(indexer_topk, "filtered_topk_index_counts", lambda *a: taken.append(1) or form(*a))
    monkeypatch.setattr(indexer_topk, "SPLIT_MAX_ROWS", S * Lq)
    monkeypatch.setattr(indexer_topk, "HELD_WRITE_ROW", E - 1)
    monkeypatch.setenv("DEEPINFER_NVIDIA_TOPK_FILTER", "1")
    assert torch.equal(indexer_topk.indexer_topk_index_counts(scores, counts, k).cpu(), want) and taken == [1]
    monkeypatch.setattr(indexer_topk, "FILTER_CAP", k * indexer_topk.FILTER_TILE - 1)  # below a k-tile row's list
    with pytest.raises(ValueError, match="exceed"):
        form(scores.reshape(-1, E), counts.reshape(-1), k)


def counted_case(S: int, Lq: int, E: int, levels: int, k: int, seed: int, device: str = DEVICE):
    """``long_case``'s scores with causal prefix visibility as counts ``[S, Lq]`` int32 (a chunk's rows see more entries
    row by row, as after a prefix): rows that see nothing, fewer than ``k``, exactly ``k``, ``k + 1`` and every entry;
    and the mask they stand for."""
    scores, _ = long_case(S, Lq, E, levels, seed, device="cpu")
    counts = torch.linspace(E // 3, E, Lq).to(torch.int32)[None, :].repeat(S, 1)  # [S, Lq]
    counts[0, :5] = torch.tensor([0, min(k - 1, E), min(k, E), min(k + 1, E), E], dtype=torch.int32)
    mask = torch.arange(E) < counts[..., None]
    return scores.to(device), counts.to(device), mask


COUNTED_CASES = [(1, 6, 4096, 5, 512), (2, 5, 3000, 0, 64), (1, 6, 1031, 3, 1030), (1, 5, 700, 2, 100)]
COUNTED_FORMS = {  # the counted radix kernels: 4-bit passes; rows held on chip; the two-stage split; the filtered
    "4-bit": indexer_topk.radix_topk_index_counts,
    "held": indexer_topk.wide_topk_index_counts,
    "split": indexer_topk.split_topk_index_counts,
    "filtered": indexer_topk.filtered_topk_index_counts,
}


def counted_forms(E: int, k: int) -> dict:
    """``COUNTED_FORMS`` that take rows of ``E`` entries for a top-``k``: held rows up to ``HELD_ROW``, the split where
    its candidates fit, the filtered select where its tiles and list fit."""
    takes = {"held": E <= indexer_topk.HELD_ROW, "split": bool(indexer_topk.split_chunk(E, k)),
             "filtered": indexer_topk.filter_fits(E, k)}
    return {name: form for name, form in COUNTED_FORMS.items() if takes.get(name, True)}


@pytest.mark.parametrize(("S", "Lq", "E", "levels", "k"), COUNTED_CASES)
def test_torch_counts_select_what_the_masked_reference_selects(S, Lq, E, levels, k):
    scores, counts, mask = counted_case(S, Lq, E, levels, k, seed=E, device="cpu")
    want = ref.indexer_topk_index(scores, mask, k)
    assert torch.equal(indexer_topk.keyed_topk_index_counts(scores.reshape(-1, E), counts.reshape(-1), k),
                       want.reshape(-1, k))
    assert torch.equal(indexer_topk.indexer_topk_index_counts(scores, counts, k), want)
    assert torch.equal(indexer_topk.indexer_topk_index_counts(scores[..., :40], counts.clamp(max=40), 64),
                       ref.indexer_topk_index_counts(scores[..., :40], counts.clamp(max=40), 64))  # all fit


@kernel_runs_here
@pytest.mark.parametrize(("S", "Lq", "E", "levels", "k"), COUNTED_CASES)
def test_counted_kernels_select_as_the_masked_reference(S, Lq, E, levels, k):
    """The radix select over each row's visible prefix and the counted order keys + ``torch.topk``: ties at the k-th
    key, k = E - 1, rows of at most ``k`` visible entries listed unscored, rows that see nothing."""
    scores, counts, mask = counted_case(S, Lq, E, levels, k, seed=E + 3)
    want = ref.indexer_topk_index(scores.cpu(), mask, k).reshape(-1, k)
    keys = indexer_topk.order_keys_counts(scores.reshape(-1, E), counts.reshape(-1))
    assert torch.equal(keys.cpu(), indexer_topk.order_keys_torch(scores.reshape(-1, E).cpu(), mask.reshape(-1, E)))
    forms = {**counted_forms(E, k), "keyed": indexer_topk.keyed_topk_index_counts}
    for name, form in forms.items():
        got = form(scores.reshape(-1, E), counts.reshape(-1), k)
        assert got.dtype == torch.int32 and torch.equal(got.cpu(), want), name


WIDE_CASES = [  # (S, Lq, E, levels, k): the wide-digit forms across the held rows' sizes
    (1, 6, 5000, 3, 512),  # three levels: the k-th key's ties span the first pass block and the second
    (1, 5, 4999, 0, 600),  # continuous: ties only among the specials (signed zeros, infinities, NaNs)
    (1, 5, 1024, 2, 1000),  # held in exactly one 1,024-entry row, two levels
    (2, 5, 2500, 40, 64),
    (1, 5, 9000, 4, 512),  # held as a 16,384-entry row (32 warps), written from registers
    (1, 5, 20000, 3, 512),  # held as a 32,768-entry row, written by a pass over memory
]


@kernel_runs_here
@pytest.mark.parametrize(("S", "Lq", "E", "levels", "k"), WIDE_CASES)
def test_wide_counted_forms_select_as_the_masked_reference(S, Lq, E, levels, k, monkeypatch):
    """The wide-digit forms (``wide_topk_index_counts``, held on chip, and the split select), each with 8-bit digits
    and with 12, 12, 8, against the reference and the 4-bit kernel: rows that see nothing, fewer than ``k``,
    exactly ``k``, ``k + 1`` and every entry, the k-th key tied across blocks, NaN above ``+inf``, ``-0.0`` tying
    ``+0.0``."""
    scores, counts, mask = counted_case(S, Lq, E, levels, k, seed=E + 4)
    want = ref.indexer_topk_index(scores.cpu(), mask, k).reshape(-1, k)
    assert (want[0] == -1).all() and (want >= 0).sum(-1).max() == k  # an empty row, a full one
    assert torch.equal(indexer_topk.radix_topk_index_counts(scores.reshape(-1, E), counts.reshape(-1), k).cpu(), want)
    for digit in (8, 12):
        monkeypatch.setattr(indexer_topk, "HELD_DIGIT", digit)
        for name in ("held", "split", "filtered")[:3 if indexer_topk.filter_fits(E, k) else 2]:
            got = COUNTED_FORMS[name](scores.reshape(-1, E), counts.reshape(-1), k)
            assert got.dtype == torch.int32 and torch.equal(got.cpu(), want), (digit, name)


@kernel_runs_here
def test_the_counted_op_takes_the_radix_kernel_from_radix_min_rows(monkeypatch):
    monkeypatch.setattr(indexer_topk, "RADIX_MIN_ROWS", 4)  # 64 by default: fewer rows keep the interpreter quick
    monkeypatch.setenv("DEEPINFER_NVIDIA_RADIX_TOPK_WIDE", "1")
    scores, counts, mask = counted_case(1, 5, 600, 4, 100, seed=8)
    want = ref.indexer_topk_index(scores.cpu(), mask, 100)
    taken = []
    for name in ("radix_topk_index_counts", "wide_topk_index_counts"):
        form = getattr(indexer_topk, name)
        monkeypatch.setattr(indexer_topk, name, lambda *a, n=name, f=form: taken.append(n) or f(*a))
    assert torch.equal(indexer_topk.indexer_topk_index_counts(scores, counts, 100).cpu(), want)
    monkeypatch.setenv("DEEPINFER_NVIDIA_RADIX_TOPK_WIDE", "0")
    assert torch.equal(indexer_topk.indexer_topk_index_counts(scores, counts, 100).cpu(), want)
    monkeypatch.setenv("DEEPINFER_NVIDIA_RADIX_TOPK", "0")
    assert torch.equal(indexer_topk.indexer_topk_index_counts(scores, counts, 100).cpu(), want)
    assert taken == ["wide_topk_index_counts", "radix_topk_index_counts"]


def mostly_minus_inf(rows: int, E: int, gen: torch.Generator) -> torch.Tensor:
    """``[rows, E]`` scores, 90% ``-inf``, 3% ``-3e38`` (in ``-inf``'s first-digit bin), 1% ``-0.0``, 0.5% NaN, the
    rest normal."""
    scores = torch.randn(rows, E, generator=gen)
    pick = torch.rand(rows, E, generator=gen)
    scores = torch.where(pick < 0.9, float("-inf"), scores)
    scores = torch.where((pick >= 0.9) & (pick < 0.93), -3e38, scores)
    scores = torch.where((pick >= 0.93) & (pick < 0.94), -0.0, scores)
    return torch.where((pick >= 0.94) & (pick < 0.945), float("nan"), scores)


@kernel_runs_here
@pytest.mark.parametrize("E", [3000, 20000])
def test_wide_counted_forms_with_the_kth_key_at_minus_inf(E, monkeypatch):
    """Rows of mostly ``-inf`` scores, so that the ``k``-th key is often ``-inf`` or a finite score in ``-inf``'s
    first-digit bin (``-3e38``): the held select leaves every ``-inf`` key out of its first histogram and adds the
    visible ones back (the row's padding past its count is ``-inf`` too), which must count exactly."""
    gen = torch.Generator().manual_seed(E)
    rows, k = 12, 100
    scores = mostly_minus_inf(rows, E, gen)  # [rows, E]
    counts = torch.tensor([0, 50, 100, 101, 500, 999, 1000, 1500, E // 2, E - 1000, E - 1, E], dtype=torch.int32)
    mask = torch.arange(E) < counts[:, None]  # [rows, E]
    want = ref.indexer_topk_index(scores[None], mask[None], k)[0]
    finite = (scores.isfinite() & (scores > -1e38) | scores.isnan()) & mask
    assert ((finite.sum(-1) < k) & (counts > k)).sum() >= 3  # rows whose k-th key is -3e38 or -inf
    for digit in (8, 12):
        monkeypatch.setattr(indexer_topk, "HELD_DIGIT", digit)
        for name in ("held", "split", "filtered"):
            got = COUNTED_FORMS[name](scores.to(DEVICE), counts.to(DEVICE), k)
            assert torch.equal(got.cpu(), want), (digit, name)


MASK_FORMS = {  # the mask-based radix kernels (selection mask, indices): 4-bit passes; held on chip
    "4-bit": (indexer_topk.radix_topk, indexer_topk.radix_topk_index),
    "held": (indexer_topk.wide_topk, indexer_topk.wide_topk_index),
}
WIDE_MASK_CASES = [  # (S, Lq, E, levels, k): held rows of 1,024 to 32,768 entries
    (1, 5, 5000, 3, 512),  # three levels: the k-th key's ties span blocks
    (1, 4, 4999, 0, 600),  # continuous: ties only among the specials (signed zeros, infinities, NaNs)
    (1, 4, 1031, 3, 1030),  # k = E - 1
    (2, 3, 2500, 40, 64),
    (1, 4, 9000, 4, 512),  # held as a 16,384-entry row, written from registers
    (1, 4, 20000, 3, 512),  # held as a 32,768-entry row, written by a pass over memory
]


def _check_mask_forms(scores, visible, k, monkeypatch, forms=("held",)):
    """Each wide mask form (selection mask and indices), with 8-bit digits and with 12, 12, 8, against the
    reference op."""
    E = scores.shape[-1]
    want = ref.indexer_topk(scores.cpu(), visible.cpu(), k).reshape(-1, E)
    want_index = ref.visible_index(want, k)
    flat = (scores.reshape(-1, E), visible.reshape(-1, E))
    for digit in (8, 12):
        monkeypatch.setattr(indexer_topk, "HELD_DIGIT", digit)
        for name in forms:
            mask_form, index_form = MASK_FORMS[name]
            got = mask_form(*flat, k)
            assert got.dtype == torch.bool and torch.equal(got.cpu(), want), (name, digit)
            got = index_form(*flat, k)
            assert got.dtype == torch.int32 and torch.equal(got.cpu(), want_index), (name, digit)
    return want


@kernel_runs_here
@pytest.mark.parametrize(("S", "Lq", "E", "levels", "k"), WIDE_MASK_CASES)
def test_wide_mask_forms_select_as_the_reference(S, Lq, E, levels, k, monkeypatch):
    """``wide_topk`` / ``wide_topk_index`` (held on chip) under a visibility mask: the
    k-th key tied across blocks, ``-0.0`` tying ``+0.0``, NaN above ``+inf``, a row that sees nothing, one that sees
    fewer entries than ``k`` (its k-th key ``-inf``: invisible entries tie the visible ``-inf`` scores), k = E - 1."""
    scores, visible = long_case(S, Lq, E, levels, seed=E + 5)
    want = _check_mask_forms(scores, visible, k, monkeypatch)
    seen = visible.reshape(-1, E).sum(-1).cpu()  # [R]
    assert not want[0].any() and 0 < want[1].sum() <= 7 and (want.sum(-1) == torch.clamp(seen, max=k)).all()


@kernel_runs_here
@pytest.mark.parametrize("E", [3000, 20000])
def test_wide_mask_forms_with_the_kth_key_at_minus_inf(E, monkeypatch):
    """Rows of mostly ``-inf`` scores under a scattered visibility, so that the ``k``-th key is ``-inf`` with visible
    and invisible entries tied there (the first ``need`` of them in index order taken, the invisible ones dropped),
    or a finite score in ``-inf``'s first-digit bin (``-3e38``); rows that see nothing, fewer than ``k``, every
    entry."""
    gen = torch.Generator().manual_seed(E)
    rows, k = 12, 100
    scores = mostly_minus_inf(rows, E, gen)  # [rows, E]
    seen = torch.rand(rows, E, generator=gen) < torch.linspace(0.0, 1.0, rows)[:, None]  # [rows, E]: 0% to 100%
    seen[1] = False
    seen[1, torch.randperm(E, generator=gen)[:50]] = True  # fewer visible entries than k
    rare = torch.rand(3, E, generator=gen) < 1 - 200 / E  # rows 2-4: ~200 scores not -inf, fewer visible than k
    scores[2:5] = scores[2:5].masked_fill(rare, float("-inf"))
    finite = (scores.isfinite() & (scores > -1e38) | scores.isnan()) & seen
    at_minus_inf = (finite.sum(-1) < k) & (seen.sum(-1) > k)  # rows whose k-th key is -inf and some -inf are visible
    assert at_minus_inf.sum() >= 2 and ((scores == float("-inf")) & seen & at_minus_inf[:, None]).any()
    want = _check_mask_forms(scores[None].to(DEVICE), seen[None].to(DEVICE), k, monkeypatch)
    assert not want[0].any() and 0 < want[1].sum() < 50  # its visible -inf scores rank after earlier invisible ones


@pytest.mark.skipif(DEVICE != "cuda", reason="rows of 2K-64K entries need the GPU")
@pytest.mark.parametrize("E", [2048, 16384, 16385, 32768, 32769, 65536])
def test_counted_forms_at_long_rows_on_the_gpu(E):
    """The counted forms at the prefill shapes (bf16-rounded scores: ties at the k-th key) on both sides of
    ``HELD_ROW``, the causal counts of the last 384 tokens of a ``4 E``-token context plus the special rows; the op's
    default form replayed in a CUDA graph on new scores."""
    gen = torch.Generator(device="cuda").manual_seed(E)
    scores = torch.randn(384, E, generator=gen, device="cuda").bfloat16().float()  # [R, E]
    counts = ((torch.arange(4 * E - 384, 4 * E, device="cuda") + 1) // 4).to(torch.int32)  # [R]
    counts[:5] = torch.tensor([0, 511, 512, 513, E], dtype=torch.int32, device="cuda")
    scores[5, :64] = torch.tensor([float("nan"), float("inf"), -0.0, 0.0] * 16, device="cuda")
    mask = torch.arange(E, device="cuda") < counts[:, None]  # [R, E]
    want = ref.indexer_topk_index(scores[None], mask[None], 512)[0]
    for name, form in counted_forms(E, 512).items():
        assert torch.equal(form(scores, counts, 512), want), name
    _replays_on_new_scores(indexer_topk.indexer_topk_index_counts, scores.clone(), counts, gen,
                           lambda new: ref.indexer_topk_index(new[None], mask[None], 512)[0])


@pytest.mark.skipif(DEVICE != "cuda", reason="rows of 2K-64K entries need the GPU")
@pytest.mark.parametrize("E", [2048, 16384, 16385, 32768, 32769, 65536])
def test_mask_forms_at_long_rows_on_the_gpu(E):
    """The mask forms at the prefill shapes (bf16-rounded scores: ties at the k-th key) on both sides of ``HELD_ROW``
    and ``HELD_WRITE_ROW``: the causal visibility of the last 384 tokens of a ``4 E``-token context with holes, a row
    that sees nothing, one that sees fewer than ``k``, one whose k-th key is ``-inf`` with invisible entries tied
    there, signed zeros, infinities and NaNs; ``wide_topk`` replayed in a CUDA graph on new scores."""
    gen = torch.Generator(device="cuda").manual_seed(E)
    scores = torch.randn(384, E, generator=gen, device="cuda").bfloat16().float()  # [R, E]
    limit = (torch.arange(4 * E - 384, 4 * E, device="cuda") + 1) // 4  # [R]
    visible = torch.arange(E, device="cuda") < limit[:, None]  # [R, E]
    visible &= torch.rand(384, E, generator=gen, device="cuda") > 0.05
    visible[0] = False
    visible[1] = False
    visible[1, :300] = True
    scores[2, 200:] = float("-inf")  # 200 finite scores at most: the k-th key is -inf
    scores[5, :64] = torch.tensor([float("nan"), float("inf"), -0.0, 0.0] * 16, device="cuda")
    want = ref.indexer_topk(scores[None], visible[None], 512)[0]
    want_index = ref.visible_index(want, 512)
    for name, (mask_form, index_form) in MASK_FORMS.items():
        if name == "held" and E > indexer_topk.HELD_ROW:
            continue
        assert torch.equal(mask_form(scores, visible, 512), want), name
        assert torch.equal(index_form(scores, visible, 512), want_index), name
    _replays_on_new_scores(indexer_topk.indexer_topk, scores.clone(), visible, gen,
                           lambda new: ref.indexer_topk(new[None], visible[None], 512)[0])


def _replays_on_new_scores(form, static: torch.Tensor, rows: torch.Tensor, gen: torch.Generator, reference) -> None:
    """``form(static, rows, 512)`` captured in a CUDA graph, then replayed on new bf16-rounded scores written into
    ``static``: its output is ``reference`` of them."""
    form(static, rows, 512)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = form(static, rows, 512)
    static.copy_(torch.randn(static.shape, generator=gen, device="cuda").bfloat16().float())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, reference(static))


def _compile(fn, signature: dict, constexprs: dict, capability: int, num_warps: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    source = ASTSource(fn, signature, constexprs={(fn.arg_names.index(n),): v for n, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": num_warps})


def _ptxas_usage(ptx: str, capability: int, tmp_path) -> tuple[int, int]:
    """Registers a thread and spilled bytes (stores + loads) of ``ptx`` by Triton's own ``ptxas -v`` (what a GPU's
    ``kernel.n_regs`` / ``n_spills`` would say, without one)."""
    import re
    import subprocess

    from triton.backends.nvidia.compiler import get_ptxas

    source = tmp_path / "kernel.ptx"
    source.write_text(ptx)
    log = subprocess.run([get_ptxas(capability).path, "-v", f"--gpu-name=sm_{capability}a", str(source), "-o",
                          str(tmp_path / "kernel.cubin")], check=True, capture_output=True, text=True).stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return registers, spills


@pytest.mark.skipif(INTERPRETED, reason="ahead-of-time compiles need the real Triton compiler, not the interpreter")
@pytest.mark.parametrize("capability", [90, 100])
def test_kernels_compile_for_sm90a_and_sm100a(capability):
    """The kernels compile for the GPU targets on a machine without one (Triton compiles ahead of time)."""
    counted = {"scores_ptr": "*fp32", "counts_ptr": "*i32", "out_ptr": "*i32", "E": "i32", "k": "i32"}
    signatures = {
        "_radix_topk_kernel": {"scores_ptr": "*fp32", "visible_ptr": "*u8", "out_ptr": "*u8", "E": "i32", "k": "i32"},
        "_order_keys_kernel": {"scores_ptr": "*fp32", "visible_ptr": "*u8", "keys_ptr": "*i64", "numel": "i64",
                               "E": "i32"},
        "_radix_topk_index_kernel": {"scores_ptr": "*fp32", "visible_ptr": "*u8", "out_ptr": "*i32", "E": "i32",
                                     "k": "i32"},
        "_radix_topk_counts_kernel": counted,
        "_order_keys_counts_kernel": {"scores_ptr": "*fp32", "counts_ptr": "*i32", "keys_ptr": "*i64",
                                      "numel": "i64", "E": "i32"},
    }
    for name, signature in signatures.items():
        compiled = _compile(getattr(indexer_topk, name), signature, {"BLOCK": indexer_topk.BLOCK}, capability, 4)
        assert f".target sm_{capability}a" in compiled.asm["ptx"], name


@pytest.mark.skipif(INTERPRETED, reason="ahead-of-time compiles need the real Triton compiler, not the interpreter")
@pytest.mark.parametrize("capability", [90, 100])
def test_wide_counted_kernels_compile_without_spills(capability, tmp_path):
    """The wide-digit counted kernels as ``wide_topk_index_counts`` launches them, for each held row size up to
    ``HELD_ROW`` (written from registers up to ``HELD_WRITE_ROW``): no register spills
    (the held row stays in registers) within the register file's share of each program's warps."""
    counted = {"scores_ptr": "*fp32", "counts_ptr": "*i32", "out_ptr": "*i32", "E": "i32", "k": "i32"}
    launches = []
    for E in (1000, 2048, 4096, 8192, 16384, 16385, 32768):
        meta = indexer_topk.held_launch(E)
        launches.append(("_radix_topk_counts_held_kernel", meta, meta.pop("num_warps")))
    assert launches[-1][1]["ROW"] == indexer_topk.HELD_ROW and not launches[-1][1]["WRITE_HELD"]
    assert launches[-2][1]["ROW"] == indexer_topk.HELD_ROW and launches[-3][1]["WRITE_HELD"]
    for name, constexprs, warps in launches:
        compiled = _compile(getattr(indexer_topk, name), counted, constexprs, capability, warps)
        registers, spills = _ptxas_usage(compiled.asm["ptx"], capability, tmp_path)
        assert spills == 0 and registers <= min(255, 65536 // (32 * warps)), (name, constexprs, registers, spills)


@pytest.mark.skipif(INTERPRETED, reason="ahead-of-time compiles need the real Triton compiler, not the interpreter")
@pytest.mark.parametrize("capability", [90, 100])
def test_wide_mask_kernels_compile_without_spills(capability, tmp_path):
    """The wide-digit mask kernels (selection mask and indices) as ``wide_topk`` / ``wide_topk_index`` launch them,
    for each held row size up to ``HELD_ROW``: no register spills within the register
    file's share of each program's warps."""
    launches = []
    for index in (False, True):
        signature = {"scores_ptr": "*fp32", "visible_ptr": "*u8", "out_ptr": "*i32" if index else "*u8", "E": "i32",
                     "k": "i32"}
        for E in (1000, 2048, 4096, 8192, 16384, 16385, 32768):
            meta = indexer_topk.held_launch(E)
            warps = meta.pop("num_warps")
            launches.append(("_radix_topk_held_kernel", signature, {**meta, "INDEX": index}, warps))
    for name, signature, constexprs, warps in launches:
        compiled = _compile(getattr(indexer_topk, name), signature, constexprs, capability, warps)
        registers, spills = _ptxas_usage(compiled.asm["ptx"], capability, tmp_path)
        assert spills == 0 and registers <= min(255, 65536 // (32 * warps)), (name, constexprs, registers, spills)


@pytest.mark.skipif(INTERPRETED, reason="ahead-of-time compiles need the real Triton compiler, not the interpreter")
@pytest.mark.parametrize("capability", [90, 100])
def test_split_kernels_compile_without_spills(capability, tmp_path):
    """The split select's two kernels as ``split_topk_index_counts`` launches them for top-512 over an 8K prompt's
    entries, a 128K decode row's (9 chunks), a 512K one's and a 1M one's (16 chunks of 16,384, 8,192 candidates):
    no register spills within the register file's share of each program's warps."""
    first = {"scores_ptr": "*fp32", "counts_ptr": "*i32", "cand_ptr": "*i32", "entry_ptr": "*i32", "E": "i32",
             "k": "i32", "CK": "i32"}
    second = {"cand_ptr": "*i32", "entry_ptr": "*i32", "counts_ptr": "*i32", "out_ptr": "*i32", "E": "i32",
              "k": "i32", "CK": "i32"}
    for E in (2048, 32800, 131072, 262144):
        _, chunk_meta, merge_meta = indexer_topk.split_launch(E, 512)
        for kernel, signature, meta in ((indexer_topk._split_chunk_kernel, first, chunk_meta),
                                        (indexer_topk._split_merge_kernel, second, merge_meta)):
            meta = dict(meta)
            warps = meta.pop("num_warps")
            compiled = _compile(kernel, signature, meta, capability, warps)
            registers, spills = _ptxas_usage(compiled.asm["ptx"], capability, tmp_path)
            assert spills == 0 and registers <= min(255, 65536 // (32 * warps)), (E, meta, registers, spills)


@pytest.mark.skipif(INTERPRETED, reason="ahead-of-time compiles need the real Triton compiler, not the interpreter")
@pytest.mark.parametrize("capability", [90, 100])
def test_filtered_kernels_compile_without_spills(capability, tmp_path):
    """The filtered select's kernels as ``filtered_topk_index_counts`` launches them for top-512 over a 128K prompt's
    rows, a 256K one's and a 1M one's (16,384 tile maxima): no register spills within the register file's share of
    each program's warps."""
    import triton

    counted = {"scores_ptr": "*fp32", "counts_ptr": "*i32", "E": "i32"}
    lists = {"key_ptr": "*i32", "entry_ptr": "*i32", "listed_ptr": "*i32"}
    cap = indexer_topk.FILTER_CAP
    launches = [("_listed_select_kernel", {**lists, "out_ptr": "*i32", "k": "i32"},
                 {"CAP": cap, "BLOCK": 1024, "WIDE": indexer_topk.HELD_DIGIT}, indexer_topk.held_warps(cap)),
                ("_listed_overflow_kernel", {**counted, "listed_ptr": "*i32", "out_ptr": "*i32", "k": "i32"},
                 {"CAP": cap, "BLOCK": 1024}, 4),
                ("_tile_max_kernel", {**counted, "max_ptr": "*i32", "T": "i32"},
                 {"TILE": indexer_topk.FILTER_TILE, "TILES": indexer_topk.TILE_MAX_TILES}, 8),
                ("_list_kernel", {**counted, "floor_ptr": "*i32", **lists},
                 {"CAP": cap, "BLOCK": indexer_topk.LIST_BLOCK}, indexer_topk.LIST_WARPS)]
    for E in (32768, 65536, 262144):
        assert indexer_topk.filter_fits(E, 512)
        t_row = max(triton.next_power_of_2(triton.cdiv(E, indexer_topk.FILTER_TILE)), 1024)
        launches.append(("_floor_kernel", {**counted, "max_ptr": "*i32", "floor_ptr": "*i32", "T": "i32", "k": "i32"},
                         {"TILE": indexer_topk.FILTER_TILE, "T_ROW": t_row, "WIDE": indexer_topk.HELD_DIGIT},
                         indexer_topk.held_warps(t_row)))
    for name, signature, constexprs, warps in launches:
        fn = getattr(indexer_topk, name)
        signature = {arg: signature[arg] for arg in fn.arg_names if arg in signature}
        compiled = _compile(fn, signature, constexprs, capability, warps)
        registers, spills = _ptxas_usage(compiled.asm["ptx"], capability, tmp_path)
        assert spills == 0 and registers <= min(255, 65536 // (32 * warps)), (name, constexprs, registers, spills)

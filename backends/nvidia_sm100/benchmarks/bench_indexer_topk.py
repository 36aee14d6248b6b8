"""Lightning-indexer selection (``indexer_topk``, top-512): the reference op (a stable sort of every row) against the
NVIDIA op's forms (``kernels/indexer_topk.py``): the radix select per row in 4-bit digits (``radix_topk``), in wide
digits with the row held on chip (``wide_topk``, ``DEEPINFER_NVIDIA_RADIX_TOPK_WIDE``: rows of up to 32,768 entries),
and order keys + ``torch.topk``, at the query x entry shapes one CSA layer sees at long context: an 8K prompt's chunk,
16K-token chunks late in 64K and 128K prompts, one 1,024-row slice of a 16K chunk at 1M context
(``DEEPINFER_INDEXER_CHUNK_ENTRIES``'s default), and decode rows: batch 16 and 1 at 128K, batch 1 at 256K and 1M.

    python backends/nvidia_sm100/benchmarks/bench_indexer_topk.py      # on a GPU; prints two tables

The second table times the selection as entry indices (index mode, ``DEEPINFER_SPARSE_CSA_ATTENTION=1``): the radix
select reading the ``[S, Lq, E]`` mask (``indexer_topk_index``) against the forms reading per-row visible counts
``[S, Lq]`` (``indexer_topk_index_counts``: the 4-bit radix select over each row's visible prefix; the held wide form
``wide_topk_index_counts``; counted keys + ``torch.topk``; the two-stage split ``split_topk_index_counts``, each
chunk's top-k, then the row's among the candidates; the filtered select ``filtered_topk_index_counts``, a floor
from the row's tile maxima, then the top-k of the entries at or above it; and the op as it dispatches). A form that
does not take a shape (the held ones past 32,768 entries) shows ``-``.

Checks each form against the reference first (``torch.equal`` of the selections; any difference stops the run), then
times them (CUDA events, median of repeats, after warmup; the second table's decode rows replayed from CUDA graphs).
Floor = bytes of scores, visibility and selection (4 + 1 + 1 per score) / 4.25 TB/s (the H200's ceiling,
docs/performance.md): one read of the inputs and one write of the mask.
"""

from __future__ import annotations

import torch
from cuda_timing import cuda_time, graphed

from deepinfer_core.ops import reference as ref

K, BW = 512, 4.25e12
SHAPES = (  # (sequences, query rows, entries, what)
    (1, 8192, 2048, "8K prompt"),
    (1, 16384, 16384, "16K chunk at 64K"),
    (1, 16384, 32768, "16K chunk at 128K"),
    (1, 1024, 262144, "1M: one slice"),
    (16, 1, 32768, "decode b16 at 128K"),
    (1, 1, 32768, "decode b1 at 128K"),
    (1, 1, 65536, "decode b1 at 256K"),
    (1, 1, 262144, "decode b1 at 1M"),
)


def case(S: int, Lq: int, E: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16-rounded normal scores (ties, as bf16 indexer products give) under the CSA's causal visibility (ratio 4)
    for the last ``Lq`` tokens of a ``4 * E``-token context: query ``t`` at position ``p`` sees ``(p + 1) // 4``; as a
    mask ``[S, Lq, E]`` and as counts ``[S, Lq]`` int32."""
    scores = torch.randn(S, Lq, E, device="cuda").bfloat16().float()
    positions = torch.arange(4 * E - Lq, 4 * E, device="cuda")  # [Lq]
    limit = (positions + 1).div(4, rounding_mode="floor")  # [Lq]
    visible = torch.arange(E, device="cuda")[None, None, :] < limit[None, :, None]  # [1, Lq, E]
    counts = limit.to(torch.int32)[None, :].expand(S, -1).contiguous()  # [S, Lq]
    return scores, visible.expand(S, -1, -1).contiguous(), counts


def timed(fn, query_rows: int) -> float:
    """Median seconds per call of ``fn``: decode rows (one query row a sequence) replayed from a CUDA graph, as the
    engine runs a decode step (eager, a form of several launches would time its launches); others eagerly."""
    if query_rows == 1:
        fn = graphed(fn)
    return cuda_time(fn, reps=10)


def main() -> None:
    from deepinfer_nvidia_sm100.kernels.indexer_topk import (
        HELD_ROW,
        filter_fits,
        filtered_topk_index_counts,
        indexer_topk_index_counts,
        keyed_topk,
        keyed_topk_index_counts,
        radix_topk,
        radix_topk_index,
        radix_topk_index_counts,
        split_chunk,
        split_topk_index_counts,
        wide_topk,
        wide_topk_index_counts,
    )

    def held(E: int) -> bool:  # the held forms take rows of at most HELD_ROW entries
        return E <= HELD_ROW

    mask_forms = {"radix 4-bit": (radix_topk, None), "radix wide": (wide_topk, held),
                  "keys + torch.topk": (keyed_topk, None)}
    counted_forms = {"radix 4-bit, counts": (radix_topk_index_counts, None),
                     "radix wide, counts": (wide_topk_index_counts, held),
                     "keys + torch.topk, counts": (keyed_topk_index_counts, None),
                     "split (chunks, then candidates)": (split_topk_index_counts, lambda E: split_chunk(E, K)),
                     "filtered (tile maxima, floor)": (filtered_topk_index_counts, lambda E: filter_fits(E, K)),
                     "the op": (indexer_topk_index_counts, None)}
    torch.manual_seed(0)
    rows, index_rows = [], []
    for S, Lq, E, what in SHAPES:
        scores, visible, counts = case(S, Lq, E)
        flat = (scores.view(-1, E), visible.view(-1, E))
        counted = (scores.view(-1, E), counts.view(-1))
        want = ref.indexer_topk(scores, visible, K).view(-1, E)
        takes = {name: rule is None or bool(rule(E)) for name, (_, rule) in {**mask_forms, **counted_forms}.items()}
        same = {name: torch.equal(form(*flat, K), want) for name, (form, _) in mask_forms.items() if takes[name]}
        want_index = ref.visible_index(want, K)  # [R, K]
        del want
        same["radix, mask (indices)"] = torch.equal(radix_topk_index(*flat, K), want_index)
        same.update({name: torch.equal(form(*counted, K), want_index) for name, (form, _) in counted_forms.items()
                     if takes[name]})
        del want_index
        floor = S * Lq * E * 6 / BW
        times = {"reference (sort)": cuda_time(lambda a=(scores, visible): ref.indexer_topk(*a, K), reps=5)}
        times.update({name: cuda_time(lambda a=flat, f=form: f(*a, K), reps=10)
                      for name, (form, _) in mask_forms.items() if takes[name]})
        index_times = {"radix, mask": timed(lambda a=flat: radix_topk_index(*a, K), Lq)}
        index_times.update({name: timed(lambda a=counted, f=form: f(*a, K), Lq)
                            for name, (form, _) in counted_forms.items() if takes[name]})
        rows.append((what, S, Lq, E, floor, times))
        index_rows.append((what, S, Lq, E, index_times))
        if not all(same.values()):
            print(f"{what}: differs from the reference: {[name for name, ok in same.items() if not ok]}")
            raise SystemExit("indexer_topk / indexer_topk_index(_counts) differ from the reference op")
        del scores, visible, counts, flat, counted
        torch.cuda.empty_cache()
    print(f"\nindexer_topk, top-{K}, fp32 scores (H200); every form equal to the reference; floor: one read of the "
          "inputs and one write of the mask")
    _table(["floor", "reference (sort)", *mask_forms], [(what, S, Lq, E, {"floor": floor, **times})
                                                        for what, S, Lq, E, floor, times in rows])
    print(f"\nindexer_topk_index / indexer_topk_index_counts, top-{K} as entry indices (H200; decode rows from CUDA "
          "graphs)")
    _table(["radix, mask", *counted_forms], index_rows)


def _table(columns: list[str], rows: list) -> None:
    """A markdown table: shape, sequences x queries x entries, then each column's time (``-`` where a form does not
    take the shape)."""
    print("| shape | sequences x queries x entries | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 2) + "|")
    for what, S, Lq, E, times in rows:
        cells = [f"{times[c] * 1e3:.3f} ms" if c in times else "-" for c in columns]
        print(f"| {what} | {S} x {Lq} x {E} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

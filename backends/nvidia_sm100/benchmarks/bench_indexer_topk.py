"""Lightning-indexer selection (``indexer_topk``, top-512): the reference op (a stable sort of every row) against the
NVIDIA op's forms (``kernels/indexer_topk.py``: the Triton radix select per row, 4-bit digits, ``radix_topk``, and
wide digits, ``wide_topk`` (``DEEPINFER_NVIDIA_RADIX_TOPK_WIDE``): rows of up to 32,768 entries held on chip, longer
ones 3 passes of 12, 12 and 8 bits + the write; order keys + ``torch.topk``), at the query x entry shapes one CSA
layer sees at long context: an 8K prompt's chunk, 16K-token chunks late in 64K and 128K prompts, one 1,024-row slice
of a 16K chunk at 1M context (``DEEPINFER_INDEXER_CHUNK_ENTRIES``'s default), and decode rows: batch 16 and 1 at
128K, batch 1 at 256K and 1M.

    python backends/nvidia_sm100/benchmarks/bench_indexer_topk.py      # on a GPU; prints two tables

The second table times the selection as entry indices (index mode, ``DEEPINFER_SPARSE_CSA_ATTENTION=1``): the radix
select reading the ``[S, Lq, E]`` mask (``indexer_topk_index``) against the forms reading per-row visible counts
``[S, Lq]`` (``indexer_topk_index_counts``: the 4-bit radix select over each row's visible prefix; the wide-digit
form, ``wide_topk_index_counts``: rows of up to 32,768 entries held on chip, longer ones 3 passes of 12, 12 and 8
bits + the write; its passes over memory alone, ``held_row=0``; counted keys + ``torch.topk``; the two-stage split,
``split_topk_index_counts``: each 4,096-entry chunk's top-k, then the row's among the candidates; and the op as it
dispatches), each checked against the reference's indices first.

Checks each form against the reference first (``torch.equal`` of the selections), then times them (CUDA events,
median of repeats, after warmup; the second table's decode rows replayed from CUDA graphs). Floor = bytes of scores, visibility and selection (4 + 1 + 1 per score) / 4.25 TB/s (the
H200's ceiling, docs/performance.md): one read of the inputs and one write of the mask.
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
        indexer_topk_index_counts,
        keyed_topk,
        keyed_topk_index_counts,
        radix_topk,
        radix_topk_index,
        radix_topk_index_counts,
        split_topk_index_counts,
        wide_topk,
        wide_topk_index_counts,
    )

    def passes(scores: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
        return wide_topk_index_counts(scores, counts, k, held_row=0)

    def op(scores: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
        return indexer_topk_index_counts(scores, counts, k)

    counted_forms = (radix_topk_index_counts, wide_topk_index_counts, passes, keyed_topk_index_counts,
                     split_topk_index_counts, op)
    torch.manual_seed(0)
    rows, index_rows = [], []
    for S, Lq, E, what in SHAPES:
        scores, visible, counts = case(S, Lq, E)
        flat = (scores.view(-1, E), visible.view(-1, E))
        counted = (scores.view(-1, E), counts.view(-1))
        want = ref.indexer_topk(scores, visible, K).view(-1, E)
        same = [torch.equal(form(*flat, K), want) for form in (radix_topk, wide_topk, keyed_topk)]
        want_index = ref.visible_index(want, K)  # [R, K]
        del want
        same_index = [torch.equal(radix_topk_index(*flat, K), want_index)]
        same_index += [torch.equal(form(*counted, K), want_index)
                       for form in counted_forms]
        del want_index
        floor = S * Lq * E * 6 / BW
        t_ref = cuda_time(lambda a=(scores, visible): ref.indexer_topk(*a, K), reps=5)
        t_radix = cuda_time(lambda a=flat: radix_topk(*a, K), reps=10)
        t_wide = cuda_time(lambda a=flat: wide_topk(*a, K), reps=10)
        t_keyed = cuda_time(lambda a=flat: keyed_topk(*a, K), reps=10)
        rows.append((what, S, Lq, E, same, floor, t_ref, t_radix, t_wide, t_keyed))
        times = [timed(lambda a=flat: radix_topk_index(*a, K), Lq)]
        times += [timed(lambda a=counted, f=form: f(*a, K), Lq) for form in counted_forms]
        index_rows.append((what, S, Lq, E, same_index, times))
        del scores, visible, counts, flat, counted
        torch.cuda.empty_cache()
    print(f"\nindexer_topk, top-{K}, fp32 scores (H200)")
    print("| shape | sequences x queries x entries | equal (radix 4-bit, wide, keyed) | floor | reference (sort) | "
          "radix 4-bit | radix wide | keys + torch.topk | wide % floor | wide speed-up | wide over 4-bit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for what, S, Lq, E, same, floor, a, b, w, c in rows:
        print(f"| {what} | {S} x {Lq} x {E} | {', '.join(map(str, same))} | {floor * 1e3:.3f} ms | {a * 1e3:.3f} ms | "
              f"{b * 1e3:.3f} ms | {w * 1e3:.3f} ms | {c * 1e3:.3f} ms | {100 * floor / w:.0f}% | {a / w:.1f}x | "
              f"{b / w:.2f}x |")
    print(f"\nindexer_topk_index / indexer_topk_index_counts, top-{K} as entry indices (H200)")
    print("| shape | sequences x queries x entries | equal (mask radix, counts radix 4-bit, wide, wide passes, "
          "keyed, split, op) | radix, mask | radix 4-bit, counts | radix wide, counts | wide passes only | "
          "keys + torch.topk, counts | split (chunks, then candidates) | the op | counts speed-up | wide over 4-bit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for what, S, Lq, E, same, (a, b, w, p, c, sp, o) in index_rows:
        print(f"| {what} | {S} x {Lq} x {E} | {', '.join(map(str, same))} | {a * 1e3:.3f} ms | {b * 1e3:.3f} ms | "
              f"{w * 1e3:.3f} ms | {p * 1e3:.3f} ms | {c * 1e3:.3f} ms | {sp * 1e3:.3f} ms | {o * 1e3:.3f} ms | "
              f"{a / b:.2f}x | {b / w:.2f}x |")
    if not all(all(row[4]) for row in rows) or not all(all(row[4]) for row in index_rows):
        raise SystemExit("indexer_topk / indexer_topk_index(_counts) differ from the reference op")


if __name__ == "__main__":
    main()

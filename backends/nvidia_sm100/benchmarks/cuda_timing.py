"""CUDA timing shared by the benchmark scripts in this folder (run them as scripts: this folder is on sys.path).

Method (docs/performance.md): warm up, time with CUDA events, median of repeats.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from collections.abc import Callable, Iterator

import torch

BACK_TO_BACK = 5  # calls queued between an event pair where the time of one small product matters: the host's
# launch (or graph replay) of each call then overlaps the GPU's previous one, as a step's kernels follow each other,
# instead of counting as GPU time


def cuda_time(fn: Callable[[], object], reps: int = 20, inner: int = 1, warmup: int = 3) -> float:
    """Median seconds per call of ``fn``: ``reps`` event pairs, each around ``inner`` back-to-back calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(times)


def graphed(fn: Callable[[], object], strict: bool = True) -> Callable[[], None] | None:
    """``fn`` captured in a CUDA graph (its inputs stay fixed) after two warm-up calls on a side stream; returns
    the replay callable. With ``strict=False`` a failed capture is printed and None is returned."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay
    except Exception as exc:  # any capture failure is reported, not raised, when strict is off
        if strict:
            raise
        print(f"graph capture failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def ab_row(label: str, size: int, floor: float, baseline: Callable[[], torch.Tensor],
           candidate: Callable[[], torch.Tensor], tol: float = 2e-2) -> tuple:
    """Check ``candidate`` against ``baseline`` (max error relative to the largest value below ``tol``), then time
    both replayed from CUDA graphs: ``(label, size, floor, baseline seconds, candidate seconds)``."""
    want, got = baseline().float(), candidate().float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < tol, f"{label} at {size}: max relative error {err:.1e}"
    return label, size, floor, cuda_time(graphed(baseline)), cuda_time(graphed(candidate))


def print_ab_table(title: str, columns: tuple[str, str, str, str], rows: list[tuple]) -> None:
    """The ``ab_row`` rows as a markdown table; ``columns`` = (label, size, baseline, candidate) headers."""
    label, size, base, cand = columns
    print(f"\n{title}; % = floor / time")
    print(f"| {label} | {size} | floor | {base} | {cand} | faster |")
    print("|---|---|---|---|---|---|")
    for name, n, floor, a, b in rows:
        print(f"| {name} | {n} | {floor * 1e6:.2f} us | {a * 1e6:.1f} us ({100 * floor / a:.0f}%) | "
              f"{b * 1e6:.1f} us ({100 * floor / b:.0f}%) | {cand if b < a else base} |")


@contextlib.contextmanager
def module_settings(module, **values) -> Iterator[None]:
    """``module``'s attributes set to ``values`` for the block (the kernels' launch settings, read at each call),
    then restored: one variant of a benchmark."""
    before = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(module, name, value)

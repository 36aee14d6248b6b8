"""The static decode step's index math compiled by TorchInductor (``compiled.compiled_ops``: ``decode_key_index``,
``decode_entry_places``, ``decode_window_plan``) against the reference ops, value for value.

Eagerly these ops are ~100 small integer kernels per decode step; compiled with dynamic shapes, one compile per op
serves every batch size above one. Runs on the CPU (Inductor's C++ backend): the same graph Inductor lowers to
Triton on the GPU, where ``test_model_gpu.py`` runs the decode steps that use them.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the test extra installs triton")
from deepinfer_nvidia_sm100.kernels import compiled

from deepinfer_core.ops import reference as ref

WINDOW, BLOCK, CONTEXT = 16, 32, 256
SPARE_SLOT, SPARE_BLOCK = 13, 70


def _inputs(num_seqs: int, seed: int):
    """Per-sequence inputs of a decode step: contexts on both sides of window ends, floors and write starts."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(0, CONTEXT - 1, (num_seqs,), generator=g)
    ctx[0] = 3  # ends a ratio-4 window
    floor = torch.where(torch.rand(num_seqs, generator=g) < 0.5, 0, ctx // 2)
    write_start = torch.where(torch.rand(num_seqs, generator=g) < 0.5, 0, ctx)
    slots = torch.randperm(SPARE_SLOT, generator=g)[:num_seqs]
    tables = torch.randint(0, SPARE_BLOCK, (num_seqs, CONTEXT // BLOCK), generator=g)
    return ctx, floor, write_start, slots, tables, torch.arange(num_seqs)


def _calls(num_seqs: int, seed: int):
    ctx, floor, write_start, slots, tables, seq = _inputs(num_seqs, seed)
    yield "decode_key_index", (ctx, floor, seq, torch.arange(WINDOW), WINDOW)
    for ratio, span in ((4, 8), (32, 32)):  # overlapping (CSA-like) and whole-block (HCA-like) windows
        yield "decode_entry_places", (ctx, tables, torch.arange(CONTEXT // ratio), ratio, BLOCK // ratio)
        yield "decode_window_plan", (ctx, write_start, slots, tables, seq, torch.arange(span), ratio, span,
                                     BLOCK // ratio, SPARE_SLOT, SPARE_BLOCK)


@pytest.mark.parametrize("num_seqs", [1, 5])
def test_compiled_decode_index_ops_equal_the_reference(monkeypatch, num_seqs):
    monkeypatch.setenv("DEEPINFER_NVIDIA_COMPILE", "1")
    ops = compiled.compiled_ops()
    for seed in range(2):
        for name, args in _calls(num_seqs, seed):
            want, got = getattr(ref, name)(*args), ops[name](*args)
            assert len(got) == len(want), name
            for i, (w, o) in enumerate(zip(want, got, strict=True)):
                assert o.shape == w.shape and o.dtype == w.dtype, (name, i, o.shape, w.shape)
                assert torch.equal(o, w), f"{name} output {i} differs (batch {num_seqs}, seed {seed})"


def test_the_index_ops_are_compiled_overrides(monkeypatch):
    monkeypatch.setenv("DEEPINFER_NVIDIA_COMPILE", "1")
    ops = compiled.compiled_ops()
    for name in ("decode_key_index", "decode_entry_places", "decode_window_plan"):
        assert ops[name] is not getattr(ref, name) and ops[name].__name__ == name
    monkeypatch.setenv("DEEPINFER_NVIDIA_COMPILE", "0")
    assert compiled.compiled_ops() == {}


def test_graph_only_ops_run_eagerly_outside_a_capture_and_compiled_inside(monkeypatch):
    """``compiled_in_graphs``: outside ``capturing()`` a call runs the function itself, inside (nested too) its
    ``maybe_compile`` form; the table's graph-only ops are built that way."""
    monkeypatch.setenv("DEEPINFER_NVIDIA_COMPILE", "1")
    routed = []
    monkeypatch.setattr(compiled, "maybe_compile", lambda fn: lambda *a: routed.append("compiled") or fn(*a))

    def scaled(x):
        routed.append("eager")
        return (x * 3 + 1).sin()

    op, x = compiled.compiled_in_graphs(scaled), torch.linspace(-2, 2, 16)
    want = (x * 3 + 1).sin()
    torch.testing.assert_close(op(x), want)
    with compiled.capturing():
        torch.testing.assert_close(op(x), want)
        with compiled.capturing():
            op(x)
    torch.testing.assert_close(op(x), want)
    assert routed == ["eager", "compiled", "eager", "compiled", "eager", "eager"]
    ops = compiled.compiled_ops()
    assert set(compiled.GRAPH_ONLY_OPS) <= set(ops) and ops["rope_cos_sin"].__name__ == "rope_cos_sin"

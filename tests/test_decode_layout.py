"""``DecodeLayout`` (a static decode step's layout, computed by device ops inside the graph) against ``StepLayout``
(the host-built layout of the same batch, the spec): equal wherever the dynamic layout has values, invisible padding
elsewhere, one compressor window per sequence with dummies writing only the spare state."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer_core.forward_batch import ForwardBatch
from deepinfer_core.models.deepseek_v4.layout import DecodeInputs, DecodeLayout, StaticShape, StepLayout

WINDOW, BLOCK, CONTEXT = 8, 16, 64
WINDOWS = ((4, 8), (8, 8))  # (ratio, span): an overlapping CSA-like compressor and an HCA-like one
SPARE_SLOT, SPARE_BLOCK = 9, 40


def decode_batch(rng: random.Random, real: int, padded: int) -> ForwardBatch:
    """``real`` one-token sequences of random lengths (some with a replay floor / write start), then dummies."""
    ctxs = [rng.randrange(CONTEXT) for _ in range(real)]
    blocks = rng.sample(range(SPARE_BLOCK), real * (CONTEXT // BLOCK))
    tables = [blocks[i * 4:i * 4 + ctx // BLOCK + 1] for i, ctx in enumerate(ctxs)]
    floors = [rng.choice([0, rng.randint(0, ctx)]) for ctx in ctxs]
    pad = padded - real
    return ForwardBatch(
        input_ids=torch.zeros(padded, dtype=torch.long), positions=torch.tensor(ctxs + [0] * pad),
        query_start=list(range(padded + 1)), context_lens=ctxs + [0] * pad,
        slots=rng.sample(range(SPARE_SLOT), real) + [SPARE_SLOT] * pad,
        block_tables=tables + [[SPARE_BLOCK]] * pad, logits_rows=torch.arange(padded),
        compressed_write_start=[rng.choice([0, f, c]) for f, c in zip(floors, ctxs)] + [0] * pad, sliding_floor=floors + [0] * pad)


def layouts(batch: ForwardBatch) -> tuple[StepLayout, DecodeLayout]:
    static = StaticShape(batch.num_seqs, WINDOW, CONTEXT, SPARE_SLOT, SPARE_BLOCK, WINDOWS,
                         tuple(r for r, _ in WINDOWS))
    dynamic = StepLayout(batch, WINDOW, BLOCK, torch.device("cpu"))
    return dynamic, DecodeLayout(DecodeInputs.from_batch(batch, static, BLOCK), WINDOW, BLOCK, static)


@pytest.mark.parametrize("seed", range(12))
def test_decode_layout_equals_the_host_layout(seed):
    rng = random.Random(seed)
    batch = decode_batch(rng, real=rng.randint(1, 6), padded=8)
    dynamic, decode = layouts(batch)
    x = torch.randn(batch.num_seqs, 3)
    assert torch.equal(decode.pad(x), dynamic.pad(x)) and torch.equal(decode.unpad(decode.pad(x)), x)
    for name in ("query_valid", "query_rows", "query_positions", "token_seq", "token_offset",
                 "ring_write_rows", "ring_write_slots", "ring_write_index"):
        assert torch.equal(getattr(decode, name), getattr(dynamic, name)), name
    width = dynamic.key_from_new.shape[1]
    for name in ("key_from_new", "key_new_rows", "key_slots", "key_ring_index"):
        assert torch.equal(getattr(decode, name)[:, :width], getattr(dynamic, name)), name
    assert torch.equal(decode.sliding_visible[..., :width], dynamic.sliding_visible)
    assert not decode.sliding_visible[..., width:].any()
    for ratio, span in WINDOWS:
        ours, spec = decode.entries(ratio), dynamic.entries(ratio)
        width = spec.blocks.shape[1]
        assert torch.equal(ours.blocks[:, :width], spec.blocks) and torch.equal(ours.rows[:, :width], spec.rows)
        assert torch.equal(ours.visible[..., :width], spec.visible) and not ours.visible[..., width:].any()
        assert_same_windows(decode.windows(ratio, span), dynamic.windows(ratio, span))


def assert_same_windows(ours, spec) -> None:
    """Our plan has a window per sequence: the real ones (in sequence order) equal the spec's, the rest are
    dummies that read the spare slot and write the spare block; carry writes are the same."""
    real = ours.write_blocks != SPARE_BLOCK  # [S]
    assert int(real.sum()) == spec.num_windows
    for name in ("from_new", "new_rows", "carry_slots", "carry_index", "valid", "entry_positions", "write_blocks",
                 "write_rows"):
        assert torch.equal(getattr(ours, name)[real], getattr(spec, name)), name
    assert (ours.carry_slots[~real] == SPARE_SLOT).all() and not ours.from_new[~real].any()
    for name in ("carry_write_rows", "carry_write_slots", "carry_write_index"):
        assert torch.equal(getattr(ours, name), getattr(spec, name)), name


def test_some_batches_complete_windows_and_some_have_none():
    """The randomised batches above exercise both cases (else the window comparison would test dummies only), and
    windows that a write start keeps from being rewritten."""
    completed, kept = [], 0
    for seed in range(12):
        rng = random.Random(seed)
        batch = decode_batch(rng, real=rng.randint(1, 6), padded=8)
        completed.append(layouts(batch)[0].windows(4, 8).num_windows)
        kept += sum((c + 1) % 4 == 0 and (c // 4) * 4 < w
                    for c, w in zip(batch.context_lens, batch.compressed_write_start, strict=True))
    assert min(completed) == 0 < max(completed) and kept > 0


def test_decode_inputs_refuse_a_batch_that_is_not_one_token_per_sequence():
    batch = ForwardBatch.build([[1, 2], [3]], [0, 5], [0, 1], [[0], [1]])
    static = StaticShape(2, WINDOW, CONTEXT, SPARE_SLOT, SPARE_BLOCK, WINDOWS, (4, 8))
    with pytest.raises(ValueError, match="one token each"):
        DecodeInputs.from_batch(batch, static, BLOCK)


def test_the_visibility_masks_are_computed_on_the_target_device():
    """The ``[S, Lq, Lk]`` / ``[S, Lq, E]`` masks grow with the square of a prefill's tokens: they are broadcast on the
    model's device from small copied tensors, not built on the host (meta tensors stand in for a GPU here)."""
    batch = ForwardBatch.build([[1] * 40, [2] * 40], [0, 8], [0, 1], [[0, 1, 2], [3, 4, 5]])
    layout = StepLayout(batch, WINDOW, BLOCK, torch.device("meta"))
    assert layout.sliding_visible.device.type == "meta" and layout.sliding_visible.shape == (2, 40, 47)
    assert layout.entries(4).visible.device.type == "meta" and layout.entries(4).visible.shape == (2, 40, 12)


def test_an_eager_layout_reaches_the_device_in_one_copy(monkeypatch):
    """Every index tensor of a step, every compressor plan included, travels in one host-to-device copy: on CUDA
    each copy from pageable memory waits for the stream to drain (the host stalled behind the running step once
    per tensor). Meta tensors stand in for the GPU; a plan the model did not name costs one more copy."""
    copies = []
    to = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        out = to(self, *args, **kwargs)
        if self.device.type == "cpu" and out.device.type == "meta":
            copies.append(tuple(self.shape))
        return out

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    batch = ForwardBatch.build([[1] * 40, [2] * 40], [0, 8], [0, 1], [[0, 1, 2], [3, 4, 5]])
    layout = StepLayout(batch, WINDOW, BLOCK, torch.device("meta"), windows=WINDOWS, entry_ratios=(4, 8))
    assert len(copies) == 1
    for ratio, span in WINDOWS:
        assert layout.windows(ratio, span).new_rows.device.type == "meta"
        assert layout.entries(ratio).blocks.device.type == "meta"
    assert len(copies) == 1  # all built with the layout
    layout.entries(16)
    assert len(copies) == 2


def test_attention_visibility_is_made_once_per_ratio_for_the_layouts_own_entries():
    """``attention_visible``: the window's visibility, then the entries'; shared by the layers that read the layout's
    own entries of a ratio, made anew for an indexer's selection."""
    batch = decode_batch(random.Random(3), real=4, padded=8)
    for layout in layouts(batch):
        own = layout.entries(4).visible
        first = layout.attention_visible(4, own)
        assert torch.equal(first, torch.cat([layout.sliding_visible, own], dim=-1))
        assert layout.attention_visible(4, own) is first
        selected = own.clone()
        selected[..., 0] = False  # an indexer's selection: another tensor
        chosen = layout.attention_visible(4, selected)
        assert chosen is not first and torch.equal(chosen, torch.cat([layout.sliding_visible, selected], dim=-1))

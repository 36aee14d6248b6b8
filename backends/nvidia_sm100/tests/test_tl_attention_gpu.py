"""TileLang sink attention against the reference op on the GPU (marker ``nvidia``; needs TileLang)."""

import pytest
import torch

from deepinfer_core.ops import reference as ref

pytestmark = pytest.mark.nvidia
H, D = 64, 512


def _case(S, Lq, Lk, dtype, seed=0, sparse=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(S, Lq, H, D, device="cuda", generator=g).to(dtype)  # [S, Lq, H, d]
    kv = torch.randn(S, Lk, D, device="cuda", generator=g).to(dtype)  # [S, Lk, d]
    visible = torch.rand(S, Lq, Lk, device="cuda", generator=g) < 0.7  # [S, Lq, Lk]
    if sparse:  # each row sees ~25% of the 64-key blocks (prefill: a window plus selected entries)
        blocks = torch.rand(S, Lq, -(-Lk // 64), device="cuda", generator=g) < 0.25
        visible &= blocks.repeat_interleave(64, dim=-1)[..., :Lk]
    visible[0, 0] = False  # a row with nothing visible must give 0
    sinks = torch.randn(H, device="cuda", generator=g)  # [H]
    return q, kv, visible, sinks


@pytest.mark.parametrize("S, Lq, Lk", [(1, 1, 128), (16, 1, 640), (64, 1, 2048), (4, 1, 200), (2, 33, 300)])
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_sink_attention_bf16_matches_fp32_reference(S, Lq, Lk, splits):
    pytest.importorskip("tilelang")
    from deepinfer_nvidia_sm100.kernels import tl_attention as tla

    q, kv, visible, sinks = _case(S, Lq, Lk, torch.bfloat16)
    assert tla.supported(q, kv)
    got = tla.sink_attention(q, kv, visible, sinks, D**-0.5, splits=splits)
    want = ref.sink_attention(q.float(), kv.float(), visible, sinks, D**-0.5)  # same bf16 inputs, fp32 math
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    assert got[0, 0].abs().max().item() == 0.0


@pytest.mark.parametrize("S, Lq, Lk", [(1, 70, 1300), (3, 16, 640)])
def test_rows_that_see_some_key_blocks_read_only_those(S, Lq, Lk):
    """Block-sparse visibility (the prefill case): the kernel walks each row's visible-block list."""
    pytest.importorskip("tilelang")
    from deepinfer_nvidia_sm100.kernels import tl_attention as tla

    q, kv, visible, sinks = _case(S, Lq, Lk, torch.bfloat16, seed=Lk, sparse=True)
    got = tla.sink_attention(q, kv, visible, sinks, D**-0.5)
    want = ref.sink_attention(q.float(), kv.float(), visible, sinks, D**-0.5)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_sink_attention_fp32_and_odd_heads_take_the_reference():
    pytest.importorskip("tilelang")
    from deepinfer_nvidia_sm100.kernels import tl_attention as tla

    q, kv, visible, sinks = _case(2, 1, 96, torch.float32)
    assert not tla.supported(q, kv)
    torch.testing.assert_close(tla.sink_attention(q, kv, visible, sinks, 0.1),
                               ref.sink_attention(q, kv, visible, sinks, 0.1), atol=0, rtol=0)
    q4 = q[:, :, :4].to(torch.bfloat16)
    assert not tla.supported(q4, kv.to(torch.bfloat16))


def test_more_query_rows_than_one_grid_launch_holds(monkeypatch):
    """Mixed prefill + decode steps pad every sequence to the longest chunk (64 x 1024 rows on the bench): past
    the grid's 65535 rows the op launches per group of sequences. Checked with the limit lowered."""
    pytest.importorskip("tilelang")
    from deepinfer_nvidia_sm100.kernels import tl_attention as tla

    q, kv, visible, sinks = _case(5, 24, 300, torch.bfloat16, seed=3)
    whole = tla.sink_attention(q, kv, visible, sinks, D**-0.5)
    monkeypatch.setattr(tla, "MAX_ROWS", 50)  # 2 sequences (48 rows) per launch
    grouped = tla.sink_attention(q, kv, visible, sinks, D**-0.5)
    want = ref.sink_attention(q.float(), kv.float(), visible, sinks, D**-0.5)
    torch.testing.assert_close(grouped.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(grouped.float(), whole.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("S, Lq, Lk, sparse", [(256, 1, 640, False), (1, 70, 1300, True), (3, 16, 640, False)])
def test_whole_row_kernel_equals_split_and_combine(monkeypatch, S, Lq, Lk, sparse):
    """SM90 rows of one key split run one kernel that normalises in its epilogue (no partials, no combine pass,
    the default): the same result as the split kernel with one split followed by the combine
    (``DEEPINFER_TL_ATTN_WHOLE=0``), and the reference's."""
    pytest.importorskip("tilelang")
    from deepinfer_nvidia_sm100.kernels import tl_attention as tla

    if tla.device_arch(torch.device("cuda")) != "sm_90a":
        pytest.skip("the whole-row kernel is built for sm_90a only")
    q, kv, visible, sinks = _case(S, Lq, Lk, torch.bfloat16, seed=Lk + S, sparse=sparse)
    monkeypatch.setenv("DEEPINFER_TL_ATTN_WHOLE", "0")
    split = tla.sink_attention(q, kv, visible, sinks, D**-0.5, splits=1)
    monkeypatch.delenv("DEEPINFER_TL_ATTN_WHOLE")
    whole = tla.sink_attention(q, kv, visible, sinks, D**-0.5, splits=1)
    want = ref.sink_attention(q.float(), kv.float(), visible, sinks, D**-0.5)
    torch.testing.assert_close(whole.float(), split.float(), atol=8e-3, rtol=8e-3)  # one bf16 rounding apart
    torch.testing.assert_close(whole.float(), want, atol=2e-2, rtol=2e-2)
    assert whole[0, 0].abs().max().item() == 0.0

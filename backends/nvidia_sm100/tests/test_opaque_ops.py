"""The kernel wrappers are single opaque custom ops to ``torch.compile`` (``compiled.opaque_under_compile``).

A decode step compiled whole (``DEEPINFER_NVIDIA_COMPILE_STEP=1``) must see each Triton / TileLang wrapper as one
node whose fake implementation gives the real output's shape and dtype. Runs on the CPU: TorchDynamo traces with
``fullgraph=True`` (any graph break fails) into a backend that only records the graph, so no kernel launches;
the fake outputs are checked against the reference op's outputs on the same inputs. The RMS norm kernels are the
exception: under ``torch.compile`` they trace the reference op (``compiled.reference_under_compile``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the test extra installs triton")
from deepinfer_nvidia_sm100.kernels import (
    cache_writes,
    compressor,
    decode_attention,
    gemv,
    hc,
    indexer,
    indexer_topk,
    keys,
    moe,
    norm,
    rope,
    route,
    sparse_attention,
    tl_attention,
)
from deepinfer_nvidia_sm100.kernels.key_blocks import visible_blocks_torch

from deepinfer_core.ops import reference as ref

T, HC, D, H, HD, E, I, TOP_K = 3, 4, 32, 64, 512, 4, 16, 2


def _cases():
    g = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    streams = rand(T, HC, D, dtype=torch.bfloat16)
    mix = (2 + HC) * HC
    cos, sin = rand(T, 8), rand(T, 8)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    q, kv = rand(1, T, H, HD, dtype=torch.bfloat16), rand(1, 5, HD, dtype=torch.bfloat16)
    visible = torch.ones(1, T, 5, dtype=torch.bool)
    return {
        "apply_rope": (rope.apply_rope, ref.apply_rope, (rand(T, H, 64, dtype=torch.bfloat16), cos, sin, True)),
        "hc_pre": (hc.hc_pre, ref.hc_pre, (streams, rand(mix, HC * D), rand(mix), rand(3), 3, 1e-6, 1e-6)),
        "hc_pre_normed": (hc.hc_pre_normed, ref.hc_pre_normed, (streams, rand(mix, HC * D), rand(mix), rand(3), 3,
                                                                1e-6, 1e-6, rand(D))),
        "hc_post": (hc.hc_post, ref.hc_post, (streams, rand(T, D, dtype=torch.bfloat16), rand(T, HC),
                                              rand(T, HC, HC))),
        "hc_post_sum": (hc.hc_post_sum, ref.hc_post_sum, (streams, rand(T, D, dtype=torch.bfloat16),
                                                          rand(T, D, dtype=torch.bfloat16), rand(T, HC),
                                                          rand(T, HC, HC))),
        "moe_experts": (moe.moe_experts, ref.moe_experts, (rand(T, D, dtype=torch.bfloat16), ids, rand(T, TOP_K),
                                                           rand(E, I, D, dtype=torch.bfloat16),
                                                           rand(E, D, I, dtype=torch.bfloat16),
                                                           rand(E, I, D, dtype=torch.bfloat16), 7.0)),
        "gemv_linear": (gemv.linear, ref.linear, (rand(T, 1, D, dtype=torch.bfloat16),
                                                  rand(2048, D, dtype=torch.bfloat16))),
        "gemv_grouped_linear": (gemv.grouped_linear, ref.grouped_linear, (rand(T, 2, D, dtype=torch.bfloat16),
                                                                          rand(2 * 1024, D, dtype=torch.bfloat16), 2)),
        "indexer_scores": (indexer.indexer_scores, ref.indexer_scores, (rand(1, T, 4, 32, dtype=torch.bfloat16),
                                                                        rand(1, 5, 32, dtype=torch.bfloat16),
                                                                        rand(1, T, 4), 0.125)),
        "indexer_topk": (indexer_topk.indexer_topk, ref.indexer_topk, (rand(1, T, 9), rand(1, T, 9) > -0.5, 4)),
        "indexer_topk_index": (indexer_topk.indexer_topk_index, ref.indexer_topk_index,
                               (rand(1, T, 9), rand(1, T, 9) > -0.5, 4)),
        "indexer_topk_index_counts": (indexer_topk.indexer_topk_index_counts, ref.indexer_topk_index_counts,
                                      (rand(1, T, 9), torch.tensor([[0, 5, 9]], dtype=torch.int32), 4)),
        "gather_keys": (keys.gather_keys, ref.gather_keys, _key_case(rand)),
        "compressor_pool_windows": (compressor.pool_windows, _pool_windows_reference, _window_case(rand)),
        "moe_route_topk": (route.moe_route_topk, ref.moe_route_topk, (rand(T, E, dtype=torch.bfloat16), rand(E),
                                                                      TOP_K, 2.5, "sqrtsoftplus")),
        "moe_route_hash": (route.moe_route_hash, ref.moe_route_hash, (rand(T, E, dtype=torch.bfloat16),
                                                                      torch.tensor([3, 0, 7]),
                                                                      torch.randint(0, E, (8, TOP_K), generator=g),
                                                                      2.5, "sqrtsoftplus")),
        "decode_sink_attention": (decode_attention.decode_attention, lambda q, kv, vis, blocks, counts, sinks, scale,
                                  splits: ref.sink_attention(q, kv, vis, sinks, scale),
                                  (q[:, :1], kv, visible[:, :1],
                                   *visible_blocks_torch(visible[:, 0].view(torch.uint8), decode_attention.BLOCK_N),
                                   rand(H), 0.05, 2)),
        "sparse_sink_attention": (sparse_attention.sparse_attention,
                                  lambda q, kv, index, sinks, scale, splits, block_h, *entries:
                                  ref.sparse_sink_attention(q, kv, index, sinks, scale, *entries),
                                  (q, kv, torch.tensor([[[0, 4, 6, -1]] * T], dtype=torch.int32), rand(H), 0.05, 1, 16,
                                   rand(3, 2, HD, dtype=torch.bfloat16), torch.tensor([[2, 0]]),
                                   torch.tensor([[1, 0]]))),
        "visible_index": (sparse_attention.visible_places, ref.visible_index, (visible, 4)),
        "tl_sink_attention": (tl_attention._launch, lambda *a: ref.sink_attention(*a[:5]),
                              (q, kv, visible, rand(H), 0.05, None)),
    }


def _key_case(rand):
    """A ring of 3 slots x 4 keys, 2 sequences x 4 window keys (the last from this step), 3 entries each."""
    ring, store = rand(3, 4, HD, dtype=torch.bfloat16), rand(5, 2, HD, dtype=torch.bfloat16)
    slots = torch.tensor([[0], [2]]).expand(2, 4)
    from_new = torch.tensor([[False] * 3 + [True]] * 2)
    new_rows = torch.where(from_new, torch.tensor([[0], [1]]), 0)
    blocks, rows = torch.tensor([[1, 1, 3], [4, 0, 0]]), torch.tensor([0, 1, 0]).expand(2, 3)
    return ring, slots, torch.arange(4).expand(2, 4), rand(2, HD, dtype=torch.bfloat16), new_rows, from_new, store, \
        blocks, rows


def _window_case(rand):
    """Two CSA windows (ratio 2, 4 slots of d = 8 from a width of 16) over a carry of 3 slots."""
    from_new = torch.tensor([[False, False, True, True], [False, True, True, True]])
    return (rand(T, 16, dtype=torch.bfloat16), rand(T, 16, dtype=torch.bfloat16), rand(3, 4, 16, dtype=torch.bfloat16),
            rand(3, 4, 16, dtype=torch.bfloat16), from_new, torch.tensor([[0, 0, 1, 2], [0, 0, 1, 2]]),
            torch.tensor([[1] * 4, [2] * 4]), torch.arange(4).expand(2, 4), torch.ones(2, 4, dtype=torch.bool),
            rand(2, 16), 2, True)


def _pool_windows_reference(*args):
    """``compressor_pool`` of the windows without its norm: the pooled rows' shape and dtype."""
    kv, gate = ref.compressor_window(*args)
    return (kv * gate.float().softmax(dim=1).to(kv.dtype)).sum(dim=1)


CASES = _cases()


def _flat(out):
    return list(out) if isinstance(out, tuple) else [out]


def _custom_ops_traced(fn, *args) -> list:
    """The ``deepinfer_nvidia`` custom-op nodes of the one graph TorchDynamo traces from ``fn(*args)`` with
    ``fullgraph=True`` (the graph is recorded, never run)."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return _never

    torch._dynamo.reset()
    with pytest.raises(_NotRun):
        torch.compile(fn, backend=record, fullgraph=True)(*args)
    (gm,) = graphs
    return [n for n in gm.graph.nodes if n.op == "call_function" and "deepinfer_nvidia" in str(n.target)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_wrapper_is_one_custom_op_under_compile_with_the_reference_shapes(name):
    wrapper, reference, args = CASES[name]
    ops = _custom_ops_traced(wrapper, *args)
    assert [str(n.target) for n in ops] == [f"deepinfer_nvidia.{name}.default"]
    fake = _flat(ops[0].meta["example_value"])
    want = _flat(reference(*args))
    assert [(tuple(t.shape), t.dtype) for t in fake] == [(tuple(t.shape), t.dtype) for t in want]


def _in_place_cases():
    x = torch.randn(T, H, 64).to(torch.bfloat16)
    cos, sin = torch.randn(T, 8), torch.randn(T, 8)
    cache, src = torch.randn(3, 4, 16).to(torch.bfloat16), torch.randn(5, 16).to(torch.bfloat16)
    slots, index, rows = torch.tensor([2, 0]), torch.tensor([3, 1]), torch.tensor([4, 0])
    return {"apply_rope_": (lambda t: rope.apply_rope_(t, cos, sin, True) + 1, x),
            "write_rows_": (lambda t: cache_writes.write_rows_(t, slots, index, src, rows) * 2, cache)}


@pytest.mark.parametrize("name", ["apply_rope_", "write_rows_"])
def test_in_place_kernel_is_one_mutating_custom_op_under_compile(name):
    """``apply_rope_`` and ``write_rows_`` write into their first argument: under ``torch.compile`` each kernel is
    the custom op ``deepinfer_nvidia::<name>`` declared as mutating it (so Inductor orders its reads after it)."""
    fn, arg = _in_place_cases()[name]
    ops = _custom_ops_traced(fn, arg)
    assert [str(n.target) for n in ops] == [f"deepinfer_nvidia.{name}.default"]
    schema = ops[0].target._schema
    assert schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write


@pytest.mark.parametrize("kernel,reference,weighted,rope", [
    (norm.rms_norm, ref.rms_norm, True, False), (norm.unweighted_rms_norm, ref.unweighted_rms_norm, False, False),
    (norm.rms_norm_rope, ref.rms_norm_rope, True, True), (norm.rms_norm_rope, ref.rms_norm_rope, False, True)])
def test_norm_kernels_trace_the_reference_under_compile(kernel, reference, weighted, rope):
    """The Triton norms step aside inside a compiled step: Dynamo traces the reference op (no custom op, no
    Triton launch, so Inductor can fuse it), and the traced graph computes the reference's result on the CPU."""
    x = torch.randn(T, HC, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    weight = torch.rand(D) + 0.5 if weighted else None
    args = (x, weight, 1e-6) if weighted or rope else (x, 1e-6)
    if rope:
        args += (torch.randn(T, 4).to(torch.bfloat16), torch.randn(T, 4).to(torch.bfloat16))
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    got = torch.compile(kernel, backend=record, fullgraph=True)(*args)
    (gm,) = graphs
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets and not any("deepinfer_nvidia" in t for t in targets)
    torch.testing.assert_close(got, reference(*args), rtol=0, atol=0)


class _NotRun(Exception):
    pass


def _never(*args):
    raise _NotRun("the recorded graph is not run: its kernels need a GPU")

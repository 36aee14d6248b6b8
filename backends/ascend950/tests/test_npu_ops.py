"""HARDWARE tests (markers npu, ci_npu): each torch_npu adapter on an Ascend 950 vs the reference op on the CPU.

Skipped unless the ascend950 probe finds an Ascend 950 with CANN and torch_npu. NEVER RUN YET: written with the
contract tests' inputs at DeepSeek-V4-like sizes (64 heads of 512 with rope 64, 1 shared KV head).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hardware import hardware_marks

from deepinfer_core.ops import reference

pytestmark = hardware_marks()


@pytest.fixture(scope="module")
def npu():
    return importlib.import_module("torch_npu")


@pytest.fixture(scope="module")
def ops(npu):
    from deepinfer_ascend950.ops import NpuOps

    return NpuOps(npu)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _close(got, want, tol):
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_npu_rms_norms(ops, dtype):
    x = torch.randn(37, 4096, generator=_gen()).to(dtype)
    weight = 1 + 0.1 * torch.randn(4096, generator=_gen(1))
    _close(ops.rms_norm(x.npu(), weight.npu(), 1e-6), reference.rms_norm(x.float(), weight, 1e-6), 2e-2)
    _close(ops.unweighted_rms_norm(x.npu(), 1e-6), reference.unweighted_rms_norm(x.float(), 1e-6), 2e-2)


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("shape", [(37, 64, 512), (37, 512)])
def test_npu_apply_rope_interleaved(ops, inverse, shape):
    x = torch.randn(shape, generator=_gen()).to(torch.bfloat16)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    cos, sin = reference.rope_cos_sin(torch.arange(100, 137), inv_freq, 1.0, torch.bfloat16)
    got = ops.apply_rope(x.npu(), cos.npu(), sin.npu(), inverse=inverse)
    _close(got, reference.apply_rope(x.float(), cos.float(), sin.float(), inverse=inverse), 2e-2)


@pytest.mark.parametrize("q_len", [1, 7])
def test_npu_sink_attention_window_plus_entries(ops, q_len):
    seqs, heads, dim, kv_len = 3, 64, 512, 128 + 40  # sliding window keys, then compressed entries
    gen = _gen()
    q = torch.randn(seqs, q_len, heads, dim, generator=gen).to(torch.bfloat16)
    kv = torch.randn(seqs, kv_len, dim, generator=gen).to(torch.bfloat16)
    visible = torch.rand(seqs, q_len, kv_len, generator=gen) < 0.5
    visible[0, 0] = False  # a row that sees nothing must return 0
    sinks = torch.randn(heads, generator=gen)
    got = ops.sink_attention(q.npu(), kv.npu(), visible.npu(), sinks.npu(), dim**-0.5)
    _close(got, reference.sink_attention(q.float(), kv.float(), visible, sinks, dim**-0.5), 2e-2)


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
def test_npu_route_topk(ops, scoring):
    logits = torch.randn(64, 256, generator=_gen())
    bias = 0.1 * torch.randn(256, generator=_gen(1))
    got_w, got_ids = ops.moe_route_topk(logits.npu(), bias.npu(), 6, 1.5, scoring)
    want_w, want_ids = reference.moe_route_topk(logits, bias, 6, 1.5, scoring)
    assert torch.equal(got_ids.cpu(), want_ids)
    _close(got_w, want_w, 1e-4)


def test_npu_moe_experts(ops):
    tokens, top_k, experts, dim, inter = 64, 6, 16, 512, 256
    gen = _gen()
    x = torch.randn(tokens, dim, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    w1, w3 = ((0.05 * torch.randn(experts, inter, dim, generator=gen)).to(torch.bfloat16) for _ in range(2))
    w2 = (0.05 * torch.randn(experts, dim, inter, generator=gen)).to(torch.bfloat16)
    got = ops.moe_experts(x.npu(), ids.npu(), weights.npu(), w1.npu(), w2.npu(), w3.npu(), 10.0)
    want = reference.moe_experts(x.float(), ids, weights, w1.float(), w2.float(), w3.float(), 10.0)
    _close(got, want, 3e-2)


def test_npu_acl_graph_capture_matches_eager(npu):
    from deepinfer_ascend950.backend import Ascend950Backend

    backend = Ascend950Backend(0)
    table = backend.make_op_table()
    weight = torch.rand(1024, device="npu")

    def step(x):
        return table.rms_norm(x, weight, 1e-6) * 2

    x = torch.randn(16, 1024, device="npu")
    replay = backend.capture_graph(step, (x,))
    new = torch.randn(16, 1024, device="npu")
    torch.testing.assert_close(replay(new).clone(), step(new))


def test_npu_memory_and_capabilities(npu):
    from deepinfer_ascend950.backend import Ascend950Backend

    backend = Ascend950Backend(0)
    memory = backend.memory_info()
    assert 0 < memory.free_bytes <= memory.total_bytes
    assert backend.capabilities().distributed_backend == "hccl"

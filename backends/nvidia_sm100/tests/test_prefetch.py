"""The L2 prefetch op (``kernels/prefetch.py``): its plan on the CPU, its kernel compiled for sm_90a and sm_100a
(CI), and on the GPU (marker ``nvidia``) that it changes no result, eagerly and inside a CUDA graph."""

from __future__ import annotations

import re

import pytest
import torch

triton = pytest.importorskip("triton", reason="the test extra installs triton")
from deepinfer_nvidia_sm100.kernels import prefetch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

MB = 2**20


def test_plan_takes_each_weight_from_its_start_in_order_until_the_budget():
    first = torch.empty(4 * MB // 2, dtype=torch.bfloat16)
    second = torch.empty(8 * MB // 2, dtype=torch.bfloat16)
    third = torch.empty(16, dtype=torch.bfloat16)
    segments = prefetch.plan((first, second, third), budget=10 * MB + 5)
    assert [(t is first, t is second, n) for t, n in segments] == [(True, False, 4 * MB), (False, True, 6 * MB + 4)]
    assert [n for _, n in prefetch.plan((first, third), budget=64 * MB)] == [4 * MB, 32]
    assert prefetch.plan((first,), budget=3) == []  # less than one word


def test_plan_keeps_at_most_four_weights():
    weights = tuple(torch.empty(1000, dtype=torch.float32) for _ in range(6))  # 4000 bytes each
    segments = prefetch.plan(weights, budget=2**30)
    assert len(segments) == prefetch.MAX_SEGMENTS and all(n == 4000 for _, n in segments)


def test_prefetch_reads_nothing_for_cpu_tensors_or_prefill_sized_steps():
    weight = torch.ones(64, 64)
    assert prefetch.prefetch(torch.ones(4, 64), weight).join() is None
    assert prefetch.prefetch(torch.ones(prefetch.MAX_ROWS + 1, 64), weight).join() is None
    assert torch.equal(weight, torch.ones(64, 64))


def test_budget_from_the_environment(monkeypatch):
    monkeypatch.setenv(prefetch.BUDGET_ENV, "12.5")
    assert prefetch.budget_bytes(torch.device("cuda", 0)) == int(12.5 * MB)


@pytest.mark.parametrize("capability, arch", [(90, "sm_90a"), (100, "sm_100a")])
def test_kernel_reads_with_evict_last_vector_loads_and_keeps_them(capability, arch):
    """Compiled for the target (no GPU needed): 16-byte loads under an L2 ``evict_last`` policy, and the folded
    word stored (the loads are not dead code)."""
    fn = prefetch._warm_kernel
    signature = {name: "constexpr" if i in fn.constexprs else "*bf16" if name.startswith("p") else
                 "*i32" if name == "sink_ptr" else "i32" for i, name in enumerate(fn.arg_names)}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name.startswith(("p", "n")) and i not in fn.constexprs}
    source = ASTSource(fn, signature, constexprs={(fn.arg_names.index("BLOCK"),): prefetch.BLOCK}, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": 8})
    ptx = compiled.asm["ptx"]
    assert re.search(r"^\.target (\S+)", ptx, re.MULTILINE).group(1) == arch
    assert len(compiled.asm["cubin"]) > 0
    loads = re.findall(r"ld\.global\S*", ptx)
    assert len(loads) >= prefetch.MAX_SEGMENTS and all(".v4" in load for load in loads), loads
    assert "evict_last" in ptx and "st.global" in ptx


@pytest.mark.nvidia
def test_prefetch_changes_no_result_eagerly_and_in_a_cuda_graph():
    from deepinfer_nvidia_sm100.kernels import streams

    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(4096, 4096, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)  # 32 MB
    other = (torch.randn(1024, 4096, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(prefetch.MIN_ROWS, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    snapshot = weight.clone()

    def step():
        warm = prefetch.prefetch(x, weight, other)
        y = torch.nn.functional.linear(x, other)
        out = torch.nn.functional.linear(y.repeat(1, 4), weight)
        warm.join()
        return out

    eager = step()
    handle = prefetch.prefetch(x, weight)
    assert isinstance(handle, streams.Forked) and handle.join() is None  # read for two rows
    assert not isinstance(prefetch.prefetch(x[:1], weight), streams.Forked)  # batch 1: nothing
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(weight, snapshot)


@pytest.mark.nvidia
def test_backend_puts_prefetch_in_the_table():
    from deepinfer_nvidia_sm100.backend import triton_ops

    assert triton_ops()["prefetch"] is prefetch.prefetch

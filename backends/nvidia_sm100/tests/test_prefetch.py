"""The L2 prefetch op (``kernels/prefetch.py``): its plan on the CPU, its kernel compiled for sm_90a and sm_100a
(CI), and on the GPU (marker ``nvidia``) that it changes no result, eagerly and forked inside a CUDA graph."""

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
    first, second, third = torch.empty(4 * MB // 2, dtype=torch.bfloat16), torch.empty(8 * MB // 2,
                                                                                      dtype=torch.bfloat16), \
        torch.empty(16, dtype=torch.bfloat16)
    segments = prefetch.plan((first, second, third), budget=10 * MB + 5)
    assert [(t is first, t is second, n) for t, n in segments] == [(True, False, 4 * MB), (False, True, 6 * MB)]
    whole = prefetch.plan((first, third), budget=64 * MB)
    assert [n for _, n in whole] == [4 * MB, 32]
    assert prefetch.plan((first,), budget=15) == []  # less than one 16-byte unit


def test_plan_rounds_to_16_bytes_and_keeps_at_most_four_weights():
    weights = tuple(torch.empty(1000, dtype=torch.float32) for _ in range(6))  # 4000 bytes each
    segments = prefetch.plan(weights, budget=2**30)
    assert len(segments) == prefetch.MAX_SEGMENTS and all(n == 4000 for _, n in segments)
    assert [n for _, n in prefetch.plan(weights, budget=4000 + 1007)] == [4000, 992]  # 1007 down to 16s


def test_prefetch_skips_cpu_tensors_and_prefill_sized_steps():
    weight = torch.ones(64, 64)
    assert prefetch.prefetch(torch.ones(1, 64), weight) is None  # CPU: nothing launched (no GPU here to launch on)
    assert prefetch.prefetch(torch.ones(prefetch.MAX_ROWS + 1, 64), weight) is None
    assert torch.equal(weight, torch.ones(64, 64))


def test_budget_from_the_environment(monkeypatch):
    monkeypatch.setenv(prefetch.BUDGET_ENV, "12.5")
    assert prefetch.budget_bytes(torch.device("cuda", 0)) == int(12.5 * MB)


@pytest.mark.parametrize("capability, arch", [(90, "sm_90a"), (100, "sm_100a")])
def test_kernel_issues_bulk_l2_prefetches_before_its_pdl_wait(capability, arch):
    """Compiled for the target (no GPU needed): one ``cp.async.bulk.prefetch.L2.global`` per weight, all issued
    before ``griddepcontrol.wait`` (weights are not written by the previous kernel); without PDL no griddepcontrol."""
    fn = prefetch._prefetch_kernel
    signature = {name: "constexpr" if i in fn.constexprs else "*bf16" if name.startswith("p") else "i32"
                 for i, name in enumerate(fn.arg_names)}
    for pdl in (False, True):
        constants = {"CHUNK": prefetch.CHUNK, "LANES": prefetch.LANES, "PDL": pdl}
        source = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
        compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": 1})
        ptx = compiled.asm["ptx"]
        assert re.search(r"^\.target (\S+)", ptx, re.MULTILINE).group(1) == arch
        assert len(compiled.asm["cubin"]) > 0
        issued = [m.start() for m in re.finditer(r"cp\.async\.bulk\.prefetch\.L2\.global", ptx)]
        assert len(issued) == prefetch.MAX_SEGMENTS
        if pdl:
            assert max(issued) < ptx.index("griddepcontrol.launch_dependents") < ptx.index("griddepcontrol.wait")
        else:
            assert "griddepcontrol" not in ptx


@pytest.mark.nvidia
def test_prefetch_changes_no_result_eagerly_and_forked_in_a_cuda_graph():
    from deepinfer_nvidia_sm100.kernels import gemv, streams

    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(4096, 4096, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)  # 32 MB
    other = (torch.randn(1024, 4096, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(1, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    want = gemv.linear(x, weight)
    snapshot = weight.clone()
    prefetch.prefetch(x, weight, other)
    assert torch.equal(gemv.linear(x, weight), want)

    def step():
        warm = streams.fork(prefetch.prefetch, x, weight, other)
        y = gemv.linear(x, other)
        warm.join()
        return gemv.linear(y.view(1, -1).repeat(1, 4), weight)

    eager = step()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(weight, snapshot)


@pytest.mark.nvidia
def test_backend_puts_prefetch_in_the_table():
    from deepinfer_nvidia_sm100.backend import triton_ops

    assert triton_ops()["prefetch"] is prefetch.prefetch

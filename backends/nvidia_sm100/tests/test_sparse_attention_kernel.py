"""``sparse_sink_attention`` and ``visible_index`` (``kernels/sparse_attention.py``) against the reference ops: rows of
V4's window and top-k (128 + 512 listed keys) among thousands of entries, rows listing nothing, lists with -1 holes,
one split and several (decode rows), 16-bit and fp32.

On the GPU the kernels run here; without one in a child pytest process under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the test extra installs triton")
from deepinfer_nvidia_sm100.kernels import sparse_attention
from interpreted import DEVICE, INTERPRETED, kernel_runs_here, run_under_interpreter, starts_the_interpreter

from deepinfer_core.errors import EnvironmentVariableError
from deepinfer_core.ops import reference as ref


@starts_the_interpreter
def test_kernels_under_triton_interpreter():
    run_under_interpreter(__file__, "compile or v4_shape")


def case(S: int, Lq: int, Lk: int, E: int, H: int, d: int, W: int, k: int, dtype: torch.dtype, seed: int = 0):
    """Queries, keys ``[S, Lk + E, d]``, sinks and each row's list: its window (row t: keys t .. t + W - 1 of the first
    ``Lk``), then ``k`` random entries among ``E`` (ascending), a few dropped to -1; row (0, 0) lists nothing."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(S, Lq, H, d, generator=gen).to(dtype)
    kv = torch.randn(S, Lk + E, d, generator=gen).to(dtype)
    sinks = torch.randn(H, generator=gen)
    window = (torch.arange(Lq)[:, None] + torch.arange(W)[None, :]).clamp(max=Lk - 1)  # [Lq, W]
    entries = torch.rand(S, Lq, E, generator=gen).argsort(dim=-1)[..., :k].sort(dim=-1).values + Lk  # [S, Lq, k]
    index = torch.cat([window.expand(S, -1, -1), entries], dim=-1)
    index = torch.where(torch.rand(index.shape, generator=gen) < 0.05, -1, index).to(torch.int32)
    index[0, 0] = -1
    return [t.to(DEVICE) for t in (q, kv, index, sinks)]


TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@kernel_runs_here
@pytest.mark.parametrize(("S", "Lq", "Lk", "E", "H", "d", "W", "k", "splits", "dtype"), [
    (1, 3, 140, 3000, 16, 64, 128, 512, 1, torch.float32),  # V4's window and top-k among thousands of entries
    (2, 1, 128, 2000, 32, 32, 128, 512, 3, torch.float32),  # decode rows, the keys split three ways
    (2, 4, 20, 100, 16, 16, 8, 40, 1, torch.float16),  # fewer keys than a block
    (1, 2, 40, 600, 16, 64, 32, 100, 2, torch.float16),
])
def test_kernel_equals_the_reference(S, Lq, Lk, E, H, d, W, k, splits, dtype):
    q, kv, index, sinks = case(S, Lq, Lk, E, H, d, W, k, dtype)
    got = sparse_attention.sparse_attention(q, kv, index, sinks, d**-0.5, splits)
    want = ref.sparse_sink_attention(q.float(), kv.float(), index, sinks, d**-0.5)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert got[0, 0].abs().max() == 0  # nothing listed: 0


def paged(entries: torch.Tensor, per_block: int, seed: int):
    """``entries [S, E, d]`` in a paged store ``[blocks, per_block, d]`` at shuffled blocks: ``(store, blocks [S, E],
    rows [S, E])``."""
    S, E, d = entries.shape
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-E // per_block)
    order = torch.randperm(S * per_seq + 2, generator=gen)[:S * per_seq].view(S, per_seq).to(entries.device)
    store = torch.randn(S * per_seq + 2, per_block, d, generator=gen).to(entries.device, entries.dtype)
    ids = torch.arange(E, device=entries.device)
    blocks, rows = order[:, ids // per_block], (ids % per_block).expand(S, -1).contiguous()
    store[blocks, rows] = entries
    return store, blocks, rows


@kernel_runs_here
@pytest.mark.parametrize(("splits", "dtype"), [(1, torch.float32), (3, torch.float32), (1, torch.float16)])
def test_kernel_reads_entries_from_a_paged_store(splits, dtype):
    """Window keys from ``kv [S, Lk, d]``, entries from the paged store where they lie: as the reference, and as the
    same keys gathered behind the window."""
    S, Lq, Lk, E, H, d = 2, 3, 140, 900, 16, 32
    q, kv, index, sinks = case(S, Lq, Lk, E, H, d, 128, 256, dtype, seed=5)
    store, blocks, rows = paged(kv[:, Lk:], 16, seed=5)
    got = sparse_attention.sparse_attention(q, kv[:, :Lk], index, sinks, d**-0.5, splits, 16, store, blocks, rows)
    tol = TOLERANCE[dtype]
    want = ref.sparse_sink_attention(q.float(), kv[:, :Lk].float(), index, sinks, d**-0.5, store.float(), blocks, rows)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    gathered = sparse_attention.sparse_attention(q, kv, index, sinks, d**-0.5, splits)
    torch.testing.assert_close(got, gathered, atol=tol, rtol=tol)


@pytest.mark.skipif(DEVICE != "cuda", reason="V4's attention shape: long under the interpreter")
@pytest.mark.parametrize(("Lq", "splits", "block_h"), [(1, 5, 16), (4, 1, 16), (64, 1, 16), (64, 1, 64)])
def test_v4_shape_with_the_entries_in_a_paged_store_on_the_gpu(Lq, splits, block_h):
    """bf16, 64 heads x 512, V4's window and top-512 among 8,192 entries read from a paged store: decode rows split,
    prefill rows whole, against the fp32 reference on the same bf16 inputs; and in a CUDA graph."""
    Lk, E, H, d = 127 + Lq, 8192, 64, 512
    q, kv, index, sinks = case(1, Lq, Lk, E, H, d, 128, 512, torch.bfloat16, seed=Lq)
    store, blocks, rows = paged(kv[:, Lk:], 64, seed=Lq)
    args = (q, kv[:, :Lk], index, sinks, d**-0.5, splits, block_h, store, blocks, rows)
    got = sparse_attention.sparse_attention(*args)
    want = ref.sparse_sink_attention(q.float(), kv[:, :Lk].float(), index, sinks, d**-0.5, store.float(), blocks,
                                     rows)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    graph = torch.cuda.CUDAGraph()
    sparse_attention.sparse_attention(*args)  # compiled before the capture
    with torch.cuda.graph(graph):
        replayed = sparse_attention.sparse_attention(*args)
    graph.replay()
    assert torch.equal(replayed, got)


@kernel_runs_here
@pytest.mark.parametrize(("H", "block_h", "splits"), [(32, 32, 1), (64, 64, 1), (64, 32, 2)])
def test_wider_head_blocks_equal_the_reference(H, block_h, splits):
    q, kv, index, sinks = case(1, 2, 40, 300, H, 16, 16, 64, torch.float32, seed=4)
    got = sparse_attention.sparse_attention(q, kv, index, sinks, 0.25, splits, block_h)
    torch.testing.assert_close(got, ref.sparse_sink_attention(q, kv, index, sinks, 0.25), atol=2e-5, rtol=2e-5)


@kernel_runs_here
def test_kernel_equals_the_masked_dense_attention():
    """The same keys under a mask over every key (the dense path) give the same rows."""
    S, Lq, Lk, E, H, d = 1, 2, 140, 1500, 16, 32
    q, kv, index, sinks = case(S, Lq, Lk, E, H, d, 128, 512, torch.float32, seed=1)
    visible = torch.zeros(S, Lq, Lk + E + 1, dtype=torch.bool, device=DEVICE)  # the last place: where -1 lands
    visible = visible.scatter_(-1, torch.where(index >= 0, index, Lk + E).long(), True)[..., :-1]
    listed = (index >= 0).sum(-1)
    assert (visible.sum(-1) == listed).all()  # distinct keys in each list
    got = sparse_attention.sparse_attention(q, kv, index, sinks, d**-0.5, 1)
    torch.testing.assert_close(got, ref.sink_attention(q, kv, visible, sinks, d**-0.5), atol=2e-5, rtol=2e-5)


@kernel_runs_here
@pytest.mark.parametrize(("rows", "n", "count", "density"), [(5, 3000, 512, 0.3), (4, 2100, 128, 0.02),
                                                             (3, 50, 64, 0.5), (2, 0, 8, 0.5)])
def test_visible_index_kernel_equals_the_reference(rows, n, count, density):
    gen = torch.Generator().manual_seed(rows)
    visible = (torch.rand(2, rows, n, generator=gen) < density).to(DEVICE)
    if n:
        visible[0, 0] = False
    got = sparse_attention.visible_places(visible, count)
    assert got.dtype == torch.int32 and torch.equal(got.cpu(), ref.visible_index(visible.cpu(), count))


def test_covered_and_splits():
    q = torch.zeros(1, 1, 64, 512, dtype=torch.bfloat16)
    assert sparse_attention.covered(q, torch.zeros(1, 10, 512, dtype=torch.bfloat16))
    assert not sparse_attention.covered(q[..., :8, :], torch.zeros(1, 10, 512, dtype=torch.bfloat16))
    assert not sparse_attention.covered(q[..., :48], torch.zeros(1, 10, 48, dtype=torch.bfloat16))
    assert sparse_attention.num_splits(16384, 64, 640, 132) == 1  # a prefill chunk: no split
    assert sparse_attention.num_splits(1, 64, 640, 132) == 5  # a decode row: 10 blocks, two a split
    assert sparse_attention.num_splits(16, 64, 640, 132) == 2
    assert sparse_attention.num_splits(1, 64, 640, 132, 64) == 5


def test_head_block_reads_the_variable(monkeypatch):
    assert sparse_attention.head_block(64) == 16
    monkeypatch.setenv("DEEPINFER_NVIDIA_SPARSE_ATTN_HEADS", "64")
    assert sparse_attention.head_block(64) == 64 and sparse_attention.head_block(16) == 16  # 16 heads: 16
    monkeypatch.setenv("DEEPINFER_NVIDIA_SPARSE_ATTN_HEADS", "48")
    with pytest.raises(EnvironmentVariableError, match="16, 32 or 64, got 48"):
        sparse_attention.head_block(64)


@pytest.mark.skipif(INTERPRETED, reason="ahead-of-time compiles need the real Triton compiler, not the interpreter")
@pytest.mark.parametrize("capability", [90, 100])
@pytest.mark.parametrize("dtype,whole", [("bf16", True), ("bf16", False), ("fp32", True)])
def test_kernels_compile_for_sm90a_and_sm100a(capability, dtype, whole):
    """Both kernels compile for the GPU targets on a machine without one (Triton compiles ahead of time); the
    attention's ``tl.dot`` tiles take the tensor cores (``mma``) at V4's head width."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_kernel(fn, types, constants):
        signature = {arg: "constexpr" if i in fn.constexprs else types.get(arg, "i32")
                     for i, arg in enumerate(fn.arg_names)}
        source = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
        return triton.compile(source, target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": 4, "num_stages": 2})

    pointers = {name: f"*{dtype}" for name in ("q_ptr", "kv_ptr", "out_ptr")}
    attention = compile_kernel(
        sparse_attention._sparse_split_kernel,
        {**pointers, "index_ptr": "*i32", "store_ptr": f"*{dtype}", "blocks_ptr": "*i64", "rows_ptr": "*i64",
         "sinks_ptr": "*fp32", "opart_ptr": "*fp32", "mpart_ptr": "*fp32", "lpart_ptr": "*fp32", "scale_log2": "fp32"},
        {"D": 512 if dtype == "bf16" else 64, "BLOCK_H": 16, "BLOCK_N": 64, "WHOLE": whole, "HAS_STORE": whole,
         "PRECISION": "ieee" if dtype == "fp32" else "tf32"})
    ptx = attention.asm["ptx"]
    assert f".target sm_{capability}a" in ptx
    if dtype == "bf16":
        assert "mma" in ptx
    index = compile_kernel(sparse_attention._visible_index_kernel, {"vis_ptr": "*u8", "out_ptr": "*i32"},
                           {"CHUNK": sparse_attention.INDEX_CHUNK})
    assert len(index.asm["cubin"]) > 0

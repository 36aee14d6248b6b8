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


ON_GPU_ONLY = {torch.bfloat16} if DEVICE == "cpu" else set()  # the interpreter's bf16 tl.dot is wrong
PAGED_CASES = [  # (H, heads a program, splits, dtype, the tables' read)
    (16, 16, 1, torch.float32, False), (16, 16, 3, torch.float32, False), (16, 16, 1, torch.float16, False),
    (32, 32, 2, torch.float16, False), (64, 64, 1, torch.float32, False), (64, 64, 3, torch.float16, False),
    (64, 16, 2, torch.float32, False), (16, 16, 1, torch.bfloat16, False), (64, 64, 2, torch.bfloat16, False),
    (16, 16, 1, torch.float32, True), (32, 32, 3, torch.float16, True), (64, 64, 1, torch.float32, True),
]


@kernel_runs_here
@pytest.mark.parametrize(("H", "block_h", "splits", "dtype", "tables"),
                         [c for c in PAGED_CASES if c[3] not in ON_GPU_ONLY])
def test_kernel_reads_entries_from_a_paged_store(H, block_h, splits, dtype, tables):
    """Window keys from ``kv [S, Lk, d]``, entries from a paged store at shuffled blocks (a partly filled last block,
    spare blocks), -1 holes and a row listing nothing: as the reference, and as the same keys gathered behind the
    window; through the key-rows pass or the tables (``tables``), 16 / 32 / 64 heads a program, one split or more."""
    S, Lq, Lk, E, d = 2, 3, 140, 900, 32
    q, kv, index, sinks = case(S, Lq, Lk, E, H, d, 128, 256, dtype, seed=5)
    store, blocks, rows = paged(kv[:, Lk:], 16, seed=5)
    got = sparse_attention.sparse_attention(q, kv[:, :Lk], index, sinks, d**-0.5, splits, block_h, store, blocks, rows,
                                            tables=tables)
    tol = TOLERANCE[dtype]
    want = ref.sparse_sink_attention(q.float(), kv[:, :Lk].float(), index, sinks, d**-0.5, store.float(), blocks, rows)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert got[0, 0].abs().max() == 0  # nothing listed: 0
    gathered = sparse_attention.sparse_attention(q, kv, index, sinks, d**-0.5, splits, block_h)
    torch.testing.assert_close(got, gathered, atol=tol, rtol=tol)


@kernel_runs_here
def test_a_store_without_entries_yet_reads_the_window():
    """Early in a prompt the store holds no entries (``E`` = 0): the lists name window keys only."""
    q, kv, index, sinks = case(2, 3, 40, 1, 16, 16, 16, 1, torch.float32, seed=3)
    index = index[..., :16].contiguous()  # [S, Lq, W]
    store, blocks = torch.zeros(0, 64, 16, device=DEVICE), torch.zeros(2, 0, dtype=torch.long, device=DEVICE)
    got = sparse_attention.sparse_attention(q, kv[:, :40], index, sinks, 0.25, 2, 16, store, blocks, blocks)
    want = ref.sparse_sink_attention(q, kv[:, :40], index, sinks, 0.25, store, blocks, blocks)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@kernel_runs_here
def test_key_rows_name_the_keys_the_reference_reads():
    """``key_rows``: row ``r`` of the window keys then the store's rows is the key the reference reads for each listed
    place; -1 stays -1; int32, int64 once the rows pass 2**31."""
    S, Lq, Lk, E, d = 3, 4, 50, 700, 8
    _, kv, index, _ = case(S, Lq, Lk, E, 16, d, 32, 100, torch.float32, seed=7)
    store, blocks, rows = paged(kv[:, Lk:], 64, seed=7)
    got = sparse_attention.key_rows(index, Lk, blocks, rows, 64, store.shape[0] * 64)  # [S * Lq, N]
    assert got.dtype == torch.int32 and torch.equal(got < 0, index.reshape(S * Lq, -1) < 0)
    table = torch.cat([kv[:, :Lk].reshape(-1, d), store.reshape(-1, d)])  # [S * Lk + blocks * 64, d]
    keys = torch.cat([kv[:, :Lk], store[blocks, rows]], dim=1)  # [S, Lk + E, d]: the reference's keys
    seq = torch.arange(S, device=DEVICE)[:, None, None]
    want = keys[seq, index.long().clamp(min=0)].reshape(S * Lq, -1, d)  # [S * Lq, N, d]
    listed = got >= 0
    assert listed.sum() > 0.8 * listed.numel()  # 5% holes and row (0, 0)
    assert torch.equal(table[got.long().clamp(min=0)][listed], want[listed])
    wide = sparse_attention.key_rows(index, Lk, blocks, rows, 64, 2**31)
    assert wide.dtype == torch.int64 and torch.equal(wide, got.long())


@pytest.mark.skipif(DEVICE != "cuda", reason="V4's attention shape: long under the interpreter")
@pytest.mark.parametrize(("Lq", "splits", "block_h", "tables"), [
    (1, 5, 16, False), (4, 1, 16, False), (64, 1, 16, False), (64, 1, 32, False), (64, 1, 64, False),
    (1, 5, 64, False), (64, 1, 16, True), (64, 1, 32, True), (64, 1, 64, True)])
def test_v4_shape_with_the_entries_in_a_paged_store_on_the_gpu(Lq, splits, block_h, tables):
    """bf16, 64 heads x 512, V4's window and top-512 among 8,192 entries read from a paged store (the key-rows pass or
    the tables): decode rows split, prefill rows whole, 16 / 32 / 64 heads a program (each launches: ``tile``), against
    the fp32 reference on the same bf16 inputs; and in a CUDA graph."""
    Lk, E, H, d = 127 + Lq, 8192, 64, 512
    q, kv, index, sinks = case(1, Lq, Lk, E, H, d, 128, 512, torch.bfloat16, seed=Lq)
    store, blocks, rows = paged(kv[:, Lk:], 64, seed=Lq)
    args = (q, kv[:, :Lk], index, sinks, d**-0.5, splits, block_h, store, blocks, rows, tables)
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
    monkeypatch.delenv("DEEPINFER_NVIDIA_SPARSE_ATTN_HEADS", raising=False)
    assert sparse_attention.head_block(64, rows=16, sms=132) == 16  # decode rows: 16 heads, keys split
    assert sparse_attention.head_block(64, rows=16384, sms=132) == 64  # prefill rows: each key loaded once
    assert sparse_attention.head_block(16, rows=16384, sms=132) == 16  # 64 does not divide 16 heads
    monkeypatch.setenv("DEEPINFER_NVIDIA_SPARSE_ATTN_HEADS", "64")
    assert sparse_attention.head_block(64) == 64 and sparse_attention.head_block(16) == 16  # 16 heads: 16
    monkeypatch.setenv("DEEPINFER_NVIDIA_SPARSE_ATTN_HEADS", "16")
    assert sparse_attention.head_block(64, rows=16384, sms=132) == 16
    monkeypatch.setenv("DEEPINFER_NVIDIA_SPARSE_ATTN_HEADS", "48")
    with pytest.raises(EnvironmentVariableError, match="16, 32 or 64, got 48"):
        sparse_attention.head_block(64)


AOT = pytest.mark.skipif(INTERPRETED, reason="ahead-of-time compiles need the real Triton compiler, not the interpreter")


def compile_kernel(fn, types: dict, constants: dict, capability: int, warps: int = 4, stages: int = 2):
    """``fn`` compiled for sm_{capability}a on this machine, as a launch specializes it: pointers and the integer
    arguments in ``aot.SPARSE_WIDTHS`` 16-aligned (so shared memory and vector widths are the launch's), others ``i32``."""
    from deepinfer_nvidia_sm100.kernels import aot

    return aot.compile_divisible(fn, types, constants, capability, warps, stages, aot.SPARSE_WIDTHS)


def compile_attention(capability: int, dtype: str, d: int, block_h: int, store: int, whole: bool = True,
                      tiling: tuple[int, int] | None = None):
    """``_sparse_split_kernel`` at ``block_h`` heads a program and the ``store`` read, the tile the wrapper launches
    (``sparse_attention.tile``) unless ``tiling`` = (BLOCK_N, stages) is given."""
    block_n, stages = tiling or sparse_attention.tile(block_h, store == sparse_attention.TABLES.value)
    types = {**{name: f"*{dtype}" for name in ("q_ptr", "kv_ptr", "store_ptr", "out_ptr")}, "index_ptr": "*i32",
             "blocks_ptr": "*i64", "rows_ptr": "*i64", "sinks_ptr": "*fp32", "opart_ptr": "*fp32",
             "mpart_ptr": "*fp32", "lpart_ptr": "*fp32", "scale_log2": "fp32"}
    constants = {"D": d, "BLOCK_H": block_h, "BLOCK_N": block_n, "WHOLE": whole, "STORE": store,
                 "PRECISION": "ieee" if dtype == "fp32" else "tf32", "PDL": True, **({"splits": 1} if whole else {})}
    return compile_kernel(sparse_attention._sparse_split_kernel, types, constants, capability,
                          4 if block_h <= 16 else 8, stages)


@AOT
@pytest.mark.parametrize("capability", [90, 100])
@pytest.mark.parametrize("dtype,whole,store", [("bf16", True, 1), ("bf16", False, 1), ("bf16", True, 0),
                                               ("bf16", False, 2), ("fp32", True, 1), ("fp32", True, 2)])
def test_kernels_compile_for_sm90a_and_sm100a(capability, dtype, whole, store):
    """The kernels compile for the GPU targets on a machine without one (Triton compiles ahead of time); the
    attention's ``tl.dot`` tiles take the tensor cores (``mma``) at V4's head width."""
    attention = compile_attention(capability, dtype, 512 if dtype == "bf16" else 64, 16, store, whole)
    ptx = attention.asm["ptx"]
    assert f".target sm_{capability}a" in ptx
    if dtype == "bf16":
        assert "mma" in ptx
    for out in ("*i32", "*i64"):
        rows = compile_kernel(sparse_attention._key_rows_kernel,
                              {"index_ptr": "*i32", "blocks_ptr": "*i64", "rows_ptr": "*i64", "out_ptr": out},
                              {"BLOCK": sparse_attention.ROWS_CHUNK, "PDL": True}, capability)
        assert len(rows.asm["cubin"]) > 0
    index = compile_kernel(sparse_attention._visible_index_kernel, {"vis_ptr": "*u8", "out_ptr": "*i32"},
                           {"CHUNK": sparse_attention.INDEX_CHUNK}, capability)
    assert len(index.asm["cubin"]) > 0


@AOT
@pytest.mark.parametrize("capability", [90, 100])
@pytest.mark.parametrize("block_h", [16, 32, 64])
@pytest.mark.parametrize("store", [1, 2])
def test_tiles_compile_within_shared_memory(capability, block_h, store):
    """V4's shape (bf16, d = 512) at 16 / 32 / 64 heads a program, one split and several: the tile ``tile`` picks
    needs at most ``SHARED_BYTES`` of shared memory (the H200's limit; the tables' read at 32 heads and two stages
    asked 233,984 there and failed to launch)."""
    for whole in (True, False):
        shared = compile_attention(capability, "bf16", 512, block_h, store, whole).metadata.shared
        assert 0 < shared <= sparse_attention.SHARED_BYTES, (capability, block_h, store, whole, shared)


@AOT
@pytest.mark.parametrize("capability", [90, 100])
def test_key_rows_read_compiles_to_one_gather_a_tile(capability):
    """At 16 heads a program the key-rows read issues the contiguous read's asynchronous copies (one ``[BLOCK_N,
    d]`` gather a tile) and needs its shared memory; the tables' read issues two tiles' copies and the tables'."""
    import re

    def copies(store):
        compiled = compile_attention(capability, "bf16", 512, 16, store, tiling=(64, 2))
        found = re.findall(r"cp\.async\.\w+\.shared\.global \[[^]]*\], \[[^]]*\], (0x[0-9a-f]+)", compiled.asm["ptx"])
        return {size: found.count(size) for size in set(found)}, compiled.metadata.shared

    contiguous, rows, tables = copies(0), copies(1), copies(2)
    assert contiguous[0].get("0x10", 0) > 0 and rows == contiguous, (rows, contiguous)
    assert tables[0]["0x10"] == 2 * contiguous[0]["0x10"] and tables[1] > rows[1], (tables, rows)

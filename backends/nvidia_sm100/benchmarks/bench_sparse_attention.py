"""Check, then time, the three ways a CSA layer whose indexer selects can attend (``DEEPINFER_SPARSE_CSA_ATTENTION``):

- dense (``0``): ``roped_sink_attention`` over every key of the sequence under the mask ``[S, Lq, Lk + E]`` (the
  window's mask and the selection concatenated, as ``layout.attention_visible`` does);
- gathered (``gather``): each query row a one-query row over its gathered window + selected keys
  (``models/deepseek_v4/sparse_attention.sparse_roped_attention``);
- in place (``1``): each row's keys listed by index (``visible_index`` of the window's mask, then the selection as
  indices, as ``indexer_topk_index`` writes them) and read in place by
  ``roped_sparse_sink_attention`` (``kernels/sparse_attention.py``): the window keys from ``[S, Lk, d]``, the entries
  from a paged store (64 a block) where they lie, as the model runs it; also with the entries gathered behind the
  window. Its parts are timed too (the index lists; the key-rows pass, which translates each listed key to its row of
  the window keys or the store; the attention kernel as the op launches it, and with one split at 16, 32 and 64 heads
  a program; at decode rows with 2, 5 and 10 splits of the keys at 16 and 64 heads), and the ``[S, E, d]`` copy of
  the entries the other two paths' steps make. Each attention-kernel row is timed twice: through the key-rows pass
  (the op's read, the pass included) and, marked "the tables' read", with the entries read through their block and
  row tables in the loop (``tables=True``, the read before the pass), so one run gives the A/B; the kernel rows are
  checked against the op's output first.

All three through the NVIDIA backend's op table (``sm90_ops``: TileLang ``sink_attention`` where installed, the Triton
decode kernel for decode rows), bf16, V4's attention (64 heads x 512, window 128, top-512 of entries at ratio 4), at:
a decode row late in a 128K context (E = 32,768), 16 decode rows at 32K, and a 16,384-row prefill chunk late in a
128K prompt (its rows at positions 114,688 + t). Outputs are compared with each other (bf16: max relative error
below 2e-2) before anything is timed; times are CUDA-event medians, decode rows replayed from CUDA graphs.

    PYTHONPATH=$PWD:$PWD/backends/nvidia_sm100 python backends/nvidia_sm100/benchmarks/bench_sparse_attention.py \
        [--cases decode decode16 prefill] [--no-dense]
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from cuda_timing import cuda_time, graphed
from deepinfer_nvidia_sm100.backend import sm90_ops
from deepinfer_nvidia_sm100.kernels import gpu, tl_attention
from deepinfer_nvidia_sm100.kernels import sparse_attention as kernels

from deepinfer_core.models.deepseek_v4.sparse_attention import (
    indexed_roped_attention,
    key_index,
    sparse_roped_attention,
)
from deepinfer_core.ops.table import OpTable

H, D, ROPE, W, K, RATIO = 64, 512, 64, 128, 512, 4
SCALE, EPS = D**-0.5, 1e-6
DEVICE = "cuda"
CASES = {  # name -> (sequences, query rows, context before the rows, graphed)
    "decode": (1, 1, 131071, True),
    "decode16": (16, 1, 32767, True),
    "prefill": (1, 16384, 131072 - 16384, False),
}


def make_case(S: int, Lq: int, ctx: int, seed: int = 0):
    """Inputs on CUDA: raw queries ``[S, Lq, H, D]``, keys ``[S, Lk + E, D]`` (the window's ring keys then the rows'
    own, then the entries), the window mask ``[S, Lq, Lk]``, the selection ``[S, Lq, E]`` (K random visible entries
    per row), sinks, cos / sin."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    ring = min(ctx, W - 1)
    Lk = ring + Lq
    E = (ctx + Lq) // RATIO
    q = torch.randn(S, Lq, H, D, device=DEVICE, generator=g).to(torch.bfloat16)
    keys = torch.randn(S, Lk + E, D, device=DEVICE, generator=g).to(torch.bfloat16)
    t = torch.arange(Lq, device=DEVICE)[:, None]  # [Lq, 1]; key j is position ctx - ring + j
    j = torch.arange(Lk, device=DEVICE)[None, :]
    window = ((j <= t + ring) & (j > t + ring - W))[None].expand(S, -1, -1).contiguous()  # [S, Lq, Lk]
    limit = (ctx + torch.arange(Lq, device=DEVICE) + 1) // RATIO  # [Lq] entries visible to each row
    selected = torch.zeros(S, Lq, E, dtype=torch.bool, device=DEVICE)
    for start in range(0, Lq, 2048):  # 2,048 rows of random scores at a time
        rows = slice(start, start + 2048)
        scores = torch.rand(S, limit[rows].numel(), E, device=DEVICE, generator=g)
        scores.masked_fill_(torch.arange(E, device=DEVICE)[None, None, :] >= limit[rows][None, :, None], -1.0)
        selected[:, rows].scatter_(-1, scores.topk(K, dim=-1).indices, True)
    sinks = torch.randn(H, device=DEVICE, generator=g)
    cos = torch.randn(S, Lq, ROPE // 2, device=DEVICE, generator=g).to(torch.bfloat16)
    sin = torch.randn(S, Lq, ROPE // 2, device=DEVICE, generator=g).to(torch.bfloat16)
    return q, keys, window, selected, sinks, cos, sin


def paged(keys: torch.Tensor, Lk: int, per_block: int = 64):
    """The entries of ``keys [S, Lk + E, d]`` in a paged store ``[S * E / per_block, per_block, d]`` (each sequence's
    blocks in turn) and their places ``[S, E]``, as the layer's compressed-entry store holds them."""
    S, total, d = keys.shape
    E = total - Lk
    per_block = math.gcd(E, per_block)
    store = keys[:, Lk:].reshape(S * E // per_block, per_block, d).contiguous()
    ids = torch.arange(E, device=keys.device)
    blocks = (torch.arange(S, device=keys.device)[:, None] * (E // per_block) + ids // per_block).contiguous()
    return store, blocks, (ids % per_block).expand(S, -1).contiguous()


def paths(ops: OpTable, case) -> dict:
    """name -> callable of the case's inputs (the roped op, as the model calls it)."""
    q, keys, window, selected, sinks, cos, sin = case
    entry_index = ops.visible_index(selected, K)  # [S, Lq, K]: the selection as the indexer's top-k writes it
    index = key_index(ops, window, entry_index, W)
    Lk = window.shape[-1]
    entries = paged(keys, Lk)
    store_rows = entries[0].shape[0] * entries[0].shape[1]
    rows, sms = q.shape[0] * q.shape[1], gpu.sm_count(0)
    block_h = kernels.head_block(H, rows, sms)
    split = kernels.num_splits(rows, H, index.shape[-1], sms, block_h)  # the op's
    kernel = {  # row name -> (splits, heads a program), each through the key-rows pass and the tables
        **{f"in place: attention kernel, {h} heads a program, one split": (1, h) for h in (16, 32, 64)},
        **({f"in place: attention kernel, {h} heads a program, {n} splits": (n, h) for h in (16, 64) for n in (2, 5, 10)}
           if q.shape[0] * q.shape[1] <= 16 else {}),  # decode rows
    }
    reads = {"": False, " (the tables' read)": True}
    return {
        "dense": lambda: ops.roped_sink_attention(q, keys, torch.cat([window, selected], dim=-1), sinks, SCALE, EPS,
                                                  cos, sin),
        "gathered": lambda: sparse_roped_attention(ops, q, keys, window, selected, W, K, sinks, SCALE, EPS, cos, sin),
        "in place": lambda: indexed_roped_attention(ops, q, keys[:, :Lk], window, entry_index, W, sinks, SCALE, EPS,
                                                    cos, sin, entries),
        "in place, entries gathered behind the window": lambda: indexed_roped_attention(
            ops, q, keys, window, entry_index, W, sinks, SCALE, EPS, cos, sin),
        "in place: index lists": lambda: key_index(ops, window, entry_index, W),
        "in place: key rows pass": lambda: kernels.key_rows(index, Lk, entries[1], entries[2], entries[0].shape[1],
                                                            store_rows),
        "in place: attention kernel": lambda: ops.sparse_sink_attention(q, keys[:, :Lk], index, sinks, SCALE,
                                                                        *entries),
        "in place: attention kernel (the tables' read)": lambda: kernels.sparse_attention(
            q, keys[:, :Lk], index, sinks, SCALE, split, block_h, *entries, tables=True),
        "dense and gathered: the step's [S, E, d] copy of the entries": lambda: entries[0][entries[1], entries[2]],
        **{row + how: lambda n=n, h=h, tables=tables: kernels.sparse_attention(q, keys[:, :Lk], index, sinks, SCALE, n,
                                                                               h, *entries, tables=tables)
           for row, (n, h) in kernel.items() for how, tables in reads.items()},
    }


def check(name: str, outputs: dict, against: str) -> None:
    """Every output against ``outputs[against]``: max error relative to the largest value below 2e-2."""
    want = outputs[against].float()
    for path, got in outputs.items():
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        print(f"check {name}: {path} vs {against}: max relative error {err:.2e}", flush=True)
        assert err < 2e-2, f"{name}: {path} differs from {against} by {err:.2e}"


def run(name: str, ops: OpTable, dense: bool) -> list[tuple]:
    S, Lq, ctx, graph = CASES[name]
    case = make_case(S, Lq, ctx)
    calls = paths(ops, case)
    if not dense or (Lq > 1 and not tl_attention.available()):  # the reference op: [S, H, Lq, Lk + E] fp32 logits
        print(f"{name}: dense path skipped", flush=True)
        calls.pop("dense")
    check(name, {path: calls[path]() for path in ("dense", "gathered", "in place",
                                                  "in place, entries gathered behind the window") if path in calls},
          "in place")
    op = calls["in place: attention kernel"]()
    for path in [path for path in calls if path.startswith("in place: attention kernel")]:  # one at a time: 1 GiB
        check(name, {"in place: attention kernel": op, path: calls[path]()}, "in place: attention kernel")
    del op
    rows = []
    for path, fn in calls.items():
        replay = graphed(fn, strict=False) if graph else None
        seconds = cuda_time(replay or fn, reps=20 if graph else 5)
        rows.append((name, S, Lq, ctx, path, "graph" if replay else "eager", seconds))
        print(f"time {name}: {path} {seconds * 1e3:.3f} ms", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--no-dense", action="store_true", help="skip the dense path (the longest at prefill)")
    args = ap.parse_args()
    ops = OpTable(sm90_ops(), "nvidia_sm100")
    print(f"{torch.cuda.get_device_name()}; sink_attention: {ops.sources()['sink_attention']}; "
          f"sparse_sink_attention: {ops.sources()['sparse_sink_attention']}; (BLOCK_N, stages) at 16 / 32 / 64 "
          f"heads a program: {[kernels.tile(h) for h in (16, 32, 64)]}, the tables' read "
          f"{[kernels.tile(h, True) for h in (16, 32, 64)]}", flush=True)
    rows = [row for name in args.cases for row in run(name, ops, not args.no_dense)]
    print("\n| case | S | rows | context | path | how | ms | vs dense |")
    print("|---|---|---|---|---|---|---|---|")
    dense = {r[0]: r[6] for r in rows if r[4] == "dense"}
    for name, S, Lq, ctx, path, how, seconds in rows:
        ratio = f"{dense[name] / seconds:.2f}x" if name in dense else "-"
        print(f"| {name} | {S} | {Lq} | {ctx} | {path} | {how} | {seconds * 1e3:.3f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

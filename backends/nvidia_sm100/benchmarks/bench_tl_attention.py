"""Check and time the TileLang sink attention against the reference op on one GPU (one call does everything).

    PYTHONPATH=$PWD:$PWD/backends/nvidia_sm100 python backends/nvidia_sm100/benchmarks/bench_tl_attention.py [--out DIR]

1. Correctness of ``kernels.tl_attention.sink_attention`` against ``reference.sink_attention`` for decode shapes
   (Lq = 1, S in {1, 16, 64}, Lk in {128, 640, 2048}, H = 64, d = 512), a ragged Lk (200) and a prefill shape
   (sliding window 128 + compressed entries), in bf16 (kernel) and fp32 (the wrapper's reference fallback).
   Masks are random with some fully masked rows (their output must be 0). The bf16 kernel is compared with the
   fp32 reference on the same bf16 inputs (the kernel computes in fp32) and with the bf16 reference.
2. Time (bf16): the kernel (split count from the heuristic, and the best of a sweep) vs the current path (the
   reference op on CUDA), eager and inside a CUDA graph; CUDA events, warm-up, median of repeats.
   Bytes = K/V read + Q + out (+ mask); roofline 4.8 TB/s (H200 HBM3e peak).
Writes ``tl_attention_bench.md`` / ``.json`` and the generated CUDA source to ``--out``; prints the table last.
"""

import argparse
import json
import os
import sys
import time

import torch
from cuda_timing import cuda_time as cuda_seconds
from cuda_timing import graphed as capture
from deepinfer_nvidia_sm100.kernels import tl_attention as tla

from deepinfer_core.ops import reference as ref

HBM_TBS = 4.8
H, D = 64, 512
SCALE = D**-0.5


def make_case(S, Lq, Lk, dtype, seed=0, prefill=False):
    """Inputs on CUDA. Decode: random visibility (about 70 %), row 0 of sequence 0 fully masked when S > 1.
    Prefill: the first Lq keys are the sequence's own tokens (causal window 128), the rest compressed entries
    (entry e visible to query t when 4 * (e + 1) <= t + 1)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(S, Lq, H, D, device="cuda", generator=g).to(dtype)
    kv = torch.randn(S, Lk, D, device="cuda", generator=g).to(dtype)
    sinks = torch.randn(H, device="cuda", generator=g).float()
    if prefill:
        t = torch.arange(Lq, device="cuda")
        own = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - 128)  # [Lq, Lq]
        e = torch.arange(Lk - Lq, device="cuda")
        ent = 4 * (e[None, :] + 1) <= t[:, None] + 1  # [Lq, E]
        visible = torch.cat([own, ent], dim=1)[None].expand(S, Lq, Lk).contiguous()
    else:
        visible = torch.rand(S, Lq, Lk, device="cuda", generator=g) < 0.7
        if S > 1:
            visible[0, 0] = False
    return q, kv, visible, sinks


def cuda_time(fn, reps=30, inner=10):
    """Median milliseconds per call: ``reps`` event pairs around ``inner`` back-to-back calls, after warm-up."""
    return 1e3 * cuda_seconds(fn, reps=reps, inner=inner)


def graphed(fn):
    """``fn`` captured in a CUDA graph (its inputs are fixed); returns the replay callable, or None on failure."""
    return capture(fn, strict=False)


def time_shape(S, Lq, Lk, pre, sms):
    """Eager and graphed medians of the reference op and the kernel (heuristic splits, plus a split sweep)."""
    q, kv, vis, sinks = make_case(S, Lq, Lk, torch.bfloat16, prefill=pre)
    B = S * Lq
    nbytes = S * Lk * D * 2 + 2 * B * H * D * 2 + B * Lk
    heur = tla.num_splits(B, Lk, sms)
    t_ref = cuda_time(lambda: ref.sink_attention(q, kv, vis, sinks, SCALE))
    t_heur = cuda_time(lambda: tla.sink_attention(q, kv, vis, sinks, SCALE, splits=heur))
    sweep = {}
    for n in (1, 2, 4, 8, 16, 32):
        if n <= max(1, -(-Lk // tla.BLOCK_N)) and (n == 1 or B < sms):
            sweep[n] = cuda_time(lambda n=n: tla.sink_attention(q, kv, vis, sinks, SCALE, splits=n), reps=10)
    best_n = min(sweep, key=sweep.get)
    g_ref = graphed(lambda: ref.sink_attention(q, kv, vis, sinks, SCALE))
    g_tl = graphed(lambda: tla.sink_attention(q, kv, vis, sinks, SCALE, splits=heur))
    tg_ref = cuda_time(g_ref) if g_ref else float("nan")
    tg_tl = cuda_time(g_tl) if g_tl else float("nan")
    best_t = min(t_heur, tg_tl) if g_tl else t_heur
    row = {"S": S, "Lq": Lq, "Lk": Lk, "prefill": pre, "bytes": nbytes, "splits": heur, "ref_ms": t_ref,
           "tl_ms": t_heur, "ref_graph_ms": tg_ref, "tl_graph_ms": tg_tl, "sweep_ms": sweep, "best_splits": best_n,
           "speedup_eager": t_ref / t_heur, "speedup_graph": tg_ref / tg_tl if g_tl and g_ref else None,
           "roofline_pct": 100 * nbytes / (best_t * 1e-3) / (HBM_TBS * 1e12),
           "best_sweep_roofline_pct": 100 * nbytes / (sweep[best_n] * 1e-3) / (HBM_TBS * 1e12)}
    print(f"time S={S} Lq={Lq} Lk={Lk}: ref {t_ref * 1e3:.1f} us, tl {t_heur * 1e3:.1f} us (splits {heur}), "
          f"graph ref {tg_ref * 1e3:.1f} tl {tg_tl * 1e3:.1f} us, sweep best {best_n}: "
          f"{sweep[best_n] * 1e3:.1f} us", flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.cuda.get_device_name()
    arch = tla.device_arch(torch.device("cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    t0 = time.time()
    split, _combine = tla._compiled(arch, "bfloat16", float(SCALE))
    compile_s = time.time() - t0
    src = split.get_kernel_source()
    with open(os.path.join(args.out, f"tl_attention_split_{arch}.cu"), "w") as f:
        f.write(src)
    print(f"compiled bf16 kernels for {arch} in {compile_s:.1f}s; wgmma in source: {'wgmma' in src}; "
          f"tcgen05 in source: {'tcgen05' in src}", flush=True)

    decode = [(S, 1, Lk, False) for S in (1, 16, 64) for Lk in (128, 640, 2048)]
    shapes = decode + [(4, 1, 200, False), (2, 256, 256 + 64, True)]

    # ---- correctness
    checks = []
    for S, Lq, Lk, pre in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            q, kv, vis, sinks = make_case(S, Lq, Lk, dtype, prefill=pre)
            got = tla.sink_attention(q, kv, vis, sinks, SCALE)
            want32 = ref.sink_attention(q.float(), kv.float(), vis, sinks, SCALE)
            err32 = (got.float() - want32).abs().max().item()
            if dtype == torch.bfloat16:
                want_same = ref.sink_attention(q, kv, vis, sinks, SCALE)
                err_same = (got.float() - want_same.float()).abs().max().item()
                ok = err32 < 2e-2 and torch.isfinite(got).all().item()
            else:
                err_same = err32
                ok = err32 < 1e-5
            if S > 1 and not pre:
                ok = ok and got[0, 0].abs().max().item() == 0.0  # fully masked row -> 0
            checks.append({"S": S, "Lq": Lq, "Lk": Lk, "prefill": pre, "dtype": str(dtype).split(".")[-1],
                               "path": "kernel" if tla.supported(q, kv) else "reference fallback",
                               "err_vs_fp32_ref": err32, "err_vs_same_dtype_ref": err_same, "ok": bool(ok)})
            print(f"check S={S} Lq={Lq} Lk={Lk} {checks[-1]['dtype']} {checks[-1]['path']}: "
                  f"max|err| vs fp32 ref {err32:.2e}, vs same-dtype ref {err_same:.2e} -> {'ok' if ok else 'FAIL'}",
                  flush=True)
    # a split sweep must not change the result beyond rounding
    q, kv, vis, sinks = make_case(1, 1, 2048, torch.bfloat16, seed=1)
    base = tla.sink_attention(q, kv, vis, sinks, SCALE, splits=1).float()
    split_err = max((tla.sink_attention(q, kv, vis, sinks, SCALE, splits=n).float() - base).abs().max().item()
                    for n in (2, 4, 8, 16, 32))
    print(f"split sweep 1..32 on S=1 Lk=2048: max|diff| {split_err:.2e}", flush=True)

    # ---- timing (bf16)
    rows = [time_shape(S, Lq, Lk, pre, sms) for S, Lq, Lk, pre in shapes]

    head = (f"TileLang sink_attention vs reference op, bf16, H={H}, d={D}; {dev} ({arch}, {sms} SMs); torch "
            f"{torch.__version__}; {time.strftime('%Y-%m-%d')}; roofline {HBM_TBS} TB/s; times are medians (us)")
    lines = [head, "",
             ("| S | Lq | Lk | splits | ref eager | TL eager | ref graph | TL graph | speedup eager | speedup graph "
             "| % roofline (TL best) | sweep best (splits: us) |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['S']} | {r['Lq']} | {r['Lk']}{' (prefill)' if r['prefill'] else ''} | {r['splits']} | "
            f"{r['ref_ms'] * 1e3:.1f} | {r['tl_ms'] * 1e3:.1f} | {r['ref_graph_ms'] * 1e3:.1f} | "
            f"{r['tl_graph_ms'] * 1e3:.1f} | {r['speedup_eager']:.2f}x | "
            f"{(r['speedup_graph'] or float('nan')):.2f}x | {r['roofline_pct']:.1f}% | "
            f"{r['best_splits']}: {r['sweep_ms'][r['best_splits']] * 1e3:.1f} |")
    bad = [c for c in checks if not c["ok"]]
    lines += ["", (f"correctness: {len(checks) - len(bad)}/{len(checks)} ok; max bf16 err vs fp32 ref "
              f"{max(c['err_vs_fp32_ref'] for c in checks if c['dtype'] == 'bfloat16'):.2e}; split sweep diff "
              f"{split_err:.2e}; compile {compile_s:.1f}s; wgmma={'wgmma' in src} tcgen05={'tcgen05' in src}")]
    with open(os.path.join(args.out, "tl_attention_bench.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "tl_attention_bench.json"), "w") as f:
        json.dump({"device": dev, "arch": arch, "checks": checks, "rows": rows, "split_err": split_err,
                       "compile_s": compile_s}, f, indent=1)
    print("\n".join(lines))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

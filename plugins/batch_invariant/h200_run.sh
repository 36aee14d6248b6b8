#!/usr/bin/env bash
# The batch-invariant plugin on a GPU machine: the GPU tests, then the overhead of the mode against the plain path
# (docs/batch-invariant.md, "Overhead on the H200"). BUDGET_S (default 560) bounds the whole run. For a machine where the packages
# are not installed (a lent GPU machine: no package index): entry points come from tools/gpu_site.sh.
# Run from the repository root. OUT (default /tmp/bi-out) receives the logs and JSON results.
set -u
OUT=${OUT:-/tmp/bi-out}; mkdir -p "$OUT"
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-560} ))
source tools/gpu_site.sh  # entry points without installing (dist-info folders on PYTHONPATH)
export PYTHONUNBUFFERED=1
left() { echo $(( DEADLINE - $(date +%s) )); }

{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c \
  "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; date -u; } > "$OUT/machine.txt" 2>&1

# STEPS: what to run, in order (default: every GPU test, then the overhead table). "overhead": plain vs
# batch-invariant at batches 1, 16, 64 and 256 (BATCHES) in one process (bench_overhead.py: one engine per mode,
# 1,024 in / 128 out, a warm-up and ITERS timed runs per batch), the ratio per batch; "kernels": the GEMM launches
# against cuBLAS at GEMM_ROWS rows (bench_gemm.py) and the MoE paths (bench_moe.py), each variant's bits checked;
# b1_plain ... b64_bi: separate `deepinfer bench` processes as in docs/performance.md.
STEPS=${STEPS:-"tests overhead"}
want() { [[ " $STEPS " == *" $1 "* ]]; }
if want tests || want optests; then
    select=(); want tests || select=(-k "not needles")  # optests: the op-level tests only
    timeout "$(( $(left) < 300 ? $(left) : 300 ))" python3 -m pytest -q -p no:cacheprovider -rs "${select[@]}" plugins/batch_invariant/tests/test_cuda.py \
        > "$OUT/pytest_cuda.log" 2>&1
    echo "pytest rc=$?" >> "$OUT/pytest_cuda.log"
fi

# The preset (30 GB) may already be on this machine (another run wrote it): reuse its cache folder. Remove
# half-written preset folders (*.tmp-PID) whose writer is gone: a full disk leaves them behind.
for tmp in $(find / -xdev -type d -name 'v4-flash-8l64e-*.tmp-*' 2>/dev/null); do
    kill -0 "${tmp##*.tmp-}" 2>/dev/null || rm -rf "$tmp"
done
marker=$(find / -xdev -name bench_preset.json -path '*v4-flash-8l64e-*' 2>/dev/null | head -n 1)
CACHE=${marker:+$(dirname "$(dirname "$marker")")}
if [ -z "$CACHE" ] && [ "$(df --output=avail -k / | tail -n 1)" -lt 36000000 ]; then CACHE=/dev/shm/di-bench; fi
{ df -h / | tail -n 1; echo "preset cache: ${CACHE:-none found}"; } >> "$OUT/machine.txt"
B="python3 -m deepinfer_core.cli bench ${CACHE:+--cache-dir $CACHE} --preset v4-flash-8l64e --backend nvidia_sm100 --dtype bfloat16 --input-len 1024 --output-len 128"
run() {  # name, env value, extra args
    local budget; budget=$(left)
    if [ "$budget" -lt 30 ]; then echo "$1: skipped (no time left)" >> "$OUT/bench.log"; return; fi
    echo "== $1: DEEPINFER_BATCH_INVARIANT=$2 $B ${*:3}" >> "$OUT/bench.log"
    DEEPINFER_BATCH_INVARIANT=$2 timeout "$budget" $B "${@:3}" --json "$OUT/$1.json" >> "$OUT/bench.log" 2>&1
    echo "rc=$?" >> "$OUT/bench.log"
}
if want kernels; then
    timeout "$(left)" python3 plugins/batch_invariant/bench_gemm.py --rows ${GEMM_ROWS:-1 16 64 256} > "$OUT/gemm.txt" 2>&1
    (cd backends/nvidia_sm100/benchmarks && timeout "$(left)" python3 bench_moe.py) > "$OUT/moe.txt" 2>&1
fi
if want profile_b1; then  # GPU kernel time of a decode step at batch 1 (graph replays, PDL off), plain then the mode
    for mode in 0 1; do
        DEEPINFER_BENCH_CACHE=${CACHE:-} DEEPINFER_NVIDIA_PDL=0 DEEPINFER_BATCH_INVARIANT=$mode timeout "$(left)" \
            python3 backends/nvidia_sm100/benchmarks/profile_decode.py --batches 1 > "$OUT/profile_b1_$mode.log" 2>&1
        echo "profile rc=$?" >> "$OUT/profile_b1_$mode.log"
    done
fi
if want overhead; then
    timeout "$(left)" python3 plugins/batch_invariant/bench_overhead.py ${CACHE:+--cache-dir $CACHE} \
        --preset v4-flash-8l64e --backend nvidia_sm100 --dtype bfloat16 --input-len 1024 --output-len 128 \
        --batches ${BATCHES:-1 16 64 256} --num-iters "${ITERS:-1}" --json "$OUT/overhead.json" \
        > "$OUT/overhead.txt" 2> "$OUT/overhead.log"
    echo "overhead rc=$?" >> "$OUT/overhead.log"
fi
want b1_plain && run b1_plain 0 --num-prompts 1 --max-num-seqs 1
want b1_bi && run b1_bi 1 --num-prompts 1 --max-num-seqs 1
want b64_plain && run b64_plain 0 --num-prompts 64 --max-num-seqs 64
want b64_bi && run b64_bi 1 --num-prompts 64 --max-num-seqs 64

cat "$OUT/machine.txt"; tail -n 3 "$OUT/pytest_cuda.log" 2>/dev/null
tail -n 4 "$OUT/gemm.txt" 2>/dev/null; tail -n 22 "$OUT/moe.txt" 2>/dev/null
cat "$OUT/overhead.txt" 2>/dev/null; grep -E "round|rc=|Error|error" "$OUT/overhead.log" 2>/dev/null | tail -n 20
for mode in 0 1; do grep -A 22 "=== batch" "$OUT/profile_b1_$mode.log" 2>/dev/null | cut -c 1-150; done
grep -E "^==|rc=|output tok/s|TPOT|TTFT|skipped|Error|error" "$OUT/bench.log" | head -n 60
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
for p in sorted(Path(sys.argv[1]).glob("*.json")):
    r = json.loads(p.read_text())
    m = r["engine"]
    print(f"{p.stem}: total {m['total_time_s']:.2f} s, output {m['output_throughput']:.1f} tok/s, "
          f"TTFT mean {m['ttft_s']['mean']:.3f} s, TPOT mean {1e3 * (m['tpot_s']['mean'] or 0):.1f} ms, "
          f"graph replays {r.get('graph_replays', r['engine'].get('graph_replays'))}")
PY

#!/usr/bin/env bash
# The NVIDIA backend's GPU tests, benchmarks and profiles on one lent GPU machine, one mode per call (each mode is
# sized for a 10-minute call). From the repository root:
#
#   bash backends/nvidia_sm100/benchmarks/h200_session.sh MODE
#
# Modes:
#   tests    every test file of the backend (backends/nvidia_sm100/tests), then the batch-invariant plugin's GPU
#            tests (plugins/batch_invariant/tests/test_cuda.py), file by file (TESTS: other files)
#   bench    `deepinfer bench` on the v4-flash-8l64e preset, 1,024 prompt and 128 output tokens per request, rows
#            b1 b16 b64 b256 (ROWS; bN = N requests at batch N), each the median of ITERS timed runs (default 3);
#            long-context rows (issue #38, on PRESETS=v4-flash-8l64e-1m): ctx-N, one prompt of N tokens to 128 output
#            tokens in 16,384-token steps, ctx16-N the same for 16 prompts at batch 16 (e.g. ROWS="ctx-1024
#            ctx-8192 ctx-131072 ctx16-32768"; the 1M row is ctx-1048448: max_model_len is prompt + output)
#   prefill  8 prompts of 1,024 tokens in one step and one prompt of 8,192 tokens, to one output token each
#            (rows prefill-8x1k prefill-8k), the median of ITERS timed runs (default 5)
#   profile  where the time goes (PROFILES, default "decode prefill run"): decode steps at batch 1 and 64 with
#            programmatic dependent launch off, so per-kernel times and the two streams' timeline read cleanly
#            (profile_decode.py, traces kept); the 8 x 1K and 1 x 8K prefill steps (profile_decode.py --prefill, the
#            8 x 1K trace kept); a whole 8 x 1K bench run, engine step by step (profile_run.py)
#   kernels  op benchmarks, each checking its kernel against the reference op before timing it (KERNELS, default
#            below; sweep_gemv, sweep_moe_configs and sweep_indexer, the GEMV launch, MoE tile and indexer tile
#            sweeps, run when named there;
#            NAME:ARG passes one argument, e.g. KERNELS="bench_quant:mxfp4 bench_quant:fp8")
#
# Variables (bench and prefill; PRESETS and LOAD_FORMAT also the decode profiles):
#   PRESETS       bench presets, each row run on each (default v4-flash-8l64e); rows of a preset after the first are
#                 named ROW@PRESET, e.g. PRESETS="v4-flash-8l64e v4-flash-8l64e-fp4" ROWS="b1 b64" puts the fp4
#                 preset's rows beside bf16's in one call (the quantized preset is written from the bf16 one)
#   BENCH_ARGS    extra `deepinfer bench` arguments for every row, e.g. "--compare-hf" (HF transformers timed in
#                 the same process) or "--enforce-eager"
#   BENCH_ENV     VAR=value words every bench process starts with, e.g. "DEEPINFER_NVIDIA_PDL=0"
#   BASELINE=DIR  a second source tree of this repository, e.g. `mkdir DIR && git archive <commit> | tar -x -C DIR`:
#                 each row then runs on DIR and on this tree alternately in the same call, ROUNDS pairs per row
#                 (default 1; the order swaps every round), so a before / after comparison is made in one run; the
#                 summary's last table sets each row's baseline beside this tree's. Each row then runs twice:
#                 name one or two rows per call (ROWS) to stay within a call's time
#   VARIANTS      settings to compare in the same call, separated by ";", each a list of VAR=value words, e.g.
#                 VARIANTS="DEEPINFER_NVIDIA_ROW_PICKS_APART=1;DEEPINFER_NVIDIA_FP8_SPLITS_MEET=1": every row also runs
#                 once per variant (named ROW+vN, N from 1, on the presets in VARIANT_PRESETS, default all of
#                 PRESETS), right after its default run; the summary's last table sets each beside the default
#   BENCH_TIMEOUT seconds per bench process (default 300)
#   LOAD_FORMAT   dummy: each bench process draws its preset's weights on the GPU (`--load-format dummy`, the same
#                 values), nothing but config.json and the tokenizer is written: no disk time, and v4-flash-20l-fp4
#                 (73.5 GB, more than this machine's disk) runs; default auto (the presets written to disk once)
#
# Results: every output goes to RES (default /tmp/h200-results); after every step RES is archived into
# $OUT/h200-results.tgz (OUT defaults to ./h200-out), so a call cut short still returns what finished.
# The lent machine has this tree but no installed packages: tools/gpu_site.sh writes dist-info folders with the
# entry points and puts the sources on PYTHONPATH; TileLang (sink_attention) and transformers (--compare-hf) come
# from wheels unpacked into /tmp/site beforehand, when present.
set -uo pipefail
mode=${1:-}
case $mode in
  tests | bench | prefill | profile | kernels) ;;
  *) echo "usage: $0 tests|bench|prefill|profile|kernels (see the comment at the top)" >&2; exit 2 ;;
esac
REPO=$PWD
OUT=${OUT:-$PWD/h200-out}; RES=${RES:-/tmp/h200-results}; mkdir -p "$OUT" "$RES"
save() { tar -czf "$OUT/h200-results.tgz" -C "$RES" .; }
trap save EXIT  # a run cut short (timeout) still returns what it wrote
PLAIN_PYTHONPATH=${PYTHONPATH:-}
source tools/gpu_site.sh  # entry points without installing
existing=$(ls -d /tmp/deepinfer-bench/v4-* /tmp/db/v4-* 2>/dev/null | head -1)  # a preset already written here
export DEEPINFER_BENCH_CACHE=${DEEPINFER_BENCH_CACHE:-$( [[ -n $existing ]] && dirname "$existing" || echo /tmp/deepinfer-bench)}
KERNELS=${KERNELS:-bench_moe bench_indexer bench_indexer_topk bench_hc_mix bench_hc_norm bench_norm bench_rope bench_pool bench_tl_attention bench_sparse_attention}
if [[ -n ${BASELINE:-} ]]; then
  BASELINE=$(cd "$BASELINE" && pwd) || exit 2
  rm -rf /tmp/site-di-baseline  # the baseline tree's dist-info folders, written afresh
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$RES/gpu.txt"
python -c "import tilelang" 2>/dev/null && echo "tilelang: yes" || echo "tilelang: no (sink_attention takes the reference op)"

PRESETS=${PRESETS:-v4-flash-8l64e}
preset_flushed() {  # the presets written when the machine has none, then flushed to disk before the first bench
  for preset in $PRESETS; do
    python -c "from deepinfer_core.bench.presets import ensure_preset; ensure_preset('$preset', \
      weights='${LOAD_FORMAT:-auto}' != 'dummy')" >> "$RES/preset.log" 2>&1
  done
  sync
}
bench() {  # tree (. = this one), result name, preset, then deepinfer bench arguments
  local tree=$1 name=$2 preset=$3; shift 3
  (
    if [[ $tree != . ]]; then  # the baseline's sources and entry points instead of this tree's
      cd "$tree" && PYTHONPATH=$PLAIN_PYTHONPATH GPU_SITE=/tmp/site-di-baseline source "$REPO/tools/gpu_site.sh"
    fi
    # shellcheck disable=SC2086  # BENCH_ENV, LOAD_FORMAT and BENCH_ARGS are word lists
    env ${BENCH_ENV:-} timeout "${BENCH_TIMEOUT:-300}" python -m deepinfer_core.cli bench --preset "$preset" \
      --backend nvidia_sm100 --dtype bfloat16 ${LOAD_FORMAT:+--load-format $LOAD_FORMAT} --json "$RES/$name.json" \
      "$@" ${BENCH_ARGS:-}
  ) > "$RES/$name.txt" 2> "$RES/$name.log" || echo "bench $name failed: $(tail -3 "$RES/$name.log")"
  grep -E "^output tok/s|^roofline \(|^engine/HF" "$RES/$name.txt" | sed "s/^/$name: /"
  save
}
row_args() {  # the deepinfer bench arguments of a row
  case $1 in
    b[0-9]*) echo "--input-len 1024 --output-len 128 --num-prompts ${1#b} --max-num-seqs ${1#b}" ;;
    prefill-8x1k) echo "--input-len 1024 --output-len 1 --num-prompts 8 --max-num-seqs 8 --max-num-batched-tokens 8192" ;;
    prefill-8k) echo "--input-len 8192 --output-len 1 --num-prompts 1 --max-num-seqs 1 --max-num-batched-tokens 8192" ;;
    ctx-[0-9]*) echo "--input-len ${1#ctx-} --output-len 128 --num-prompts 1 --max-num-seqs 1 --max-num-batched-tokens 16384" ;;
    ctx16-[0-9]*) echo "--input-len ${1#ctx16-} --output-len 128 --num-prompts 16 --max-num-seqs 16 --max-num-batched-tokens 16384" ;;
    *) return 1 ;;
  esac
}
rows() {  # iterations, then row names: each row on each preset, on this tree or with BASELINE on both alternately
  local iters=$1 row args round suffix preset at first=${PRESETS%% *}; shift
  for row in "$@"; do
    args=$(row_args "$row") || { echo "unknown row: $row"; continue; }
    for preset in $PRESETS; do
      at=$([[ $preset != "$first" ]] && echo "@$preset")
      if [[ -z ${BASELINE:-} ]]; then
        bench . "$row$at" "$preset" $args --num-iters "$iters"
        [[ " ${VARIANT_PRESETS:-$PRESETS} " == *" $preset "* ]] || continue
        local n=0 variant variants
        IFS=';' read -ra variants <<< "${VARIANTS:-}"
        for variant in "${variants[@]}"; do
          n=$((n + 1))
          echo "$row+v$n$at: $variant" >> "$RES/variants.txt"
          BENCH_ENV="${BENCH_ENV:-} $variant" bench . "$row+v$n$at" "$preset" $args --num-iters "$iters"
        done
        continue
      fi
      for ((round = 1; round <= ${ROUNDS:-1}; round++)); do
        suffix=$( ((round > 1)) && echo "-r$round")
        if ((round % 2)); then
          bench "$BASELINE" "$row-base$suffix$at" "$preset" $args --num-iters "$iters"
          bench . "$row$suffix$at" "$preset" $args --num-iters "$iters"
        else
          bench . "$row$suffix$at" "$preset" $args --num-iters "$iters"
          bench "$BASELINE" "$row-base$suffix$at" "$preset" $args --num-iters "$iters"
        fi
      done
    done
  done
}
summary() {  # every bench result in RES, the engine's steps, and with BASELINE each row against its baseline
  python - "$RES" <<'PY'
import json, statistics, sys
from pathlib import Path

def ms(stats):
    return f"{1e3 * stats['p50']:.2f}" if stats and stats.get("p50") is not None else "-"

def fraction(r):
    roof = r["roofline"]["engine"]
    return roof.get("fraction") if isinstance(roof, dict) else None

results = {f.stem: json.loads(f.read_text()) for f in sorted(Path(sys.argv[1]).glob("*.json"))}
print(f"\n{'run':28} {'out tok/s':>10} {'total tok/s':>11} {'tpot ms':>8} {'ttft ms':>9} {'roofline':>9} {'vs HF':>6} "
      f"{'runs (ms)':>24}")
for name, r in results.items():
    e = r["engine"]; frac = fraction(r)
    ratio = (r.get("ratio") or {}).get("output_throughput")
    runs = " ".join(f"{1e3 * t:.1f}" for t in e.get("iteration_total_times_s") or [])
    print(f"{name:28} {e['output_throughput']:10.1f} {e['total_throughput']:11.1f} {ms(e['tpot_s']):>8} "
          f"{ms(e['ttft_s']):>9} {f'{100 * frac:.1f}%' if frac else '-':>9} {f'{ratio:.2f}x' if ratio else '-':>6} "
          f"{runs:>24}")
for name, r in results.items():  # the engine's steps one by one: the first six, then the median of the rest
    steps = r["engine"].get("step_times_s") or []
    if len(steps) > 6:
        print(f"{name:28} steps (ms): {' '.join(f'{1e3 * t:.1f}' for t in steps[:6])} "
              f"| median after {1e3 * statistics.median(steps[6:]):.2f}")
pairs = [(n, n.replace("-base", "", 1)) for n in results if "-base" in n and n.replace("-base", "", 1) in results]
variants = [(n.split("+v")[0] + ("@" + n.split("@", 1)[1] if "@" in n else ""), n) for n in results if "+v" in n]
pairs += [(base, variant) for base, variant in variants if base in results]  # a variant beside its default run
if pairs:
    print(f"\n{'row (tok/s)':28} {'baseline':>10} {'this':>10} {'change':>8} {'baseline roof':>13} {'this roof':>10}"
          "  (this: the tree against BASELINE, or a variant against the default run)")
    for base, this in pairs:  # output tok/s; total tok/s for prefill rows (one output token)
        b, t = results[base], results[this]
        key = "output_throughput" if t["config"].get("output_len", 2) > 1 else "total_throughput"
        bt, tt = b["engine"][key], t["engine"][key]
        bf, tf = fraction(b), fraction(t)
        print(f"{this:28} {bt:10.1f} {tt:10.1f} {100 * (tt / bt - 1):+7.1f}% "
              f"{f'{100 * bf:.1f}%' if bf else '-':>13} {f'{100 * tf:.1f}%' if tf else '-':>10}")
PY
}

if [[ $mode == tests ]]; then  # file by file, saved after each: a cut run keeps what finished
  for file in ${TESTS:-backends/nvidia_sm100/tests/test_*.py plugins/batch_invariant/tests/test_cuda.py}; do
    echo "== $file" | tee -a "$RES/tests.txt"
    python -m pytest -q -p no:cacheprovider "$file" -rfEs 2>&1 | tee -a "$RES/tests-full.txt" \
      | tail -8 | grep -vE "^\s*$|warnings summary|Docs: https" | tee -a "$RES/tests.txt"  # full log in the archive
    save
  done
fi
if [[ $mode == bench ]]; then
  preset_flushed
  # shellcheck disable=SC2086
  rows "${ITERS:-3}" ${ROWS:-b1 b16 b64 b256}
  summary
fi
if [[ $mode == prefill ]]; then
  preset_flushed
  rows "${ITERS:-5}" prefill-8x1k prefill-8k
  summary
fi
if [[ $mode == profile ]]; then
  preset_flushed
  profiles=" ${PROFILES:-decode prefill run} "
  TRACES=${TMPDIR:-/tmp}  # where the profilers write their Chrome traces (tempfile.gettempdir())
  if [[ $profiles == *" decode "* ]]; then  # per-kernel costs read from a profile with PDL off, each preset
    for preset in $PRESETS; do
      DEEPINFER_NVIDIA_PDL=0 timeout 240 python backends/nvidia_sm100/benchmarks/profile_decode.py --batches 1 64 \
        --preset "$preset" --load-format "${LOAD_FORMAT:-auto}" > "$RES/profile-decode-$preset.txt" 2>&1
      for b in 1 64; do gzip -c "$TRACES/trace-decode-b$b.json" > "$RES/trace-decode-b$b-$preset.json.gz"; done
      grep -E "^=== |^\||^step with" "$RES/profile-decode-$preset.txt" | sed "s/^/$preset: /"; save
    done
  fi
  if [[ $profiles == *" prefill "* ]]; then
    for shape in "8 1024" "1 8192"; do
      set -- $shape
      timeout 200 python backends/nvidia_sm100/benchmarks/profile_decode.py --prefill "$1" --input-len "$2" \
        --max-num-batched-tokens 8192 > "$RES/profile-prefill-$1x$2.txt" 2>&1
      grep -E "^=== |^step span" "$RES/profile-prefill-$1x$2.txt"; save
    done
    gzip -c "$TRACES/trace-prefill-8x1024.json" > "$RES/trace-prefill-8x1024.json.gz"; save
  fi
  if [[ $profiles == *" run "* ]]; then
    timeout 200 python backends/nvidia_sm100/benchmarks/profile_run.py --num-prompts 8 --input-len 1024 \
      --output-len 1 --runs 2 > "$RES/profile-run-8x1024.txt" 2>&1
    grep -E "^=== |^step span" "$RES/profile-run-8x1024.txt"; save
  fi
fi
if [[ $mode == kernels ]]; then
  for entry in $KERNELS; do
    k=${entry%%:*}; extra=()  # NAME:ARG passes ARG, e.g. bench_quant:mxfp4 (one section)
    [[ $entry == *:* ]] && extra=("${entry#*:}")
    [[ $k == bench_tl_attention ]] && extra=(--out "$RES/tl-attention") && mkdir -p "$RES/tl-attention"
    [[ $k == sweep_moe_configs ]] && extra=(--out "$RES/moe-sweep.json")  # the scripts that write files: into RES
    (cd backends/nvidia_sm100/benchmarks && timeout "${KERNEL_TIMEOUT:-300}" python "$k.py" "${extra[@]}") \
      > "$RES/${entry/:/-}.txt" 2>&1 || echo "$entry failed (rc $?)"
    echo "== $entry"; tail -25 "$RES/${entry/:/-}.txt"; save
  done
fi
save

#!/usr/bin/env bash
# One lease on the lent GPU machine: correctness first, then the bench matrix; results under $OUT (or ./h200-out).
# The machine has the repo's tree but no installed packages and no hatchling, so entry points come from
# hand-made dist-info folders on PYTHONPATH; TileLang (for sink_attention) comes from /tmp/site when
# ../shared/tools/gpu-wheels.sh put it there. Usage (repo root):
#   bash backends/nvidia_sm100/benchmarks/h200_session.sh [tests|bench|all|quick]
set -uo pipefail
OUT=${OUT:-$PWD/h200-out}; mkdir -p "$OUT"
S=/tmp/site-di
mkdir -p $S/deepinfer-0.1.0.dist-info $S/deepinfer_nvidia_sm100-0.1.0.dist-info
printf 'Metadata-Version: 2.1\nName: deepinfer\nVersion: 0.1.0\n' > $S/deepinfer-0.1.0.dist-info/METADATA
printf '[deepinfer.backends]\ncpu = deepinfer_core.backends.cpu:probe\n' > $S/deepinfer-0.1.0.dist-info/entry_points.txt
printf 'Metadata-Version: 2.1\nName: deepinfer-nvidia-sm100\nVersion: 0.1.0\n' > $S/deepinfer_nvidia_sm100-0.1.0.dist-info/METADATA
printf '[deepinfer.backends]\nnvidia_sm100 = deepinfer_nvidia_sm100.probe:probe\n' > $S/deepinfer_nvidia_sm100-0.1.0.dist-info/entry_points.txt
export PYTHONPATH=/tmp/site:$S:$PWD:$PWD/backends/nvidia_sm100${PYTHONPATH:+:$PYTHONPATH}
existing=$(ls -d /tmp/deepinfer-bench/v4-* /tmp/db/v4-* 2>/dev/null | head -1)  # a preset already written here
export DEEPINFER_BENCH_CACHE=${DEEPINFER_BENCH_CACHE:-$( [[ -n $existing ]] && dirname "$existing" || echo /tmp/deepinfer-bench)}
what=${1:-all}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python -c "import tilelang" 2>/dev/null && echo "tilelang: yes" || echo "tilelang: no (sink_attention takes the reference op)"
if [[ $what == tests || $what == all ]]; then
  python -m pytest -q -p no:cacheprovider backends/nvidia_sm100/tests -x -rs 2>&1 | tail -25 | tee "$OUT/tests.txt"
fi
bench() {  # name, then deepinfer bench arguments
  local name=$1; shift
  python -m deepinfer_core.cli bench --preset v4-flash-8l64e --backend nvidia_sm100 --dtype bfloat16 \
    --json "$OUT/$name.json" "$@" > "$OUT/$name.txt" 2> "$OUT/$name.log" || echo "bench $name failed: $(tail -3 "$OUT/$name.log")"
}
if [[ $what == bench || $what == all || $what == quick ]]; then
  bench b1 --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1
  bench b64 --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64
  if [[ $what != quick ]]; then
    bench b256 --input-len 1024 --output-len 128 --num-prompts 256 --max-num-seqs 256 --max-num-batched-tokens 8192
    bench b16 --input-len 1024 --output-len 128 --num-prompts 16 --max-num-seqs 16
    bench b1-eager --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1 --enforce-eager
    bench b64-eager --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64 --enforce-eager
  fi
  python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'run':10} {'out tok/s':>10} {'tpot ms':>8} {'ttft ms':>8} {'roofline':>9} {'replays':>8}")
for f in sorted(out.glob("*.json")):
    r = json.loads(f.read_text()); e = r["engine"]; roof = r["roofline"]["engine"]
    frac = roof.get("fraction") if isinstance(roof, dict) else None
    print(f"{f.stem:10} {e['output_throughput']:10.1f} {1e3 * e['tpot_s']['p50']:8.2f} {1e3 * e['ttft_s']['p50']:8.1f} "
          f"{str(frac)[:8]:>9} {r['config'].get('decode_graph_replays')!s:>8}")
PY
fi
if [[ $what == quick ]]; then  # the graph and attention tests only
  python -m pytest -q -p no:cacheprovider backends/nvidia_sm100/tests/test_tl_attention_gpu.py \
    "backends/nvidia_sm100/tests/test_model_gpu.py::test_cuda_graph_decode_matches_eager" \
    "backends/nvidia_sm100/tests/test_model_gpu.py::test_fp32_greedy_and_logprobs_match_cpu" 2>&1 | tail -4 | tee "$OUT/tests.txt"
fi

#!/usr/bin/env bash
# One lease on the lent GPU machine: correctness first, then the bench matrix. Results go to $RES (default
# /tmp/h200-results) and, after every step, into one archive $OUT/h200-results.tgz (the lent machine returns at most
# 8 files from $OUT, and a run cut by the time limit keeps what was archived).
# The machine has the repo's tree but no installed packages and no hatchling, so entry points come from
# dist-info folders written by tools/gpu_site.sh; TileLang (for sink_attention) comes from /tmp/site when
# ../shared/tools/gpu-wheels.sh put it there (transformers too, for --compare-hf). Usage (repo root):
#   bash backends/nvidia_sm100/benchmarks/h200_session.sh MODE     (each mode fits one 10-minute call)
#   tests    every GPU test of the backend            quick   b1, b64, then the graph / attention tests
#   bench    b1 b64 b256 b16 + --enforce-eager A/B    hf      b1 and b64 with --compare-hf (HF in the same run)
#   decode   b1 b64 b256 b16 (graphs, the backend's defaults: 8192-token steps, async scheduling), then b1 and
#            b64 with --no-async-scheduling (A/B)          prefill 8 x 1K prompts in one step, one 8K prompt
#   compiled b1 and b64 with decode steps compiled whole (prompts prefilled in one step: one compile per run)
#   async    b1 and b64 with and without asynchronous scheduling, then b1 compiled
#   compile  decode steps compiled whole before capture (DEEPINFER_NVIDIA_COMPILE_STEP=1): the decode profile at
#            batch 1 and 64, the compiled-step test, then b1 and b64 (prompts prefilled in one step, so one compile
#            per run) and b64 uncompiled alike
#   moe      the MoE op by path and size (bench_moe.py: Triton kernels vs grouped GEMM), then prefill, b1 b64 b256 b16
#   prefill-bound  prefill, then b64 and b256 (their prompts' prefill is most of their floor)
#   profile  one prefill step of 8 x 1K and of 1 x 8K tokens, then one decode step at batch 1 and 64 (profile_decode.py)
#   kernels  op benchmarks: indexer scores (bench_indexer.py), hc_mix_logits variants by batch (bench_hc_mix.py), the
#            decode projections' Triton gemv against cuBLAS (bench_gemv.py), the RMS norm kernel (bench_norm.py),
#            RoPE copying vs in place (bench_rope.py)
#   whole    the whole-row attention kernel A/B (DEEPINFER_TL_ATTN_WHOLE=0 / 1): the 8 x 1K and 1 x 8K prefill steps
#            profiled, then the 8 x 1K prefill bench, each both ways
#   check    the kernel and attention GPU tests, then the decode profile at batch 1 (kernels per step)
#   streams  b1, b64 with forked work on a second stream and without (DEEPINFER_NVIDIA_STREAMS=0), then b256 and
#            both prefill shapes
#   final    b1 b64 b256 and both prefill shapes, then the decode profile at batch 256 and 1
#   sched    b256 and b64 with prompts folded first (the default) and with --enable-mixed-chunk, b256 with
#            16384-token steps, b1, then the decode profile at batch 256 and 1 and one mixed step profiled
#   pool     bench_pool.py (the pooling kernel on real and dummy windows), then batch 1 with the decode step compiled
#            whole (DEEPINFER_NVIDIA_COMPILE_STEP=1): its profile and the bench
#   s12      the twelfth session's lease: the model and compressor GPU tests, b1, b1 with the Triton GEMV
#            (DEEPINFER_NVIDIA_GEMV=1), b64, b256, the 8K prefill, then the decode profile at batch 256 and 1 and
#            the 1K-token prefill step profiled (the batch-1 bench's first token)
#   s13      the thirteenth session's first lease: the model and changed kernels' GPU tests, sweep_gemv.py (the
#            one-row GEMV's launch configurations), b1 with cuBLAS and with the Triton GEMV, the decode profile at b1
#   s13b     test_model_gpu (also with DEEPINFER_NVIDIA_PDL=1), the kernel tests, b1 with and without PDL, their profiles
#   s13c     b1 with DEEPINFER_NVIDIA_GEMV=0, then b64 and b256 with and without PDL
#   s13final the model and changed kernels' GPU tests, b1 and b64 with --compare-hf, b256, both prefill shapes,
#            the decode profile at batch 1 and 256
#   s14d     the fourteenth session's last lease: the decode attention, one-token MoE and hc kernel tests, b1, the
#            batch-1 decode profile (each step bounded; the session's earlier modes s14-s14c ran code since removed,
#            docs/performance.md 4.17)
#   ttft     the first bench of a fresh machine: the preset written and flushed (`sync`) first, b1 three times, the
#            1K-token prefill step profiled; then b16 with the decode attention opened to 16 rows and without
#   s15a     the fifteenth session's first lease: the preset flushed, b1 once, b1 with --num-iters 5, the 1K-token
#            prefill step profiled with --sync-debug, then test_model_gpu.py
#   s15final the fifteenth session's last lease (its s15b and s15c ran code since removed: docs/performance.md 4.18):
#            test_model_gpu.py, the small-op and decode-attention GPU tests, b1 (median of 3), b64, b256
#   forks    b64 (FORKS_BATCH=256: b256) with the defaults, with the key path in place
#            (DEEPINFER_NVIDIA_FORK_INLINE=_keys,_fold_index) and with the side stream at priority 0
#   s16final b1 (median of 3) on the final code. The session's other modes ran code since removed (docs/performance.md
#            4.19): prefetch (the script at 267d46e), s16 (6d6d12e: bench_l2_warm.py, the GC freeze A/B, the 1K
#            prefill profiled), s16b and s16c (6816b2b: the L2 warm-up at batch 1, 64 and 256)
#   timeline the decode profile at batch 1 and 64 with DEEPINFER_NVIDIA_PDL=0 and its two-stream timeline
#   s17a     the seventeenth session's first lease: b1 once, the batch-1 decode profile with DEEPINFER_NVIDIA_PDL=0
#            and the 1K-token prefill step profiled, both traces kept (gzipped) for offline reading
#   s17b     the greedy sampler's kernel and the router ahead of the shared expert: its kernel tests and
#            test_model_gpu.py, b1 (median of 3), b1 with DEEPINFER_NVIDIA_GREEDY=0, the batch-1 decode trace with
#            PDL off, b64
#   s17c     (ran 1ad071c's scalar Sinkhorn, since removed: docs/performance.md 4.20)
#   s17d     the prefill graphs of lone prompts: their GPU test, b1 (median of 3) with them and with
#            --no-prefill-graphs, the 1K prefill step profiled (through the graph), b64
#   s17final b1 (median of 3) on the final code, the new paths' GPU tests (the sampled rows' copy beside the next
#            step; fp32 parity, async against sync, the prefill graphs), b64, b256
#   s18a     the eighteenth session's first lease: b1 (median of 5), b64 (median of 3), the batch-64 decode trace with
#            PDL off and the 8 x 1K prefill step's trace (both kept, gzipped), the 8K prompt through its prefill graph
#   s18b     whole bench runs profiled (profile_run.py): 8 x 1K prompts to one token, then batch 64 (1K -> 128 tokens,
#            16384-token steps), two runs each right after a warmup, the first 8 x 1K trace kept (gzipped)
#   s18c     bench_hc_finish.py (the Sinkhorn's share of hc_pre_normed), then b64 (median of 3) and the 8 x 1K prefill
#            (median of 5) with glibc's heap kept (MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_: no memory handed
#            back to the system and faulted in again) and, for the prefill, without
#   s18final the eighteenth session's final code, first call: the model GPU tests and the hc kernels' (the Sinkhorn
#            beside the block), b1 (median of 5) with it and with DEEPINFER_NVIDIA_HC_BESIDE=0, b64 (median of 3)
#   s18final2 its second call: b64 with DEEPINFER_KEEP_HEAP=0 and with DEEPINFER_NVIDIA_HC_BESIDE=0 (2 runs each), b256,
#            both prefill shapes (median of 5)
#   s18hf    the final code once more: b1 (median of 5), b1 with --compare-hf (HF in the same process), b64 (median of 3)
#   s18omp   b64 (median of 3) with OMP_NUM_THREADS=1, then with the default threads, then with 1 again
#   idle     where prefill steps leave the GPU idle: both prefill shapes profiled with the idle report and
#            --sync-debug, the 8 x 1K step again with the whole-row kernel, then bench_rope.py
set -uo pipefail
OUT=${OUT:-$PWD/h200-out}; RES=${RES:-/tmp/h200-results}; mkdir -p "$OUT" "$RES"
save() { tar -czf "$OUT/h200-results.tgz" -C "$RES" .; }
trap save EXIT  # a run cut short (timeout) still returns what it wrote
source tools/gpu_site.sh  # entry points without installing
existing=$(ls -d /tmp/deepinfer-bench/v4-* /tmp/db/v4-* 2>/dev/null | head -1)  # a preset already written here
export DEEPINFER_BENCH_CACHE=${DEEPINFER_BENCH_CACHE:-$( [[ -n $existing ]] && dirname "$existing" || echo /tmp/deepinfer-bench)}
what=${1:-all}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$RES/gpu.txt"
python -c "import tilelang" 2>/dev/null && echo "tilelang: yes" || echo "tilelang: no (sink_attention takes the reference op)"
bench() {  # name, then deepinfer bench arguments (BENCH_ENV: VAR=value words the process starts with)
  local name=$1; shift
  env ${BENCH_ENV:-} timeout "${BENCH_TIMEOUT:-1200}" python -m deepinfer_core.cli bench --preset v4-flash-8l64e --backend nvidia_sm100 \
    --dtype bfloat16 --json "$RES/$name.json" "$@" > "$RES/$name.txt" 2> "$RES/$name.log" || echo "bench $name failed: $(tail -3 "$RES/$name.log")"
  save
}
model_and_kernel_tests() {  # test_model_gpu.py, then the test_triton_kernels.py cases -k "$1", into tests.txt
  python -m pytest -q -p no:cacheprovider -rfEs backends/nvidia_sm100/tests/test_model_gpu.py 2>&1 | tail -3 \
    | tee "$RES/tests.txt"; save
  python -m pytest -q -p no:cacheprovider -rfE backends/nvidia_sm100/tests/test_triton_kernels.py -k "$1" 2>&1 \
    | tail -3 | tee -a "$RES/tests.txt"; save
}
preset_flushed() {  # the preset written when the machine has none, then flushed to disk before the first bench
  python -c "from deepinfer_core.bench.presets import ensure_preset; ensure_preset('v4-flash-8l64e')" \
    > "$RES/preset.log" 2>&1; sync
}
traces() {  # the decode step's trace at batch $1 (PDL off) and the $2 x 1K prefill step's, both kept (gzipped)
  DEEPINFER_NVIDIA_PDL=0 timeout 200 python backends/nvidia_sm100/benchmarks/profile_decode.py --batches "$1" \
    > "$RES/profile-b$1-pdl0.txt" 2>&1
  gzip -c "/tmp/trace-decode-b$1.json" > "$RES/trace-decode-b$1-pdl0.json.gz"
  grep -E "^=== batch $1: decode step" "$RES/profile-b$1-pdl0.txt"; save
  timeout 150 python backends/nvidia_sm100/benchmarks/profile_decode.py --prefill "$2" --input-len 1024 \
    > "$RES/profile-prefill-$2x1k.txt" 2>&1
  gzip -c "/tmp/trace-prefill-$2x1024.json" > "$RES/trace-prefill-$2x1k.json.gz"
  grep -E "^=== |^step span" "$RES/profile-prefill-$2x1k.txt"; save
}
prefill_shapes() {  # both prefill shapes in 8192-token steps, median of 5
  bench prefill-8x1k --input-len 1024 --output-len 1 --num-prompts 8 --max-num-seqs 8 --max-num-batched-tokens 8192 \
    --num-iters 5
  bench prefill-8k --input-len 8192 --output-len 1 --num-prompts 1 --max-num-seqs 1 --max-num-batched-tokens 8192 \
    --num-iters 5
}
if [[ $what == compile ]]; then  # every prompt prefilled in one step: decode meets one batch size, one compile
  export DEEPINFER_NVIDIA_COMPILE_STEP=1 TORCHDYNAMO_VERBOSE=1  # a failed compile logs its internal stack
  for b in 1 64; do
    timeout 200 python backends/nvidia_sm100/benchmarks/profile_decode.py --batches $b \
      --max-num-batched-tokens $((b * 1024)) > "$RES/profile-compile-b$b.txt" 2>&1
    grep -E "^=== |compiling the decode step failed|^\|" "$RES/profile-compile-b$b.txt"; save
  done
  timeout 200 python -m pytest -q -rxX -p no:cacheprovider \
    "backends/nvidia_sm100/tests/test_model_gpu.py::test_compiled_decode_step_matches_eager" 2>&1 | tail -6 | tee "$RES/tests-compile.txt"
  save
  bench b1-compiled --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1
  bench b64-compiled --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64 --max-num-batched-tokens 65536
  unset DEEPINFER_NVIDIA_COMPILE_STEP
  bench b64-1step --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64 --max-num-batched-tokens 65536
  what=summary
fi
if [[ $what == kernels ]]; then
  (cd backends/nvidia_sm100/benchmarks && python bench_indexer.py) 2>&1 | tail -8 | tee "$RES/bench-indexer.txt"; save
  (cd backends/nvidia_sm100/benchmarks && python bench_hc_mix.py) 2>&1 | tail -12 | tee "$RES/bench-hc-mix.txt"; save
  (cd backends/nvidia_sm100/benchmarks && python sweep_gemv.py) 2>&1 | tail -22 | tee "$RES/sweep-gemv.txt"; save
  (cd backends/nvidia_sm100/benchmarks && python bench_norm.py) 2>&1 | tail -20 | tee "$RES/bench-norm.txt"; save
  (cd backends/nvidia_sm100/benchmarks && python bench_rope.py) 2>&1 | tail -10 | tee "$RES/bench-rope.txt"; save
fi
if [[ $what == whole ]]; then  # the same process order both ways; the profile's wall vs kernel time is the question
  for w in 0 1; do
    for shape in "8 1024" "1 8192"; do
      set -- $shape
      DEEPINFER_TL_ATTN_WHOLE=$w timeout 150 python backends/nvidia_sm100/benchmarks/profile_decode.py --prefill $1 \
        --input-len $2 --max-num-batched-tokens 8192 > "$RES/profile-prefill-$1x$2-whole$w.txt" 2>&1
      grep -E "^=== |Self CUDA time total" "$RES/profile-prefill-$1x$2-whole$w.txt"; save
    done
    DEEPINFER_TL_ATTN_WHOLE=$w bench prefill-8x1k-whole$w --input-len 1024 --output-len 1 --num-prompts 8 --max-num-seqs 8 \
      --max-num-batched-tokens 8192
  done
  what=summary
fi
if [[ $what == check ]]; then
  timeout 330 python -m pytest -q -p no:cacheprovider -rfEs backends/nvidia_sm100/tests/test_kernels_gpu.py \
    backends/nvidia_sm100/tests/test_tl_attention_gpu.py backends/nvidia_sm100/tests/test_triton_kernels.py \
    -k "not under_triton_interpreter" 2>&1 | tee "$RES/tests-check-full.txt" | tail -15 | tee "$RES/tests-check.txt"
  save
  timeout 200 python backends/nvidia_sm100/benchmarks/profile_decode.py --batches 1 > "$RES/profile-b1.txt" 2>&1
  grep -E "^=== batch 1: decode|^\|" "$RES/profile-b1.txt"; save
fi
if [[ $what == streams ]]; then
  bench b1 --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1
  DEEPINFER_NVIDIA_STREAMS=0 bench b1-nostreams --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1
  bench b64 --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64
  DEEPINFER_NVIDIA_STREAMS=0 bench b64-nostreams --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64
  bench b256 --input-len 1024 --output-len 128 --num-prompts 256 --max-num-seqs 256
  what=prefill
fi
if [[ $what == final ]]; then
  bench b1 --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1
  bench b64 --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64
  bench b256 --input-len 1024 --output-len 128 --num-prompts 256 --max-num-seqs 256
  prefill_shapes
  timeout 200 python backends/nvidia_sm100/benchmarks/profile_decode.py --batches 256 1 > "$RES/profile-decode.txt" 2>&1
  grep -E "^=== batch|^\|" "$RES/profile-decode.txt"; save
  what=summary
fi
if [[ $what == s12 ]]; then
  model_and_kernel_tests "compressor or write_rows or norm or hc_pre"
  bench b1 --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1
  DEEPINFER_NVIDIA_GEMV=1 bench b1-gemv --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1
  bench b64 --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64
  bench b256 --input-len 1024 --output-len 128 --num-prompts 256 --max-num-seqs 256
  bench prefill-8k --input-len 8192 --output-len 1 --num-prompts 1 --max-num-seqs 1 --max-num-batched-tokens 8192 \
    --num-iters 5
  timeout 150 python backends/nvidia_sm100/benchmarks/profile_decode.py --batches 256 1 > "$RES/profile-decode.txt" 2>&1
  grep -E "^=== batch|^\|" "$RES/profile-decode.txt"; save
  timeout 90 python backends/nvidia_sm100/benchmarks/profile_decode.py --prefill 1 --input-len 1024 \
    --max-num-batched-tokens 8192 > "$RES/profile-prefill-1k.txt" 2>&1  # the batch-1 bench's TTFT step
  grep -E "^=== |Self CUDA time total" "$RES/profile-prefill-1k.txt"; save
  what=summary
fi
if [[ $what == s13 ]]; then
  model_and_kernel_tests "compressor or norm or hc_pre or gemv"
  (cd backends/nvidia_sm100/benchmarks && timeout 330 python sweep_gemv.py) > "$RES/sweep-gemv.txt" 2>&1
  tail -25 "$RES/sweep-gemv.txt"; save
  bench b1 --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1
  DEEPINFER_NVIDIA_GEMV=1 bench b1-gemv --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1
  timeout 100 python backends/nvidia_sm100/benchmarks/profile_decode.py --batches 1 > "$RES/profile-decode.txt" 2>&1
  grep -E "^=== batch|^\|" "$RES/profile-decode.txt"; save
  what=summary
fi
if [[ $what == s13b ]]; then  # correctness of this session's changes, then PDL at batch 1
  python -m pytest -q -p no:cacheprovider -rfEs backends/nvidia_sm100/tests/test_model_gpu.py 2>&1 | tail -3 \
    | tee "$RES/tests.txt"; save
  DEEPINFER_NVIDIA_PDL=1 python -m pytest -q -p no:cacheprovider -rfEs backends/nvidia_sm100/tests/test_model_gpu.py \
    2>&1 | tail -3 | tee -a "$RES/tests.txt"; save
  python -m pytest -q -p no:cacheprovider -rfE backends/nvidia_sm100/tests/test_triton_kernels.py \
    "backends/nvidia_sm100/tests/test_kernels_gpu.py::test_small_ops_match_reference" 2>&1 | tail -3 \
    | tee -a "$RES/tests.txt"; save
  bench b1 --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1
  DEEPINFER_NVIDIA_PDL=1 bench b1-pdl --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1
  for pdl in 0 1; do
    DEEPINFER_NVIDIA_PDL=$pdl timeout 100 python backends/nvidia_sm100/benchmarks/profile_decode.py --batches 1 \
      > "$RES/profile-decode-pdl$pdl.txt" 2>&1
    grep -E "^=== batch 1: decode" "$RES/profile-decode-pdl$pdl.txt"; save
  done
  what=summary
fi
if [[ $what == s13c ]]; then  # PDL at larger batches, the GEMV default A/B at batch 1
  DEEPINFER_NVIDIA_GEMV=0 bench b1-nogemv --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1
  for b in 64 256; do
    bench b$b --input-len 1024 --output-len 128 --num-prompts $b --max-num-seqs $b
    DEEPINFER_NVIDIA_PDL=1 bench b$b-pdl --input-len 1024 --output-len 128 --num-prompts $b --max-num-seqs $b
  done
  what=summary
fi
if [[ $what == s13final ]]; then  # the session's last code: its GPU tests, then the record with HF in the same run
  model_and_kernel_tests "gemv or shared_expert or align or hc_post or compressor_entries"
  bench b1-hf --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1 --compare-hf
  bench b64-hf --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64 --compare-hf
  bench b256 --input-len 1024 --output-len 128 --num-prompts 256 --max-num-seqs 256
  prefill_shapes
  timeout 120 python backends/nvidia_sm100/benchmarks/profile_decode.py --batches 1 256 > "$RES/profile-decode.txt" 2>&1
  grep -E "^=== batch|^\|" "$RES/profile-decode.txt"; save
  what=summary
fi
if [[ $what == s14d ]]; then  # the kernel tests (bounded), b1, its profile
  export BENCH_TIMEOUT=110
  timeout 70 python -u -m pytest -v -p no:cacheprovider backends/nvidia_sm100/tests/test_triton_kernels.py \
    -k "decode_attention or one_token or hc_pre or hc_post" > "$RES/tests-v.txt" 2>&1
  echo "pytest rc $?" >> "$RES/tests-v.txt"; grep -E "FAILED|ERROR|passed|failed|rc " "$RES/tests-v.txt" | tail -8; save
  bench b1 --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1
  timeout 60 python backends/nvidia_sm100/benchmarks/profile_decode.py --batches 1 > "$RES/profile-decode.txt" 2>&1
  grep -E "^=== batch 1: decode" "$RES/profile-decode.txt"; save
  what=summary
fi
if [[ $what == ttft ]]; then  # the first bench of a fresh machine (docs/nvidia.md "The next lease" 3): the preset
  export BENCH_TIMEOUT=150    # written (if not cached) and flushed first, then b1 three times, then the first prefill
  preset_flushed
  for run in 1 2 3; do bench "b1-run$run" --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1; done
  grep -h "^b1-run" "$RES"/b1-run*.txt
  timeout 90 python backends/nvidia_sm100/benchmarks/profile_decode.py --prefill 1 --input-len 1024 \
    > "$RES/profile-prefill-1k.txt" 2>&1
  grep -E "^===" "$RES/profile-prefill-1k.txt"; save
  DEEPINFER_NVIDIA_DECODE_ATTN_MAX_ROWS=16 bench b16-decode-attn --input-len 1024 --output-len 128 --num-prompts 16 \
    --max-num-seqs 16
  bench b16 --input-len 1024 --output-len 128 --num-prompts 16 --max-num-seqs 16
  what=summary
fi
if [[ $what == s15a ]]; then  # the fifteenth session's first lease: the first token, then the model tests
  export BENCH_TIMEOUT=150
  preset_flushed
  bench b1-first --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1
  bench b1-iters5 --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1 --num-iters 5
  timeout 100 python backends/nvidia_sm100/benchmarks/profile_decode.py --prefill 1 --input-len 1024 --sync-debug \
    > "$RES/profile-prefill-1k.txt" 2>&1
  grep -E "^===" "$RES/profile-prefill-1k.txt"; save
  timeout 200 python -m pytest -q -p no:cacheprovider -rfEs backends/nvidia_sm100/tests/test_model_gpu.py 2>&1 \
    | tail -5 | tee "$RES/tests-model.txt"; save
  what=summary
fi
if [[ $what == s15final ]]; then  # the last: the model and changed ops' GPU tests, then b1 (median of 3), b64, b256
  export BENCH_TIMEOUT=170
  timeout 150 python -m pytest -q -p no:cacheprovider -rfEs backends/nvidia_sm100/tests/test_model_gpu.py 2>&1 \
    | tail -3 | tee "$RES/tests-model.txt"; save
  timeout 60 python -m pytest -q -p no:cacheprovider -rfE backends/nvidia_sm100/tests/test_kernels_gpu.py \
    backends/nvidia_sm100/tests/test_triton_kernels.py -k "small_ops or decode_attention or planned" 2>&1 \
    | tail -3 | tee "$RES/tests-kernels.txt"; save
  preset_flushed
  bench b1 --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1 --num-iters 3
  bench b64 --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64
  bench b256 --input-len 1024 --output-len 128 --num-prompts 256 --max-num-seqs 256
  what=summary
fi
if [[ $what == forks ]]; then  # 4.18's forked key path and side-stream priority at batch 64 / 256 (FORKS_BATCH)
  b=${FORKS_BATCH:-64}
  args=(--input-len 1024 --output-len 128 --num-prompts "$b" --max-num-seqs "$b")
  bench "b$b" "${args[@]}"
  DEEPINFER_NVIDIA_FORK_INLINE=_keys,_fold_index bench "b$b-keys-inline" "${args[@]}"
  DEEPINFER_NVIDIA_SIDE_PRIORITY=0 bench "b$b-side-priority0" "${args[@]}"
  what=summary
fi
if [[ $what == s16final ]]; then  # the final code's batch 1 (median of 3)
  preset_flushed
  BENCH_TIMEOUT=120 bench b1 --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1 --num-iters 3
  what=summary
fi
if [[ $what == timeline ]]; then  # the two streams of a decode step without PDL's early waits (timeline.py)
  DEEPINFER_NVIDIA_PDL=0 timeout 300 python backends/nvidia_sm100/benchmarks/profile_decode.py --batches 1 64 \
    > "$RES/profile-timeline.txt" 2>&1
  grep -E -A12 "^=== batch [0-9]+: the streams" "$RES/profile-timeline.txt"; save
fi
if [[ $what == s17a ]]; then  # a baseline, then both traces kept for reading off the lease
  preset_flushed
  BENCH_TIMEOUT=120 bench b1 --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1
  traces 1 1
  what=summary
fi
if [[ $what == s17b ]]; then
  preset_flushed
  timeout 60 python -m pytest -q -p no:cacheprovider -rfE backends/nvidia_sm100/tests/test_triton_kernels.py -k greedy \
    2>&1 | tail -3 | tee "$RES/tests.txt"; save
  timeout 200 python -m pytest -q -p no:cacheprovider -rfEs backends/nvidia_sm100/tests/test_model_gpu.py 2>&1 \
    | tail -4 | tee -a "$RES/tests.txt"; save
  BENCH_TIMEOUT=120 bench b1 --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1 --num-iters 3
  DEEPINFER_NVIDIA_GREEDY=0 BENCH_TIMEOUT=100 bench b1-greedy0 --input-len 1024 --output-len 128 --num-prompts 1 \
    --max-num-seqs 1
  DEEPINFER_NVIDIA_PDL=0 timeout 150 python backends/nvidia_sm100/benchmarks/profile_decode.py --batches 1 \
    > "$RES/profile-b1-pdl0.txt" 2>&1
  gzip -c /tmp/trace-decode-b1.json > "$RES/trace-decode-b1-pdl0.json.gz"; grep -E "^=== batch 1: decode" "$RES/profile-b1-pdl0.txt"
  save
  BENCH_TIMEOUT=150 bench b64 --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64
  what=summary
fi
if [[ $what == s17d ]]; then
  preset_flushed
  timeout 200 python -m pytest -q -p no:cacheprovider -rfE backends/nvidia_sm100/tests/test_model_gpu.py \
    -k "prefill_graph or fp32_greedy" 2>&1 | tail -4 | tee "$RES/tests.txt"; save
  args=(--input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1 --num-iters 3)
  BENCH_TIMEOUT=100 bench b1 "${args[@]}"
  BENCH_TIMEOUT=100 bench b1-eager-prefill "${args[@]}" --no-prefill-graphs
  timeout 120 python backends/nvidia_sm100/benchmarks/profile_decode.py --prefill 1 --input-len 1024 \
    > "$RES/profile-prefill-1k.txt" 2>&1
  grep -E "^=== |^step span" "$RES/profile-prefill-1k.txt"; save
  BENCH_TIMEOUT=150 bench b64 --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64
  what=summary
fi
if [[ $what == s17final ]]; then
  preset_flushed
  BENCH_TIMEOUT=100 bench b1 --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1 --num-iters 3
  timeout 170 python -m pytest -q -p no:cacheprovider -rfE backends/nvidia_sm100/tests/test_kernels_gpu.py \
    backends/nvidia_sm100/tests/test_model_gpu.py -k "sampled_rows or fp32_greedy or async_scheduling or prefill_graph" \
    2>&1 | tail -4 | tee "$RES/tests.txt"; save
  BENCH_TIMEOUT=120 bench b64 --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64
  BENCH_TIMEOUT=120 bench b256 --input-len 1024 --output-len 128 --num-prompts 256 --max-num-seqs 256
  what=summary
fi
if [[ $what == s18a ]]; then  # the spread of b1 and b64, then the two traces batch 64 spends its time in
  preset_flushed
  BENCH_TIMEOUT=120 bench b1 --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1 --num-iters 5
  BENCH_TIMEOUT=200 bench b64 --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64 --num-iters 3
  traces 64 8
  BENCH_TIMEOUT=100 bench prefill-8k --input-len 8192 --output-len 1 --num-prompts 1 --max-num-seqs 1 \
    --max-num-batched-tokens 8192 --num-iters 5
  what=summary
fi
if [[ $what == s18b ]]; then  # where the first steps of a run lose time against the same step profiled alone
  preset_flushed
  timeout 150 python backends/nvidia_sm100/benchmarks/profile_run.py --num-prompts 8 --input-len 1024 --output-len 1 \
    --runs 2 > "$RES/profile-run-8x1k.txt" 2>&1
  gzip -c /tmp/trace-run-8x1024-0.json > "$RES/trace-run-8x1k-0.json.gz"; grep -E "^=== |^step span" "$RES/profile-run-8x1k.txt"
  save
  timeout 240 python backends/nvidia_sm100/benchmarks/profile_run.py --num-prompts 64 --input-len 1024 --output-len 128 \
    --max-num-batched-tokens 16384 --runs 2 > "$RES/profile-run-64.txt" 2>&1
  grep -E "^=== |^step span" "$RES/profile-run-64.txt"
  what=summary
fi
if [[ $what == s18c ]]; then  # is the first step's host time page faults of fresh heap memory?
  preset_flushed
  (cd backends/nvidia_sm100/benchmarks && timeout 120 python bench_hc_finish.py) 2>&1 | tail -12 | tee "$RES/bench-hc-finish.txt"
  save
  heap="MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=17179869184"  # 32 MB: glibc's largest
  BENCH_ENV=$heap BENCH_TIMEOUT=200 bench b64-heap --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64 \
    --num-iters 3
  args=(--input-len 1024 --output-len 1 --num-prompts 8 --max-num-seqs 8 --max-num-batched-tokens 8192 --num-iters 5)
  BENCH_TIMEOUT=100 bench prefill-8x1k "${args[@]}"
  BENCH_ENV=$heap BENCH_TIMEOUT=100 bench prefill-8x1k-heap "${args[@]}"
  what=summary
fi
if [[ $what == s18final ]]; then
  preset_flushed
  timeout 200 python -m pytest -q -p no:cacheprovider -rfE backends/nvidia_sm100/tests/test_model_gpu.py \
    -k "fp32_greedy or graph or async" 2>&1 | tail -4 | tee "$RES/tests.txt"; save
  timeout 100 python -m pytest -q -p no:cacheprovider -rfE backends/nvidia_sm100/tests/test_triton_kernels.py \
    -k "deferred or hc_pre or hc_post" 2>&1 | tail -3 | tee -a "$RES/tests.txt"; save
  args=(--input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1 --num-iters 5)
  BENCH_TIMEOUT=100 bench b1 "${args[@]}"
  BENCH_ENV=DEEPINFER_NVIDIA_HC_BESIDE=0 BENCH_TIMEOUT=100 bench b1-hc-inline "${args[@]}"
  BENCH_TIMEOUT=150 bench b64 --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64 --num-iters 3
  what=summary
fi
if [[ $what == s18final2 ]]; then
  b64=(--input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64 --num-iters 2)
  BENCH_ENV=DEEPINFER_KEEP_HEAP=0 BENCH_TIMEOUT=130 bench b64-heap-off "${b64[@]}"
  BENCH_ENV=DEEPINFER_NVIDIA_HC_BESIDE=0 BENCH_TIMEOUT=130 bench b64-hc-inline "${b64[@]}"
  BENCH_TIMEOUT=150 bench b256 --input-len 1024 --output-len 128 --num-prompts 256 --max-num-seqs 256
  BENCH_TIMEOUT=90 prefill_shapes
  what=summary
fi
if [[ $what == s18hf ]]; then
  BENCH_TIMEOUT=100 bench b1-final --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1 --num-iters 5
  BENCH_TIMEOUT=200 bench b1-hf --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1 --compare-hf
  BENCH_TIMEOUT=150 bench b64-final --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64 --num-iters 3
  what=summary
fi
if [[ $what == s18omp ]]; then  # is the slow first prefill step of some processes the CPU thread pool's?
  b64=(--input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64 --num-iters 3)
  BENCH_ENV=OMP_NUM_THREADS=1 BENCH_TIMEOUT=100 bench b64-omp1 "${b64[@]}"
  BENCH_TIMEOUT=100 bench b64-omp16 "${b64[@]}"
  BENCH_ENV=OMP_NUM_THREADS=1 BENCH_TIMEOUT=100 bench b64-omp1b "${b64[@]}"
  what=summary
fi
if [[ $what == sched ]]; then
  bench b256 --input-len 1024 --output-len 128 --num-prompts 256 --max-num-seqs 256
  bench b256-mixed --input-len 1024 --output-len 128 --num-prompts 256 --max-num-seqs 256 --enable-mixed-chunk
  bench b256-16k --input-len 1024 --output-len 128 --num-prompts 256 --max-num-seqs 256 --max-num-batched-tokens 16384
  bench b64 --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64
  bench b64-mixed --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64 --enable-mixed-chunk
  bench b1 --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1
  timeout 150 python backends/nvidia_sm100/benchmarks/profile_decode.py --batches 256 1 > "$RES/profile-decode.txt" 2>&1
  grep -E "^=== batch|^\|" "$RES/profile-decode.txt"; save
  timeout 120 python backends/nvidia_sm100/benchmarks/profile_decode.py --prefill 8 --decoding 248 \
    > "$RES/profile-mixed.txt" 2>&1
  grep -E "^=== |^step span|gaps of" "$RES/profile-mixed.txt"; save
  what=summary
fi
if [[ $what == idle ]]; then
  for shape in "8 1024" "1 8192"; do
    set -- $shape
    timeout 150 python backends/nvidia_sm100/benchmarks/profile_decode.py --prefill $1 --input-len $2 \
      --max-num-batched-tokens 8192 --sync-debug > "$RES/idle-$1x$2.txt" 2>&1
    grep -E "^=== |^step span|gaps of|synchronising calls" "$RES/idle-$1x$2.txt"; save
  done
  DEEPINFER_TL_ATTN_WHOLE=1 timeout 150 python backends/nvidia_sm100/benchmarks/profile_decode.py --prefill 8 \
    --input-len 1024 --max-num-batched-tokens 8192 > "$RES/idle-8x1024-whole1.txt" 2>&1
  grep -E "^=== |^step span|gaps of" "$RES/idle-8x1024-whole1.txt"; save
  (cd backends/nvidia_sm100/benchmarks && python bench_rope.py) 2>&1 | tail -10 | tee "$RES/bench-rope.txt"; save
fi
if [[ $what == profile ]]; then  # kernels by time; the prefill steps first (their tables decide the next kernels)
  for shape in "8 1024" "1 8192"; do
    set -- $shape
    timeout 240 python backends/nvidia_sm100/benchmarks/profile_decode.py --prefill $1 --input-len $2 \
      --max-num-batched-tokens 8192 > "$RES/profile-prefill-$1x$2.txt" 2>&1
    grep -E "^=== " "$RES/profile-prefill-$1x$2.txt"; save
  done
  timeout 240 python backends/nvidia_sm100/benchmarks/profile_decode.py --batches 1 64 > "$RES/profile-decode.txt" 2>&1
  grep -E "^=== |^\|" "$RES/profile-decode.txt"; save
fi
if [[ $what == moe ]]; then  # then the prefill-bound runs below (prefill, b64, b256)
  (cd backends/nvidia_sm100/benchmarks && python bench_moe.py) 2>&1 | tail -20 | tee "$RES/bench-moe.txt"; save
fi
if [[ $what == tests || $what == all ]]; then  # file by file, saved after each: a cut run keeps what finished
  for file in backends/nvidia_sm100/tests/test_*.py; do  # every failure's name and error line in the kept tail
    echo "== $file" | tee -a "$RES/tests.txt"
    python -m pytest -q -p no:cacheprovider "$file" -rfEs 2>&1 | tee -a "$RES/tests-full.txt" \
      | tail -8 | grep -vE "^\s*$|warnings summary|Docs: https" | tee -a "$RES/tests.txt"  # full log in the archive
    save
  done
fi
if [[ $what == async ]]; then  # A/B of asynchronous scheduling (the NVIDIA default) at batch 1 and 64, then compiled b1
  bench b1 --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1
  bench b1-sync --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1 --no-async-scheduling
  bench b64 --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64
  bench b64-sync --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64 --no-async-scheduling
  DEEPINFER_NVIDIA_COMPILE_STEP=1 bench b1-compiled --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1
  what=summary
fi
if [[ $what == pool ]]; then
  (cd backends/nvidia_sm100/benchmarks && timeout 120 python bench_pool.py) 2>&1 | tail -16 | tee "$RES/bench-pool.txt"; save
  export DEEPINFER_NVIDIA_COMPILE_STEP=1
  timeout 200 python backends/nvidia_sm100/benchmarks/profile_decode.py --batches 1 > "$RES/profile-compile-b1.txt" 2>&1
  grep -E "^=== |compiling the decode step failed|^\|" "$RES/profile-compile-b1.txt"; save
  bench b1-compiled --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1
  unset DEEPINFER_NVIDIA_COMPILE_STEP
  what=summary
fi
if [[ $what == compiled ]]; then
  export DEEPINFER_NVIDIA_COMPILE_STEP=1
  bench b1-compiled --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1
  bench b64-compiled --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64 --max-num-batched-tokens 65536
  unset DEEPINFER_NVIDIA_COMPILE_STEP
  what=summary
fi
if [[ $what == hf ]]; then
  bench b1-hf --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1 --compare-hf
  bench b64-hf --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64 --compare-hf
fi
if [[ $what == prefill || $what == moe || $what == prefill-bound ]]; then
  prefill_shapes
fi
if [[ $what == bench || $what == all || $what == quick || $what == summary || $what == hf || $what == prefill || $what == decode || $what == moe || $what == prefill-bound || $what == streams ]]; then
  if [[ $what == prefill-bound ]]; then
    bench b64 --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64
    bench b256 --input-len 1024 --output-len 128 --num-prompts 256 --max-num-seqs 256
  elif [[ $what != hf && $what != prefill && $what != summary ]]; then
    bench b1 --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1
    bench b64 --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64
  fi
  if [[ $what == bench || $what == all || $what == decode || $what == moe ]]; then
    bench b256 --input-len 1024 --output-len 128 --num-prompts 256 --max-num-seqs 256
    bench b16 --input-len 1024 --output-len 128 --num-prompts 16 --max-num-seqs 16
  fi
  if [[ $what == decode ]]; then
    bench b1-sync --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1 --no-async-scheduling
    bench b64-sync --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64 --no-async-scheduling
  fi
  if [[ $what == bench || $what == all ]]; then
    bench b1-eager --input-len 1024 --output-len 128 --num-prompts 1 --max-num-seqs 1 --enforce-eager
    bench b64-eager --input-len 1024 --output-len 128 --num-prompts 64 --max-num-seqs 64 --enforce-eager
  fi
  python - "$RES" <<'PY'
import json, sys
from pathlib import Path

def ms(stats):
    return f"{1e3 * stats['p50']:.2f}" if stats and stats.get("p50") is not None else "-"

out = Path(sys.argv[1])
print(f"{'run':14} {'out tok/s':>10} {'total tok/s':>11} {'tpot ms':>8} {'ttft ms':>9} {'roofline':>9} {'vs HF':>6} "
      f"{'replays':>8} {'budget':>7} {'async':>6}")
for f in sorted(out.glob("*.json")):
    r = json.loads(f.read_text()); e = r["engine"]; roof = r["roofline"]["engine"]
    frac = roof.get("fraction") if isinstance(roof, dict) else None
    frac = f"{100 * frac:.1f}%" if isinstance(frac, float) else "-"
    ratio = (r.get("ratio") or {}).get("output_throughput")
    ratio = f"{ratio:.2f}x" if ratio else "-"
    print(f"{f.stem:14} {e['output_throughput']:10.1f} {e['total_throughput']:11.1f} {ms(e['tpot_s']):>8} "
          f"{ms(e['ttft_s']):>9} {frac:>9} {ratio:>6} {r['config'].get('decode_graph_replays')!s:>8} "
          f"{r['config'].get('max_num_batched_tokens')!s:>7} {r['config'].get('async_scheduling')!s:>6}")
for f in sorted(out.glob("*.json")):  # the engine's steps one by one: the first six, then the median of the rest
    steps = json.loads(f.read_text())["engine"].get("step_times_s") or []
    if len(steps) > 6:
        rest = sorted(steps[6:])[len(steps[6:]) // 2]
        print(f"{f.stem:14} steps (ms): {' '.join(f'{1e3 * t:.1f}' for t in steps[:6])} | median after {1e3 * rest:.2f}")
PY
fi
if [[ $what == quick ]]; then  # the graph and attention tests only
  python -m pytest -q -p no:cacheprovider backends/nvidia_sm100/tests/test_tl_attention_gpu.py \
    "backends/nvidia_sm100/tests/test_model_gpu.py::test_cuda_graph_decode_matches_eager" \
    "backends/nvidia_sm100/tests/test_model_gpu.py::test_fp32_greedy_and_logprobs_match_cpu" 2>&1 | tail -4 | tee "$RES/tests.txt"
fi
save

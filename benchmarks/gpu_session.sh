#!/usr/bin/env bash
# One device call that checks and times everything, results under $OUT.
#
#   MOE_SANDBOX_COMMIT=<hash> bash benchmarks/gpu_session.sh [A|B|T|P]   # on nvidia-h200-x2
#
# A device call may run 10 minutes, so the work comes in parts, called back to back (the
# second finds the machine still warm):
#   A  GPU 0: tests, then compute-sanitizer      GPU 1: GEMM tuner, stage and GEMM benchmarks
#      then both GPUs: multi-GPU tests, EP check, EP benchmark
#   B  GPU 0: notebooks in GPU mode               GPU 1: Numba and quantized benchmarks
#   T  (checks, when the GEMM table needs no refresh) the GPU test suite in four shards, two
#      per GPU, beside compute-sanitizer; then the multi-GPU tests, EP check and EP benchmark
#   P  (timings) GPU 0: stage and Numba benchmarks   GPU 1: quantized benchmarks
#   W  (int4 development, one GPU) the weight-only ladder's GPU tests, compute-sanitizer on
#      its module, and its rungs and configs timed (WNA16_TOKENS, default 1, 16, 64, 256;
#      WNA16_EXTRA: more configs)
#
# Two GPUs let the checks and the timings run side by side without disturbing each other:
#   A/B: GPU 0 checks (pytest -m gpu, compute-sanitizer memcheck/racecheck on each kernel
#        module's --quick case, notebooks in GPU mode), GPU 1 times (one process at a time);
#   T:   no timing runs, so the test shards share the GPUs (the tests are mostly host-bound:
#        NumPy references and compiles), which is what makes the ~2,900 GPU tests fit;
#   P:   one benchmark process per GPU, nothing else on it;
#   both GPUs, after A or T: the multi-GPU tests, the EP check and the EP benchmark.
# On a single-GPU machine everything runs on GPU 0, one after the other.
#
# Runs from the repository root on the GPU machine (the device tool's working-tree copy).
# Nothing is installed: the image has CuPy, Numba, torch and pytest; the project runs from
# the source tree (PYTHONPATH), and numba-cuda's numpy-2.5 incompatibility is handled by
# cuda_kernels/numba/_compat.py. What comes back (at most 8 files): the logs, the junit XML
# and results.tgz (benchmarks/results/) + figures.tgz (notebook figures).
set -uo pipefail
OUT=${OUT:-/tmp/moe_sandbox_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MPLBACKEND=Agg
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}   # never turn NVLink multicast on (KINDS.md)
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l); (( NGPU < 1 )) && NGPU=1   # (no GPU: the scripts report it themselves)
BENCH_GPU=$(( NGPU > 1 ? 1 : 0 ))
BUDGET=${BUDGET:-540}   # seconds for the whole call (the device allows 600)
say() { echo "== $* ($(date +%T))"; }
# budget T: at most T seconds, and never past the call's budget (minus 150 s kept for the multi-GPU part)
budget() { local left=$(( BUDGET - 150 - SECONDS )); (( left < 5 )) && left=5; echo $(( $1 < left ? $1 : left )); }

device_info() {
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import cupy, numba, numpy, torch; print('cupy', cupy.__version__, 'numba', numba.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__)"
  echo "commit ${MOE_SANDBOX_COMMIT:-unknown}"
}

checks() {   # GPU 0
  export CUDA_VISIBLE_DEVICES=0
  say "device"
  device_info
  say "GPU tests"
  timeout $(budget 300) python3 -m pytest -q --maxfail=40 --timeout 200 -m "gpu and not multigpu" \
    -p no:cacheprovider --junitxml="$OUT/junit_gpu.xml" tests 2>&1 | tail -n 80
  sanitizer
}

sanitizer() {   # [MODULE ...] (default: every kernel module) on the current CUDA_VISIBLE_DEVICES
  say "compute-sanitizer"
  local mods=("$@")
  (( ${#mods[@]} )) || mods=(cuda_kernels.cupy.routing cuda_kernels.cupy.align cuda_kernels.cupy.permute
    cuda_kernels.cupy.activation cuda_kernels.cupy.combine cuda_kernels.cupy.gemm
    cuda_kernels.cupy.quant.act cuda_kernels.cupy.quant.w8a8 cuda_kernels.cupy.quant.wna16
    cuda_kernels.cupy.ep_layout cuda_kernels.numba._sanitize)
  for mod in "${mods[@]}"; do
    tools=memcheck      # racecheck where the kernels share memory between warps
    case $mod in
      *routing|*align|*permute|*.gemm|*quant.w8a8|*quant.wna16|*_sanitize) tools="memcheck racecheck" ;;
    esac
    for tool in $tools; do
      printf -- "-- %s %s: " "$tool" "$mod"
      timeout $(budget 45) compute-sanitizer --tool $tool --error-exitcode 9 python3 -m $mod --quick \
        >"$OUT/san.tmp" 2>&1; rc=$?
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/san.tmp" | tail -n 1 | tr -d '\n'; echo " (rc=$rc)"
      (( rc )) && grep -m 12 -A 3 -E "^========= (Error|Warning|Race)" "$OUT/san.tmp"
    done
  done
  rm -f "$OUT/san.tmp"
}

notebooks() {   # GPU 0
  export CUDA_VISIBLE_DEVICES=0
  say "notebooks (GPU mode)"
  mkdir -p notebooks/figures
  for nb in notebooks/[0-9]*.py; do
    [ -f "$nb" ] || continue
    printf -- "-- %s: " "$nb"
    MOE_SANDBOX_NOTEBOOK_MODE=gpu MOE_SANDBOX_FIGURES=notebooks/figures \
      timeout $(budget 60) python3 "$nb" >"$OUT/nb.tmp" 2>&1 && echo ok || { echo "FAILED"; tail -n 15 "$OUT/nb.tmp"; }
  done
  rm -f "$OUT/nb.tmp"
}

benches_a() {  # GPU 1 (or 0): tune the GEMM table, then time with it
  export CUDA_VISIBLE_DEVICES=$BENCH_GPU
  say "GEMM tuner"
  timeout $(budget 110) python3 -m cuda_kernels.cupy.tune --versions v4,v5 --budget-s 90 2>&1 | tail -n 30
  cp cuda_kernels/cupy/gemm_configs.json "$OUT/gemm_configs.json"
  say "bench_cupy_stages"
  timeout $(budget 60) python3 benchmarks/bench_cupy_stages.py --out-dir benchmarks/results --budget-s 45 2>&1 | tail -n 70
  say "bench_cupy_gemm"
  timeout $(budget 190) python3 benchmarks/bench_cupy_gemm.py --out-dir benchmarks/results --versions v1,v2,v3,v4,v5 --budget-s 170 2>&1 | tail -n 75
}

benches_b() {  # GPU 1 (or 0)
  export CUDA_VISIBLE_DEVICES=$BENCH_GPU
  say "bench_numba"
  timeout $(budget 170) python3 benchmarks/bench_numba.py --out-dir benchmarks/results --budget-s 150 2>&1 | tail -n 70
  say "bench_quant"
  timeout $(budget 170) python3 benchmarks/bench_quant.py --out benchmarks/results --budget-s 150 2>&1 | tail -n 40
}

# the GPU test files in four shards of similar run time (measured 2026-11-29: ~5 tests/s);
# the last shard is every other test file (the quantized ones, and any file added later)
SHARDS=(
  "tests/cupy/test_routing.py tests/cupy/test_align.py tests/cupy/test_permute.py tests/cupy/test_activation.py tests/cupy/test_combine.py"
  "tests/numba"
  "tests/cupy/test_gemm.py tests/cupy/quant/test_gemm.py tests/sandbox/test_bench.py tests/sandbox/test_layer.py tests/sandbox/test_registry.py tests/torch tests/sandbox/test_validate.py tests/cupy/test_ep_layout.py"
)

shard() {   # shard i on GPU i % NGPU
  export CUDA_VISIBLE_DEVICES=$(( $1 % NGPU )) OMP_NUM_THREADS=4
  local files f
  if [ "$1" -lt "${#SHARDS[@]}" ]; then files=${SHARDS[$1]}
  else files=tests; for f in ${SHARDS[*]}; do files="$files --ignore=$f"; done; fi
  say "GPU tests, shard $1 on GPU $CUDA_VISIBLE_DEVICES: $files"
  # shellcheck disable=SC2086
  timeout $(budget 300) python3 -m pytest -q --maxfail=40 --timeout 200 -m "gpu and not multigpu" \
    -p no:cacheprovider $files 2>&1 | tail -n 40
}

checks_t() {   # both GPUs: the four shards and the sanitizer at once
  say "device"; device_info
  for i in 0 1 2 3; do shard $i >"$OUT/shard_$i.tmp" 2>&1 & done
  ( export CUDA_VISIBLE_DEVICES=$BENCH_GPU; sanitizer ) >"$OUT/sanitizer.tmp" 2>&1 &
  wait
  cat "$OUT"/shard_*.tmp "$OUT/sanitizer.tmp"; rm -f "$OUT"/shard_*.tmp "$OUT/sanitizer.tmp"
}

benches_p() {  # one benchmark process per GPU (the Numba bench times CuPy's stages beside its own)
  ( export CUDA_VISIBLE_DEVICES=0
    say "bench_cupy_stages"
    timeout $(budget 50) python3 benchmarks/bench_cupy_stages.py --out-dir benchmarks/results --budget-s 35 2>&1 | tail -n 70
    say "bench_numba"
    timeout $(budget 200) python3 benchmarks/bench_numba.py --out-dir benchmarks/results --budget-s 180 --gemm-versions numba-v3,numba-v3v,cupy-v3,cupy-v4 2>&1 | tail -n 70
  ) >"$OUT/bench_gpu0.tmp" 2>&1 &
  ( export CUDA_VISIBLE_DEVICES=$BENCH_GPU
    say "bench_quant"
    timeout $(budget 170) python3 benchmarks/bench_quant.py --out benchmarks/results --budget-s 150 2>&1 | tail -n 40
    say "bench_wna16"
    timeout $(budget 70) python3 benchmarks/bench_wna16.py --out benchmarks/results --budget-s 55 2>&1 | tail -n 40
  ) >"$OUT/bench_gpu1.tmp" 2>&1 &
  wait
  cat "$OUT/bench_gpu0.tmp" "$OUT/bench_gpu1.tmp"; rm -f "$OUT"/bench_gpu?.tmp
}

wna16_dev() {   # GPU 0: the weight-only int4 ladder, checked then timed rung by rung
  export CUDA_VISIBLE_DEVICES=0
  say "device"; device_info
  say "weight-only GPU tests"
  timeout $(budget 120) python3 -m pytest -q --maxfail=20 --timeout 100 -m gpu -p no:cacheprovider \
    tests/cupy/quant/test_wna16.py tests/cupy/quant/test_wna16_packed.py \
    tests/cupy/quant/test_wna16_staged.py tests/cupy/quant/test_wna16_wgmma.py 2>&1 | tail -n 20
  sanitizer cuda_kernels.cupy.quant.wna16
  # the route beside each rung, then every config of the table and WNA16_EXTRA (variants,
  # name+KEY=VALUE)
  say "bench_wna16: the rungs and their configs"
  timeout $(budget 300) python3 benchmarks/bench_wna16.py --out benchmarks/results --tokens ${WNA16_TOKENS:-1,16,64,256} \
    --sweep ${WNA16_EXTRA:+--configs q8,t24,t32,t24ws,h32,$WNA16_EXTRA} \
    --budget-s 280 2>&1 | tail -n 80
}

multi() {    # both GPUs
  unset CUDA_VISIBLE_DEVICES
  say "multi-GPU tests"
  timeout 70 python3 -m pytest -q --maxfail=20 --timeout 60 -m multigpu -p no:cacheprovider \
    --junitxml="$OUT/junit_multigpu.xml" tests 2>&1 | tail -n 40
  say "EP check"
  timeout 30 python3 -m sandbox.ep check --gpus 2 2>&1 | tail -n 20
  say "EP benchmark"
  timeout $(( BUDGET - SECONDS > 10 ? BUDGET - SECONDS : 10 )) python3 benchmarks/bench_ep.py --out benchmarks/results --gpus 2 2>&1 | tail -n 50
}

part=${1:-A}
case $part in
  A)
    if [ "$NGPU" -gt 1 ]; then
      checks >"$OUT/log_checks.txt" 2>&1 &
      benches_a >"$OUT/log_bench_A.txt" 2>&1 &
      wait
      multi >"$OUT/log_multi.txt" 2>&1
    else
      { checks; benches_a; } >"$OUT/log_checks.txt" 2>&1
    fi ;;
  B)
    BUDGET=$(( BUDGET + 150 ))   # no multi-GPU part after B
    { say "device"; device_info; } >"$OUT/log_device_b.txt" 2>&1
    if [ "$NGPU" -gt 1 ]; then
      notebooks >"$OUT/log_notebooks.txt" 2>&1 &
      benches_b >"$OUT/log_bench_b.txt" 2>&1 &
      wait
    else
      { notebooks; benches_b; } >"$OUT/log_notebooks.txt" 2>&1
    fi ;;
  T)
    checks_t >"$OUT/log_checks.txt" 2>&1
    [ "$NGPU" -gt 1 ] && multi >"$OUT/log_multi.txt" 2>&1 ;;
  P)
    BUDGET=$(( BUDGET + 150 ))   # no multi-GPU part after P
    { say "device"; device_info; benches_p; } >"$OUT/log_bench_P.txt" 2>&1 ;;
  W)
    BUDGET=$(( BUDGET + 150 ))   # no multi-GPU part after W
    wna16_dev >"$OUT/log_wna16_W.txt" 2>&1 ;;
  *) echo "part: expected A, B, T, P or W, got $part" >&2; exit 2 ;;
esac
tar czf "$OUT/results.tgz" benchmarks/results 2>/dev/null
[ -d notebooks/figures ] && tar czf "$OUT/figures.tgz" notebooks/figures
say "done"
tail -n 25 "$OUT"/log_*.txt

#!/usr/bin/env bash
# One device call that builds, checks and times what is asked, results under $OUT.
#
#   bash benchmarks/gpu_session.sh [tests] [sanitize] [bench] [ep]
#
# Runs from the repository root on the GPU machine (the device tool's working tree copy).
# Nothing is installed: the image has CuPy, Numba, torch, pytest; the project is used from
# the source tree (PYTHONPATH), and numba-cuda's numpy-2.5 incompatibility is handled by
# cuda_kernels/numba/_compat.py. Logs and result JSON come back as a few files in $OUT
# (the device returns at most 8 files): log.txt, junit XMLs, results.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}   # never turn NVLink multicast on (KINDS.md)
LOG=$OUT/log.txt
steps=${*:-tests sanitize bench}
say() { echo "== $* ($(date +%T))" | tee -a "$LOG"; }

say "device"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import cupy, numba, numpy, torch; print('cupy', cupy.__version__, 'numba', numba.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__)"
  git rev-parse --short HEAD 2>/dev/null; } 2>&1 | tee -a "$LOG"

for step in $steps; do
  case $step in
    tests)
      say "GPU tests"
      timeout 420 python3 -m pytest -q --maxfail=40 --timeout 300 -m "gpu and not multigpu" -p no:cacheprovider \
        --junitxml="$OUT/junit_gpu.xml" tests 2>&1 | tail -n 60 | tee -a "$LOG" ;;
    sanitize)
      say "compute-sanitizer"
      for mod in cuda_kernels.cupy.routing cuda_kernels.cupy.permute cuda_kernels.cupy.activation \
                 cuda_kernels.cupy.combine cuda_kernels.cupy.grouped_gemm; do
        for tool in memcheck racecheck; do
          echo "-- $tool $mod" | tee -a "$LOG"
          timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 python3 -m $mod --quick 2>&1 \
            | grep -E "ERROR SUMMARY|error|Error|ok|PASS|FAIL" | tail -n 5 | tee -a "$LOG"
        done
      done ;;
    bench)
      say "benchmarks"
      for script in benchmarks/bench_cupy_stages.py benchmarks/bench_cupy_gemm.py benchmarks/bench_numba.py; do
        [ -f "$script" ] || continue
        echo "-- $script" | tee -a "$LOG"
        timeout 280 python3 "$script" 2>&1 | tail -n 80 | tee -a "$LOG"
      done ;;
    ep)
      say "multi-GPU tests and EP benchmark"
      timeout 300 python3 -m pytest -q --maxfail=20 --timeout 240 -m multigpu -p no:cacheprovider \
        --junitxml="$OUT/junit_multigpu.xml" tests 2>&1 | tail -n 40 | tee -a "$LOG"
      timeout 120 python3 -m sandbox.ep check --gpus 2 2>&1 | tail -n 20 | tee -a "$LOG"
      timeout 240 python3 benchmarks/bench_ep.py --gpus 2 2>&1 | tail -n 60 | tee -a "$LOG" ;;
    notebooks)
      say "notebooks on the GPU"
      mkdir -p notebooks/figures
      for nb in notebooks/[0-9]*.py; do
        echo "-- $nb" | tee -a "$LOG"
        MOE_SANDBOX_NOTEBOOK_MODE=gpu MOE_SANDBOX_FIGURES=notebooks/figures MPLBACKEND=Agg \
          timeout 120 python3 "$nb" 2>&1 | tail -n 8 | tee -a "$LOG"
      done
      tar czf "$OUT/figures.tgz" notebooks/figures ;;
    *) echo "unknown step $step" | tee -a "$LOG" ;;
  esac
done
tar czf "$OUT/results.tgz" benchmarks/results 2>/dev/null
say "done"

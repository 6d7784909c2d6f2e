#!/usr/bin/env bash
# One device call for the staged int4 rung (quant_gemm_wna16_staged.cu), results under $OUT:
# parallel precompile, its GPU tests, then a sweep beside the routed packed configs.
#   MOE_SANDBOX_COMMIT=<hash> STAGED_CONFIGS=t8,t24,... bash benchmarks/dev/staged_session.sh
set -uo pipefail
OUT=${OUT:-/tmp/moe_sandbox_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUDA_VISIBLE_DEVICES=0
say() { echo "== $* ($(date +%T))"; }
{
  say "device"
  nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv
  echo "commit ${MOE_SANDBOX_COMMIT:-unknown}"
  say "precompile"
  timeout 150 python3 benchmarks/dev/precompile.py --elems ${PRE_ELEMS:-bf16,fp16} staged 2>&1 | tail -n 30
  if [ -z "${SKIP_TESTS:-}" ]; then
    say "staged GPU tests"
    timeout 150 python3 -m pytest -q --maxfail=10 --timeout 100 -m gpu -p no:cacheprovider \
      tests/test_quant_wna16_staged.py 2>&1 | tail -n 25
  fi
  if [ -n "${SANITIZE:-}" ]; then
    say "compute-sanitizer (quant_gemm_wna16 --quick)"
    for tool in memcheck racecheck; do
      timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 python3 -m cuda_kernels.cupy.quant_gemm_wna16 --quick \
        >"$OUT/san_$tool.txt" 2>&1; echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|FAIL" "$OUT/san_$tool.txt" | tail -n 5
    done
  fi
  say "sweep"
  timeout ${SWEEP_S:-330} python3 benchmarks/bench_wna16.py --tokens ${WNA16_TOKENS:-64,1,16} \
    --no-old --sweep --configs ${STAGED_CONFIGS:-t24,t32,u24,n24,q24,q32,t8,t16,q8} \
    --budget-s $(( ${SWEEP_S:-330} - 20 )) --out "$OUT" 2>&1 | tail -n 80
  say "done"
} >"$OUT/log_staged.txt" 2>&1

#!/usr/bin/env bash
# The closing device call of an int4 session (one GPU), results under $OUT: the quantized GPU
# tests, compute-sanitizer (memcheck, racecheck) on quant_gemm_wna16 --quick, then the routed
# int4 path beside quant_gemm's own rungs (bench_wna16) and the table for Mixtral
# (bench_quant); SKIP_WNA16=1 leaves out bench_wna16. MOE_SANDBOX_COMMIT=<hash> bash benchmarks/dev/final_wna16.sh
set -uo pipefail
OUT=${OUT:-/tmp/moe_sandbox_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
say() { echo "== $* ($(date +%T))"; }
{
  say "device"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  echo "commit ${MOE_SANDBOX_COMMIT:-unknown}"
  python3 benchmarks/dev/precompile.py --elems bf16,fp16 staged 2>&1 | tail -n 2
  say "quantized GPU tests"
  timeout ${TEST_S:-200} python3 -m pytest -q --maxfail=20 --timeout 150 -m gpu -p no:cacheprovider \
    tests/test_prebuilt.py tests/test_quant_wna16_staged.py tests/test_quant_wna16_packed.py tests/test_quant_wna16_cupy.py \
    tests/test_quant_wna16_wgmma.py tests/test_quant_cupy.py 2>&1 | tail -n 15
  for tool in memcheck racecheck; do
    say "compute-sanitizer $tool"
    timeout ${SAN_S:-70} compute-sanitizer --tool $tool --error-exitcode 9 python3 -m cuda_kernels.cupy.quant_gemm_wna16 --quick \
      >"$OUT/san.tmp" 2>&1; echo "rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|FAIL" "$OUT/san.tmp" | tail -n 4
  done
  rm -f "$OUT/san.tmp"
  if [ -z "${SKIP_WNA16:-}" ]; then
    say "bench_wna16"
    timeout 70 python3 benchmarks/bench_wna16.py --tokens 1,16,64,256 --out "$OUT" 2>&1 | tail -n 8
  fi
  say "bench_quant mixtral"
  timeout 110 python3 benchmarks/bench_quant.py --models mixtral --tokens 1,16,64,256,1024 --budget-s 95 2>&1 | tail -n 12
  cp "$(ls -t benchmarks/results/bench_quant_*.json | head -n 1)" "$OUT"/
  say "done"
} >"$OUT/log_final.txt" 2>&1

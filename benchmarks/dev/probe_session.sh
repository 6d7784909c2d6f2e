#!/usr/bin/env bash
# One device call for a staged-rung change, results under $OUT: the staged GPU tests, then the
# probe (CUDA events, L2 flushed) of PROBE_CONFIGS (default t24) at T = 64, 16, 256, each CTA's
# end (TIMES) at T = 64, then bench_quant's int4 row. For a baseline in the same call, copy an
# earlier version of the .cu to cuda_kernels/cupy/quant_gemm_wna16_staged_base.cu, carry it to
# the device, and add base:t24 (PROBE_CONFIGS=base:t24,t24 TIMES_CONFIGS=base:t24,t24). A dev
# macro against the kernel without it, alternating: PROBE_VARIANTS=base,LT_COST=3,base,LT_COST=3
# TIMES_VARIANTS=TIMES=1,TIMES=1+LT_COST=3. SKIP_TESTS=1 / SKIP_BENCH=1 leave out the tests /
# bench_quant (a dev macro off leaves the launcher's build as it was: see staged_cubins.py).
#   MOE_SANDBOX_COMMIT=<hash> bash benchmarks/dev/probe_session.sh
set -uo pipefail
OUT=${OUT:-/tmp/moe_sandbox_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
say() { echo "== $* ($(date +%T))"; }
{
  say "device"; nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
  echo "commit ${MOE_SANDBOX_COMMIT:-unknown}"
  timeout 150 python3 benchmarks/dev/precompile.py --elems bf16 staged 2>&1 | tail -n 2
  if [ -z "${SKIP_TESTS:-}" ]; then
    say "staged GPU tests"
    timeout ${TEST_S:-150} python3 -m pytest -q --maxfail=10 --timeout 100 -m gpu -p no:cacheprovider \
      tests/test_quant_wna16_staged.py 2>&1 | tail -n 12
  fi
  say "probe"
  timeout ${PROBE_S:-200} python3 benchmarks/dev/probe_staged.py --configs ${PROBE_CONFIGS:-t24} \
    --tokens ${PROBE_TOKENS:-64,16,256} --variants ${PROBE_VARIANTS:-base} --out "$OUT" 2>&1 \
    | grep -v "^read" | tail -n 40
  say "probe: each CTA's end at T = 64"
  mkdir -p "$OUT/times"
  timeout 100 python3 benchmarks/dev/probe_staged.py --configs ${TIMES_CONFIGS:-t24} --tokens 64 \
    --variants ${TIMES_VARIANTS:-TIMES=1} --out "$OUT/times" 2>&1 | grep -v "^read" | tail -n 20
  if [ -z "${SKIP_BENCH:-}" ]; then
    say "bench_quant mixtral"
    timeout 110 python3 benchmarks/bench_quant.py --models mixtral --tokens ${BENCH_TOKENS:-1,16,64} \
      --no-bf16 --budget-s 95 2>&1 | tail -n 8
    cp "$(ls -t benchmarks/results/bench_quant_*.json | head -n 1)" "$OUT"/
  fi
  say "done"
} >"$OUT/log_probe.txt" 2>&1

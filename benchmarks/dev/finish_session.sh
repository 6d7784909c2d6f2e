#!/usr/bin/env bash
# One device call for the finishing CTA's round trips (dev macros STAGED_PMAX, STAGED_DERIVED,
# STAGED_RW_PREFETCH of quant_gemm_wna16_staged.cu), results under $OUT: every variant compiled
# in parallel first, then the probe (base: the .cu of the tree before, carried as
# quant_gemm_wna16_staged_base.cu) at T = 64, 16, 256, 1 with the bits checked against it, each
# CTA's end (TIMES) at T = 64, and two of bench_quant's T = 64 routings.
#   VARIANTS=base,PMAX=2 MOE_SANDBOX_COMMIT=<hash> bash benchmarks/dev/finish_session.sh
set -uo pipefail
OUT=${OUT:-/tmp/moe_sandbox_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
V=${VARIANTS:-base,PMAX=2,PMAX=2+DERIVED=1,PMAX=2+DERIVED=1+RW_PREFETCH=1,PMAX=3}
TV=${TIMES_VARIANTS:-TIMES=1+PMAX=2+DERIVED=1,TIMES=1+PMAX=2+DERIVED=1+RW_PREFETCH=1}
RV=${ROUTING_VARIANTS:-base,PMAX=2+DERIVED=1,PMAX=2+DERIVED=1+RW_PREFETCH=1}
P=benchmarks/dev/probe_staged.py
say() { echo "== $* ($(date +%T))"; }
{
  say "device"; nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
  echo "commit ${MOE_SANDBOX_COMMIT:-unknown}"
  say "compile"
  for v in ${V//,/ } ${TV//,/ }; do
    timeout 200 python3 $P --configs t24 --variants "$v" --compile-only &
  done
  for v in base TIMES=1; do timeout 200 python3 $P --configs "base:t24@$v" --compile-only & done
  wait
  say "probe"
  timeout 200 python3 $P --configs "base:t24@base,t24,base:t24@base" --tokens 64,16,256,1 \
    --variants "$V" --out "$OUT" 2>&1 | grep -v "^read"
  say "probe: each CTA's end at T = 64"
  mkdir -p "$OUT/times"
  timeout 100 python3 $P --configs "base:t24@TIMES=1,t24" --tokens 64 --variants "$TV" \
    --out "$OUT/times" 2>&1 | grep -v "^read"
  for j in 0 1; do
    say "probe: bench_quant's routing $j of 1,16,64"
    mkdir -p "$OUT/routing$j"
    timeout 100 python3 $P --configs "base:t24@base,t24,base:t24@base" --tokens 64 \
      --variants "$RV" --bench-routing 1,16,64:$j --flush read --out "$OUT/routing$j" 2>&1 \
      | grep -v "^read"
  done
  say "done"
} >"$OUT/log_finish.txt" 2>&1

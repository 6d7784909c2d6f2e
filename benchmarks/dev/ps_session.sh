#!/usr/bin/env bash
# One device call for the staged rung's PS mode (the tokens' sums precomputed by
# wna16_row_chunk_sums instead of the sums mma): t24 against t24+PS=1 on bench_quant's four
# T = 64 routings of a 1,16,64 run (the table's), each also with PS in GEMM1 only (--layer2 t24),
# then T = 16 and 256 on the probe's routing. Results under $OUT.
#   MOE_SANDBOX_COMMIT=<hash> bash benchmarks/dev/ps_session.sh
set -uo pipefail
OUT=${OUT:-/tmp/moe_sandbox_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
say() { echo "== $* ($(date +%T))"; }
probe() { timeout 150 python3 benchmarks/dev/probe_staged.py --variants base "$@" 2>&1 | grep -v "^read"; }
{
  say "device"; nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
  echo "commit ${MOE_SANDBOX_COMMIT:-unknown}"
  timeout 200 python3 benchmarks/dev/precompile.py --elems bf16 staged 2>&1 | tail -n 2 &
  timeout 200 python3 benchmarks/dev/probe_staged.py --compile-only --configs t24+PS=1 \
    --variants base 2>&1 | tail -n 2 &
  wait
  for j in 0 1 2 3; do
    say "routing $j of 1,16,64: both GEMMs in the config"
    mkdir -p "$OUT/r$j" "$OUT/r${j}_g1"
    probe --configs t24,t24+PS=1,t24 --tokens 64 --bench-routing 1,16,64:$j --flush read \
      --out "$OUT/r$j"
    say "routing $j: the layer's GEMM2 in t24"
    probe --configs t24,t24+PS=1 --tokens 64 --bench-routing 1,16,64:$j --flush read \
      --layer2 t24 --out "$OUT/r${j}_g1"
  done
  say "T = 16, 256 (the probe's routings)"
  mkdir -p "$OUT/t16_256"
  probe --configs t24,t24+PS=1 --tokens 16,256 --out "$OUT/t16_256"
  say "done"
} >"$OUT/log_ps.txt" 2>&1

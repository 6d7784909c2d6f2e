#!/usr/bin/env bash
# One device call (one H100 / H200) for the int4 layer with silu_and_mul fused into GEMM1 and
# the dataflow to GEMM2 (quant_gemm_wna16.BlockFlow; the staged kernel's ACT / AWAIT roles),
# results under $OUT:
#   1. the GPU tests of both roles (fused activation, dataflow chain), the programmatic-launch,
#      t24ws and prebuilt tests;
#   2. compute-sanitizer memcheck and racecheck on quant_gemm_wna16 --quick (its last case is
#      the dataflow chain);
#   3. benchmarks/dev/act_probe.py, interleaved, T = 64 and 256: base (fused + dataflow),
#      noact (bench_quant's default layer), nodataflow, and VARIANTS (label=CUBIN[%CUBIN]:
#      cubins that benchmarks/dev/nvrtc_sweep.py built, carried);
#   4. bench_quant's Mixtral int4 layer at TOKENS, with --fuse-activation and without.
#   [VARIANTS=",one=c/act_sites1.cubin"] [TOKENS=1,16,64,256] bash benchmarks/dev/dataflow_call.sh
set -uo pipefail
OUT=${OUT:-/tmp/moe_sandbox_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
say() { echo "== $* ($(date +%T))"; }
touch "$OUT/start"
{
  say "device"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  say "GPU tests"
  timeout 240 python3 -m pytest -q -p no:cacheprovider --timeout 150 -m gpu tests/test_prebuilt.py \
    tests/test_quant_wna16_staged.py -k "activation or dataflow or programmatic or t24ws or prebuilt" 2>&1 | tail -n 15
  for tool in memcheck racecheck; do
    say "compute-sanitizer $tool"
    timeout 90 compute-sanitizer --tool $tool --error-exitcode 9 python3 -m cuda_kernels.cupy.quant_gemm_wna16 --quick \
      >"$OUT/san.tmp" 2>&1; echo "rc=$?"; grep -E "dataflow|ERROR SUMMARY|RACECHECK SUMMARY|FAIL" "$OUT/san.tmp" | tail -n 5
  done
  rm -f "$OUT/san.tmp"
  say "act_probe"
  timeout 240 python3 benchmarks/dev/act_probe.py --variants "base,noact,nodataflow${VARIANTS:-}" \
    --tokens 64,256 --runs 2 --out "$OUT" 2>&1 | grep -av "^ *read"
  for flags in "--fuse-activation" ""; do
    say "bench_quant mixtral $flags"
    timeout 110 python3 benchmarks/bench_quant.py --models mixtral --tokens ${TOKENS:-1,16,64,256} --no-bf16 \
      --budget-s 95 $flags 2>&1 | tail -n 8
  done
  find benchmarks/results -maxdepth 1 -name "bench_quant_*.json" -newer "$OUT/start" -exec cp {} "$OUT"/ \;
  say "done"
} >"$OUT/log_dataflow.txt" 2>&1

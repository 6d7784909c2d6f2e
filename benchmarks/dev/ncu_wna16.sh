#!/usr/bin/env bash
# Nsight Compute metrics of the packed int4 rung, one config at a time (development; GPU only):
#   bash benchmarks/dev/ncu_wna16.sh T MT:CONFIG [MT:CONFIG ...]    e.g. 64 1:q8 3:q16+MT=3
# (KERNEL=wna16_wgmma for the wgmma rung's configs; EXTRA_METRICS=a,b adds metrics) profiles
# the first two KERNEL<MT, ...> launches of bench_wna16.py at T tokens (GEMM1 then GEMM2 of
# the first config whose MT matches) and appends them to $OUT/ncu_T<T>.csv
# (one file: the device tool brings back only a few).
set -uo pipefail
OUT=${OUT:-/tmp/moe_sandbox_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
T=$1; shift
M=gpu__time_duration.sum,dram__bytes_read.sum,lts__t_bytes.sum
M=$M,lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__t_sector_hit_rate.pct
M=$M,l1tex__throughput.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum
M=$M,smsp__issue_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread
M=$M,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed
M=$M,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
M=$M,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active${EXTRA_METRICS:+,$EXTRA_METRICS}
for s in long_scoreboard wait barrier math_pipe_throttle lg_throttle mio_throttle short_scoreboard; do
  M=$M,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio
done
# SECTIONS=1: Nsight Compute's sections (speed of light, memory, compute, warp states, scheduler)
# at the benchmark's clocks, instead of the metric list
WHAT=(--metrics "$M")
[ "${SECTIONS:-0}" = 1 ] && WHAT=(--clock-control none --section SpeedOfLight
  --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats
  --section SchedulerStats --section Occupancy --section LaunchStats)
for spec in "$@"; do
  mt=${spec%%:*} cfg=${spec#*:}
  tmp=$(mktemp -d)
  timeout 120 ncu --csv --log-file "$tmp/ncu.csv" "${WHAT[@]}" \
    --kernel-name-base demangled --kernel-name "regex:${KERNEL:-wna16_packed}<(\(int\))?$mt," --launch-count 2 \
    python3 benchmarks/bench_wna16.py --tokens "$T" --no-old --sweep --configs "$cfg" --reps 1 \
    --out "$tmp" >/dev/null 2>"$tmp/err"
  echo "$spec rc=$?"
  { echo "# $spec"; grep -v '^==PROF==' "$tmp/ncu.csv"; tail -n 5 "$tmp/err"; } >>"$OUT/ncu_T$T.csv"
  rm -rf "$tmp"
done

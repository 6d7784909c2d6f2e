#!/usr/bin/env bash
# Per-instruction execution counts (Nsight Compute's source page, SASS) of one kernel launch of
# bench_wna16.py (development; GPU only):
#   bash benchmarks/dev/ncu_source.sh T CONFIG KERNEL_REGEX OUTNAME [SRC_DIR]
# writes $OUT/OUTNAME.csv; SRC_DIR runs another tree (a git archive of an older commit).
set -uo pipefail
OUT=${OUT:-/tmp/moe_sandbox_out}; mkdir -p "$OUT"
T=$1 CFG=$2 RX=$3 NAME=$4 SRC=${5:-$PWD}
tmp=$(mktemp -d)
(cd "$SRC" && PYTHONPATH=$SRC timeout 200 ncu --section SourceCounters --section InstructionStats \
  --kernel-name-base demangled --kernel-name "regex:$RX" --launch-count 1 -o "$tmp/prof" \
  python3 benchmarks/bench_wna16.py --tokens "$T" --no-old --sweep --configs "$CFG" --reps 1 \
  --out "$tmp" >"$tmp/log" 2>&1); grep -E "==PROF==|==ERROR==|Error" "$tmp/log" | tail -n 5
ncu --import "$tmp/prof.ncu-rep" --page source --csv --print-source sass >"$OUT/$NAME.csv" 2>"$tmp/err" || cat "$tmp/err"
ls -la "$OUT/$NAME.csv"; head -c 600 "$OUT/$NAME.csv"; echo
rm -rf "$tmp"

# One device call timing cubins of the staged rung built elsewhere (benchmarks/dev/
# probe_staged.py's cubin=PATH variants; benchmarks/dev/ptxas_cubins.py and nvrtc_sweep.py
# build some; a cubin's config is t24 or the spec in PATH.config) beside a base (BASE: t24@base,
# the launcher's kernel, by default; base:t24@base is an earlier .cu, carried as
# cuda_kernels/cupy/quant_gemm_wna16_staged_base.cu and built by the device's CuPy NVRTC), at
# T = 64 and 256 on the probe's routing (TOKENS), then on bench_quant's four T = 64 routings of
# 1,16,64.
#   CUBINS="a.cubin b.cubin" [BASE=base:t24@base] bash benchmarks/dev/cubins_call.sh
# (results under $OUT)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
P=benchmarks/dev/probe_staged.py
B=${BASE:-t24@base}
CF=$B
for c in $CUBINS; do
  if [ -f $c.config ]; then CF="$CF,$(cat $c.config)@cubin=$c"; else CF="$CF,t24@cubin=$c"; fi
done
CF="$CF,$B"
{
  date; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  timeout 100 python3 $P --configs $B --compile-only
  echo "== probe"; mkdir -p $OUT/probe
  timeout 150 python3 $P --configs "$CF" --tokens ${TOKENS:-64,256} --out $OUT/probe 2>&1 | grep -v "^read"
  for j in 0 1 2 3; do
    echo "== routing $j of 1,16,64"; mkdir -p $OUT/routing$j
    timeout 90 python3 $P --configs "$CF" --tokens 64 --bench-routing 1,16,64:$j --flush read --out $OUT/routing$j 2>&1 | grep -v "^read"
  done
  date
} > $OUT/log_cubins.txt 2>&1

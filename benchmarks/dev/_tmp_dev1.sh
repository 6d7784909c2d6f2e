set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
ncu --query-metrics 2>/dev/null | grep -E "pipe_tensor|gmma" | head -20
KERNEL=wna16_packed bash benchmarks/dev/ncu_wna16.sh 64 "4:q32"
KERNEL=wna16_wgmma bash benchmarks/dev/ncu_wna16.sh 64 "4:h32"
KERNEL=wna16_packed bash benchmarks/dev/ncu_wna16.sh 16 "1:q8"
cat $OUT/ncu_T*.csv | grep -E "^#|tensor|dram__throughput|duration|rc=" | cut -c1-200 | grep -v "^\"ID" | awk -F'","' '{print $1, $(NF-2), $NF}' | head -40

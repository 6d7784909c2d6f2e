set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_quant_wna16_wgmma.py 2>&1 | tail -3
python3 benchmarks/bench_wna16.py --tokens 1,16,64 --no-old --sweep --configs "q8,q32,h32,h24,p32,p24,p32+MINB=2,h32+RB=3+MINB=3,h32+RB=1+MINB=4" --out $OUT 2>&1 | grep -E "sweep|floor|wrote"
KERNEL=wna16_wgmma bash benchmarks/dev/ncu_wna16.sh 64 "4:h32"

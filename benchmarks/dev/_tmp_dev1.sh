set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_quant_wna16_wgmma.py -k "t32 or t24" 2>&1 | tail -15
timeout 200 python3 benchmarks/bench_wna16.py --tokens 1,16,64,256 --no-old --sweep --configs "q8,q32,h32,t32,t24,t32+S=6,t32+RB=1+MINB=4,t32+RB=4+MINB=3" --out $OUT 2>&1 | grep -E "sweep|floor|wrote|rror"

set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
python3 benchmarks/bench_wna16.py --tokens 16,64 --no-old --sweep --configs "q32,h32+RB=2+MINB=4,h32+RB=2+MINB=2+S=8+D=7,h32+RB=2+MINB=3+S=6+D=5,g32+S=8+D=7+MINB=3,h32+RB=4+MINB=2+S=6+D=5" --out $OUT 2>&1 | grep -E "sweep|floor|wrote" 
KERNEL=wna16_wgmma bash benchmarks/dev/ncu_wna16.sh 64 "4:h32+RB=2+MINB=4" "4:h32+RB=2+MINB=2+S=8+D=7"

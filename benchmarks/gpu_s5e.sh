#!/usr/bin/env bash
# Session 5, call 5 (about 3 minutes): what bounds the fp8 per-token kernel (benchmarks/fp8_variants.py).
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests:$PWD/benchmarks" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 240 python3 benchmarks/fp8_variants.py 2>&1 | tee "$OUT/fp8_variants.txt"

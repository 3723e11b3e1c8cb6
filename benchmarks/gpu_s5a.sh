#!/usr/bin/env bash
# Session 5, call 1 (about 6 minutes): the fp8 per-token kernel reading V^T from the pre-pass
# (transpose_v.cu) with a 3-stage ring and no transposer warps: fp8 tests, NaN tests, fp8 timings;
# then the paged path's compile-time variants (benchmarks/paged_variants.py).
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
git log -1 --format=%h 2>/dev/null
timeout 200 python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider --timeout=90 -s \
  tests/test_gpu_fp8.py tests/test_gpu_prefill.py -k "fp8 or transpose or nan" > "$OUT/pytest-fp8.log" 2>&1
grep -E "accuracy|passed|failed|FAIL|Error |assert" "$OUT/pytest-fp8.log" | head -30
timeout 90 python3 benchmarks/fp8_bench.py > "$OUT/fp8.txt" 2>&1; tail -6 "$OUT/fp8.txt"
PYTHONPATH="$PYTHONPATH:$PWD/benchmarks" timeout 200 python3 benchmarks/paged_variants.py > "$OUT/paged_variants.txt" 2>&1; tail -8 "$OUT/paged_variants.txt"

#!/usr/bin/env bash
# Session 6, call 3: v5.3, the paged (and fp8) rope written by the rope warp straight into the K
# stage (no rope ring). Correctness of every paged / rope / NaN path first, then paged vs plain
# (issue 3's 5% bar), then where the fp8 key-scale reads belong (v5.2 moved them before the S wait).
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests:$PWD/benchmarks" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 250 python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider --timeout=60 tests/test_gpu_paged_merge.py \
  tests/test_gpu_fp8.py tests/test_gpu_prefill.py -k "paged or rope or nan or (every_mask and sm90) or cache or merge" \
  > "$OUT/pytest-paged.log" 2>&1; grep -E "passed|failed" "$OUT/pytest-paged.log" | tail -3
timeout 120 python3 benchmarks/paged_merge_bench.py 2>&1 | tee "$OUT/paged_merge.txt" | grep -E "sm90|merge"
timeout 120 python3 benchmarks/fp8_variants.py default late-scales 2>&1 | tee "$OUT/fp8_variants.txt"

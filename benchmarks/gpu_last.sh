#!/usr/bin/env bash
# About 3 minutes of device time: verify the latest kernel / launch changes (paged lookahead in the
# Hopper producer, vectorized merge, kernel-object cache) and re-run the bench cases whose
# FlexAttention rows were invalid in run 2.
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 35 python3 cli.py compile 2>&1 | tail -1
timeout 70 python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider --timeout=40 \
  tests/test_gpu_paged_merge.py tests/test_gpu_prefill.py tests/test_gpu_reliability.py \
  -k "paged or merge or chunked or (sm90 and (16-bf16 or nan or graph)) or repeated" 2>&1 | tee "$OUT/pytest.log" \
  | grep -E "host overhead|passed|failed|FAIL|Error" | tail -12
timeout 30 python3 benchmarks/paged_merge_bench.py 2>&1 | tee "$OUT/paged_merge.txt"
timeout 60 python3 cli.py bench --cases 1x8192,noncausal-1x4096,H16-1x16384,1x512,1x1024,1x2048 --reps 10 \
  --json "$OUT/bench.json" --no-progress 2>&1 | tee "$OUT/bench.txt" | grep -v "^W1203" | tail -40

#!/usr/bin/env bash
# Session 6, call 5: the rope warp's k_full arrivals back to the counted (.noinc) cp.async form
# after synccheck reported "barrier overflow" for the raising form (call 4). The paged / rope
# tests, then synccheck, racecheck and memcheck over the paged / rope part of the subset.
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 170 python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider --timeout=60 tests/test_gpu_paged_merge.py \
  tests/test_gpu_fp8.py -k "paged or rope or nan or cache" > "$OUT/pytest-paged.log" 2>&1; tail -1 "$OUT/pytest-paged.log"
export SUBSET='(paged_equals_plain and 64) or (paged_equals_plain and 16) or (fp8_paged_rope and 64) or (fp8_rope_paged and 64) or (fp8_rope_plain and 16-Causal) or nan_in_one'
for tool_t in synccheck:45 racecheck:60 memcheck:40; do
  OUT=/tmp/san timeout ${tool_t#*:} bash benchmarks/sanitize.sh ${tool_t%:*} 2>&1 | tail -3
done | tee "$OUT/sanitize.txt"
cp /tmp/san/sanitize-synccheck.log "$OUT/" 2>/dev/null

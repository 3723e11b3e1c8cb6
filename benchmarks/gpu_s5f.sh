#!/usr/bin/env bash
# Session 5, call 7 (about 6 minutes, the session's last device time): v5.1 fp8 per token (q_scale
# folded into the row scale, consumers in pingpong, a shared-memory V^T pre-pass). Most important
# first: the fp8 tests (and NaN / pre-pass tests), fp8 timings, three sanitizers on an fp8 subset,
# the pingpong attribution, the fp8 fuzz.
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests:$PWD/benchmarks" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 170 python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider --timeout=40 -s \
  tests/test_gpu_fp8.py tests/test_gpu_prefill.py -k "fp8 or transpose or nan" > "$OUT/pytest-fp8.log" 2>&1
grep -E "accuracy|passed|failed|FAIL|Error |assert|Timeout" "$OUT/pytest-fp8.log" | head -20
timeout 55 python3 benchmarks/fp8_bench.py > "$OUT/fp8.txt" 2>&1; tail -4 "$OUT/fp8.txt"
SUBSET='transpose_v_device or (fp8_every_mask_heads_odd_lengths and 16-CausalMask) or fp8_zero_and_tiny_q_scale or fp8_nan'
for tool in synccheck racecheck memcheck; do
  SUBSET="$SUBSET" OUT=/tmp/san timeout 35 bash benchmarks/sanitize.sh $tool 2>&1 | tail -2
done | tee "$OUT/sanitize.txt"
timeout 40 python3 benchmarks/fp8_variants.py default no-pingpong 2>&1 | tee "$OUT/fp8_variants.txt"
MLA_FUZZ_EXAMPLES=16 MLA_FUZZ_NO_SHRINK=1 timeout 40 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout=30 \
  tests/test_gpu_fuzz.py -k "fp8 or report" 2>&1 | grep -E "fuzz|passed|failed" | tail -3

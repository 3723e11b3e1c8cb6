#!/usr/bin/env bash
# Session 4, call 4 (about 6 minutes): fp8 fixes (16-byte aligned k-scale boxes; the rope ring's
# shared-memory size for the fp8 rope). fp8 tests and fuzz, fp8 timings, paged and bf16 subsets,
# paged timings.
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 200 python3 cli.py compile 2>&1 | tail -1
timeout 60 python3 benchmarks/fp8_diag.py 2>&1 | grep -E "^fp8|^   fp8" | head -10
timeout 120 python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider --timeout=60 -s \
  tests/test_gpu_fp8.py > "$OUT/pytest-fp8.log" 2>&1
grep -E "accuracy|passed|failed|FAIL|Error |assert" "$OUT/pytest-fp8.log" | head -20
timeout 60 python3 benchmarks/fp8_bench.py > "$OUT/fp8.txt" 2>&1; tail -6 "$OUT/fp8.txt"
MLA_FUZZ_EXAMPLES=20 timeout 150 python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider --timeout=60 \
  tests/test_gpu_paged_merge.py tests/test_gpu_fuzz.py tests/test_gpu_prefill.py \
  -k "paged or fuzz or (every_mask and 16)" > "$OUT/pytest.log" 2>&1
grep -E "fuzz|passed|failed|FAIL|Error |assert" "$OUT/pytest.log" | tail -12
timeout 45 python3 benchmarks/paged_merge_bench.py > "$OUT/paged_merge.txt" 2>&1; head -7 "$OUT/paged_merge.txt"

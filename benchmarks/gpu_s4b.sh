#!/usr/bin/env bash
# Session 4, call 2 (about 4 minutes): paged rope by TMA boxes of page runs (issue 3's 5% bar) and
# the first fp8 per-token kernel (issue 6). Paged tests on both kernels, the fp8 tests, a fuzz
# subset, the paged/merge timings and the fp8 timings.
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 200 python3 cli.py compile 2>&1 | tail -1
timeout 60 python3 benchmarks/fp8_diag.py 2>&1 | tail -12
timeout 100 python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider --timeout=60 -s \
  tests/test_gpu_fp8.py > "$OUT/pytest-fp8.log" 2>&1
grep -E "accuracy|passed|failed|FAIL|Error|assert" "$OUT/pytest-fp8.log" | head -30
timeout 40 python3 benchmarks/fp8_bench.py > "$OUT/fp8.txt" 2>&1; cat "$OUT/fp8.txt" | tail -8
MLA_FUZZ_EXAMPLES=15 timeout 120 python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider --timeout=60 \
  tests/test_gpu_paged_merge.py tests/test_gpu_fuzz.py -k "paged or fuzz" > "$OUT/pytest.log" 2>&1
grep -E "fuzz|passed|failed|FAIL|Error|assert" "$OUT/pytest.log" | tail -12
timeout 40 python3 benchmarks/paged_merge_bench.py > "$OUT/paged_merge.txt" 2>&1; head -14 "$OUT/paged_merge.txt"

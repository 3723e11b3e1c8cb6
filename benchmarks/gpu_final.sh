#!/usr/bin/env bash
# A short device call (about 5 minutes): precompile, the GPU tests touched by the latest kernel
# changes (Hopper kernel, paged, merge, chunked, fuzz), paged/merge timings, the full bench matrix.
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 45 python3 cli.py compile 2>&1 | tail -1
MLA_FUZZ_EXAMPLES=${FUZZ:-20} timeout ${SUITE_S:-100} python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider \
  --timeout=60 tests/test_gpu_paged_merge.py tests/test_gpu_prefill.py tests/test_gpu_fuzz.py tests/test_gpu_reliability.py \
  -k "sm90 or merge or chunked or paged or fuzz or repeated" 2>&1 | tee "$OUT/pytest.log" | grep -E "host overhead|fuzz:|passed|failed|FAIL|Error" | tail -14
timeout 30 python3 benchmarks/paged_merge_bench.py 2>&1 | tee "$OUT/paged_merge.txt"
timeout ${BENCH_S:-120} python3 cli.py bench --json "$OUT/bench.json" --no-progress --reps 10 2>&1 | tee "$OUT/bench.txt" | tail -85

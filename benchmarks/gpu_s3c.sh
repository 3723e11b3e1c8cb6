#!/usr/bin/env bash
# Session 3, call 3 (under 10 minutes, at most 8 files back): v3.1 = v3 + paged rope ring (second
# producer warp), merge in the epilogue (accumulate=True), driver launches from packed arguments.
# Smoke (falls back to CuPy's launcher if the driver path fails), the whole GPU suite on both
# kernels with a fuzz, paged/merge timings, the full bench with the plot, four sanitizers, ncu.
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 60 python3 cli.py compile 2>&1 | tail -1
if ! timeout 30 python3 cli.py smoke 2>&1 | tail -1 | grep -- "-> OK"; then
  echo "SMOKE FAILED with driver launches; retrying with MLA_CUPY_LAUNCH=cupy"; export MLA_CUPY_LAUNCH=cupy
  timeout 30 python3 cli.py smoke 2>&1 | tail -3
fi
MLA_FUZZ_EXAMPLES=30 timeout 230 python3 -m pytest -m gpu -q -rfE --tb=line -p no:cacheprovider --timeout=60 \
  tests/test_gpu_prefill.py tests/test_gpu_paged_merge.py tests/test_gpu_fuzz.py tests/test_gpu_reliability.py \
  tests/test_gpu_bench.py > "$OUT/pytest.log" 2>&1
grep -E "host overhead|fuzz|passed|failed|FAIL|Error" "$OUT/pytest.log" | tail -25
timeout 25 python3 benchmarks/paged_merge_bench.py > "$OUT/paged_merge.txt" 2>&1; tail -8 "$OUT/paged_merge.txt"
timeout 110 python3 cli.py bench --json "$OUT/bench.json" --plot "$OUT/bench.png" --reps 20 --no-progress 2>&1 \
  | grep -v "^W1203" > "$OUT/bench.txt"; grep -E "device|mla_cupy" "$OUT/bench.txt" | cut -c1-150
for tool in memcheck racecheck synccheck initcheck; do
  SUBSET='(every_mask_dtype_heads and 16-bf16) or (paged_equals_plain and 64) or nan_in_one or merge_states_exact or accumulate' \
    OUT=/tmp/san timeout 22 bash benchmarks/sanitize.sh $tool 2>&1 | tail -2
done > "$OUT/sanitize.txt"; cat "$OUT/sanitize.txt"
timeout 25 ncu --clock-control none -k regex:prefill --launch-skip 2 --launch-count 1 --section SpeedOfLight \
  --section WarpStateStats --section Occupancy python3 benchmarks/ncu_case.py 1x512 > "$OUT/ncu-1x512.txt" 2>&1
grep -E "Duration|Throughput|Warp Cycles Per Issued" "$OUT/ncu-1x512.txt" | head -8

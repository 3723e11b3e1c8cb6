#!/usr/bin/env bash
# Session 3, call 1 (about 8 minutes): verify the pending patch (paged lookahead, vector merge,
# kernel cache), host overhead, chunked memory; ncu on the slowest and the headline cases; the
# full default bench matrix with the plot for RESULTS.md.
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
git log -1 --format=%h 2>/dev/null
timeout 45 python3 cli.py compile 2>&1 | tail -1
timeout 100 python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider --timeout=60 \
  tests/test_gpu_paged_merge.py tests/test_gpu_prefill.py tests/test_gpu_reliability.py \
  -k "paged or merge or chunked or (sm90 and (16-bf16 or nan or graph)) or repeated" 2>&1 | tee "$OUT/pytest.log" \
  | grep -E "host overhead|passed|failed|FAIL|Error" | tail -12
timeout 30 python3 benchmarks/paged_merge_bench.py 2>&1 | tee "$OUT/paged_merge.txt"
for c in 1x512 1x8192; do
  timeout 40 ncu --clock-control none -k regex:prefill --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
    python3 benchmarks/ncu_case.py $c > "$OUT/ncu-$c.txt" 2>&1
  grep -E "Duration|Throughput|Stall|Warp Cycles|Achieved Occ|Registers|Waves|Issued" "$OUT/ncu-$c.txt" | head -24
done
timeout 220 python3 cli.py bench --json "$OUT/bench.json" --csv "$OUT/bench.csv" --plot "$OUT/bench.png" \
  --no-progress --reps 20 2>&1 | tee "$OUT/bench.txt" | grep -v "^W1203" | tail -45

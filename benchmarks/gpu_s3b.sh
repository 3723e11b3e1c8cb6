#!/usr/bin/env bash
# Session 3, call 2 (under 10 minutes): the v3 Hopper kernel (persistent, L2 head sections,
# intra-warpgroup overlap, interval masks) and the cached host path. In priority order, each step
# time-boxed, every log under $OUT: smoke (stop if it fails), the full bench matrix with the plot,
# the GPU suite on both kernels with a fuzz, paged/merge timings, host-time profile, launch
# variants, ncu, and the four sanitizers on the small-shape subset.
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 60 python3 cli.py compile 2>&1 | tail -1
timeout 40 python3 cli.py smoke 2>&1 | tail -2 | tee "$OUT/smoke.txt"; grep -q -- "-> OK" "$OUT/smoke.txt" || { echo "SMOKE FAILED"; exit 1; }
timeout 110 python3 cli.py bench --json "$OUT/bench.json" --csv "$OUT/bench.csv" --plot "$OUT/bench.png" --reps 20 \
  --no-progress 2>&1 | grep -v "^W1203" > "$OUT/bench.txt"; grep -E "device|mla_cupy" "$OUT/bench.txt" | cut -c1-150
MLA_FUZZ_EXAMPLES=30 timeout 170 python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider --timeout=60 \
  tests/test_gpu_prefill.py tests/test_gpu_paged_merge.py tests/test_gpu_fuzz.py tests/test_gpu_reliability.py \
  tests/test_gpu_bench.py 2>&1 | tee "$OUT/pytest.log" | grep -E "host overhead|fuzz|passed|failed|FAIL|Error|assert" | tail -20
timeout 25 python3 benchmarks/paged_merge_bench.py 2>&1 | tee "$OUT/paged_merge.txt" | tail -7
timeout 20 python3 benchmarks/host_profile.py 2>&1 > "$OUT/host_profile.txt"; head -30 "$OUT/host_profile.txt" | cut -c1-140
timeout 30 python3 benchmarks/variants.py 1x512,1x8192,16x512 2>&1 | tee "$OUT/variants.txt"
for c in 1x512 1x8192; do
  timeout 25 ncu --clock-control none -k regex:prefill --launch-skip 2 --launch-count 1 --section SpeedOfLight \
    --section WarpStateStats --section ComputeWorkloadAnalysis python3 benchmarks/ncu_case.py $c > "$OUT/ncu-$c.txt" 2>&1
  grep -E "Duration|Throughput|Warp Cycles Per Issued|Issue Slots|Executed Ipc A" "$OUT/ncu-$c.txt" | head -10
done
for tool in memcheck racecheck synccheck initcheck; do
  timeout 28 bash benchmarks/sanitize.sh $tool 2>&1 | tail -3
done

#!/usr/bin/env bash
# Session 3, call 2 (about 7 minutes): the v3 Hopper kernel (persistent, L2 sections, intra-warpgroup
# overlap): smoke first (stop there if it fails), the prefill / paged / merge GPU tests on both
# kernels, a short fuzz, the host-time profile, paged/merge timings, and a bench subset.
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 60 python3 cli.py compile 2>&1 | tail -1
timeout 40 python3 cli.py smoke 2>&1 | tail -3 || { echo "SMOKE FAILED"; exit 1; }
MLA_FUZZ_EXAMPLES=25 timeout 230 python3 -m pytest -m gpu -q -x -rfE --tb=short -p no:cacheprovider --timeout=60 \
  tests/test_gpu_prefill.py tests/test_gpu_paged_merge.py tests/test_gpu_fuzz.py \
  tests/test_gpu_reliability.py -k "not 2_31 and not cannot_fit" 2>&1 | tee "$OUT/pytest.log" \
  | grep -E "host overhead|fuzz|passed|failed|FAIL|Error|assert" | tail -25
timeout 40 python3 benchmarks/host_profile.py 2>&1 | tee "$OUT/host_profile.txt" | head -45
timeout 60 python3 benchmarks/variants.py 2>&1 | tee "$OUT/variants.txt"
timeout 30 python3 benchmarks/paged_merge_bench.py 2>&1 | tee "$OUT/paged_merge.txt"
timeout 150 python3 cli.py bench --cases 1x512,1x1024,1x4096,1x8192,1x16384,16x512,ragged,noncausal-1x4096 --reps 10 \
  --json "$OUT/bench.json" --no-progress 2>&1 | tee "$OUT/bench.txt" | grep -v "^W1203" | grep -E "device|case|mla_cupy|cudnn-sdpa  |failed"

#!/usr/bin/env bash
# Session 5, call 3 (under 10 minutes): memcheck and racecheck on the v5 kernels (call 2 gave them
# 60 s each, spent compiling under the sanitizer), after one plain run of the subset fills the
# compile cache; then the fp8 timings.
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
SUBSET='(every_mask_dtype_heads and 16-bf16) or (paged_equals_plain and 64) or nan_ or merge_states_exact or (fp8_every_mask_heads_odd_lengths and 16) or (fp8_paged_rope and 64) or (fp8_rope_plain and 16) or transpose_v_device'
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_prefill.py tests/test_gpu_paged_merge.py \
  tests/test_gpu_fp8.py -k "$SUBSET" 2>&1 | tail -1
OUT=/tmp/san timeout 150 bash benchmarks/sanitize.sh memcheck 2>&1 | tail -2 | tee "$OUT/sanitize.txt"
OUT=/tmp/san timeout 270 bash benchmarks/sanitize.sh racecheck 2>&1 | tail -2 | tee -a "$OUT/sanitize.txt"
cp /tmp/san/sanitize-*.log "$OUT/" 2>/dev/null
timeout 50 python3 benchmarks/fp8_bench.py > "$OUT/fp8.txt" 2>&1; tail -5 "$OUT/fp8.txt"

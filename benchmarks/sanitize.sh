#!/usr/bin/env bash
# compute-sanitizer over a small-shape GPU subset: every mask, both dtypes, both kernels, paged,
# the fp8 variants and the V^T pre-pass.
# Usage (GPU machine): bash benchmarks/sanitize.sh [tools...]   (default: memcheck racecheck synccheck)
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SUBSET=${SUBSET:-'(every_mask_dtype_heads and 16-bf16) or (paged_equals_plain and 64) or nan_ or merge_states_exact or (fp8_every_mask_heads_odd_lengths and 16) or (fp8_paged_rope and 64) or (fp8_rope_plain and 16) or transpose_v_device'}
for tool in ${@:-memcheck racecheck synccheck}; do
  echo "== compute-sanitizer --tool $tool"
  compute-sanitizer --tool "$tool" --target-processes all --print-limit 20 \
    python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_prefill.py tests/test_gpu_paged_merge.py tests/test_gpu_fp8.py -k "($SUBSET)${K:+ and ($K)}" \
    2>&1 | tee "$OUT/sanitize-$tool.log" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed|Error" | tail -5
done

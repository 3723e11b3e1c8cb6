#!/usr/bin/env bash
# Session 6, call 6 (the last minutes): synccheck over the non-paged part of the subset at HEAD
# (call 4's synccheck stopped at the paged kernel's error; the paged part ran clean in call 5).
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export SUBSET='(every_mask_dtype_heads and 16-bf16 and CausalMask) or (fp8_every_mask_heads_odd_lengths and 16-CausalMask) or transpose_v_device or fp8_nan'
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_prefill.py tests/test_gpu_fp8.py -k "$SUBSET" 2>&1 | tail -1
OUT=/tmp/san timeout 40 bash benchmarks/sanitize.sh synccheck 2>&1 | tail -3 | tee "$OUT/sanitize.txt"

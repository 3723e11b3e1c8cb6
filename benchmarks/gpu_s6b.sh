#!/usr/bin/env bash
# Session 6, call 2: v5.2 (descriptors advanced by adds, key scales read before the S wait, the fp8
# P scale folded into the exponent, row max by a tree). Correctness first (every fp8 test, the
# 16-bit Hopper kernel's mask/dtype/heads, prefix, odd-length and NaN tests), then the A/B timing
# against the previous kernels (ab_old/kernels: git archive of the last commit), then ncu.
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests:$PWD/benchmarks" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 200 python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider --timeout=60 tests/test_gpu_fp8.py \
  > "$OUT/pytest-fp8.log" 2>&1; grep -E "accuracy|passed|failed" "$OUT/pytest-fp8.log" | tail -4
timeout 130 python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider --timeout=60 tests/test_gpu_prefill.py \
  -k "sm90 and (every_mask or prefix or odd or nan or more_queries or batch_zero or graph)" > "$OUT/pytest-bf16.log" 2>&1
tail -2 "$OUT/pytest-bf16.log"
timeout 170 python3 benchmarks/ab_bench.py ab_old/kernels 2>&1 | tee "$OUT/ab_bench.txt"
timeout 60 ncu --clock-control none -k regex:mla_prefill_kernel --launch-skip 2 --launch-count 1 --set full \
  --import-source no -f -o /tmp/ncu-fp8 python3 benchmarks/ncu_fp8.py fp8 > /tmp/ncu.log 2>&1
ncu --import /tmp/ncu-fp8.ncu-rep --page source --csv --print-source sass > "$OUT/ncu-fp8-sass.csv" 2>&1
ncu --import /tmp/ncu-fp8.ncu-rep --print-details all > "$OUT/ncu-fp8-details.txt" 2>&1
grep -E "Duration|Elapsed Cycles|Tensor \(FP\)|Issue Slots Busy" "$OUT/ncu-fp8-details.txt" | head -6

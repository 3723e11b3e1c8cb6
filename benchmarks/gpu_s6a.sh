#!/usr/bin/env bash
# Session 6, call 1: what bounds the fp8 per-token kernel (issue 6). The zero/tiny q_scale test
# changed after its last GPU run; ncu (full set, SASS-level stall sampling) of the fp8 and bf16
# kernels on 1x8192; then compile-time variants timed against bf16 in one process.
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests:$PWD/benchmarks" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 120 python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider --timeout=100 \
  tests/test_gpu_fp8.py -k "zero_and_tiny" > "$OUT/pytest-zero.log" 2>&1; tail -3 "$OUT/pytest-zero.log"
for m in fp8 bf16; do
  timeout 120 ncu --clock-control none -k regex:mla_prefill_kernel --launch-skip 2 --launch-count 1 --set full \
    --import-source no -f -o /tmp/ncu-$m python3 benchmarks/ncu_fp8.py $m > /tmp/ncu-$m.log 2>&1; tail -2 /tmp/ncu-$m.log
  ncu --import /tmp/ncu-$m.ncu-rep --print-details all > "$OUT/ncu-$m-details.txt" 2>&1 || \
    ncu --import /tmp/ncu-$m.ncu-rep > "$OUT/ncu-$m-details.txt" 2>&1
  grep -E "Duration|Throughput|Issue Slots|Executed Ipc A|Warp Cycles Per Issued" "$OUT/ncu-$m-details.txt" | head -12
done
ncu --import /tmp/ncu-fp8.ncu-rep --page source --csv --print-source sass > "$OUT/ncu-fp8-sass.csv" 2>&1; wc -c "$OUT/ncu-fp8-sass.csv"
cp /tmp/ncu-fp8.ncu-rep "$OUT/" 2>/dev/null
timeout 200 python3 benchmarks/fp8_variants.py default no-exp no-softmax poly2 poly4 no-dequant 2>&1 | tee "$OUT/fp8_variants.txt"

#!/usr/bin/env bash
# Prepared in session 6 for the next session's first call (NOT RUN YET), about 8 minutes:
# (1) where paged loses to plain (issue 3: ~10% with or without the rope ring): ncu SASS stall
#     sampling of both on 1x8192;
# (2) which v5.2 change cost the fp8 kernel ~2.7% (issue 6): v5.1's row-max chain and P-scale
#     multiply as variants of the current kernel, and the producer loading K ahead of V (k-ahead),
#     against bf16 in one process;
# (3) paged variants: flag reads, registers, the page-table lookups (no-lookup, lookahead-2); the
#     static SASS count found the paged consumers' loop only ~6% longer than plain's.
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests:$PWD/benchmarks" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
for m in bf16 paged; do
  timeout 90 ncu --clock-control none -k regex:mla_prefill_kernel --launch-skip 2 --launch-count 1 --set full \
    --import-source no -f -o /tmp/ncu-$m python3 benchmarks/ncu_fp8.py $m > /tmp/ncu-$m.log 2>&1; tail -1 /tmp/ncu-$m.log
  ncu --import /tmp/ncu-$m.ncu-rep --page source --csv --print-source sass > "$OUT/ncu-$m-sass.csv" 2>&1
  ncu --import /tmp/ncu-$m.ncu-rep --print-details all > "$OUT/ncu-$m-details.txt" 2>&1
  grep -E "Duration|Tensor \(FP\)|Issue Slots Busy" "$OUT/ncu-$m-details.txt" | head -4
done
timeout 180 python3 benchmarks/fp8_variants.py default chain-max pscale-mul k-ahead 2>&1 | tee "$OUT/fp8_variants.txt"
timeout 180 python3 benchmarks/paged_variants.py 2>&1 | tee "$OUT/paged_variants.txt"

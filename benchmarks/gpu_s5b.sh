#!/usr/bin/env bash
# Session 5, call 2 (under 10 minutes): issue 7's evidence on the v5 kernels (fp8 V^T pre-pass):
# the four sanitizers over a subset with the fp8 variants, then the whole GPU suite (both kernels,
# the fuzz over every kernel incl. fp8, reliability, bench, fp8, paged/merge).
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 40 python3 cli.py smoke 2>&1 | tail -1
for tool in memcheck racecheck synccheck initcheck; do
  OUT=/tmp/san timeout 60 bash benchmarks/sanitize.sh $tool 2>&1 | tail -2
done > "$OUT/sanitize.txt"; cat "$OUT/sanitize.txt"
MLA_FUZZ_EXAMPLES=24 MLA_FUZZ_NO_SHRINK=1 timeout 330 python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider \
  --timeout=120 -s tests/ > "$OUT/pytest.log" 2>&1
grep -E "host overhead|fuzz|accuracy|passed|failed|FAIL|Error" "$OUT/pytest.log" | tail -25

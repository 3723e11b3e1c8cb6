#!/usr/bin/env bash
# Session 4, call 1 (about 2 minutes): the launch-plan cache for fully specified repeat calls:
# host time per call (issue 7's 30 us bar), the fast-path tests, graph capture, a correctness subset.
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 50 python3 cli.py compile 2>&1 | tail -1
timeout 80 python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider --timeout=40 \
  tests/test_gpu_reliability.py tests/test_gpu_prefill.py tests/test_gpu_paged_merge.py \
  -k "repeated or fast_path or graph or (every_mask and 16-bf16) or accumulate or (paged_equals and 64)" 2>&1 \
  | tee "$OUT/pytest.log" | grep -E "host overhead|passed|failed|FAIL|Error|assert" | tail -12
timeout 20 python3 benchmarks/host_profile.py 2>&1 | head -1

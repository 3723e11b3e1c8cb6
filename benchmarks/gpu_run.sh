#!/usr/bin/env bash
# One device call: GPU tests, then (optionally) benchmark cases. Usage on the GPU machine:
#   bash benchmarks/gpu_run.sh "<pytest args>" "<bench cases or empty>" [extra bench args]
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
git rev-parse --short HEAD 2>/dev/null || true
if [ -n "${1:-}" ]; then
  python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider $1 2>&1 | tee "$OUT/pytest.log" | tail -60
fi
if [ -n "${2:-}" ]; then
  python3 cli.py bench --cases "$2" --json "$OUT/bench.json" --no-progress ${3:-} 2>&1 | tee "$OUT/bench.txt"
fi

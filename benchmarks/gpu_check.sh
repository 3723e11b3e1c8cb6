#!/usr/bin/env bash
# One device call: a quick Hopper-kernel smoke (bounded), the whole GPU suite, then sanitizers.
# If the Hopper smoke fails, the suite runs on the portable kernel only (MLA_CUPY_DISABLE_SM90).
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
echo "== smoke (sm90, one small case)"
export K=""
if ! timeout ${SMOKE_S:-90} python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_gpu_prefill.py \
  -k "every_mask_dtype_heads and sm90 and 16-bf16 and Causal" 2>&1 | tee "$OUT/smoke.log" | tail -25; then
  echo "!! sm90 smoke failed: suite on the portable kernel only"; export MLA_CUPY_DISABLE_SM90=1; K="not sm90"
fi
echo "== GPU suite"
timeout ${SUITE_S:-300} python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider --timeout=120 ${K:+-k "$K"} tests 2>&1 \
  | tee "$OUT/pytest.log" | tail -45
echo "== sanitizers"
for tool in ${SAN_TOOLS:-memcheck racecheck}; do
  OUT=$OUT timeout ${SAN_S:-90} bash benchmarks/sanitize.sh $tool 2>&1 | tail -4 || echo "($tool: stopped after ${SAN_S:-90}s)"
done

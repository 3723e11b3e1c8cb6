#!/usr/bin/env bash
# Everything in one bounded device call (about 10 minutes): precompile, Hopper smoke, GPU suite,
# benchmark cases, paged/merge timings, sanitizers. Each stage has its own time limit and writes
# its log under $OUT as it goes.
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
echo "== precompile"; timeout 50 python3 cli.py compile 2>&1 | tail -3
echo "== smoke (sm90)"
export K=""
if [ -z "${SKIP_SMOKE:-}" ] && ! timeout 50 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_gpu_prefill.py \
  -k "every_mask_dtype_heads and sm90 and 16-bf16 and Causal" 2>&1 | tee "$OUT/smoke.log" | tail -25; then
  echo "!! sm90 smoke failed: the rest on the portable kernel only"; export MLA_CUPY_DISABLE_SM90=1; K="not sm90"
fi
echo "== GPU suite"
MLA_FUZZ_EXAMPLES=${FUZZ:-50} timeout ${SUITE_S:-200} python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider \
  --timeout=100 ${K:+-k "$K"} tests 2>&1 | tee "$OUT/pytest.log" | tail -30
echo "== bench"
timeout ${BENCH_S:-170} python3 cli.py bench --cases "${CASES:-1x8192,ragged,16x512,1x16384,1x4096,4x2048,1024+ctx8192,H16-1x8192,noncausal-1x4096,H16-1x16384,1x512,1x1024,1x2048}" \
  --json "$OUT/bench.json" --no-progress --reps 15 2>&1 | tee "$OUT/bench.txt" | tail -70
echo "== paged / merge"
timeout 35 python3 benchmarks/paged_merge_bench.py 2>&1 | tee "$OUT/paged_merge.txt" | tail -10
echo "== sanitizers"
for tool in ${SAN_TOOLS:-memcheck racecheck synccheck initcheck}; do
  OUT=$OUT timeout ${SAN_S:-30} bash benchmarks/sanitize.sh $tool 2>&1 | tail -3 || echo "($tool: stopped at the time limit)"
done

#!/usr/bin/env bash
# Session 6, call 4: issue 7's evidence on the final kernels (v5.3): the whole `pytest -m gpu`
# first (it also fills the compile cache), then the four sanitizers over a subset that covers
# what changed (the rope warp writing into the K stage, the fp8 softmax, the descriptors):
# both kernels, paged aligned/unaligned, fp8 per token and fp8 rope, the pre-pass, NaN isolation.
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
MLA_FUZZ_EXAMPLES=16 MLA_FUZZ_NO_SHRINK=1 timeout 310 python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider \
  --timeout=120 -s tests/ > "$OUT/pytest.log" 2>&1
grep -E "host overhead|fuzz|accuracy|passed|failed|FAIL|Error" "$OUT/pytest.log" | tail -20
export SUBSET='(every_mask_dtype_heads and 16-bf16 and CausalMask) or (paged_equals_plain and 64) or (paged_equals_plain and 16) or nan_in_one or (fp8_every_mask_heads_odd_lengths and 16-CausalMask) or (fp8_paged_rope and 64) or (fp8_rope_paged and 64) or transpose_v_device or (fp8_rope_plain and 16-Causal)'
for tool_t in racecheck:85 synccheck:55 memcheck:65 initcheck:55; do
  OUT=/tmp/san timeout ${tool_t#*:} bash benchmarks/sanitize.sh ${tool_t%:*} 2>&1 | tail -3
done | tee "$OUT/sanitize.txt"
cp /tmp/san/sanitize-*.log "$OUT/" 2>/dev/null; ls "$OUT"

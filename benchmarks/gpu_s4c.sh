#!/usr/bin/env bash
# Session 4, call 3 (about 4 minutes): bisect the fp8 per-token kernel's illegal instruction
# (debug defines drop one part each), compute-sanitizer on the full kernel, and the paged timings
# with the consumer fence only after cp.async-gathered tiles.
set -u -o pipefail
export PYTHONPATH="$PWD:$PWD/tests" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cat > /tmp/one.py <<'PY'
import numpy as np, cupy as cp, mla_cupy
from mla_cupy import NullMask, quant, reference
from _cases import BF16, make_case, per_slice_errors
c = make_case([128], [128], 1, BF16, seed=1)
f = quant.quantize_per_token(c.q, c.k, c.v, c.k_rope)
d = {n: cp.asarray(a.view(np.uint8) if a.dtype.itemsize == 1 else a) for n, a in f.items()}
vl = cp.asarray(c.valid_length)
try:
    out, lse = mla_cupy.mla_prefill_fp8(d["q_nope"], d["q_rope"], d["q_scale"], d["k"], d["k_scales"], d["v"], d["k_rope"], vl, vl, mask=NullMask(), return_lse=True)
    cp.cuda.Device().synchronize()
    ref, rl = reference.mla_prefill_fp8(f["q_nope"], f["q_rope"], f["q_scale"], f["k"], f["k_scales"], f["v"], f["k_rope"], c.valid_length, c.valid_length, mask=NullMask(), return_lse=True)
    print("OK out err %.4f lse err %.4f" % (max(per_slice_errors(cp.asnumpy(out).astype(np.float64), ref, c.valid_length)), np.abs(cp.asnumpy(lse) - rl).max()))
except Exception as e:
    print("ERR", type(e).__name__, str(e)[:120])
PY
for defs in "-DMLA_DBG_NO_KSCALE" "-DMLA_DBG_NO_PV8" "-DMLA_DBG_NO_S8"; do
  echo "defines [$defs]: $(MLA_CUPY_DEFINES="$defs" timeout 60 python3 /tmp/one.py 2>&1 | grep -E '^(OK|ERR)' | head -1)"
done
timeout 60 compute-sanitizer --tool memcheck --print-limit 3 python3 /tmp/one.py 2>&1 | grep -vE "^\s+(Host|=========\s+in /|=========\s+Host)" | head -30 > "$OUT/sanitize-fp8.txt"; head -30 "$OUT/sanitize-fp8.txt"
timeout 60 python3 benchmarks/paged_merge_bench.py 2>&1 | head -7

"""fp8 variants on a few small cases, printing errors instead of asserting (one line each): the
lse depends on S only, the output on S and P V, so the pair localizes a fault.

    PYTHONPATH=.:tests python3 benchmarks/fp8_diag.py
"""
import numpy as np

import cupy as cp

import mla_cupy
from mla_cupy import CausalMask, NullMask, quant, reference

from _cases import BF16, make_case, per_slice_errors


def main():
    for sq, sk, h, mask in (([128], [128], 1, NullMask()), ([256], [256], 2, NullMask()), ([100], [300], 16, CausalMask()),
                            ([1000], [1000], 16, CausalMask())):
        c = make_case(sq, sk, h, BF16, seed=1)
        f = quant.quantize_per_token(c.q, c.k, c.v, c.k_rope)
        d = {n: cp.asarray(a.view(np.uint8) if a.dtype.itemsize == 1 else a) for n, a in f.items()}
        vl, cro = cp.asarray(c.valid_length), cp.asarray(c.cache_row_offsets)
        try:
            out, lse = mla_cupy.mla_prefill_fp8(d["q_nope"], d["q_rope"], d["q_scale"], d["k"], d["k_scales"], d["v"],
                                                d["k_rope"], vl, cro, mask=mask, return_lse=True)
            cp.cuda.Device().synchronize()
        except Exception as exc:  # noqa: BLE001 - a diagnostic
            print(f"fp8 {sq}x{sk} H={h}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        ref, ref_lse = reference.mla_prefill_fp8(f["q_nope"], f["q_rope"], f["q_scale"], f["k"], f["k_scales"], f["v"],
                                                 f["k_rope"], c.valid_length, c.cache_row_offsets, mask=mask, return_lse=True)
        o = cp.asnumpy(out).astype(np.float64)
        l = cp.asnumpy(lse)
        fin = np.isfinite(ref_lse)
        print(f"fp8 {sq}x{sk} H={h} {type(mask).__name__}: out nan {np.isnan(o).sum()}, worst out err "
              f"{max(per_slice_errors(o, ref, c.valid_length)):.4f}, max |lse err| {np.abs(l[fin] - ref_lse[fin]).max():.4f}")
        r8, sc = quant.quantize_rope_blocks(c.k_rope)
        try:
            o2 = mla_cupy.mla_prefill(cp.asarray(c.q), cp.asarray(c.k), cp.asarray(c.v), cp.asarray(r8.view(np.uint8)), vl, cro,
                                      mask=mask, k_rope_scales=cp.asarray(sc))
            ref2 = reference.mla_prefill_fp8_rope(c.q, c.k, c.v, r8, sc, c.valid_length, c.cache_row_offsets, mask=mask)
            print(f"   fp8 rope: worst out err {max(per_slice_errors(cp.asnumpy(o2).astype(np.float64), ref2, c.valid_length)):.4f}")
        except Exception as exc:  # noqa: BLE001
            print(f"   fp8 rope: {type(exc).__name__}: {str(exc)[:300]}")


if __name__ == "__main__":
    main()

"""Helpers for GPU tests: upload a Case, run the kernel with a NaN-poisoned output, compare with
the float64 reference per (sequence, head) slice as the SPEC defines accuracy."""
import numpy as np

import mla_cupy
from mla_cupy import reference

from _cases import per_slice_errors


def _kernels():
    """Every kernel this GPU runs: the portable one always, the Hopper one on compute capability 9.0."""
    try:
        import cupy

        return ["sm80", "sm90"] if cupy.cuda.Device().compute_capability == "90" else ["sm80"]
    except Exception:
        return ["sm80"]


KERNELS = _kernels()


def pooled_blocks(c, block_m, sections):
    """The query blocks of case ``c`` that end the Hopper launch outside its L2 sections of
    ``sections`` heads (_select.tail_blocks) with work tiles of ``block_m`` rows, causal."""
    import cupy as cp

    from mla_cupy import _select, validation

    sq, sk = np.diff(c.valid_length.astype(np.int64)), np.diff(c.cache_row_offsets.astype(np.int64))
    p = validation.Problem(batch=len(sq), heads=c.q.shape[1], tq=int(sq.sum()), tk=int(sk.sum()), dtype=c.q.dtype,
                           out_dtype=c.q.dtype, mask=mla_cupy.CausalMask(), scale=1.0, max_sq=int(sq.max()),
                           paged=False)
    nmb = -(-p.max_sq // block_m)
    ctas = min(nmb * p.batch * p.heads, _select.sm_count(cp.cuda.runtime.getDevice()))
    return _select.tail_blocks(p, sections, nmb, ctas)


def small_problem(sq: int, heads: int, seed: int):
    """One sequence of ``sq`` queries over ``sq`` keys on the GPU: q, k (also used as v), k_rope,
    offsets and an output buffer, for tests that call the kernel many times."""
    import cupy as cp

    from _cases import BF16

    rng = np.random.default_rng(seed)
    return dict(q=cp.asarray(rng.standard_normal((sq, heads, 192)).astype(BF16)),
                k=cp.asarray(rng.standard_normal((sq, heads, 128)).astype(BF16)),
                k_rope=cp.asarray(rng.standard_normal((sq, 1, 64)).astype(BF16)),
                offsets=cp.asarray(np.array([0, sq], np.uint32)),
                out=cp.full((sq, heads, 128), np.nan, BF16))


def upload(case):
    import cupy as cp

    return {name: (None if getattr(case, name) is None else cp.asarray(getattr(case, name)))
            for name in ("q", "k", "v", "k_rope", "valid_length", "cache_row_offsets", "cache_offsets", "q_start_pos")}


def run_and_check(case, mask=None, out_dtype=None, tol=1e-2, k_rope=None, ref_k_rope=None, return_lse=True, **kw):
    """Kernel vs reference; returns (out, lse, max_err). Output is poisoned with NaN first."""
    import cupy as cp

    d = upload(case)
    tq, h = case.q.shape[:2]
    odt = np.dtype(out_dtype) if out_dtype is not None else case.q.dtype
    out = cp.full((tq, h, 128), np.nan, dtype=odt)
    res = mla_cupy.mla_prefill(d["q"], d["k"], d["v"], d["k_rope"] if k_rope is None else k_rope, d["valid_length"],
                               d["cache_row_offsets"], mask=mask, cache_offsets=d["cache_offsets"],
                               q_start_pos=d["q_start_pos"], out=out, out_dtype=out_dtype, return_lse=return_lse, **kw)
    got, lse = (res if return_lse else (res, None))
    assert got is out
    ref, ref_lse = reference_result(case, mask=mask, k_rope=ref_k_rope, scale=kw.get("scale"),
                                    validate=kw.get("validate", True))
    worst = check_result(case, got, lse, ref, ref_lse, tol=tol)
    return got, lse, worst


def reference_result(case, mask=None, k_rope=None, scale=None, validate=True):
    """``(out, lse)`` of the float64 reference for the case (``k_rope``: another rope source, e.g.
    a host :class:`~mla_cupy.PagedKVCache`, instead of the case's plain rope)."""
    return reference.mla_prefill(case.q, case.k, case.v, case.k_rope if k_rope is None else k_rope, case.valid_length,
                                 case.cache_row_offsets, mask=mask, scale=scale, cache_offsets=case.cache_offsets,
                                 q_start_pos=case.q_start_pos, return_lse=True, validate=validate)


def check_result(case, got, lse, ref, ref_lse, tol=1e-2, lse_tol=2e-2) -> float:
    """A kernel's result (device or host arrays; ``lse`` may be None) against the reference's:
    every element written and finite where the reference is, rows that see no key exactly 0 (and
    their lse ``-inf``), the worst per-(sequence, head) relative error below ``tol``, the lse within
    ``lse_tol``. Returns the worst error."""
    import cupy as cp

    got_h = cp.asnumpy(got).astype(np.float64)
    assert not np.isnan(got_h).any(), f"{np.isnan(got_h).sum()} output elements unwritten or NaN"
    empty_rows = np.isneginf(ref_lse)
    assert np.all(got_h[empty_rows] == 0), "rows with no visible key must be exactly 0"
    errs = per_slice_errors(got_h, ref, case.valid_length)
    worst = max(errs) if errs else 0.0
    assert worst < tol, f"worst per-slice relative error {worst:.3g} >= {tol}"
    if lse is not None:
        lse_h = cp.asnumpy(lse)
        assert lse_h.dtype == np.float32
        np.testing.assert_array_equal(np.isneginf(lse_h), empty_rows)
        fin = ~empty_rows
        np.testing.assert_allclose(lse_h[fin], ref_lse[fin], rtol=lse_tol, atol=lse_tol)
    return worst


def assert_like_reference(got, ref, valid_length, tol=1e-2, got_lse=None, ref_lse=None):
    """A kernel result with NaN or Inf inputs against the reference's: NaN and +-Inf at exactly the
    same places, the finite values within ``tol`` per (sequence, head) slice, and the lse with NaN
    and -inf at the same places and close finite values."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg="NaN positions differ")
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(ref), err_msg="+Inf positions differ")
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref), err_msg="-Inf positions differ")
    fin = np.isfinite(ref)
    errs = per_slice_errors(np.where(fin, got, 0.0), np.where(fin, ref, 0.0), valid_length)
    assert max(errs, default=0.0) < tol, f"worst per-slice relative error {max(errs):.3g} >= {tol}"
    if got_lse is not None:
        got_lse = np.asarray(got_lse, np.float64)
        np.testing.assert_array_equal(np.isnan(got_lse), np.isnan(ref_lse), err_msg="lse NaN positions differ")
        np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(ref_lse), err_msg="lse -inf positions differ")
        fin = np.isfinite(ref_lse)
        np.testing.assert_allclose(got_lse[fin], ref_lse[fin], rtol=2e-2, atol=2e-2)

"""Helpers for GPU tests: upload a Case, run the kernel with a NaN-poisoned output, compare with
the float64 reference per (sequence, head) slice as the SPEC defines accuracy; the backward's
problem (forward, then backward into poisoned gradients) and its check against the reference."""
from typing import List

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


# ------------------------------------------------------------------------------------------------
# The backward

#: mla_prefill_backward's results, in its order.
GRADIENTS = ("dq", "dk", "dv", "dk_rope")
#: The least norm a gradient's error is measured against, per (row, head) slice that the gradient
#: or its reference holds. A row that sees one key has ``P = 1`` and ``out = v``, so its
#: ``dS = P (dP - D)`` is 0 exactly in the reference, while the kernels' dP (tensor cores) and D
#: (the pre-pass) are two float32 sums of the same 128 products in different orders, which differ
#: by about 1e-6 (1e-5 at most): a gradient made of such rows alone has a reference of 0 (or near)
#: and the kernels' rounding noise, which this floor keeps below 1e-3 of it.
GRADIENT_FLOOR = 1e-2


def backward_bound(dtype) -> float:
    """The bound of each gradient's relative error: 1e-2 for bf16 inputs, 2e-3 for fp16."""
    return 2e-3 if np.dtype(dtype) == np.float16 else 1e-2


def gradient_error(got, ref, per_slice: int = 1) -> float:
    """``|got - ref| / max(|ref|, GRADIENT_FLOOR sqrt(n))`` (Frobenius norms), ``n`` the slices
    (last axis) where either is not 0, times ``per_slice`` (the heads summed into ``dk_rope``'s);
    ``inf`` where ``got`` holds a NaN or an Inf."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    slices = int(np.count_nonzero(np.any((got != 0) | (ref != 0), axis=-1))) * per_slice
    den = max(float(np.linalg.norm(ref)), GRADIENT_FLOOR * float(np.sqrt(slices)))
    return float(np.linalg.norm(got - ref)) / den if den > 0 else 0.0


def gradient_errors(grads, ref, heads: int) -> List[float]:
    """:func:`gradient_error` of each gradient (host or device arrays) against the reference's."""
    import cupy as cp

    return [gradient_error(cp.asnumpy(g), r, heads if name == "dk_rope" else 1)
            for name, g, r in zip(GRADIENTS, grads, ref)]


def check_gradients(grads, ref, dtype, heads: int) -> float:
    """The kernels' gradients (host or device arrays) against the reference's: no NaN (every
    element was poisoned before), each within :func:`backward_bound` (:func:`gradient_error`).
    Returns the worst error."""
    import cupy as cp

    grads = [np.asarray(cp.asnumpy(g), np.float64) for g in grads]
    for name, g in zip(GRADIENTS, grads):
        nans = int(np.isnan(g).sum())
        assert not nans, f"{name}: {nans} NaN (elements not written, or NaN computed)"
    bound, errs = backward_bound(dtype), gradient_errors(grads, ref, heads)
    for name, err in zip(GRADIENTS, errs):
        assert err < bound, f"{name}: relative error {err:.3g} >= {bound:.0e}"
    return max(errs)


class BackwardProblem:
    """A case's backward on the GPU: its inputs on the device, ``dout`` (and ``dlse``) drawn from
    ``seed`` (a NumPy generator's seed), the forward's ``out`` and ``lse`` (``mla_prefill`` into NaN-poisoned buffers, every
    element checked written), then backward runs into poisoned gradients (:meth:`run`) and their
    check against the float64 reference backward of the same out, lse, dout and dlse (:meth:`check`)."""

    def __init__(self, case, mask=None, kernel="auto", out_dtype=None, dlse=False, seed=99):
        import cupy as cp

        self.case, self.mask, self.kernel = case, mask, kernel
        self.d = d = upload(case)
        tq, h = case.q.shape[:2]
        rng = np.random.default_rng(seed)
        self.dout = cp.asarray(rng.standard_normal((tq, h, 128)).astype(case.q.dtype))
        self.dlse = cp.asarray(rng.standard_normal((tq, h)).astype(np.float32)) if dlse else None
        self.extra = {n: d[n] for n in ("cache_offsets", "q_start_pos") if d[n] is not None}
        out = cp.full((tq, h, 128), np.nan, np.dtype(out_dtype or case.q.dtype))
        lse = cp.full((tq, h), np.nan, np.float32)
        got, got_lse = mla_cupy.mla_prefill(d["q"], d["k"], d["v"], d["k_rope"], d["valid_length"],
                                            d["cache_row_offsets"], mask=mask, out=out, lse=lse, out_dtype=out_dtype,
                                            return_lse=True, kernel=kernel, **self.extra)
        assert got is out and got_lse is lse
        self.host = {n: cp.asnumpy(x) for n, x in (("dout", self.dout), ("out", out), ("lse", lse))}
        for n in ("out", "lse"):
            nans = int(np.isnan(np.asarray(self.host[n], np.float32)).sum())
            assert not nans, f"the forward left {nans} elements of {n} unwritten or NaN"
        self.out, self.lse = out, lse
        self._ref = None

    def gradients(self):
        """NaN-filled ``dq, dk, dv, dk_rope`` buffers (q's dtype) on the current stream."""
        import cupy as cp

        d, dtype = self.d, self.case.q.dtype
        return [cp.full(d[n].shape, np.nan, dtype) for n in ("q", "k", "v", "k_rope")]

    def run(self, grads=None, deterministic=False, stream=None, **call):
        """``mla_prefill_backward`` into ``grads`` (new poisoned ones by default), ``call`` its
        further keywords (``q_max_seq_len``, ``validate``); returns them."""
        d = self.d
        grads = self.gradients() if grads is None else grads
        got = mla_cupy.mla_prefill_backward(self.dout, d["q"], d["k"], d["v"], d["k_rope"], self.out, self.lse,
                                            d["valid_length"], d["cache_row_offsets"], mask=self.mask,
                                            kernel=self.kernel, deterministic=deterministic, dq=grads[0],
                                            dk=grads[1], dv=grads[2], dk_rope=grads[3], dlse=self.dlse, stream=stream,
                                            **self.extra, **call)
        assert all(g is w for g, w in zip(got, grads))
        return grads

    def reference(self):
        """The float64 reference backward of the problem (computed once)."""
        import cupy as cp

        if self._ref is None:
            c, h = self.case, self.host
            self._ref = reference.mla_prefill_backward(
                h["dout"], c.q, c.k, c.v, c.k_rope, h["out"], h["lse"], c.valid_length, c.cache_row_offsets,
                mask=self.mask, cache_offsets=c.cache_offsets, q_start_pos=c.q_start_pos,
                dlse=None if self.dlse is None else cp.asnumpy(self.dlse))
        return self._ref

    def check(self, grads) -> float:
        """:func:`check_gradients` of ``grads`` against :meth:`reference`; the worst error."""
        return check_gradients(grads, self.reference(), self.case.q.dtype, self.case.q.shape[1])

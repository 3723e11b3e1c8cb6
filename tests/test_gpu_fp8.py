"""GPU tests of the fp8 per-token variant against the float64 reference of the
dequantized inputs (pytest -m gpu; Hopper only)."""
import dataclasses

import numpy as np
import pytest

import mla_cupy
from mla_cupy import CausalMask, ChunkedCausalMask, ChunkedMask, NullMask, PagedKVCache, SlidingWindowCausalMask
from mla_cupy import quant, reference
from mla_cupy.fp8 import TransposedV

from _cases import BF16, build_paged, build_paged_fp8_rope, make_case, per_slice_errors
from gpu_util import KERNELS, assert_like_reference, pooled_blocks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif("sm90" not in KERNELS, reason="the fp8 per-token kernel needs a Hopper GPU")]

MASKS = [NullMask(), CausalMask(), SlidingWindowCausalMask(37), ChunkedMask(50), ChunkedCausalMask(50)]
TOL = 3e-2  # the contract: relative error against the float64 reference of the dequantized inputs
# the contract's bound on any slice: a slice of one query row (or of fewer than 64 visible keys)
# averages the e4m3 rounding of P over few values (measured on an H200: 3.3-3.5% on a 1-row slice
# of 129 keys, with a bf16 rope and with an e4m3 one alike)
TOL_ANY_SLICE = 6e-2


def quantized(case, e4m3_rope=False):
    """The case's bf16 inputs quantized per token (mla_cupy.quant), as host arrays; with
    ``e4m3_rope`` the all-e4m3 mode's (e4m3 q_rope and k_rope under the same scales)."""
    return quant.quantize_per_token(case.q, case.k, case.v, case.k_rope, e4m3_rope=e4m3_rope)


def on_device(fq):
    """Quantized host arrays as CuPy arrays (e4m3 data as its uint8 bytes)."""
    import cupy as cp

    return {n: cp.asarray(fq[n].view(np.uint8) if fq[n].dtype.itemsize == 1 else fq[n]) for n in fq}


def run_fp8(case, fq, k_rope=None, mask=None, out_dtype=None, **kw):
    """mla_prefill_fp8 on the GPU with a NaN-poisoned output; returns (out, lse) on the host."""
    import cupy as cp

    dev = on_device(fq)
    odt = np.dtype(out_dtype) if out_dtype is not None else BF16
    out = kw.pop("out", None)  # given: already NaN-poisoned
    if out is None:
        out = cp.full((case.q.shape[0], case.q.shape[1], 128), np.nan, odt)
    co = None if case.cache_offsets is None else cp.asarray(case.cache_offsets)
    q_start = None if case.q_start_pos is None else cp.asarray(case.q_start_pos)
    got, lse = mla_cupy.mla_prefill_fp8(dev["q_nope"], dev["q_rope"], dev["q_scale"], dev["k"], dev["k_scales"], dev["v"],
                                        dev["k_rope"] if k_rope is None else k_rope, cp.asarray(case.valid_length),
                                        cp.asarray(case.cache_row_offsets), mask=mask, cache_offsets=co,
                                        q_start_pos=q_start, out=out, out_dtype=out_dtype, return_lse=True, **kw)
    assert got is out
    return cp.asnumpy(got).astype(np.float64), cp.asnumpy(lse)


def check_fp8(case, mask=None, k_rope=None, tol=TOL, fq=None, **kw):
    """Kernel vs the float64 reference of the dequantized inputs (``fq``: given, or quantized from
    the case); returns the worst per-slice error."""
    fq = quantized(case) if fq is None else fq
    got, lse = run_fp8(case, fq, k_rope=k_rope, mask=mask, **kw)
    ref, ref_lse = reference.mla_prefill_fp8(fq["q_nope"], fq["q_rope"], fq["q_scale"], fq["k"], fq["k_scales"], fq["v"],
                                             fq["k_rope"], case.valid_length, case.cache_row_offsets, mask=mask,
                                             cache_offsets=case.cache_offsets, q_start_pos=case.q_start_pos,
                                             return_lse=True)
    assert not np.isnan(got).any(), f"{np.isnan(got).sum()} output elements unwritten or NaN"
    empty = np.isneginf(ref_lse)
    assert np.all(got[empty] == 0), "rows with no visible key must be exactly 0"
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=2e-2, atol=2e-2)
    errs = per_slice_errors(got, ref, case.valid_length)
    worst = max(errs) if errs else 0.0
    assert worst < tol, f"worst per-slice relative error {worst:.3g} >= {tol}"
    return worst


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("heads", [16, 128])
def test_fp8_every_mask_heads_odd_lengths(mask, heads):
    sq, sk = ([1, 7, 63, 65, 129, 0, 1000], [1, 7, 63, 65, 129, 5, 1000]) if heads == 16 else ([1, 7, 65, 129], [1, 7, 65, 200])
    check_fp8(make_case(sq, sk, heads, BF16, seed=heads + len(type(mask).__name__)), mask=mask)


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: type(m).__name__)
def test_fp8_prefix_context_float32_out(mask):
    c = make_case([65, 100, 1, 33], [300, 1000, 129, 33], 16, BF16, seed=7, cache_offsets=[0, 77, 1000, 5])
    check_fp8(c, mask=mask, out_dtype=np.float32)


# Sequences whose part-filled first query block (at most 64 rows, one consumer's: 40, 250 = 192 + 58,
# 385 = 2 x 192 + 1) sees 768 keys or more through cached context, beside sequences that have none
# (two consumers of such a work tile idle through all its key tiles); the third sequence empty.
LONG_FIRST_BLOCKS = dict(sq=[40, 250, 0, 385, 129], sk=[1000, 1150, 40, 1300, 129], cache_offsets=[0, 900, 0, 915, 3])


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: type(m).__name__)
def test_fp8_long_part_filled_blocks(mask):
    c = make_case(LONG_FIRST_BLOCKS["sq"], LONG_FIRST_BLOCKS["sk"], 16, BF16, seed=31,
                  cache_offsets=LONG_FIRST_BLOCKS["cache_offsets"])
    check_fp8(c, mask=mask, out_dtype=np.float32)


@pytest.mark.parametrize("mask", [CausalMask(), SlidingWindowCausalMask(37)], ids=lambda m: type(m).__name__)
def test_fp8_zero_and_tiny_q_scale(mask):
    """q_scale folds into each row's softmax scale in the kernel: rows with q_scale 0 (all scores 0:
    uniform weights over the visible keys, masked keys still excluded), tiny scales and 100 times
    the quantizer's scale match the reference.

    (A first version also set q_scale = 1e4, a million times the quantizer's: logits near 1e6,
    where one float32 ulp is 0.06 in the exponent, so the largest weight is off by up to 4% in any
    float32 softmax; on the H200 the causal case failed at 4.2% for that reason. Dropped; this
    version has not yet run on a GPU.)"""
    c = make_case([65, 7, 130], [100, 7, 300], 16, BF16, seed=43)
    fq = quantized(c)
    fq["q_scale"][[0, 5, 64, 70, 71, 150]] = 0.0
    fq["q_scale"][[1, 100]] = 1e-30
    fq["q_scale"][[2, 101]] *= 100
    check_fp8(c, mask=mask, fq=fq)


@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("offsets", ["unaligned", "aligned"])
def test_fp8_paged_rope(page_size, offsets):
    """The (scaled, bf16) rope from a paged cache equals the plain-array result bit for bit."""
    import cupy as cp

    co = [5, 0, 1000] if offsets == "unaligned" else [0, 512, 1024]
    c = make_case([65, 1, 130], [300, 17, 700], 16, BF16, seed=page_size, cache_offsets=co)
    fq = quantized(c)
    scaled = dataclasses.replace(c, k_rope=fq["k_rope"])  # the cache holds the scaled rope
    blocks, lut = build_paged(scaled, page_size, seed=page_size)
    cache = PagedKVCache(cp.asarray(blocks), cp.asarray(lut), page_size)
    plain, _ = run_fp8(c, fq)
    paged, _ = run_fp8(c, fq, k_rope=cache)
    np.testing.assert_array_equal(paged, plain)
    check_fp8(c, k_rope=cache)


def test_fp8_rejects_bad_input():
    import cupy as cp

    c = make_case([8], [8], 2, BF16, seed=1)
    fq = on_device(quantized(c))
    args = lambda **o: [o.get(n, fq[n]) for n in ("q_nope", "q_rope", "q_scale", "k", "k_scales", "v", "k_rope")]
    vl = cp.asarray(c.valid_length)
    with pytest.raises(TypeError, match="q_nope: expected dtype uint8"):
        mla_cupy.mla_prefill_fp8(*args(q_nope=fq["q_rope"][:, :, :64].astype(cp.float32)), vl, vl)
    with pytest.raises(ValueError, match="k_scales: expected shape"):
        mla_cupy.mla_prefill_fp8(*args(k_scales=fq["k_scales"][:4]), vl, vl)
    with pytest.raises(ValueError, match="k_scales: expected contiguous"):
        ks2 = cp.zeros((8, 2), cp.float32)
        mla_cupy.mla_prefill_fp8(*args(k_scales=ks2[:, :1]), vl, vl)
    with pytest.raises(ValueError, match="Hopper kernel only"):
        mla_cupy.mla_prefill_fp8(*args(), vl, vl, kernel="sm80")


def test_fp8_accuracy_report():
    """Error of the fp8 path against the dequantized reference and against bf16 attention of the
    ORIGINAL (unquantized) inputs, printed for the bench table."""
    import cupy as cp

    c = make_case([300, 129], [700, 129], 16, BF16, seed=11, cache_offsets=[400, 0])
    fq = quantized(c)
    got, _ = run_fp8(c, fq)
    ref_deq = reference.mla_prefill_fp8(fq["q_nope"], fq["q_rope"], fq["q_scale"], fq["k"], fq["k_scales"], fq["v"],
                                        fq["k_rope"], c.valid_length, c.cache_row_offsets, cache_offsets=c.cache_offsets)
    ref_orig = reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets,
                                     cache_offsets=c.cache_offsets)
    d = {n: cp.asarray(getattr(c, n)) for n in ("q", "k", "v", "k_rope", "valid_length", "cache_row_offsets", "cache_offsets")}
    bf16 = cp.asnumpy(mla_cupy.mla_prefill(d["q"], d["k"], d["v"], d["k_rope"], d["valid_length"], d["cache_row_offsets"],
                                           cache_offsets=d["cache_offsets"])).astype(np.float64)
    e_deq = max(per_slice_errors(got, ref_deq, c.valid_length))
    e_orig = max(per_slice_errors(got, ref_orig, c.valid_length))
    e_bf16 = max(per_slice_errors(bf16, ref_orig, c.valid_length))
    print(f"\nfp8 accuracy (worst per-slice relative error): vs dequantized reference {e_deq:.4f}; "
          f"vs original bf16 inputs {e_orig:.4f}; our bf16 kernel vs original {e_bf16:.4f}")
    assert e_deq < TOL
    assert e_orig < 0.1  # quantizing q, k, v adds error on top: reported, loosely bounded


# ------------------------------------------------------------------------------------------------
# fp8 rope: q, k, v bfloat16; k_rope e4m3 with one float32 scale per key (MAX's k_rope_scales).
# ------------------------------------------------------------------------------------------------

def run_fp8_rope(case, k_rope, k_rope_scales=None, mask=None, **kw):
    """mla_prefill with an fp8 rope (plain bytes + scales, or a PagedKVCache with scales), NaN-poisoned
    output; compared with the float64 reference of the dequantized rope. Returns the worst error."""
    import cupy as cp

    d = {n: None if getattr(case, n) is None else cp.asarray(getattr(case, n))
         for n in ("q", "k", "v", "valid_length", "cache_row_offsets", "cache_offsets", "q_start_pos")}
    out = cp.full((case.q.shape[0], case.q.shape[1], 128), np.nan, BF16)
    got, lse = mla_cupy.mla_prefill(d["q"], d["k"], d["v"], k_rope, d["valid_length"], d["cache_row_offsets"], mask=mask,
                                    cache_offsets=d["cache_offsets"], q_start_pos=d["q_start_pos"], out=out,
                                    return_lse=True, k_rope_scales=k_rope_scales, **kw)
    got = cp.asnumpy(got).astype(np.float64)
    r8, sc = quant.quantize_rope_blocks(case.k_rope)
    ref, ref_lse = reference.mla_prefill_fp8_rope(case.q, case.k, case.v, r8, sc, case.valid_length, case.cache_row_offsets,
                                                  mask=mask, cache_offsets=case.cache_offsets,
                                                  q_start_pos=case.q_start_pos, return_lse=True)
    assert not np.isnan(got).any(), f"{np.isnan(got).sum()} output elements unwritten or NaN"
    empty = np.isneginf(ref_lse)
    assert np.all(got[empty] == 0)
    np.testing.assert_array_equal(np.isneginf(cp.asnumpy(lse)), empty)
    errs = per_slice_errors(got, ref, case.valid_length)
    worst = max(errs) if errs else 0.0
    assert worst < 1e-2, f"worst per-slice relative error {worst:.3g}"  # only the rope is quantized (bf16 rounding)
    return worst


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("heads", [16, 128])
def test_fp8_rope_plain(mask, heads):
    import cupy as cp

    sq, sk = ([1, 7, 63, 65, 129, 0, 1000], [1, 7, 63, 65, 129, 5, 1000]) if heads == 16 else ([1, 7, 65, 129], [1, 7, 65, 200])
    c = make_case(sq, sk, heads, BF16, seed=heads + 3 * len(type(mask).__name__))
    r8, sc = quant.quantize_rope_blocks(c.k_rope)
    run_fp8_rope(c, cp.asarray(r8.view(np.uint8)), cp.asarray(sc), mask=mask)


@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("offsets", ["unaligned", "aligned"])
def test_fp8_rope_paged(page_size, offsets):
    """An fp8 paged cache (uint8 blocks, float32 scales [num_blocks, page_size, 1, Dc / 64]) gives the
    plain fp8 rope's result bit for bit; prefix context, shuffled pages."""
    import cupy as cp

    co = [5, 0, 1000] if offsets == "unaligned" else [0, 512, 1024]
    c = make_case([65, 1, 130], [300, 17, 700], 16, BF16, seed=page_size, cache_offsets=co)
    blocks8, lut, scales, r8, sc = build_paged_fp8_rope(c, page_size, seed=page_size)
    cache = PagedKVCache(cp.asarray(blocks8), cp.asarray(lut), page_size, scales=cp.asarray(scales))
    d = {n: None if getattr(c, n) is None else cp.asarray(getattr(c, n))
         for n in ("q", "k", "v", "valid_length", "cache_row_offsets", "cache_offsets")}
    plain = mla_cupy.mla_prefill(d["q"], d["k"], d["v"], cp.asarray(r8.view(np.uint8)), d["valid_length"],
                                 d["cache_row_offsets"], cache_offsets=d["cache_offsets"], k_rope_scales=cp.asarray(sc))
    paged = mla_cupy.mla_prefill(d["q"], d["k"], d["v"], cache, d["valid_length"], d["cache_row_offsets"],
                                 cache_offsets=d["cache_offsets"])
    np.testing.assert_array_equal(cp.asnumpy(paged).view(np.uint16), cp.asnumpy(plain).view(np.uint16))
    run_fp8_rope(c, cache)


def test_fp8_rope_needs_scales():
    import cupy as cp

    c = make_case([8], [8], 2, BF16, seed=2)
    r8, sc = quant.quantize_rope_blocks(c.k_rope)
    d = {n: cp.asarray(getattr(c, n)) for n in ("q", "k", "v", "valid_length", "cache_row_offsets")}
    with pytest.raises(ValueError, match="k_rope_scales: an fp8"):
        mla_cupy.mla_prefill(d["q"], d["k"], d["v"], cp.asarray(r8.view(np.uint8)), d["valid_length"], d["cache_row_offsets"])
    with pytest.raises(ValueError, match="Hopper kernel only"):
        mla_cupy.mla_prefill(d["q"], d["k"], d["v"], cp.asarray(r8.view(np.uint8)), d["valid_length"], d["cache_row_offsets"],
                             k_rope_scales=cp.asarray(sc), kernel="sm80")


# ------------------------------------------------------------------------------------------------
# Quantizer kernels (kernels/quantize.cu) against the host quantizers: bit for bit.
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("e4m3_rope", [False, True], ids=["bf16-rope", "e4m3-rope"])
@pytest.mark.parametrize("heads", [1, 16, 128])
def test_device_quantizers_equal_host(heads, e4m3_rope):
    import cupy as cp

    c = make_case([3, 70], [5, 200], heads, BF16, seed=heads)
    c.q[0] = 0  # an all-zero token: scale 1
    c.k[1, :, :5] = np.float32(3e4)  # large values
    c.k_rope[2] = np.float32(5e4)  # with e4m3_rope the rope decides key 2's scale
    c.k[3], c.k_rope[3] = 0, 0  # an all-zero key: scale 1
    host = quant.quantize_per_token(c.q, c.k, c.v, c.k_rope, e4m3_rope=e4m3_rope)
    dev = quant.quantize_per_token(cp.asarray(c.q), cp.asarray(c.k), cp.asarray(c.v), cp.asarray(c.k_rope),
                                   e4m3_rope=e4m3_rope)
    assert float(host["q_scale"][0, 0]) == 1.0
    for name, h in host.items():
        d = cp.asnumpy(dev[name])
        want = h.view(np.uint8) if h.dtype.itemsize == 1 else h
        assert d.dtype == want.dtype and d.shape == want.shape, name
        np.testing.assert_array_equal(d.view(np.uint8), np.ascontiguousarray(want).view(np.uint8), err_msg=name)
    r8, sc = quant.quantize_rope_blocks(c.k_rope)
    d8, dsc = quant.quantize_rope_blocks(cp.asarray(c.k_rope))
    np.testing.assert_array_equal(cp.asnumpy(d8), r8.view(np.uint8))
    np.testing.assert_array_equal(cp.asnumpy(dsc), sc)
    # strided input (a view of a wider array) gives the same bytes
    wide = cp.zeros((c.k.shape[0], heads, 256), BF16)
    wide[:, :, :128] = cp.asarray(c.k)
    d2 = quant.quantize_per_token(cp.asarray(c.q), wide[:, :, :128], cp.asarray(c.v), cp.asarray(c.k_rope),
                                  e4m3_rope=e4m3_rope)
    np.testing.assert_array_equal(cp.asnumpy(d2["k"]), host["k"].view(np.uint8))


def test_quantize_then_prefill_in_one_go():
    """bf16 device inputs -> device quantizers -> mla_prefill_fp8, against the dequantized reference."""
    import cupy as cp

    c = make_case([129, 40], [300, 40], 16, BF16, seed=5, cache_offsets=[0, 0])
    f = quant.quantize_per_token(cp.asarray(c.q), cp.asarray(c.k), cp.asarray(c.v), cp.asarray(c.k_rope))
    vl, cro, co = cp.asarray(c.valid_length), cp.asarray(c.cache_row_offsets), cp.asarray(c.cache_offsets)
    got = cp.asnumpy(mla_cupy.mla_prefill_fp8(f["q_nope"], f["q_rope"], f["q_scale"], f["k"], f["k_scales"], f["v"],
                                              f["k_rope"], vl, cro, cache_offsets=co)).astype(np.float64)
    h = {n: cp.asnumpy(a) for n, a in f.items()}
    ref = reference.mla_prefill_fp8(h["q_nope"], h["q_rope"], h["q_scale"], h["k"], h["k_scales"], h["v"], h["k_rope"],
                                    c.valid_length, c.cache_row_offsets, cache_offsets=c.cache_offsets)
    assert max(per_slice_errors(got, ref, c.valid_length)) < TOL


# ------------------------------------------------------------------------------------------------
# V^T: the pre-pass the per-token kernel reads (kernels/vt_layout.cuh, transpose_v.cu)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sk", [[0], [1, 0, 7, 63, 65, 129, 1000, 5], [16, 32, 17]], ids=["one-empty", "ragged", "aligned"])
def test_transpose_v_device_equals_host(sk):
    """The device pre-pass writes exactly the NumPy model's bytes (every column: keys, sigma order,
    zero gaps), also for a strided view of v and for B = 0."""
    import cupy as cp

    rng = np.random.default_rng(len(sk))
    tk, heads = sum(sk) + 3, 16  # 3 unused rows after the last sequence
    v = rng.integers(0, 256, (tk, heads, 128), dtype=np.uint8)  # every byte pattern, NaN (0x7f) too
    cro = np.concatenate([[0], np.cumsum(sk)]).astype(np.uint32)
    want = quant.transpose_v_host(v, cro)
    wide = cp.zeros((tk, heads, 256), cp.uint8)
    wide[:, :, :128] = cp.asarray(v)
    for dv in (cp.asarray(v), wide[:, :, :128]):
        got = quant.transpose_v(dv, cp.asarray(cro))
        assert got.shape == want.shape
        np.testing.assert_array_equal(cp.asnumpy(got), want)
    empty = quant.transpose_v(cp.asarray(v), cp.zeros(1, cp.uint32))  # B = 0: only zero columns
    assert empty.shape == (heads, 128, quant.vt_columns(tk, 0)) and not bool(empty.any())
    with pytest.raises(ValueError, match="cache_row_offsets: the last offset must be <="):
        quant.transpose_v(cp.asarray(v), cp.asarray(np.array([0, tk + 1], np.uint32)))


def test_fp8_nan_in_one_sequence_stays_there():
    """NaN bytes (0x7f) in the middle sequence's k and v never reach its neighbours: the V^T columns
    past a tile's keys are zeroed, the window mask's tiles rounded down to 16 keys stay inside the
    sequence. NaN positions and values as the reference's."""
    mask = SlidingWindowCausalMask(37)
    c = make_case([300, 100, 70], [300, 130, 70], 16, BF16, seed=41)
    fq = quantized(c)
    for n in ("k", "v"):
        fq[n].view(np.uint8)[300:430] = 0x7F
    got, lse = run_fp8(c, fq, mask=mask)
    ref, ref_lse = _ref_fp8(c, fq, mask)
    assert np.isfinite(got[:300]).all() and np.isfinite(got[400:]).all() and np.isnan(got[300:400]).any()
    assert_like_reference(got, ref, c.valid_length, tol=2 * TOL, got_lse=lse, ref_lse=ref_lse)


def _ref_fp8(c, fq, mask):
    return reference.mla_prefill_fp8(fq["q_nope"], fq["q_rope"], fq["q_scale"], fq["k"], fq["k_scales"], fq["v"],
                                     fq["k_rope"], c.valid_length, c.cache_row_offsets, mask=mask,
                                     cache_offsets=c.cache_offsets, q_start_pos=c.q_start_pos, return_lse=True)


@pytest.mark.parametrize("where", ["q_nope", "k", "k_scales", "k_rope", "v"])
def test_fp8_nan_reaches_what_the_reference_says(where):
    """One NaN in sequence 0's inputs: the kernel's NaN at the reference's places. For v, a key
    that only block 1's span rounded down to 16 keys holds (V^T's layout)."""
    mask = SlidingWindowCausalMask(37)
    c = make_case([300, 40], [420, 40], 16, BF16, seed=43, cache_offsets=[5, 0], q_start_pos=[-35, 0])
    fq = quantized(c)
    qp, kp = reference.positions(0, 300, 420, c.cache_offsets, c.q_start_pos)
    first = int(np.flatnonzero(mask.visible(qp[128:256, None], kp[None, :]).any(axis=0))[0])
    assert first % 16, "the span of block 1 must not start on a multiple of 16 keys"
    j, h, d = (first - 1, 3, 5) if where == "v" else (200, 3, 5)
    if where == "q_nope":
        fq["q_nope"].view(np.uint8)[170, h, d] = 0x7F
    elif where in ("k", "v"):
        fq[where].view(np.uint8)[j, h, d] = 0x7F
    elif where == "k_scales":
        fq["k_scales"][j, 0] = np.nan
    else:
        fq["k_rope"][j, 0, d] = np.nan
    got, lse = run_fp8(c, fq, mask=mask)
    ref, ref_lse = _ref_fp8(c, fq, mask)
    assert np.isnan(ref).any()
    assert_like_reference(got, ref, c.valid_length, tol=2 * TOL, got_lse=lse, ref_lse=ref_lse)


@pytest.mark.parametrize("e4m3_rope", [False, True], ids=["per-token", "all-e4m3"])
def test_fp8_causal_nan_in_v_reaches_what_the_reference_says(e4m3_rope):
    """Under the causal mask (three consumers: 192-row blocks counted from each sequence's end) a NaN
    in v at the reference's places: key 100 in head 1 (the block of rows 108..299 spans it, the
    part-filled first block of rows 0..107 does not) and key 257 in head 2 (the last key tile of that
    block, which only its last 64 rows see)."""
    mask = CausalMask()
    c = make_case([300, 40], [420, 40], 16, BF16, seed=47, cache_offsets=[5, 0], q_start_pos=[-35, 0])
    fq = quantized(c, e4m3_rope=e4m3_rope)
    fq["v"].view(np.uint8)[100, 1, 5] = 0x7F
    fq["v"].view(np.uint8)[257, 2, 5] = 0x7F
    got, lse = run_fp8(c, fq, mask=mask)
    ref, ref_lse = _ref_fp8(c, fq, mask)
    assert np.isnan(ref[:, 1]).any() and np.isnan(ref[:, 2]).any() and not np.isnan(ref[:108, 1]).any()
    assert_like_reference(got, ref, c.valid_length, tol=2 * TOL, got_lse=lse, ref_lse=ref_lse)


@pytest.mark.parametrize("e4m3_rope", [False, True], ids=["per-token", "all-e4m3"])
@pytest.mark.parametrize("mask", [NullMask(), CausalMask()], ids=lambda m: type(m).__name__)
def test_fp8_strided_out_only_its_elements(mask, e4m3_rope):
    """out a view into a wider buffer (other heads and columns around it): the fp8 kernels of three
    consumers store a consumer's 64 rows by TMA where all of them exist (out's map built from the
    view's strides), by the threads elsewhere; the view's elements are right and nothing around
    them is written. Lengths put whole and part-filled 64-row thirds of 192-row blocks side by side."""
    import cupy as cp

    c = make_case([64, 128, 192, 5, 256, 383, 1000], [64, 128, 192, 7, 256, 383, 1000], 16, BF16, seed=41)
    host = np.full((c.q.shape[0], 18, 136), 3.0, BF16)
    host[:, 1:17, 8:] = np.nan
    buf = cp.asarray(host)
    view = buf[:, 1:17, 8:]  # head stride 272 bytes, row stride 18 x 272, base 16 bytes in
    check_fp8(c, mask=mask, fq=quantized(c, e4m3_rope=e4m3_rope), out=view, tol=TOL_ANY_SLICE if e4m3_rope else TOL)
    around = cp.asnumpy(buf).astype(np.float64)
    around[:, 1:17, 8:] = 3.0
    assert np.all(around == 3.0), f"{int((around != 3.0).sum())} elements around the view written"


# The fp8 kernels read a key tile's scales in pairs where every sequence's first key row is even
# (mla_cupy.fp8.scale_pairs), one at a time elsewhere: the same shapes with even first key rows, and
# with the first sequence one key longer and the last one shorter (every later first row odd).
def parity_case(first, seed):
    return make_case([1, 7, 63, 65, 129, 0, 1000], [first, 8, 64, 66, 130, 6, 1001 - first], 16, BF16, seed=seed)


@pytest.mark.parametrize("e4m3_rope", [False, True], ids=["per-token", "all-e4m3"])
@pytest.mark.parametrize("mask", [NullMask(), CausalMask()], ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("first", [2, 3], ids=["even-rows", "odd-rows"])
def test_fp8_scale_pairs_by_key_row_parity(first, mask, e4m3_rope):
    import cupy as cp

    c = parity_case(first, seed=43 + first)
    fq = quantized(c, e4m3_rope=e4m3_rope)
    check_fp8(c, mask=mask, fq=fq)
    dev = on_device(fq)
    pl = mla_cupy.plan(cp.asarray(c.valid_length), cp.asarray(c.cache_row_offsets), num_heads=16, dtype=BF16,
                       mask=mask, fp8=True, fp8_rope=e4m3_rope)
    assert pl.scale_pairs is (first % 2 == 0)
    out = cp.full((c.q.shape[0], 16, 128), np.nan, BF16)
    pl.run_fp8(dev["q_nope"], dev["q_rope"], dev["q_scale"], dev["k"], dev["k_scales"], dev["v"], dev["k_rope"], out=out)
    one_shot, _ = run_fp8(c, fq, mask=mask)
    np.testing.assert_array_equal(cp.asnumpy(out).astype(np.float64), one_shot)  # the same kernel either way


def test_fp8_one_shot_takes_the_kernel_of_its_key_rows_each_call():
    """A one-shot call's launch record is kept under its offsets' pointers: offsets rewritten in
    place from even first key rows to odd ones (same shapes) take the kernel that reads the scales
    one at a time, since the host reads the offsets' values per call."""
    import cupy as cp

    vl, cro = None, None
    for first in (2, 3, 2):
        c = parity_case(first, seed=47 + first)
        fq = quantized(c)
        dev = on_device(fq)
        if cro is None:
            vl, cro = cp.asarray(c.valid_length), cp.asarray(c.cache_row_offsets)
        else:
            cro[...] = cp.asarray(c.cache_row_offsets)  # same pointer, new values
        out = cp.full((c.q.shape[0], 16, 128), np.nan, BF16)
        mla_cupy.mla_prefill_fp8(dev["q_nope"], dev["q_rope"], dev["q_scale"], dev["k"], dev["k_scales"], dev["v"],
                                 dev["k_rope"], vl, cro, out=out)
        ref = reference.mla_prefill_fp8(fq["q_nope"], fq["q_rope"], fq["q_scale"], fq["k"], fq["k_scales"], fq["v"],
                                        fq["k_rope"], c.valid_length, c.cache_row_offsets)
        assert_like_reference(cp.asnumpy(out).astype(np.float64), ref, c.valid_length, tol=TOL)


# ------------------------------------------------------------------------------------------------
# All e4m3: q_rope and k_rope e4m3 under the per-token scales, Q K^T one 192-deep e4m3 GEMM
# (VariantE4m3). The inputs: quant.quantize_per_token(..., e4m3_rope=True).
@pytest.mark.parametrize("e4m3_rope", [False, True], ids=["per-token", "all-e4m3"])
def test_fp8_cheapest_blocks_end_the_launch(e4m3_rope, monkeypatch):
    """The fp8 kernels' 192-row work tiles with the first query blocks pooled at the launch's end
    (test_gpu_prefill.py: test_cheapest_blocks_end_the_launch)."""
    from mla_cupy import _packing

    monkeypatch.setattr(_packing, "heads_per_section", lambda p, dev: 8)
    for sq, heads, seed in (([1400], 32, 61), ([1500, 901], 16, 62)):
        c = make_case(sq, sq, heads, BF16, seed=seed + e4m3_rope)
        assert pooled_blocks(c, 192, 8) >= 4, sq
        check_fp8(c, mask=CausalMask(), fq=quantized(c, e4m3_rope=e4m3_rope))


# ------------------------------------------------------------------------------------------------

def check_e4m3(case, mask=None, **kw):
    """check_fp8 on the all-e4m3 quantization of the case."""
    return check_fp8(case, mask=mask, fq=quantized(case, e4m3_rope=True), **kw)


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("heads", [16, 128])
def test_e4m3_every_mask_heads_odd_lengths(mask, heads):
    """Ragged batches with empty sequences (no queries, no keys) and lengths around the tiles."""
    sq, sk = ([1, 7, 0, 63, 65, 129, 0, 1000], [1, 7, 9, 63, 65, 129, 5, 1000]) if heads == 16 else \
        ([1, 7, 65, 0, 129], [1, 7, 65, 0, 200])
    check_e4m3(make_case(sq, sk, heads, BF16, seed=5 * heads + len(type(mask).__name__)), mask=mask)


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: type(m).__name__)
def test_e4m3_prefix_context_float32_out(mask):
    c = make_case([65, 100, 1, 33], [300, 1000, 129, 33], 16, BF16, seed=17, cache_offsets=[0, 77, 1000, 5])
    check_e4m3(c, mask=mask, out_dtype=np.float32, tol=TOL_ANY_SLICE)  # sequence 2: one query row


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: type(m).__name__)
def test_e4m3_long_part_filled_blocks(mask):
    c = make_case(LONG_FIRST_BLOCKS["sq"], LONG_FIRST_BLOCKS["sk"], 16, BF16, seed=37,
                  cache_offsets=LONG_FIRST_BLOCKS["cache_offsets"])
    check_e4m3(c, mask=mask)


def test_e4m3_rope_alone():
    """Zero nope parts: the scores are the rope part of Q K^T alone (the 64-byte-swizzled rope blocks
    and their 2 e4m3 k-steps). A failure here with the other e4m3 tests failing too points at the
    rope's tensor maps (64-byte swizzle) or wgmma descriptors (layout 2, SBO 512), kernels/sm90/ptx.cuh."""
    c = make_case([65, 200], [130, 300], 16, BF16, seed=23, cache_offsets=[0, 0])
    fq = quantized(c, e4m3_rope=True)
    fq["q_nope"][...] = 0
    fq["k"][...] = 0
    worst = check_fp8(c, mask=CausalMask(), fq=fq)
    # and the same rope as bfloat16 values through the fp8 per-token kernel (e4m3 values are exact
    # in bfloat16): the same scores up to the accumulation order
    bf = dict(fq, q_rope=fq["q_rope"].astype(np.float32).astype(BF16), k_rope=fq["k_rope"].astype(np.float32).astype(BF16))
    a, _ = run_fp8(c, fq, mask=CausalMask())
    b, _ = run_fp8(c, bf, mask=CausalMask())
    err = max(per_slice_errors(a, b, c.valid_length))
    assert err < 1e-2, f"e4m3 rope vs the same values as bf16 rope: worst per-slice difference {err:.3g} (tested {worst:.3g})"


# (queries, keys, cache offsets, the first call's keys of each sequence, tolerance, seed): short sequences,
# one of one query row (the contract's any-slice bound; measured 3.1% on an H200); and part-filled
# first query blocks that see 1000 keys or more in each call (LONG_FIRST_BLOCKS)
ACCUMULATE_CASES = {"short": ([65, 130, 1, 40], [300, 200, 17, 40], [0, 64, 3, 0], [100, 0, 17, 20], TOL_ANY_SLICE, 29),
                    "long-first-blocks": ([40, 250], [2000, 2100], [0, 64], [1000, 1100], TOL, 41)}


@pytest.mark.parametrize("name", list(ACCUMULATE_CASES))
def test_e4m3_lse_and_accumulate_over_two_key_sets(name):
    """Two calls over disjoint keys of each sequence merged with accumulate=True into a float32 out
    and lse, against the reference over all keys."""
    import cupy as cp

    from _fuzz import split_keys

    sq, sk, cache_offsets, first_keys, tol, seed = ACCUMULATE_CASES[name]
    mask = CausalMask()
    c = make_case(sq, sk, 16, BF16, seed=seed, cache_offsets=cache_offsets)
    fq = quantized(c, e4m3_rope=True)
    dev = on_device(fq)
    tq = c.q.shape[0]
    out = cp.full((tq, 16, 128), np.nan, cp.float32)
    lse = cp.full((tq, 16), np.nan, cp.float32)
    parts, q_start = split_keys(c, first_keys)
    for i, (rows, offsets, co) in enumerate(parts):
        r = cp.asarray(rows)
        mla_cupy.mla_prefill_fp8(dev["q_nope"], dev["q_rope"], dev["q_scale"], dev["k"][r], dev["k_scales"][r],
                                 dev["v"][r], dev["k_rope"][r], cp.asarray(c.valid_length), cp.asarray(offsets),
                                 mask=mask, cache_offsets=cp.asarray(co), q_start_pos=cp.asarray(q_start), out=out,
                                 lse=lse, accumulate=i > 0)
    ref, ref_lse = _ref_fp8(c, fq, mask)
    assert_like_reference(cp.asnumpy(out).astype(np.float64), ref, c.valid_length, tol=tol,
                          got_lse=cp.asnumpy(lse), ref_lse=ref_lse)


def test_e4m3_plan_equals_one_shot():
    """mla_cupy.plan(..., fp8=True, fp8_rope=True).run_fp8 gives the one-shot call's bits; a plan of
    one rope kind refuses the other."""
    import cupy as cp

    c = make_case([129, 40], [300, 40], 16, BF16, seed=31)
    dev = on_device(quantized(c, e4m3_rope=True))
    vl, cro = cp.asarray(c.valid_length), cp.asarray(c.cache_row_offsets)
    args = [dev[n] for n in ("q_nope", "q_rope", "q_scale", "k", "k_scales", "v", "k_rope")]
    one = mla_cupy.mla_prefill_fp8(*args, vl, cro, return_lse=True)
    pl = mla_cupy.plan(vl, cro, num_heads=16, dtype=BF16, fp8=True, fp8_rope=True, return_lse=True)
    got = pl.run_fp8(*args)
    for a, b in zip(got, one):
        np.testing.assert_array_equal(cp.asnumpy(a).view(np.uint8), cp.asnumpy(b).view(np.uint8))
    bf = on_device(quantized(c))
    with pytest.raises(TypeError, match="q_rope: the plan was built for e4m3"):
        pl.run_fp8(*[bf[n] for n in ("q_nope", "q_rope", "q_scale", "k", "k_scales", "v", "k_rope")])
    pl16 = mla_cupy.plan(vl, cro, num_heads=16, dtype=BF16, fp8=True)
    with pytest.raises(TypeError, match="q_rope: the plan was built for bfloat16"):
        pl16.run_fp8(*args)


def test_e4m3_rejects_bad_input():
    """Mixed rope dtypes, a paged e4m3 rope, an e4m3 rope through the 16-bit API: errors that name
    the argument."""
    import cupy as cp

    c = make_case([8], [8], 2, BF16, seed=37)
    e8, bf = on_device(quantized(c, e4m3_rope=True)), on_device(quantized(c))
    names = ("q_nope", "q_rope", "q_scale", "k", "k_scales", "v", "k_rope")
    vl = cp.asarray(c.valid_length)
    with pytest.raises(TypeError, match=r"k_rope: expected e4m3 bytes \(uint8\) like q_rope"):
        mla_cupy.mla_prefill_fp8(*[bf["k_rope"] if n == "k_rope" else e8[n] for n in names], vl, vl)
    with pytest.raises(TypeError, match="k_rope: expected bfloat16 like q_rope"):
        mla_cupy.mla_prefill_fp8(*[e8["k_rope"] if n == "k_rope" else bf[n] for n in names], vl, vl)
    blocks, lut = build_paged(c, 16)
    cache = PagedKVCache(cp.zeros(blocks.shape, cp.uint8), cp.asarray(lut), 16)
    with pytest.raises(ValueError, match="k_rope: an e4m3 rope under the per-token scales .* PagedKVCache is not supported"):
        mla_cupy.mla_prefill_fp8(*[cache if n == "k_rope" else e8[n] for n in names], vl, vl)
    d = {n: cp.asarray(getattr(c, n)) for n in ("q", "k", "v")}
    with pytest.raises(ValueError, match="k_rope_scales: an fp8"):  # the 16-bit API reads an e4m3 rope with scales only
        mla_cupy.mla_prefill(d["q"], d["k"], d["v"], e8["k_rope"], vl, vl)


@pytest.mark.parametrize("where", ["q_rope", "k_rope"])
def test_e4m3_nan_in_the_rope_reaches_what_the_reference_says(where):
    """A NaN byte (0x7f) in an e4m3 rope: the kernel's NaN at the reference's places (a key's rope:
    every head's rows that see the key; a query's: its own row and head)."""
    mask = SlidingWindowCausalMask(37)
    c = make_case([300, 40], [420, 40], 16, BF16, seed=43, cache_offsets=[5, 0], q_start_pos=[-35, 0])
    fq = quantized(c, e4m3_rope=True)
    if where == "q_rope":
        fq["q_rope"].view(np.uint8)[170, 3, 5] = 0x7F
    else:
        fq["k_rope"].view(np.uint8)[200, 0, 5] = 0x7F
    got, lse = run_fp8(c, fq, mask=mask)
    ref, ref_lse = _ref_fp8(c, fq, mask)
    assert np.isnan(ref).any()
    assert_like_reference(got, ref, c.valid_length, tol=2 * TOL, got_lse=lse, ref_lse=ref_lse)


def test_e4m3_accuracy_report():
    """Error of the all-e4m3 mode against its dequantized reference and against bf16 attention of
    the original inputs, beside the fp8 per-token mode's (bf16 rope), printed for the bench table."""
    c = make_case([300, 129], [700, 129], 16, BF16, seed=11, cache_offsets=[400, 0])
    ref_orig = reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets,
                                     cache_offsets=c.cache_offsets)
    line = []
    for e4m3 in (False, True):
        fq = quantized(c, e4m3_rope=e4m3)
        got, _ = run_fp8(c, fq)
        e_deq = max(per_slice_errors(got, _ref_fp8(c, fq, None)[0], c.valid_length))
        e_orig = max(per_slice_errors(got, ref_orig, c.valid_length))
        line.append(f"{'e4m3 rope' if e4m3 else 'bf16 rope'}: vs dequantized {e_deq:.4f}, vs original {e_orig:.4f}")
        assert e_deq < TOL and e_orig < 0.1
    print("\nfp8 per-token accuracy (worst per-slice relative error): " + "; ".join(line))


# ------------------------------------------------------------------------------------------------
# V^T made by the quantizer (quantize_per_token(..., cache_row_offsets=)): the call launches the
# kernel alone on it, with the same bits as with the per-call pre-pass.
# ------------------------------------------------------------------------------------------------

VT_SK = [0, 1, 63, 130, 0, 17, 300]  # ragged, empty sequences, unaligned starts
VT_SQ = [3, 1, 40, 129, 2, 17, 64]


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16), np.dtype(np.float32)], ids=["bf16", "fp16", "f32"])
@pytest.mark.parametrize("e4m3_rope", [False, True], ids=["bf16-rope", "e4m3-rope"])
@pytest.mark.parametrize("heads", [1, 16, 128])
def test_device_quantizers_vt_equals_host(heads, e4m3_rope, dtype):
    """The kernel that casts V writes V^T too: its "v" and "v_t" equal the host quantizer's bit
    for bit (and "v" equals the quantizer's without offsets), for aligned and misaligned views of v
    (16-byte and element loads), rows past the last sequence, B = 0 and host offsets."""
    import cupy as cp

    c = make_case(VT_SQ, VT_SK, heads, BF16, seed=heads, extra_keys=5)
    c.v[2, :, :3] = np.float32(1e4)  # saturates to 448
    v = c.v.astype(dtype)
    host = quant.quantize_per_token(c.q, c.k, v, c.k_rope, e4m3_rope=e4m3_rope, cache_row_offsets=c.cache_row_offsets)
    want_v, want_vt = host["v"].view(np.uint8), host["v_t"].data
    cro = cp.asarray(c.cache_row_offsets)
    dq, dk, dr = (cp.asarray(x) for x in (c.q, c.k, c.k_rope))
    wide = cp.zeros((v.shape[0], heads, 136), dtype)
    wide[:, :, 1:129] = cp.asarray(v)
    for dv in (cp.asarray(v), wide[:, :, 1:129]):  # 16-byte aligned, and not
        d = quant.quantize_per_token(dq, dk, dv, dr, e4m3_rope=e4m3_rope, cache_row_offsets=cro)
        np.testing.assert_array_equal(cp.asnumpy(d["v"]), want_v)
        tv = d["v_t"]
        assert tv.cache_row_offsets is cro and tv.num_keys == v.shape[0] and tv.batch == len(VT_SK)
        np.testing.assert_array_equal(cp.asnumpy(tv.data), want_vt)
        plain = quant.quantize_per_token(dq, dk, dv, dr, e4m3_rope=e4m3_rope)
        np.testing.assert_array_equal(cp.asnumpy(plain["v"]), want_v)
    d = quant.quantize_per_token(dq, dk, cp.asarray(v), dr, cache_row_offsets=c.cache_row_offsets)  # host offsets
    np.testing.assert_array_equal(cp.asnumpy(d["v_t"].data), want_vt)
    none = quant.quantize_per_token(dq, dk, cp.asarray(v), dr, cache_row_offsets=cp.zeros(1, cp.uint32))  # B = 0
    np.testing.assert_array_equal(cp.asnumpy(none["v"]), want_v)
    assert not bool(none["v_t"].data.any())


def _bits(x):
    import cupy as cp

    return cp.asnumpy(x).view(np.uint8)


@pytest.mark.parametrize("e4m3_rope", [False, True], ids=["bf16-rope", "e4m3-rope"])
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("heads", [16, 128])
def test_prefill_with_the_quantizers_vt_equals_the_pre_pass(heads, mask, e4m3_rope):
    """One-shot and plan runs given the quantizer's V^T give the bits (out and lse) of the same
    call with v (the per-call pre-pass), over masks, ragged batches with empty sequences, both
    rope modes; and the float64 reference's accuracy."""
    import cupy as cp

    c = make_case(VT_SQ, VT_SK, heads, BF16, seed=7 + heads)
    vl, cro = cp.asarray(c.valid_length), cp.asarray(c.cache_row_offsets)
    f = quant.quantize_per_token(*(cp.asarray(x) for x in (c.q, c.k, c.v, c.k_rope)), e4m3_rope=e4m3_rope,
                                 cache_row_offsets=cro)
    head = [f[n] for n in ("q_nope", "q_rope", "q_scale", "k", "k_scales")]
    want = mla_cupy.mla_prefill_fp8(*head, f["v"], f["k_rope"], vl, cro, mask=mask, return_lse=True)
    for _ in range(2):  # packed, then from the plan cache
        got = mla_cupy.mla_prefill_fp8(*head, f["v_t"], f["k_rope"], vl, cro, mask=mask, return_lse=True)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(_bits(a), _bits(b))
    pl = mla_cupy.plan(vl, cro, num_heads=heads, dtype=BF16, mask=mask, fp8=True, fp8_rope=e4m3_rope,
                       return_lse=True)
    for _ in range(2):
        got = pl.run_fp8(*head, f["v_t"], f["k_rope"])
        for a, b in zip(got, want):
            np.testing.assert_array_equal(_bits(a), _bits(b))
    h = {n: cp.asnumpy(f[n]) for n in ("q_nope", "q_rope", "q_scale", "k", "k_scales", "v", "k_rope")}
    ref = reference.mla_prefill_fp8(*(h[n] for n in ("q_nope", "q_rope", "q_scale", "k", "k_scales", "v", "k_rope")),
                                    c.valid_length, c.cache_row_offsets, mask=mask)
    assert max(per_slice_errors(cp.asnumpy(want[0]).astype(np.float64), ref, c.valid_length)) < TOL_ANY_SLICE


def test_torch_op_with_the_quantizers_vt_equals_the_pre_pass():
    """The torch op (eager, and through torch.compile) given a TransposedV: the bits of the call
    with v."""
    import cupy as cp

    torch = pytest.importorskip("torch")
    ops = pytest.importorskip("mla_cupy.torch_ops")
    c = make_case(VT_SQ, VT_SK, 16, BF16, seed=3)
    vl, cro = (torch.tensor(x.astype(np.int32), device="cuda") for x in (c.valid_length, c.cache_row_offsets))
    f = quant.quantize_per_token(*(cp.asarray(x) for x in (c.q, c.k, c.v, c.k_rope)), cache_row_offsets=cro)
    assert f["v_t"].cache_row_offsets is cro

    def tensor(x):  # through the host: bfloat16 as its bits
        h = cp.asnumpy(x)
        if h.dtype == BF16:
            return torch.from_numpy(h.view(np.int16)).view(torch.bfloat16).cuda()
        return torch.from_numpy(h).cuda()

    t = {n: tensor(f[n]) for n in ("q_nope", "q_rope", "q_scale", "k", "k_scales", "v", "k_rope")}
    head = [t[n] for n in ("q_nope", "q_rope", "q_scale", "k", "k_scales")]
    want = ops.mla_prefill_fp8(*head, t["v"], t["k_rope"], vl, cro, return_lse=True)
    got = ops.mla_prefill_fp8(*head, f["v_t"], t["k_rope"], vl, cro, return_lse=True)  # CuPy uint8 data, viewed
    tv = TransposedV(tensor(f["v_t"].data), cro, f["v_t"].num_keys)  # tensors: what a graph takes
    compiled = torch.compile(lambda *a: ops.mla_prefill_fp8(*a, return_lse=True), fullgraph=True)
    got_c = compiled(*head, tv, t["k_rope"], vl, cro)
    for g in (got, got_c):
        for a, b in zip(g, want):
            assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                               b.view(torch.int16) if b.dtype == torch.bfloat16 else b)

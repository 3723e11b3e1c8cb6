"""The float64 reference against a direct per-(sequence, head, query) implementation written here
independently of mla_cupy (plain Python loops over keys, its own mask predicates)."""
import math

import numpy as np
import pytest

from mla_cupy import reference
from mla_cupy.masks import CausalMask, ChunkedCausalMask, ChunkedMask, NullMask, SlidingWindowCausalMask
from mla_cupy.paged import PagedKVCache

from _cases import BF16, FP16, make_case


def _visible(kind, arg, qp, kp):
    if kind == "null":
        return True
    if kind == "causal":
        return kp <= qp
    if kind == "window":
        return kp <= qp and qp - kp < arg
    if kind == "chunked":
        return math.floor(qp / arg) == math.floor(kp / arg)
    if kind == "chunked_causal":
        return kp <= qp and math.floor(qp / arg) == math.floor(kp / arg)
    raise AssertionError(kind)


def naive(c, kind, arg, scale):
    q, k, v, r = (np.asarray(x, np.float64) for x in (c.q, c.k, c.v, c.k_rope))
    vl, cro = c.valid_length.astype(int), c.cache_row_offsets.astype(int)
    tq, H = q.shape[:2]
    out = np.full((tq, H, 128), np.nan)
    lse = np.full((tq, H), np.nan)
    for b in range(len(vl) - 1):
        sq, sk = vl[b + 1] - vl[b], cro[b + 1] - cro[b]
        k0 = 0 if c.cache_offsets is None else int(c.cache_offsets[b])
        q0 = k0 + sk - sq if c.q_start_pos is None else int(c.q_start_pos[b])
        for h in range(H):
            for i in range(sq):
                qi = q[vl[b] + i, h]
                scores, vals = [], []
                for j in range(sk):
                    if not _visible(kind, arg, q0 + i, k0 + j):
                        continue
                    key = np.concatenate([k[cro[b] + j, h], r[cro[b] + j, 0]])
                    scores.append(scale * float(qi @ key))
                    vals.append(v[cro[b] + j, h])
                if not scores:
                    out[vl[b] + i, h] = 0.0
                    lse[vl[b] + i, h] = -np.inf
                    continue
                m = max(scores)
                w = np.exp(np.array(scores) - m)
                out[vl[b] + i, h] = (w[:, None] * np.array(vals)).sum(0) / w.sum()
                lse[vl[b] + i, h] = m + math.log(w.sum())
    return out, lse


MASK_CASES = [
    ("null", 0, NullMask()),
    ("causal", 0, CausalMask()),
    ("window", 5, SlidingWindowCausalMask(5)),
    ("chunked", 4, ChunkedMask(4)),
    ("chunked_causal", 3, ChunkedCausalMask(3)),
]


@pytest.mark.parametrize("kind,arg,mask", MASK_CASES, ids=[m[0] for m in MASK_CASES])
@pytest.mark.parametrize(
    "sq,sk,co,qs",
    [
        ([7, 1, 0, 9], [7, 4, 3, 0], None, None),       # Sq > Sk, empty sequences
        ([3, 5], [11, 9], [20, 0], None),                # prefix context with cache offsets
        ([6, 4], [6, 10], [2, 7], [-3, 12]),             # explicit (negative) query positions
    ],
)
def test_reference_matches_naive(kind, arg, mask, sq, sk, co, qs):
    c = make_case(sq, sk, heads=2, dtype=np.float64, seed=len(sq) * 7 + sum(sk), cache_offsets=co, q_start_pos=qs)
    scale = 0.11
    out, lse = reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets, scale=scale,
                                     mask=mask, cache_offsets=c.cache_offsets, q_start_pos=c.q_start_pos,
                                     return_lse=True)
    want_out, want_lse = naive(c, kind, arg, scale)
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=1e-10)


def test_rows_without_keys_are_zero():
    c = make_case([4], [4], heads=1, dtype=np.float64, seed=3, q_start_pos=[-10])
    out, lse = reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets,
                                     q_start_pos=c.q_start_pos, return_lse=True)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


def test_default_scale_and_dtypes():
    c = make_case([5, 3], [6, 3], heads=3, dtype=BF16, seed=11)
    out = reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets)
    want, _ = naive(c, "causal", 0, 1 / math.sqrt(192))
    np.testing.assert_allclose(out, want, rtol=1e-9, atol=1e-12)
    assert out.dtype == np.float64
    out16 = reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets, out_dtype=FP16)
    assert out16.dtype == FP16


def test_paged_reference_equals_plain():
    """The paged layout gathers the same rope rows as the plain array (shuffled pages)."""
    rng = np.random.default_rng(5)
    c = make_case([5, 9], [40, 23], heads=2, dtype=np.float64, seed=9, cache_offsets=[3, 16])
    ps, dc = 16, 576
    co = c.cache_offsets.astype(int)
    sk = np.diff(c.cache_row_offsets.astype(int))
    pages = [(co[b] + sk[b] + ps - 1) // ps for b in range(2)]
    nblocks = sum(pages) + 3
    perm = rng.permutation(nblocks)
    blocks = rng.standard_normal((nblocks, ps, 1, dc))
    lut = np.zeros((2, max(pages)), np.int32)
    used = 0
    for b in range(2):
        for p in range(pages[b]):
            lut[b, p] = perm[used]
            used += 1
        for j in range(sk[b]):
            t = co[b] + j
            blocks[lut[b, t // ps], t % ps, 0, 512:576] = c.k_rope[c.cache_row_offsets[b] + j, 0]
    cache = PagedKVCache(blocks, lut, ps)
    a = reference.mla_prefill(c.q, c.k, c.v, cache, c.valid_length, c.cache_row_offsets, cache_offsets=c.cache_offsets)
    b = reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets, cache_offsets=c.cache_offsets)
    np.testing.assert_array_equal(a, b)


def test_visible_pairs_counts():
    vl = np.array([0, 4], np.uint32)
    cro = np.array([0, 4], np.uint32)
    assert reference.visible_pairs(vl, cro, CausalMask()) == 10
    assert reference.visible_pairs(vl, cro, NullMask()) == 16
    assert reference.visible_pairs(vl, cro, SlidingWindowCausalMask(2)) == 7
    assert reference.visible_pairs(vl, cro, ChunkedMask(2)) == 8
    assert reference.visible_pairs(vl, cro, ChunkedCausalMask(2)) == 6
    # Sq < Sk: queries at the end (positions 2, 3 of keys 0..3): 3 + 4 causal pairs.
    assert reference.visible_pairs(np.array([0, 2], np.uint32), cro, CausalMask()) == 7


@pytest.mark.parametrize("mask", [NullMask(), CausalMask(), SlidingWindowCausalMask(1), SlidingWindowCausalMask(37),
                                  ChunkedMask(1), ChunkedMask(50), ChunkedCausalMask(7)], ids=lambda m: repr(m))
def test_every_mask_sees_one_interval_of_keys(mask):
    """The kernels store a row's visible keys as one interval [lo, hi) (kernels/mask.cuh); that
    needs every mask to see, from one query, a contiguous run of key positions."""
    ks = np.arange(-300, 300)
    for q in range(-120, 121, 7):
        idx = np.flatnonzero(mask.visible(np.int64(q), ks))
        assert idx.size == 0 or idx[-1] - idx[0] + 1 == idx.size, f"q={q}: visible keys are not one interval"


def test_fp8_reference_reads_e4m3_rope_bytes_as_e4m3():
    """All of Q K^T in e4m3: uint8 rope bytes are decoded as e4m3 (with the per-token scales over
    all 192 values), never read as integers."""
    from mla_cupy._arrays import FP8_E4M3

    rng = np.random.default_rng(3)
    tq, tk, h = 9, 14, 2
    def e4m3(*shape):
        return (rng.standard_normal(shape) * 8).astype(FP8_E4M3)
    qn, qr, kn, kr, v = e4m3(tq, h, 128), e4m3(tq, h, 64), e4m3(tk, h, 128), e4m3(tk, 1, 64), e4m3(tk, h, 128)
    qs = rng.uniform(0.01, 0.1, (tq, 1)).astype(np.float32)
    ks = rng.uniform(0.01, 0.1, (tk, 1)).astype(np.float32)
    vl = np.array([0, 4, tq], np.uint32)
    cro = np.array([0, 6, tk], np.uint32)
    got = reference.mla_prefill_fp8(qn.view(np.uint8), qr.view(np.uint8), qs, kn.view(np.uint8), ks, v.view(np.uint8),
                                    kr.view(np.uint8), vl, cro)
    f = lambda x: x.astype(np.float64)
    q_true = qs[:, :, None] * np.concatenate([f(qn), f(qr)], axis=-1)
    want = reference.mla_prefill(q_true, ks[:, :, None] * f(kn), f(v), ks[:, :, None] * f(kr), vl, cro)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # the same bytes read as integers would give another answer
    wrong = reference.mla_prefill(qs[:, :, None] * np.concatenate([f(qn), qr.view(np.uint8).astype(np.float64)], -1),
                                  ks[:, :, None] * f(kn), f(v), ks[:, :, None] * kr.view(np.uint8).astype(np.float64),
                                  vl, cro)
    assert np.abs(wrong - want).max() > 1e-3

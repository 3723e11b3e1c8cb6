"""The float64 reference against a direct per-(sequence, head, query) implementation written here
independently of mla_cupy (plain Python loops over keys, its own mask predicates)."""
import dataclasses
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
    "sq,sk,co,q_start",
    [
        ([7, 1, 0, 9], [7, 4, 3, 0], None, None),       # Sq > Sk, empty sequences
        ([3, 5], [11, 9], [20, 0], None),                # prefix context with cache offsets
        ([6, 4], [6, 10], [2, 7], [-3, 12]),             # explicit (negative) query positions
    ],
)
def test_reference_matches_naive(kind, arg, mask, sq, sk, co, q_start):
    c = make_case(sq, sk, heads=2, dtype=np.float64, seed=len(sq) * 7 + sum(sk), cache_offsets=co, q_start_pos=q_start)
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
    out16 = reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets, out_dtype=BF16)
    assert out16.dtype == BF16
    with pytest.raises(TypeError, match=r"^out_dtype: expected bfloat16 \(the dtype of q\) or float32 or float64, got "
                                        r"float16$"):  # what the kernels refuse (tests/test_reference_checks.py)
        reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets, out_dtype=FP16)


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



@pytest.mark.parametrize("mask", [NullMask(), CausalMask(), SlidingWindowCausalMask(1), SlidingWindowCausalMask(37),
                                  ChunkedMask(1), ChunkedMask(50), ChunkedCausalMask(7)], ids=lambda m: repr(m))
def test_key_range_is_the_visible_interval(mask):
    """key_range(q, q) is exactly one query's visible keys; key_range(q_lo, q_hi) holds every key a
    query in [q_lo, q_hi] sees, and no key outside the hull of theirs."""
    ks = np.arange(-300, 300)
    for q in range(-120, 121, 7):
        lo, hi = (int(x) for x in mask.key_range(np.int64(q), np.int64(q)))
        np.testing.assert_array_equal(mask.visible(np.int64(q), ks), (ks >= lo) & (ks < hi))
    for q_lo, q_hi in [(-50, -3), (-10, 40), (7, 7), (0, 127), (60, 121)]:
        lo, hi = (int(x) for x in mask.key_range(np.int64(q_lo), np.int64(q_hi)))
        seen = mask.visible(np.arange(q_lo, q_hi + 1)[:, None], ks[None, :]).any(axis=0)
        np.testing.assert_array_equal(seen, seen & (ks >= lo) & (ks < hi))
        idx = np.flatnonzero(seen)
        assert (lo, hi) == (ks[idx[0]], ks[idx[-1]] + 1) or (lo < -300 or hi > 300), (q_lo, q_hi, lo, hi)


# ------------------------------------------------------------------------------------------------
# NaN and Inf: where the contract says they reach, with its rule written out here independently

KINDS = {type(m).__name__: (kind, arg) for kind, arg, m in MASK_CASES}
NAN_MASKS = [NullMask(), CausalMask(), SlidingWindowCausalMask(37), ChunkedMask(50), ChunkedCausalMask(20)]


def _visible_np(mask, qp, kp):
    """The mask predicates of the contract, vectorized, written here (not mla_cupy's)."""
    causal = kp <= qp
    if isinstance(mask, NullMask):
        return np.ones(np.broadcast_shapes(qp.shape, kp.shape), bool)
    if isinstance(mask, SlidingWindowCausalMask):
        return causal & (qp - kp < mask.window)
    if isinstance(mask, ChunkedMask):
        return np.floor_divide(qp, mask.chunk) == np.floor_divide(kp, mask.chunk)
    if isinstance(mask, ChunkedCausalMask):
        return causal & (np.floor_divide(qp, mask.chunk) == np.floor_divide(kp, mask.chunk))
    assert isinstance(mask, CausalMask)
    return causal


def seq_visible(c, mask, b):
    """[Sq, Sk] visible pairs of sequence b (positions as the contract defines them)."""
    vl, cro = c.valid_length.astype(int), c.cache_row_offsets.astype(int)
    sq, sk = vl[b + 1] - vl[b], cro[b + 1] - cro[b]
    k0 = 0 if c.cache_offsets is None else int(c.cache_offsets[b])
    q0 = k0 + sk - sq if c.q_start_pos is None else int(c.q_start_pos[b])
    return _visible_np(mask, (q0 + np.arange(sq))[:, None], (k0 + np.arange(sk))[None, :])


def reach_of_v(c, mask, j, key_align=1, half_tiles=True, block=128, end_aligned=False, skip_tail=False):
    """Rows of sequence 0 a NaN in key j's v reaches: every row of each ``block``-row block whose
    span of visible keys (its start rounded down to key_align) holds key j; the blocks counted from
    the sequence's end with end_aligned (one block keeps its rows at its start). In each 64-row group
    of a block the span may end early: with half_tiles (the 16-bit variants) at the middle of its
    last 128-key tile when the group's last row would see no key position at or past it; with
    skip_tail (the fp8 variants built so) at the end of the 128-key tile that holds the group's
    last row's last visible key (the first tile if it sees none)."""
    vis = seq_visible(c, mask, 0)
    sq = vis.shape[0]
    k0 = 0 if c.cache_offsets is None else int(c.cache_offsets[0])
    q0 = k0 + vis.shape[1] - sq if c.q_start_pos is None else int(c.q_start_pos[0])
    rows = np.zeros(sq, bool)
    first = sq - -(-sq // block) * block if end_aligned and sq > block else 0
    for m0 in range(first, sq, block):
        cols = np.flatnonzero(vis[max(m0, 0):m0 + block].any(axis=0))
        if not cols.size:
            continue
        begin, end = cols[0] - cols[0] % key_align, cols[-1] + 1
        cut = begin + (-(-(end - begin) // 128) - 1) * 128 + 64
        for h0 in range(m0, m0 + block, 64):
            g0, g1 = max(h0, 0), min(h0 + 64, sq)
            if g0 >= g1:
                continue
            stop = end
            if half_tiles and not _visible_np(mask, np.int64(q0 + g1 - 1), k0 + cut + np.arange(4096)).any():
                stop = min(end, cut)
            if skip_tail:
                seen = np.flatnonzero(vis[g1 - 1])
                tiles = max(1, -(-(int(seen[-1]) + 1 - begin) // 128)) if seen.size else 1
                stop = min(end, begin + 128 * tiles)
            if begin <= j < stop:
                rows[g0:g1] = True
    return rows


def nan_case(seed=21, dtype=np.float64):
    """Sequence 0: 420 keys from position 5 and 300 queries from position -35 (q_start_pos), so
    that under causal masks rows 0..39 see no key; sequence 1: 40 and 40. Three heads."""
    return make_case([300, 40], [420, 40], heads=3, dtype=dtype, seed=seed, cache_offsets=[5, 0],
                     q_start_pos=[-35, 0])


def run_ref(c, mask, **kw):
    return reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets, mask=mask,
                                 cache_offsets=c.cache_offsets, q_start_pos=c.q_start_pos, return_lse=True, **kw)


def assert_reach(out, lse, clean_out, clean_lse, rows_heads, cols=slice(None), lse_nan=True):
    """NaN exactly at rows_heads ([Tq, H] bool) in out[..., cols] (and lse when lse_nan); every
    other value equal to the clean run's."""
    if isinstance(cols, int):
        np.testing.assert_array_equal(np.isnan(out[:, :, cols]), rows_heads)
    else:
        np.testing.assert_array_equal(np.isnan(out).any(axis=-1), rows_heads)
        assert np.isnan(out[rows_heads]).all()
    keep = ~np.isnan(out)
    np.testing.assert_allclose(out[keep], clean_out[keep], rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(np.isnan(lse), rows_heads if lse_nan else np.zeros_like(rows_heads))
    fin = ~np.isnan(lse)
    np.testing.assert_allclose(lse[fin], clean_lse[fin], rtol=1e-12)


@pytest.mark.parametrize("mask", NAN_MASKS, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("where", ["q_nope", "q_rope", "k", "k_rope", "v"])
def test_nan_reaches_what_the_contract_says(mask, where):
    """A NaN in q row i reaches row i (of its head, if it sees a key); in key j's k (one head) or
    rope (every head) the rows that see key j; in key j's v every row of each 128-row block whose
    span holds j (reach_of_v: but for the half-tile cut). Never the other sequence, never another head."""
    c = nan_case()
    clean_out, clean_lse = run_ref(c, mask)
    vis = seq_visible(c, mask, 0)
    i, j, h, d = 170, 200, 1, 5   # query row 170 and key 200 of sequence 0
    want = np.zeros(clean_lse.shape, bool)
    cols = slice(None)
    if where == "q_nope":
        c.q[i, h, d] = np.nan
        want[i, h] = vis[i].any()
    elif where == "q_rope":
        c.q[i, h, 128 + d] = np.nan
        want[i, h] = vis[i].any()
    elif where == "k":
        c.k[j, h, d] = np.nan
        want[:300, h] = vis[:, j]
    elif where == "k_rope":
        c.k_rope[j, 0, d] = np.nan
        want[:300, :] = vis[:, j][:, None]
    else:
        c.v[j, h, d] = np.nan
        want[:300, h] = reach_of_v(c, mask, j)
        cols = d
        if not isinstance(mask, NullMask):  # the block rule reaches rows that do not see key j
            assert want[:300, h].sum() > vis[:, j].sum()
    assert want.any()
    out, lse = run_ref(c, mask)
    assert_reach(out, lse, clean_out, clean_lse, want, cols, lse_nan=where != "v")


@pytest.mark.parametrize("mask", [CausalMask(), SlidingWindowCausalMask(37)], ids=lambda m: type(m).__name__)
def test_nan_in_v_reaches_rows_that_see_no_key_in_its_block(mask):
    """Rows 0..39 of sequence 0 sit before every key (output 0, lse -inf); a NaN in the v of a key
    inside block 0's span makes them NaN too (0 * NaN), their lse stays -inf."""
    c = nan_case()
    clean_out, clean_lse = run_ref(c, mask)
    vis = seq_visible(c, mask, 0)
    assert not vis[:40].any() and np.all(clean_out[:40] == 0) and np.isneginf(clean_lse[:40]).all()
    j = int(np.flatnonzero(vis[:128].any(axis=0))[0])
    c.v[j, 2, 0] = np.nan
    out, lse = run_ref(c, mask)
    assert np.isnan(out[:128, 2, 0]).all() and np.isneginf(lse[:40]).all()
    assert not np.isnan(out[:, [0, 1]]).any()


def test_nan_never_leaves_its_sequence():
    c = nan_case()
    clean_out, clean_lse = run_ref(c, NullMask())
    for a in (c.q[:300], c.k[:420], c.v[:420], c.k_rope[:420]):
        a[...] = np.nan
    out, lse = run_ref(c, NullMask())
    assert np.isnan(out[:300]).all()
    np.testing.assert_array_equal(out[300:], clean_out[300:])
    np.testing.assert_array_equal(lse[300:], clean_lse[300:])


def test_inf_in_v_is_inf_where_seen_and_nan_where_multiplied_by_zero():
    c = nan_case()
    mask = CausalMask()
    clean_out, _ = run_ref(c, mask)
    vis = seq_visible(c, mask, 0)
    j, h, d = 200, 0, 9
    c.v[j, h, d] = -np.inf
    out, _ = run_ref(c, mask)
    sees, reach = vis[:, j], reach_of_v(c, mask, j)
    assert np.all(out[:300, h, d][sees] == -np.inf)
    assert np.isnan(out[:300, h, d][reach & ~sees]).all() and (reach & ~sees).any()
    np.testing.assert_array_equal(out[:300, h, d][~reach], clean_out[:300, h, d][~reach])
    assert np.isfinite(np.delete(out, d, axis=2)).all()


def test_inf_in_a_score_minus_inf_weighs_nothing_plus_inf_is_nan():
    """-inf in key j's rope: a visible score of -inf (q_rope > 0 there) takes key j out of the
    softmax, as if masked; +inf (q_rope < 0) makes the row NaN."""
    c = make_case([12], [12], heads=2, dtype=np.float64, seed=4)
    j, d = 3, 7
    c.k_rope[j, 0, d] = -np.inf
    out = reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets, mask=CausalMask())
    sees = np.arange(12) >= j
    for h in range(2):
        plus = sees & (c.q[:, h, 128 + d] < 0)
        assert plus.any() and (sees & ~plus).any()
        assert np.isnan(out[plus, h]).all()
        for i in np.flatnonzero(~plus):  # the softmax over the other visible keys
            keys = [t for t in range(i + 1) if t != j]
            s = np.array([c.q[i, h] @ np.concatenate([c.k[t, h], c.k_rope[t, 0]]) for t in keys]) / math.sqrt(192)
            w = np.exp(s - s.max())
            np.testing.assert_allclose(out[i, h], (w[:, None] * c.v[keys, h]).sum(0) / w.sum(), rtol=1e-10)


def test_a_row_of_minus_inf_scores_is_zero_like_a_row_that_sees_nothing():
    c = make_case([6], [6], heads=2, dtype=np.float64, seed=5)
    c.q[4, 1] = 0.0
    c.q[4, 1, 0] = np.inf
    c.k[:, 1, 0] = -1.0  # every score of row 4, head 1 is -inf
    out, lse = reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets, return_lse=True)
    assert np.all(out[4, 1] == 0) and np.isneginf(lse[4, 1])
    assert np.isfinite(out).all() and np.isfinite(np.delete(lse.ravel(), 4 * 2 + 1)).all()


def paged_copy(c, page_size=16, seed=5, dtype=None):
    """``c``'s rope in a paged cache (shuffled pages, 576-wide rows, spare blocks) and the slot of
    each key row: ``(cache, slot_of_row)`` with ``slot_of_row[r] = (block, offset)``."""
    rng = np.random.default_rng(seed)
    vl, cro = c.valid_length.astype(int), c.cache_row_offsets.astype(int)
    co = np.zeros(len(vl) - 1, int) if c.cache_offsets is None else c.cache_offsets.astype(int)
    sk = np.diff(cro)
    pages = [(co[b] + sk[b] + page_size - 1) // page_size for b in range(len(sk))]
    nblocks = sum(pages) + 3
    perm = rng.permutation(nblocks)
    blocks = rng.standard_normal((nblocks, page_size, 1, 576)).astype(dtype or c.k_rope.dtype)
    lut = np.zeros((len(sk), max(pages)), np.int32)
    slot = {}
    used = 0
    for b in range(len(sk)):
        for p in range(pages[b]):
            lut[b, p] = perm[used]
            used += 1
        for j in range(sk[b]):
            t = co[b] + j
            slot[cro[b] + j] = (lut[b, t // page_size], t % page_size)
            blocks[slot[cro[b] + j]][0, 512:576] = c.k_rope[cro[b] + j, 0]
    return PagedKVCache(blocks, lut, page_size), slot


@pytest.mark.parametrize("mask", [CausalMask(), ChunkedMask(50)], ids=lambda m: type(m).__name__)
def test_nan_in_a_paged_rope_reaches_the_rows_that_see_its_key(mask):
    c = nan_case()
    cache, slot = paged_copy(c)
    clean_out, clean_lse = run_ref(c, mask)
    np.testing.assert_array_equal(clean_out, reference.mla_prefill(
        c.q, c.k, c.v, cache, c.valid_length, c.cache_row_offsets, mask=mask, cache_offsets=c.cache_offsets,
        q_start_pos=c.q_start_pos))
    j = 200
    cache.blocks[slot[j]][0, 512 + 3] = np.nan
    used = {s for s in slot.values()}
    spare = next((blk, off) for blk in range(cache.blocks.shape[0]) for off in range(16) if (blk, off) not in used)
    cache.blocks[spare][0, 512:] = np.nan      # a slot no key uses
    cache.blocks[slot[j + 1]][0, :512] = np.nan  # the latent part of a used row: never read
    out, lse = reference.mla_prefill(c.q, c.k, c.v, cache, c.valid_length, c.cache_row_offsets, mask=mask,
                                     cache_offsets=c.cache_offsets, q_start_pos=c.q_start_pos, return_lse=True)
    want = np.zeros(clean_lse.shape, bool)
    want[:300] = seq_visible(c, mask, 0)[:, j][:, None]
    assert want.any()
    assert_reach(out, lse, clean_out, clean_lse, want)


def test_unreadable_pages_are_masked_without_validation():
    """validate=False with a block id outside the cache: its keys are masked (as on the GPU)."""
    c = make_case([20], [40], heads=2, dtype=np.float64, seed=8)
    cache, _ = paged_copy(c)
    cache.lookup_table[0, 1] = 99  # keys 16..31
    out = reference.mla_prefill(c.q, c.k, c.v, cache, c.valid_length, c.cache_row_offsets, mask=NullMask(),
                                validate=False)
    keep = np.r_[0:16, 32:40]
    want = reference.mla_prefill(c.q, c.k[keep], c.v[keep], c.k_rope[keep], c.valid_length,
                                 np.array([0, 24], np.uint32), mask=NullMask())
    np.testing.assert_allclose(out, want, rtol=1e-12)
    with pytest.raises(ValueError, match=r"k_rope.lookup_table: block id 99 at \[0, 1\]"):
        reference.mla_prefill(c.q, c.k, c.v, cache, c.valid_length, c.cache_row_offsets)


# ------------------------------------------------------------------------------------------------
# fp8: the dequantized inputs, the same NaN rule (key spans from a multiple of 16 keys per token)

NAN8 = 0x7F  # float8_e4m3fn NaN


def fp8_case(mask):
    from mla_cupy import quant

    c = nan_case(dtype=BF16)
    f = {n: (np.ascontiguousarray(a).view(np.uint8) if a.dtype.itemsize == 1 else a)
         for n, a in quant.quantize_per_token(c.q, c.k, c.v, c.k_rope).items()}
    return c, f


def run_fp8(c, f, mask, **kw):
    return reference.mla_prefill_fp8(f["q_nope"], f["q_rope"], f["q_scale"], f["k"], f["k_scales"], f["v"], f["k_rope"],
                                     c.valid_length, c.cache_row_offsets, mask=mask, cache_offsets=c.cache_offsets,
                                     q_start_pos=c.q_start_pos, return_lse=True, **kw)


def test_fp8_reference_is_the_attention_of_the_dequantized_inputs():
    c, f = fp8_case(CausalMask())
    from mla_cupy._arrays import FP8_E4M3

    e = {n: f[n].view(FP8_E4M3).astype(np.float64) for n in ("q_nope", "k", "v")}
    q_scales, k_scales = f["q_scale"].astype(np.float64)[:, :, None], f["k_scales"].astype(np.float64)[:, :, None]
    want = reference.mla_prefill(q_scales * np.concatenate([e["q_nope"], f["q_rope"].astype(np.float64)], -1),
                                 k_scales * e["k"], e["v"], k_scales * f["k_rope"].astype(np.float64), c.valid_length,
                                 c.cache_row_offsets, cache_offsets=c.cache_offsets, q_start_pos=c.q_start_pos)
    got, _ = run_fp8(c, f, CausalMask())
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    as_e4m3 = {n: f[n].view(FP8_E4M3) for n in ("q_nope", "k", "v")}  # ml_dtypes arrays are taken too
    got2 = reference.mla_prefill_fp8(as_e4m3["q_nope"], f["q_rope"], f["q_scale"], as_e4m3["k"], f["k_scales"],
                                     as_e4m3["v"], f["k_rope"], c.valid_length, c.cache_row_offsets,
                                     cache_offsets=c.cache_offsets, q_start_pos=c.q_start_pos)
    np.testing.assert_array_equal(got2, got)
    cache, _ = paged_copy(dataclasses.replace(c, k_rope=f["k_rope"]))  # the bf16 rope from a paged cache
    got3, _ = run_fp8(c, dict(f, k_rope=cache), CausalMask())
    np.testing.assert_array_equal(got3, got)


@pytest.mark.parametrize("where", ["q_nope", "k", "k_scales", "k_rope", "v"])
def test_fp8_nan_reaches_what_the_contract_says(where):
    """The per-token variant: the same rule, with each block's key span starting on a multiple
    of 16 keys (a NaN in v also reaches blocks whose visible keys start up to 15 keys after it)."""
    mask = SlidingWindowCausalMask(37)
    c, f = fp8_case(mask)
    clean_out, clean_lse = run_fp8(c, f, mask)
    vis = seq_visible(c, mask, 0)
    i, h, d = 170, 1, 5
    span_lo = int(np.flatnonzero(vis[128:256].any(axis=0))[0])  # block 1's first visible key
    assert span_lo % 16
    j = span_lo - 1 if where == "v" else 150  # v: a key only the rounded span holds
    want = np.zeros(clean_lse.shape, bool)
    if where == "q_nope":
        f["q_nope"][i, h, d] = NAN8
        want[i, h] = vis[i].any()
    elif where == "k":
        f["k"][j, h, d] = NAN8
        want[:300, h] = vis[:, j]
    elif where == "k_scales":
        f["k_scales"][j, 0] = np.nan
        want[:300] = vis[:, j][:, None]
    elif where == "k_rope":
        f["k_rope"][j, 0, d] = np.nan
        want[:300] = vis[:, j][:, None]
    else:
        f["v"][j, h, d] = NAN8
        want[:300, h] = reach_of_v(c, mask, j, key_align=16, half_tiles=False)
        assert want[128:256, h].all() and not reach_of_v(c, mask, j, half_tiles=False)[128:256].any()
    assert want.any()
    out, lse = run_fp8(c, f, mask)
    assert_reach(out, lse, clean_out, clean_lse, want, d if where == "v" else slice(None), lse_nan=where != "v")


def test_fp8_rope_nan_reaches_the_rows_that_see_its_key():
    from mla_cupy import quant

    c = nan_case(dtype=BF16)
    r8, sc = quant.quantize_rope_blocks(c.k_rope)
    r8 = np.ascontiguousarray(r8).view(np.uint8)
    args = dict(mask=CausalMask(), cache_offsets=c.cache_offsets, q_start_pos=c.q_start_pos, return_lse=True)
    clean_out, clean_lse = reference.mla_prefill(c.q, c.k, c.v, r8, c.valid_length, c.cache_row_offsets,
                                                 k_rope_scales=sc, **args)
    vis = seq_visible(c, CausalMask(), 0)
    for j, poison in ((200, "bytes"), (230, "scale")):
        r, s = r8.copy(), sc.copy()
        if poison == "bytes":
            r[j, 0, 3] = NAN8
        else:
            s[j] = np.nan
        out, lse = reference.mla_prefill(c.q, c.k, c.v, r, c.valid_length, c.cache_row_offsets, k_rope_scales=s, **args)
        want = np.zeros(clean_lse.shape, bool)
        want[:300] = vis[:, j][:, None]
        assert_reach(out, lse, clean_out, clean_lse, want)


def test_fp8_paged_rope_with_scales_equals_plain():
    from mla_cupy import quant

    c = make_case([20, 9], [40, 30], heads=2, dtype=BF16, seed=13, cache_offsets=[7, 0])
    r8, sc = quant.quantize_rope_blocks(c.k_rope)
    plain = reference.mla_prefill(c.q, c.k, c.v, r8, c.valid_length, c.cache_row_offsets, k_rope_scales=sc,
                                  cache_offsets=c.cache_offsets)
    c8 = make_case([20, 9], [40, 30], heads=2, dtype=BF16, seed=13, cache_offsets=[7, 0])
    c8.k_rope = np.ascontiguousarray(r8).view(np.uint8)
    cache, slot = paged_copy(c8, dtype=np.uint8)
    scales = np.full(cache.blocks.shape[:3] + (9,), np.nan, np.float32)  # unused entries: never read
    for row, sl in slot.items():
        scales[sl][0, 8] = sc[row, 0, 0]
    paged = PagedKVCache(cache.blocks, cache.lookup_table, 16, scales=scales)
    got = reference.mla_prefill(c.q, c.k, c.v, paged, c.valid_length, c.cache_row_offsets, cache_offsets=c.cache_offsets)
    np.testing.assert_array_equal(got, plain)


def test_fp8_q_scale_checked_as_on_the_gpu():
    c, f = fp8_case(CausalMask())
    f["q_scale"][7, 0] = np.nan
    with pytest.raises(ValueError, match=r"q_scale: expected non-negative scales, got q_scale\[7\] = nan"):
        run_fp8(c, f, CausalMask())
    out, _ = run_fp8(c, f, CausalMask(), validate=False)  # unchecked: the true query of row 7 is NaN
    assert np.isnan(out[7]).all() == seq_visible(c, CausalMask(), 0)[7].any()
    assert np.isfinite(np.delete(out, 7, axis=0)).all()


# ------------------------------------------------------------------------------------------------
# the kernels' keywords, partial results, long inputs


def halves(c, split):
    """Two calls' arguments: keys [0, split) and [split, Sk) of a one-sequence case, with the
    one-shot call's query positions."""
    sq, sk = int(c.valid_length[-1]), int(c.cache_row_offsets[-1])
    q_start = np.array([sk - sq], np.int64)
    parts = []
    for lo, hi in ((0, split), (split, sk)):
        parts.append((c.k[lo:hi], c.v[lo:hi], c.k_rope[lo:hi], np.array([0, hi - lo], np.uint32),
                      dict(cache_offsets=np.array([lo], np.uint32), q_start_pos=q_start)))
    return parts


@pytest.mark.parametrize("acc_dtype", [np.float32, np.float64])
def test_accumulate_merges_into_out_and_lse(acc_dtype):
    c = make_case([37], [90], heads=3, dtype=BF16, seed=14)
    full, full_lse = reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets,
                                           return_lse=True)
    out = np.full((37, 3, 128), np.nan, acc_dtype)
    lse = np.full((37, 3), np.nan, acc_dtype)
    (k0, v0, r0, cro0, kw0), (k1, v1, r1, cro1, kw1) = halves(c, 50)
    got = reference.mla_prefill(c.q, k0, v0, r0, c.valid_length, cro0, out=out, lse=lse, **kw0)
    assert got is out and not np.isnan(out).any()
    got, got_lse = reference.mla_prefill(c.q, k1, v1, r1, c.valid_length, cro1, out=out, lse=lse, accumulate=True,
                                         return_lse=True, **kw1)
    assert got is out and got_lse is lse
    tol = 1e-6 if acc_dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out, full, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, full_lse, rtol=tol)


def test_kernel_keywords_are_accepted_and_checked():
    c = make_case([9, 4], [12, 4], heads=2, dtype=BF16, seed=15)
    args = (c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets)
    want = reference.mla_prefill(*args)
    for kernel in ("auto", "sm80", "sm90"):
        np.testing.assert_array_equal(reference.mla_prefill(*args, kernel=kernel, stream=object(), q_max_seq_len=9), want)
    out16 = np.empty((13, 2, 128), BF16)
    assert reference.mla_prefill(*args, out=out16) is out16
    np.testing.assert_array_equal(out16, want.astype(BF16))
    for kw, exc, match in [(dict(kernel="sm70"), ValueError, "kernel: expected one of"),
                           (dict(q_max_seq_len=8), ValueError, "q_max_seq_len: a sequence has 9 queries"),
                           (dict(accumulate=True), ValueError, "accumulate: needs out= and lse="),
                           (dict(accumulate=True, out=out16, lse=np.zeros((13, 2))), TypeError,
                            "accumulate: out must be float32 or float64"),
                           (dict(lse=np.zeros((13, 3))), ValueError, r"lse: expected shape \[13, 2\]"),
                           (dict(progress="yes"), TypeError, "progress: expected None, True or False")]:
        with pytest.raises(exc, match=match):
            reference.mla_prefill(*args, **kw)


def test_k_rope_scales_make_the_fp8_rope_variant():
    from mla_cupy import quant

    c = make_case([9], [12], heads=2, dtype=BF16, seed=16)
    r8, sc = quant.quantize_rope_blocks(c.k_rope)
    a = reference.mla_prefill(c.q, c.k, c.v, r8, c.valid_length, c.cache_row_offsets, k_rope_scales=sc)
    b = reference.mla_prefill_fp8_rope(c.q, c.k, c.v, np.ascontiguousarray(r8).view(np.uint8), sc, c.valid_length,
                                       c.cache_row_offsets)
    q, k, v = (x.astype(np.float64) for x in (c.q, c.k, c.v))  # the oracle's float64, every input alike
    want = reference.mla_prefill(q, k, v, r8.astype(np.float64) * sc, c.valid_length, c.cache_row_offsets)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, want, rtol=1e-12)


@pytest.mark.parametrize("mask", [CausalMask(), SlidingWindowCausalMask(9), ChunkedCausalMask(16)],
                         ids=lambda m: type(m).__name__)
def test_chunked_and_merge_states_run_on_numpy(mask):
    import mla_cupy

    c = make_case([30, 0, 7], [70, 5, 7], heads=2, dtype=BF16, seed=17, cache_offsets=[3, 0, 11])
    args = (c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets)
    full, full_lse = reference.mla_prefill(*args, mask=mask, cache_offsets=c.cache_offsets, return_lse=True)
    for chunk in (1, 16, 100):
        got, lse = mla_cupy.mla_prefill_chunked(*args, chunk_size=chunk, mask=mask, cache_offsets=c.cache_offsets,
                                                return_lse=True)
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, full, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(lse, full_lse, rtol=1e-12)
    with pytest.raises(ValueError, match="chunk_size: expected a positive int"):
        mla_cupy.mla_prefill_chunked(*args, chunk_size=0)
    # merge_states: the first 40 keys of sequence 0 and the rest, merged
    one = make_case([30], [70], heads=2, dtype=BF16, seed=18)
    a, b = halves(one, 40)
    pa = reference.mla_prefill(one.q, *a[:4][:3], one.valid_length, a[3], mask=mask, return_lse=True, **a[4])
    pb = reference.mla_prefill(one.q, *b[:3], one.valid_length, b[3], mask=mask, return_lse=True, **b[4])
    want = reference.mla_prefill(one.q, one.k, one.v, one.k_rope, one.valid_length, one.cache_row_offsets, mask=mask)
    got, _ = mla_cupy.merge_states(*pa, *pb)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_merge_states_on_numpy_follows_the_formula():
    import mla_cupy

    rng = np.random.default_rng(19)
    oa, ob = rng.standard_normal((5, 2, 8)), rng.standard_normal((5, 2, 8))
    la, lb = rng.standard_normal((5, 2)), rng.standard_normal((5, 2))
    la[0], lb[1], la[2], lb[2] = -np.inf, -np.inf, -np.inf, -np.inf
    oa[0], ob[2] = np.nan, np.nan   # behind lse = -inf: never read into the sum
    lb[3, 1] = np.nan               # a NaN lse: NaN out and lse
    out, lse = mla_cupy.merge_states(oa.astype(np.float32), la.astype(np.float32), ob.astype(np.float32),
                                     lb.astype(np.float32))
    for t in range(5):
        for h in range(2):
            wa, wb = (0.0 if l == -np.inf else math.exp(l) for l in (la[t, h], lb[t, h]))
            if t == 3 and h == 1:
                assert np.isnan(out[t, h]).all() and np.isnan(lse[t, h])
            elif wa + wb == 0:
                assert np.all(out[t, h] == 0) and lse[t, h] == -np.inf
            else:
                terms = [w * o for w, o in ((wa, oa[t, h]), (wb, ob[t, h])) if w > 0]
                np.testing.assert_allclose(out[t, h], sum(terms) / (wa + wb), rtol=1e-6)
                np.testing.assert_allclose(lse[t, h], math.log(wa + wb), rtol=1e-6)
    buf, buf_lse = np.zeros((5, 2, 8), np.float32), np.zeros((5, 2), np.float32)
    res = mla_cupy.merge_states(oa, la, ob, lb, out=buf, lse_out=buf_lse)
    assert res[0] is buf and res[1] is buf_lse
    with pytest.raises(ValueError, match=r"out_b: expected shape \[5, 2, 8\]"):
        mla_cupy.merge_states(oa, la, ob[:4], lb)
    with pytest.raises(TypeError, match="lse_a: expected dtype float32 or float64, got float16"):
        mla_cupy.merge_states(oa, la.astype(np.float16), ob, lb)


def test_progress_shows_when_asked_or_when_the_call_is_long(capsys, monkeypatch):
    c = make_case([20], [20], heads=2, dtype=BF16, seed=20)
    args = (c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets)
    reference.mla_prefill(*args)
    assert capsys.readouterr().err == ""
    reference.mla_prefill(*args, progress=True)
    err = capsys.readouterr().err
    assert "mla_cupy.reference.mla_prefill" in err and "100%" in err
    monkeypatch.setattr(reference, "_SECONDS_PER_PAIR", 1.0)  # as if every pair took a second
    reference.mla_prefill(*args)
    assert "100%" in capsys.readouterr().err
    reference.mla_prefill(*args, progress=False)
    assert capsys.readouterr().err == ""


def test_working_memory_is_bounded():
    """Peak memory of a call beside its inputs and result: under WORK_BYTES, and the same for 4x
    the keys (keys in blocks, a few heads at a time)."""
    import tracemalloc

    peaks = []
    for sk in (4096, 16384):
        c = make_case([128], [sk], heads=4, dtype=BF16, seed=22)
        tracemalloc.start()
        out = reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets, mask=NullMask())
        peak = tracemalloc.get_traced_memory()[1] - out.nbytes
        tracemalloc.stop()
        peaks.append(peak)
    assert max(peaks) < reference.WORK_BYTES, peaks
    assert peaks[1] < 1.1 * peaks[0], peaks

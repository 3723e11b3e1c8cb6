"""GPU tests of the paged cache, merge_states and chunked prefill (pytest -m gpu)."""
import numpy as np
import pytest

import mla_cupy
from mla_cupy import NullMask, PagedKVCache, SlidingWindowCausalMask, reference

from _cases import BF16, build_paged, make_case
from gpu_util import KERNELS, run_and_check, upload

kernels = pytest.mark.parametrize("kernel", KERNELS)

pytestmark = pytest.mark.gpu


@kernels
@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256, 512])
@pytest.mark.parametrize("offsets", ["unaligned", "aligned"])
def test_paged_equals_plain_bit_for_bit(page_size, kernel, offsets):
    """Keys off page boundaries (unaligned cache offsets) and on them (multiples of every page
    size), with spans ending mid-tile and mid-page (the table's unused entries are out of range on
    purpose): bit for bit the plain rope's result (on Hopper the rope is gathered into key rows
    first, kernels/rope_gather.cu)."""
    import cupy as cp

    co = [5, 0, 1000] if offsets == "unaligned" else [0, 512, 1024]
    c = make_case([65, 1, 130], [300, 17, 700], 16, BF16, seed=page_size, cache_offsets=co)
    blocks, lut = build_paged(c, page_size, seed=page_size)
    d = upload(c)
    cache = PagedKVCache(cp.asarray(blocks), cp.asarray(lut), page_size)
    args = (d["q"], d["k"], d["v"])
    plain = mla_cupy.mla_prefill(*args, d["k_rope"], d["valid_length"], d["cache_row_offsets"], cache_offsets=d["cache_offsets"], kernel=kernel)
    paged = mla_cupy.mla_prefill(*args, cache, d["valid_length"], d["cache_row_offsets"], cache_offsets=d["cache_offsets"], kernel=kernel)
    np.testing.assert_array_equal(paged.get().view(np.uint16), plain.get().view(np.uint16))
    run_and_check(c, k_rope=cache, ref_k_rope=PagedKVCache(blocks, lut, page_size), kernel=kernel)


@kernels
def test_paged_rope_in_a_captured_plan_run(kernel):
    """A paged plan's run captured in a CUDA graph on its stream replays bit for bit the eager
    result after the pages change, with runs of the same plan on another stream in between: the
    Hopper kernel's gathered rows are the plan's, one buffer per stream, kept."""
    import cupy as cp

    c = make_case([70, 9], [300, 40], 16, BF16, seed=21, cache_offsets=[32, 0])
    blocks, lut = build_paged(c, 16, seed=22)
    d = upload(c)
    cache = PagedKVCache(cp.asarray(blocks), cp.asarray(lut), 16)
    pl = mla_cupy.plan(d["valid_length"], d["cache_row_offsets"], num_heads=16, dtype=BF16, q_max_seq_len=70,
                       cache_offsets=d["cache_offsets"], page_table=cache.lookup_table, page_size=16, kernel=kernel)
    args = (d["q"], d["k"], d["v"], cache)
    out = cp.full((c.q.shape[0], 16, 128), np.nan, dtype=BF16)
    s = cp.cuda.Stream(non_blocking=True)
    pl.run(*args, out=out, stream=s)  # compiles, packs and allocates the stream's rows outside the capture
    with s:
        s.begin_capture()
        pl.run(*args, out=out, stream=s)
        g = s.end_capture()
    for seed in (23, 24):
        cache.blocks[...] = cp.asarray(np.random.default_rng(seed).standard_normal(blocks.shape, np.float32)
                                       .astype(BF16))
        out.fill(np.nan)
        cp.cuda.Device().synchronize()  # the streams below do not wait for the default stream
        other = cp.cuda.Stream(non_blocking=True)
        busy = [pl.run(*args, stream=other) for _ in range(2)]  # the plan on another stream: its own rows
        g.launch(s)
        s.synchronize()
        other.synchronize()
        eager = mla_cupy.mla_prefill(*args, d["valid_length"], d["cache_row_offsets"], cache_offsets=d["cache_offsets"],
                                     kernel=kernel)
        np.testing.assert_array_equal(out.get().view(np.uint16), eager.get().view(np.uint16))
        np.testing.assert_array_equal(busy[-1].get().view(np.uint16), eager.get().view(np.uint16))


@kernels
def test_paged_noncontiguous_table_and_rope_offset(kernel):
    """A lookup table that is a column slice of a wider one, and rope values at column 0."""
    import cupy as cp

    c = make_case([40, 90], [100, 90], 16, BF16, seed=3, cache_offsets=[16, 48])
    blocks, lut = build_paged(c, 16, seed=4, dc=128, rope_offset=0)
    wide = np.zeros((lut.shape[0], lut.shape[1] + 4), np.int32)
    wide[:, 2:2 + lut.shape[1]] = lut
    dlut = cp.asarray(wide)[:, 2:2 + lut.shape[1]]
    cache = PagedKVCache(cp.asarray(blocks), dlut, 16, rope_offset=0)
    run_and_check(c, k_rope=cache, ref_k_rope=PagedKVCache(blocks, lut, 16, rope_offset=0), mask=SlidingWindowCausalMask(40),
                  kernel=kernel)


@kernels
def test_paged_bad_block_ids_are_masked_without_validation(kernel):
    """validate=False: out-of-range block ids never cause a wild read; their keys are masked."""
    import cupy as cp

    c = make_case([30, 20], [64, 80], 16, BF16, seed=5)
    blocks, lut = build_paged(c, 16, seed=6)
    lut[0, 1] = 10**6   # keys 16..31 of sequence 0 unreadable
    lut[1, 4] = -5      # keys 64..79 of sequence 1 unreadable
    cache = PagedKVCache(cp.asarray(blocks), cp.asarray(lut), 16)
    with pytest.raises(ValueError, match="block id"):
        d = upload(c)
        mla_cupy.mla_prefill(d["q"], d["k"], d["v"], cache, d["valid_length"], d["cache_row_offsets"])
    run_and_check(c, k_rope=cache, ref_k_rope=PagedKVCache(blocks, lut, 16), validate=False, mask=NullMask(), kernel=kernel)


def test_merge_states_exact_and_empty_sides():
    """merge_states against the float64 reference's merge: empty sides (lse = -inf) contribute
    nothing, NaN behind them stays out, a NaN in a side with weight passes through."""
    import cupy as cp

    rng = np.random.default_rng(0)
    t, h = 37, 16
    oa = rng.standard_normal((t, h, 128)).astype(np.float32)
    ob = rng.standard_normal((t, h, 128)).astype(np.float32)
    la = rng.standard_normal((t, h)).astype(np.float32) * 3
    lb = rng.standard_normal((t, h)).astype(np.float32) * 3
    la[0] = -np.inf          # empty side a: result is b exactly
    lb[1] = -np.inf          # empty side b
    la[2] = lb[2] = -np.inf  # both empty: 0, -inf
    oa[0] = np.nan           # garbage in an empty side must not leak
    ob[2] = np.nan
    oa[5, 3, 7] = np.nan     # a NaN in a side with weight reaches the result
    out, lse = mla_cupy.merge_states(cp.asarray(oa), cp.asarray(la), cp.asarray(ob), cp.asarray(lb))
    out, lse = out.get(), lse.get()
    want, want_lse = reference.merge_states(oa, la, ob, lb)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    assert np.isnan(out).sum() == 1
    fin = ~np.isnan(want)
    np.testing.assert_allclose(out[fin], want[fin], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out[0], ob[0])
    np.testing.assert_array_equal(out[1], oa[1])
    assert np.all(out[2] == 0) and np.all(np.isneginf(lse[2]))
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(lse[3:], want_lse[3:], rtol=1e-5, atol=1e-6)


def test_merge_states_nan_lse_makes_the_row_nan():
    """A NaN lse on either side (a row whose scores held a NaN) makes the merged row and its lse
    NaN, as the float64 reference's merge; the other rows are untouched by it."""
    import cupy as cp

    rng = np.random.default_rng(1)
    t, h = 9, 4
    oa, ob = (rng.standard_normal((t, h, 128)).astype(np.float32) for _ in range(2))
    la, lb = (rng.standard_normal((t, h)).astype(np.float32) for _ in range(2))
    la[2, 1] = np.nan
    lb[4, 3] = np.nan
    lb[6, 0] = -np.inf
    la[6, 0] = np.nan  # NaN beside an empty side
    out, lse = mla_cupy.merge_states(cp.asarray(oa), cp.asarray(la), cp.asarray(ob), cp.asarray(lb))
    out, lse = out.get(), lse.get()
    want, want_lse = reference.merge_states(oa, la, ob, lb)
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(want_lse))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    assert np.isnan(out[[2, 4, 6], [1, 3, 0]]).all() and np.isnan(out).sum() == 3 * 128
    fin = ~np.isnan(want)
    np.testing.assert_allclose(out[fin], want[fin], rtol=1e-5, atol=1e-6)


def test_merge_of_two_key_halves_equals_one_shot():
    """Attention over keys [0, s) and [s, Sk) merged == attention over all keys."""
    import cupy as cp

    c = make_case([100], [500], 16, BF16, seed=21)
    d = upload(c)
    full, full_lse = mla_cupy.mla_prefill(d["q"], d["k"], d["v"], d["k_rope"], d["valid_length"], d["cache_row_offsets"],
                                          mask=NullMask(), out_dtype=np.float32, return_lse=True)
    s = 200
    parts = []
    for lo, hi in ((0, s), (s, 500)):
        cro = cp.asarray(np.array([0, hi - lo], np.uint32))
        parts.append(mla_cupy.mla_prefill(d["q"], d["k"][lo:hi], d["v"][lo:hi], d["k_rope"][lo:hi], d["valid_length"], cro,
                                          mask=NullMask(), out_dtype=np.float32, return_lse=True))
    (oa, la), (ob, lb) = parts
    mla_cupy.merge_states(oa, la, ob, lb, out=oa, lse_out=la)  # in-place fold
    # The partial kernels round P to bf16 against their own running max, so merged and one-shot
    # outputs differ at bf16 level; both must match the float64 reference, and the lse closely.
    ref = reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets, mask=NullMask())
    for got in (oa.get(), full.get()):
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2
    assert np.linalg.norm(oa.get() - full.get()) / np.linalg.norm(full.get()) < 5e-3
    np.testing.assert_allclose(la.get(), full_lse.get(), rtol=1e-4, atol=1e-4)


@kernels
def test_accumulate_merges_in_the_epilogue(kernel):
    """accumulate=True folds this call's result into out/lse in place: keys [0, 200) then [200, 500)
    equal the one-shot call; a call over no keys leaves them as they were (no NaN); a sequence
    whose first part is empty takes the second part as it is."""
    import cupy as cp

    c = make_case([100, 37], [500, 300], 16, BF16, seed=22)
    d = upload(c)
    full, full_lse = mla_cupy.mla_prefill(d["q"], d["k"], d["v"], d["k_rope"], d["valid_length"], d["cache_row_offsets"],
                                          mask=NullMask(), out_dtype=np.float32, return_lse=True, kernel=kernel)
    acc = cp.full(full.shape, np.nan, cp.float32)
    acc_lse = cp.full(full_lse.shape, np.nan, cp.float32)
    cro = c.cache_row_offsets.astype(np.int64)
    # part 1: sequence 0 keys [0, 200), sequence 1 none; part 2: the rest of both
    for i, (begin, end) in enumerate((([0, 500], [200, 500]), ([200, 500], [500, 800]))):
        co = cp.asarray(np.array([begin[0] - cro[0], begin[1] - cro[1]], np.uint32))
        q_start = cp.asarray(np.array([400, 263], np.int64))  # the one-shot call's query positions (end-aligned)
        lens = np.array(end) - np.array(begin)
        # keys of chunk i: rows begin[b] .. end[b] of k / v for each sequence, gathered into one packed batch
        rows = np.concatenate([np.arange(begin[b], end[b]) for b in range(2)])
        kc, vc, rc = d["k"][rows], d["v"][rows], d["k_rope"][rows]
        offs = cp.asarray(np.array([0, lens[0], lens[0] + lens[1]], np.uint32))
        mla_cupy.mla_prefill(d["q"], kc, vc, rc, d["valid_length"], offs, mask=NullMask(), cache_offsets=co,
                             q_start_pos=q_start, out=acc, lse=acc_lse, accumulate=i > 0, kernel=kernel)
    assert not bool(cp.isnan(acc).any())
    assert float(cp.linalg.norm(acc - full) / cp.linalg.norm(full)) < 5e-3
    np.testing.assert_allclose(acc_lse.get(), full_lse.get(), rtol=1e-4, atol=1e-4)
    # an empty chunk changes nothing
    before, before_lse = acc.copy(), acc_lse.copy()
    none = cp.asarray(np.array([0, 0, 0], np.uint32))
    mla_cupy.mla_prefill(d["q"], d["k"][:0], d["v"][:0], d["k_rope"][:0], d["valid_length"], none, mask=NullMask(),
                         out=acc, lse=acc_lse, accumulate=True, kernel=kernel)
    assert bool(cp.all(acc == before)) and bool(cp.all(acc_lse == before_lse))


@pytest.mark.parametrize("chunks", [1, 4, 16])
def test_chunked_64k_context_equals_one_shot(chunks):
    """1k new queries after 64k keys of context, in 1, 4 and 16 chunks, vs the one-shot kernel."""
    import cupy as cp

    rng = np.random.default_rng(chunks)
    sq, sk, h = 1024, 65536 + 1024, 16
    q = cp.asarray(rng.standard_normal((sq, h, 192)).astype(BF16))
    k = cp.asarray(rng.standard_normal((sk, h, 128)).astype(BF16))
    v = cp.asarray(rng.standard_normal((sk, h, 128)).astype(BF16))
    kr = cp.asarray(rng.standard_normal((sk, 1, 64)).astype(BF16))
    vl = cp.asarray(np.array([0, sq], np.uint32))
    cro = cp.asarray(np.array([0, sk], np.uint32))
    one = mla_cupy.mla_prefill(q, k, v, kr, vl, cro).get().astype(np.float64)
    # Peak extra memory of the chunked call: a private pool keeps every block it ever needed, so its
    # total is the call's peak footprint (output included).
    pool = cp.cuda.MemoryPool()
    with cp.cuda.using_allocator(pool.malloc):
        res = mla_cupy.mla_prefill_chunked(q, k, v, kr, vl, cro, chunk_size=-(-sk // chunks))
        peak = pool.total_bytes()
    got = res.get().astype(np.float64)
    assert np.linalg.norm(got - one) / np.linalg.norm(one) < 1e-2
    # two float32 [Tq, H, 128] buffers, the bf16 output and small arrays: independent of the 65k
    # keys (K and V alone are 545 MB)
    assert peak < 3 * sq * h * 128 * 4 + (8 << 20), peak


def test_chunked_8k_against_reference():
    c = make_case([256, 1], [8192, 900], 16, BF16, seed=31, cache_offsets=[0, 50])
    d = upload(c)
    got = mla_cupy.mla_prefill_chunked(d["q"], d["k"], d["v"], d["k_rope"], d["valid_length"], d["cache_row_offsets"],
                                       cache_offsets=d["cache_offsets"], chunk_size=3000).get().astype(np.float64)
    ref = reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets, cache_offsets=c.cache_offsets)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


def test_merge_and_chunked_with_batch_zero():
    import cupy as cp

    c = make_case([], [], 16, BF16)
    d = upload(c)
    out = mla_cupy.mla_prefill_chunked(d["q"], d["k"], d["v"], d["k_rope"], d["valid_length"], d["cache_row_offsets"], chunk_size=64)
    assert out.shape == (0, 16, 128)
    o, l = mla_cupy.merge_states(cp.zeros((0, 16, 128), cp.float32), cp.zeros((0, 16), cp.float32),
                                 cp.zeros((0, 16, 128), cp.float32), cp.zeros((0, 16), cp.float32))
    assert o.shape == (0, 16, 128) and l.shape == (0, 16)

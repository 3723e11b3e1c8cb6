"""GPU tests of mla_prefill against the float64 reference (pytest -m gpu; skipped without a GPU)."""

import numpy as np
import pytest

import mla_cupy
from mla_cupy import CausalMask, ChunkedCausalMask, ChunkedMask, NullMask, SlidingWindowCausalMask, reference

from _cases import BF16, FP16, make_case
from _threads import in_threads
from gpu_util import KERNELS, assert_like_reference, pooled_blocks, run_and_check, upload

pytestmark = pytest.mark.gpu


kernels = pytest.mark.parametrize("kernel", KERNELS)

MASKS = [NullMask(), CausalMask(), SlidingWindowCausalMask(37), ChunkedMask(50), ChunkedCausalMask(50)]
ODD_SQ = [1, 7, 63, 65, 129, 0, 200]
ODD_SK = [1, 7, 63, 65, 129, 5, 300]


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", [16, 128])
@kernels
def test_every_mask_dtype_heads(mask, dtype, heads, kernel):
    c = make_case(ODD_SQ, ODD_SK, heads, dtype, seed=heads + len(type(mask).__name__))
    run_and_check(c, mask=mask, kernel=kernel)


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: type(m).__name__)
@kernels
def test_prefix_context_and_cache_offsets(mask, kernel):
    # Sk > Sq with nonzero cache offsets: queries aligned to the end of the keys.
    c = make_case([65, 100, 1, 33], [300, 1000, 129, 33], 16, BF16, seed=7, cache_offsets=[0, 77, 1000, 5])
    run_and_check(c, mask=mask, kernel=kernel)


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: type(m).__name__)
@kernels
def test_explicit_query_positions(mask, kernel):
    # q_start_pos overrides the end alignment; negative positions see nothing under causal masks.
    c = make_case([64, 50, 20], [128, 40, 20], 16, FP16, seed=8, cache_offsets=[100, 0, 3], q_start_pos=[150, -30, -7])
    run_and_check(c, mask=mask, kernel=kernel)


@kernels
def test_more_queries_than_keys(kernel):
    c = make_case([129, 70], [63, 1], 16, BF16, seed=9)
    run_and_check(c, mask=CausalMask(), kernel=kernel)


@kernels
def test_long_odd_sequence_1000(kernel):
    c = make_case([1000], [1000], 16, BF16, seed=10)
    run_and_check(c, kernel=kernel)


@kernels
def test_many_tiles_per_cta_in_l2_sections(kernel):
    """H = 128 over 2364 keys: 3072 work tiles, so each persistent Hopper CTA runs about 23 of them
    (the Q / K / V rings carry over between tiles), and the heads fall into several L2 sections."""
    import cupy as cp

    from mla_cupy._select import heads_per_section
    from mla_cupy.validation import check_inputs

    c = make_case([700, 300, 7], [2000, 300, 64], 128, BF16, seed=21)
    p = check_inputs(*[cp.asarray(a) for a in (c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets)],
                     scale=None, mask=None, q_max_seq_len=None, cache_offsets=None, q_start_pos=None, out=None,
                     out_dtype=None, validate=True, device=True, read_offsets=True)
    assert 1 < heads_per_section(p, cp.cuda.runtime.getDevice()) < 128
    run_and_check(c, kernel=kernel)
    run_and_check(c, mask=SlidingWindowCausalMask(300), kernel=kernel)


@kernels
def test_cheapest_blocks_end_the_launch(kernel, monkeypatch):
    """Causal launches in L2 sections of 4 heads (fewer than the host would take at these lengths):
    every sequence's first query blocks (part-filled ones among them) leave the sections and end
    the launch, all heads together (tile_scheduler.cuh); every work tile is still taken once."""
    from mla_cupy import _packing

    monkeypatch.setattr(_packing, "heads_per_section", lambda p, dev: 4)
    for sq, seed in (([1800], 41), ([1500, 901], 42)):
        c = make_case(sq, sq, 16, BF16, seed=seed)
        assert pooled_blocks(c, 128, 4) >= 4, sq
        run_and_check(c, mask=CausalMask(), kernel=kernel)


@kernels
def test_batch_zero_and_all_empty(kernel):
    c = make_case([], [], 16, BF16)
    d = upload(c)
    out = mla_cupy.mla_prefill(d["q"], d["k"], d["v"], d["k_rope"], d["valid_length"], d["cache_row_offsets"], kernel=kernel)
    assert out.shape == (0, 16, 128)
    c = make_case([0, 0], [5, 0], 16, BF16, seed=2)
    run_and_check(c, kernel=kernel)
    c = make_case([3, 4], [0, 0], 16, BF16, seed=3)  # queries but no keys at all (Tk = 0): zeros, lse -inf
    run_and_check(c, kernel=kernel)


@kernels
def test_float32_output_and_default_allocation(kernel):
    c = make_case([65, 7], [129, 7], 16, BF16, seed=11)
    run_and_check(c, out_dtype=np.float32, kernel=kernel)
    d = upload(c)
    out = mla_cupy.mla_prefill(d["q"], d["k"], d["v"], d["k_rope"], d["valid_length"], d["cache_row_offsets"],
                               out_dtype=np.float32)
    ref = reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets)
    assert out.dtype == np.float32
    assert np.linalg.norm(out.get() - ref) / np.linalg.norm(ref) < 1e-2


@kernels
def test_strided_rope_view_of_latent_rows(kernel):
    """k_rope as latent[:, :, 512:576] (576-wide rows), read in place without a copy."""
    import cupy as cp

    c = make_case([33, 90], [100, 90], 16, BF16, seed=12)
    latent = cp.asarray(np.random.default_rng(0).standard_normal((c.k.shape[0], 1, 576)).astype(BF16))
    latent[:, :, 512:576] = cp.asarray(c.k_rope)
    view = latent[:, :, 512:576]
    assert not view.flags.c_contiguous
    run_and_check(c, k_rope=view, kernel=kernel)


@kernels
def test_strided_q_and_out(kernel):
    """q as a head-slice of a wider buffer and out as a strided view: both used in place."""
    import cupy as cp

    c = make_case([40, 24], [64, 30], 16, BF16, seed=13)
    d = upload(c)
    big = cp.asarray(np.random.default_rng(1).standard_normal((64, 20, 192)).astype(BF16))
    big[:, 2:18] = d["q"]
    qv = big[:, 2:18]
    outbuf = cp.full((64, 16, 256), np.nan, dtype=BF16)
    ov = outbuf[:, :, 64:192]
    mla_cupy.mla_prefill(qv, d["k"], d["v"], d["k_rope"], d["valid_length"], d["cache_row_offsets"], out=ov, kernel=kernel)
    ref = reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets)
    got = ov.get().astype(np.float64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2
    assert np.isnan(outbuf[:, :, :64].get().astype(np.float32)).all()  # nothing written outside the view


@kernels
def test_int32_offsets_and_scale(kernel):
    c = make_case([50, 17], [80, 17], 16, FP16, seed=14, offset_dtype=np.int32)
    run_and_check(c, scale=0.3, kernel=kernel)


@kernels
def test_q_max_seq_len_and_graph_capture(kernel):
    import cupy as cp

    c = make_case([100, 300, 5], [100, 400, 5], 16, BF16, seed=15)
    d = upload(c)
    out = cp.full((c.q.shape[0], 16, 128), np.nan, dtype=BF16)
    args = (d["q"], d["k"], d["v"], d["k_rope"], d["valid_length"], d["cache_row_offsets"])
    eager = mla_cupy.mla_prefill(*args, q_max_seq_len=300, kernel=kernel).get()
    s = cp.cuda.Stream(non_blocking=True)
    mla_cupy.mla_prefill(*args, q_max_seq_len=300, validate=False, out=out, stream=s, kernel=kernel)  # compile outside capture
    out.fill(np.nan)
    with s:
        s.begin_capture()
        mla_cupy.mla_prefill(*args, q_max_seq_len=300, validate=False, out=out, stream=s, kernel=kernel)
        g = s.end_capture()
    g.launch(s)
    s.synchronize()
    np.testing.assert_array_equal(out.get().view(np.uint16), eager.view(np.uint16))


def test_torch_interop_zero_copy():
    torch = pytest.importorskip("torch")
    c = make_case([40, 24], [64, 30], 16, BF16, seed=16)
    d = upload(c)
    t = {k: torch.from_dlpack(v) for k, v in d.items() if v is not None}
    out = mla_cupy.mla_prefill(t["q"], t["k"], t["v"], t["k_rope"], t["valid_length"], t["cache_row_offsets"])
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.is_cuda
    ref = reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets)
    got = out.float().cpu().numpy()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


def test_threads_compile_once():
    """Eight threads ask for kernels at once, on their own streams: each family compiles once."""
    import cupy as cp

    from mla_cupy import jit

    c = make_case([70, 3], [90, 3], 16, FP16, seed=17)
    before = jit.compile_count()

    def work(i):
        with cp.cuda.Stream(non_blocking=True):
            run_and_check(c, mask=SlidingWindowCausalMask(5 + i), out_dtype=np.float32)

    errors = in_threads(work)
    assert not errors, errors
    assert jit.compile_count() - before <= 1


def _run_nan(c, mask, kernel, **kw):
    """(kernel out, kernel lse, reference out, reference lse) of a case on the host."""
    import cupy as cp

    d = upload(c)
    out, lse = mla_cupy.mla_prefill(d["q"], d["k"], d["v"], d["k_rope"], d["valid_length"], d["cache_row_offsets"],
                                    mask=mask, cache_offsets=d["cache_offsets"], q_start_pos=d["q_start_pos"],
                                    return_lse=True, kernel=kernel, **kw)
    ref, ref_lse = reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets, mask=mask,
                                         cache_offsets=c.cache_offsets, q_start_pos=c.q_start_pos, return_lse=True)
    return cp.asnumpy(out).astype(np.float64), cp.asnumpy(lse), ref, ref_lse


def nan_case():
    """Sequence 0: 420 keys from position 5 and 300 queries from position -35 (rows 0..39 see no
    key under causal masks); sequence 1: 40 and 40. 16 heads, bf16."""
    return make_case([300, 40], [420, 40], 16, BF16, seed=42, cache_offsets=[5, 0], q_start_pos=[-35, 0])


POISON = {  # where one NaN goes: (array, index)
    "q_nope": ("q", (170, 3, 5)), "q_rope": ("q", (170, 3, 128 + 5)), "k": ("k", (200, 3, 5)),
    "k_rope": ("k_rope", (200, 0, 5)), "v": ("v", (200, 3, 5)),
}


def _v_rows_that_see(c, mask):
    """Rows of sequence 0 that see key 200 (where POISON puts the NaN of v)."""
    qp, kp = reference.positions(0, 300, 420, c.cache_offsets, c.q_start_pos)
    return mask.visible(qp, kp[200])


def _within_v_reach(got, ref, sees=None):
    """The contract's reach of a NaN (or of ``0 * Inf``) in v is a range: every row that sees the
    key, at most the rows of each 128-row query block whose visible span holds it (the reference's
    rule, which the Hopper kernel meets exactly); the portable kernel's 16-row warps skip the key
    tiles outside their own span and reach fewer. Checks the upper bound (and, given ``sees``, the
    rows of sequence 0 that see key 200, the lower one), then returns ``got`` with NaN wherever the
    reference has it, for the comparison of everything else."""
    assert not (np.isnan(got) & ~np.isnan(ref)).any(), "NaN outside the contract's reach"
    if sees is not None:
        assert np.isnan(got[:300, 3, 5][sees]).all(), "a row that sees the key lacks its NaN"
    return np.where(np.isnan(ref), np.nan, got)


@pytest.mark.parametrize("where", list(POISON))
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: type(m).__name__)
@kernels
def test_nan_reaches_what_the_reference_says(kernel, mask, where):
    """One NaN in q, k, the rope or v of sequence 0: the kernel's NaN at exactly the reference's
    places (the contract's rule), every other value as the reference's."""
    c = nan_case()
    name, idx = POISON[where]
    getattr(c, name)[idx] = np.nan
    got, lse, ref, ref_lse = _run_nan(c, mask, kernel)
    assert np.isnan(ref).any()
    if where == "v" and kernel == "sm80":
        got = _within_v_reach(got, ref, _v_rows_that_see(c, mask))
    assert_like_reference(got, ref, c.valid_length, got_lse=lse, ref_lse=ref_lse)


@kernels
def test_nan_in_v_stays_inside_the_contract(kernel):
    """Every kernel, the portable one included: a NaN in v reaches every row that sees the key, and
    no row outside the contract's reach."""
    c = nan_case()
    c.v[200, 3, 5] = np.nan
    for mask in MASKS:
        got, _, ref, _ = _run_nan(c, mask, kernel)
        sees = _v_rows_that_see(c, mask)
        assert sees.any(), type(mask).__name__
        _within_v_reach(got, ref, sees)


@kernels
def test_nan_row_lse_is_nan(kernel):
    """The contract's lse of a row with a NaN score is NaN (the log-sum-exp of its scores)."""
    c = nan_case()
    c.k[200, 3, 5] = np.nan
    _, lse, _, ref_lse = _run_nan(c, CausalMask(), kernel)
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))


@kernels
def test_nan_and_inf_in_one_sequence_stay_there(kernel):
    """NaN in sequence 0's q, k and v (and an Inf in its rope) never reaches sequence 1: tiles past
    a sequence's end are masked and their V rows zeroed; inside sequence 0 the kernel's NaN and Inf
    are the reference's."""
    c = make_case([100, 70], [130, 70], 16, BF16, seed=40)
    for a in (c.q, c.k, c.v):
        a[:40] = np.nan
    c.k_rope[60, 0, 3] = np.inf
    got, lse, ref, ref_lse = _run_nan(c, NullMask(), kernel)
    assert np.isfinite(got[100:]).all() and np.isnan(ref[:100]).any()
    assert_like_reference(got, ref, c.valid_length, got_lse=lse, ref_lse=ref_lse)


@pytest.mark.parametrize("mask", [NullMask(), SlidingWindowCausalMask(37)], ids=lambda m: type(m).__name__)
@kernels
def test_inf_in_v_is_inf_where_seen_nan_where_multiplied_by_zero(kernel, mask):
    c = nan_case()
    c.v[200, 3, 5] = -np.inf
    got, lse, ref, ref_lse = _run_nan(c, mask, kernel)
    assert np.isneginf(ref).any()
    if kernel == "sm80":
        got = _within_v_reach(got, ref)
    assert_like_reference(got, ref, c.valid_length, got_lse=lse, ref_lse=ref_lse)


def test_auto_picks_the_hopper_kernel_on_hopper():
    import cupy as cp

    from mla_cupy._select import choose_kernel

    want = "sm90" if cp.cuda.Device().compute_capability == "90" else "sm80"
    assert choose_kernel("auto", paged=False) == want
    assert choose_kernel("auto", paged=True) == want
    with pytest.raises(ValueError, match="kernel: expected one of"):
        choose_kernel("fast", paged=False)


def test_reference_runs_on_cupy_arrays_as_on_numpy():
    """The float64 reference given CuPy arrays (what the fuzz, reliability and bench checks use)
    computes on the GPU what it computes on the host, NaN included; a paged rope too."""
    import cupy as cp

    c = nan_case()
    c.v[200, 3, 5] = np.nan
    c.k[150, 2, 3] = np.nan
    c.q[170, 0, 9] = np.inf
    mask = SlidingWindowCausalMask(37)
    kw = dict(mask=mask, return_lse=True)
    want, want_lse = reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets,
                                           cache_offsets=c.cache_offsets, q_start_pos=c.q_start_pos, **kw)
    d = upload(c)
    got, got_lse = reference.mla_prefill(d["q"], d["k"], d["v"], d["k_rope"], d["valid_length"],
                                         d["cache_row_offsets"], cache_offsets=d["cache_offsets"],
                                         q_start_pos=d["q_start_pos"], **kw)
    assert isinstance(got, cp.ndarray) and isinstance(got_lse, cp.ndarray)
    got, got_lse = cp.asnumpy(got), cp.asnumpy(got_lse)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isnan(got_lse), np.isnan(want_lse))
    fin = ~np.isnan(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-10, atol=1e-12)
    out16 = cp.empty(want.shape, BF16)
    assert reference.mla_prefill(d["q"], d["k"], d["v"], d["k_rope"], d["valid_length"], d["cache_row_offsets"],
                                 cache_offsets=d["cache_offsets"], q_start_pos=d["q_start_pos"], mask=mask,
                                 out=out16) is out16
    np.testing.assert_array_equal(np.isnan(cp.asnumpy(out16).astype(np.float64)), np.isnan(want))

"""GPU tests of mla_prefill against the float64 reference (pytest -m gpu; skipped without a GPU)."""
import threading

import numpy as np
import pytest

import mla_cupy
from mla_cupy import CausalMask, ChunkedCausalMask, ChunkedMask, NullMask, SlidingWindowCausalMask, reference

from _cases import BF16, FP16, make_case
from gpu_util import KERNELS, run_and_check, upload

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

    from mla_cupy import api

    c = make_case([700, 300, 7], [2000, 300, 64], 128, BF16, seed=21)
    p = api.check_inputs(*[cp.asarray(a) for a in (c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets)],
                         scale=None, mask=None, q_max_seq_len=None, cache_offsets=None, q_start_pos=None, out=None,
                         out_dtype=None, validate=True, device=True, read_offsets=True)
    assert 1 < api.heads_per_section(p, cp.cuda.runtime.getDevice()) < 128
    run_and_check(c, kernel=kernel)
    run_and_check(c, mask=SlidingWindowCausalMask(300), kernel=kernel)


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
    errors = []

    def work(i):
        try:
            with cp.cuda.Stream(non_blocking=True):
                run_and_check(c, mask=SlidingWindowCausalMask(5 + i), out_dtype=np.float32)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert jit.compile_count() - before <= 1


@kernels
def test_nan_in_one_sequence_stays_there(kernel):
    """NaN in sequence 0's q, k and v never reaches sequence 1 (tiles past a sequence's end are
    masked and their V rows zeroed, never mixed in)."""
    c = make_case([100, 70], [130, 70], 16, BF16, seed=40)
    for a in (c.q, c.k, c.v):
        a[:40] = np.nan
    d = upload(c)
    out = mla_cupy.mla_prefill(d["q"], d["k"], d["v"], d["k_rope"], d["valid_length"], d["cache_row_offsets"],
                               mask=NullMask(), kernel=kernel).get().astype(np.float64)
    c1 = make_case([70], [70], 16, BF16, seed=0)
    c1.q, c1.k, c1.v, c1.k_rope = c.q[100:], c.k[130:], c.v[130:], c.k_rope[130:]
    ref = reference.mla_prefill(c1.q, c1.k, c1.v, c1.k_rope, c1.valid_length, c1.cache_row_offsets, mask=NullMask())
    assert np.isfinite(out[100:]).all()
    assert np.linalg.norm(out[100:] - ref) / np.linalg.norm(ref) < 1e-2
    assert np.isnan(out[:100]).any()  # within sequence 0, NaN keys reach every row (documented)


@kernels
def test_nan_within_a_sequence_reaches_documented_rows(kernel):
    """Inside one causal sequence (300 queries and keys), a NaN in key 150's k reaches exactly the
    rows that see key 150 (a masked score is replaced, not multiplied); a NaN in its v reaches every
    row of each 128-row query block whose key span holds key 150 (0 * NaN in P V): rows 128-299."""
    for name, first in (("k", 150), ("v", 128)):
        c = make_case([300], [300], 16, BF16, seed=42)
        getattr(c, name)[150, 3] = np.nan
        d = upload(c)
        out = mla_cupy.mla_prefill(d["q"], d["k"], d["v"], d["k_rope"], d["valid_length"], d["cache_row_offsets"],
                                   mask=CausalMask(), kernel=kernel).get().astype(np.float64)
        bad = np.isnan(out).any(axis=2)  # [row, head]
        assert not bad[:first].any(), (name, int(np.argmax(bad.any(axis=1))))
        assert bad[first:, 3].all(), name
        assert not bad[:, [h for h in range(16) if h != 3]].any(), name  # heads do not mix


def test_auto_picks_the_hopper_kernel_on_hopper():
    import cupy as cp

    from mla_cupy.api import choose_kernel

    want = "sm90" if cp.cuda.Device().compute_capability == "90" else "sm80"
    assert choose_kernel("auto", paged=False) == want
    assert choose_kernel("auto", paged=True) == want
    with pytest.raises(ValueError, match="kernel: expected one of"):
        choose_kernel("fast", paged=False)

"""Large sizes (64-bit offsets), memory limits, repeated calls (pytest -m gpu)."""
import numpy as np
import pytest

import mla_cupy
from mla_cupy import reference

from _cases import BF16
from gpu_util import KERNELS, small_problem

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kernel", KERNELS)
def test_more_than_2_31_elements(kernel):
    """700 sequences x 128 queries over 200 keys, H = 128: Tq * H * Dqk and Tk * H * Dv pass 2^31.
    Checked on a sample of sequences that includes the last ones."""
    import cupy as cp

    B, sq, sk, H = 700, 128, 200, 128
    tq, tk = B * sq, B * sk
    assert tq * H * 192 > 2**31 and tk * H * 128 > 2**31
    rng = cp.random.default_rng(0)

    def rand(*shape):
        out = cp.empty(shape, BF16)
        step = max(1, shape[0] // 8)
        for i in range(0, shape[0], step):  # chunked: bounded float32 temporaries
            out[i:i + step] = rng.standard_normal((min(step, shape[0] - i),) + shape[1:], dtype=cp.float32).astype(BF16)
        return out

    q, k, v, kr = rand(tq, H, 192), rand(tk, H, 128), rand(tk, H, 128), rand(tk, 1, 64)
    vl = cp.arange(0, tq + 1, sq, dtype=cp.uint32)
    cro = cp.arange(0, tk + 1, sk, dtype=cp.uint32)
    out = mla_cupy.mla_prefill(q, k, v, kr, vl, cro, kernel=kernel)
    for b in (0, 351, B - 2, B - 1):
        qs, ks = slice(b * sq, (b + 1) * sq), slice(b * sk, (b + 1) * sk)
        one = cp.asarray(np.array([0, sq], np.uint32)), cp.asarray(np.array([0, sk], np.uint32))
        ref = reference.mla_prefill(q[qs], k[ks], v[ks], kr[ks], *one)  # float64 on the GPU
        got = out[qs].astype(cp.float64)
        assert float(cp.linalg.norm(got - ref) / cp.linalg.norm(ref)) < 1e-2, b
    del q, k, v, kr, out
    cp.get_default_memory_pool().free_all_blocks()


def test_request_that_cannot_fit_fails_cleanly():
    import cupy as cp
    from cupy.lib.stride_tricks import as_strided

    base = cp.asarray(np.random.default_rng(0).standard_normal((1, 128, 192)).astype(BF16))
    tq = 2**31 // 128  # the output alone would need 2^31 * 128 * 2 bytes = 512 GiB
    q = as_strided(base, shape=(tq, 128, 192), strides=(0, base.strides[1], base.strides[2]))
    small = cp.asarray(np.random.default_rng(1).standard_normal((4, 128, 128)).astype(BF16))
    kr = cp.asarray(np.random.default_rng(2).standard_normal((4, 1, 64)).astype(BF16))
    with pytest.raises(MemoryError, match="out: cannot allocate"):
        mla_cupy.mla_prefill(q, small, small, kr, cp.asarray(np.array([0, tq], np.uint32)),
                             cp.asarray(np.array([0, 4], np.uint32)))
    # the process is still usable
    out = mla_cupy.mla_prefill(base, small, small, kr, cp.asarray(np.array([0, 1], np.uint32)),
                               cp.asarray(np.array([0, 4], np.uint32)))
    assert bool(cp.isfinite(out.astype(cp.float32)).all())


def test_repeated_calls_keep_memory_flat():
    """10,000 one-shot calls with out= given keep device memory flat, and allocating calls return
    their outputs to the pool. (The host time per call of plan.run: tests/test_plan_gpu.py.)"""
    import cupy as cp

    x = small_problem(64, 16, seed=3)
    q, k, kr, vl, out = x["q"], x["k"], x["k_rope"], x["offsets"], x["out"]

    def call():
        mla_cupy.mla_prefill(q, k, k, kr, vl, vl, out=out, q_max_seq_len=64, validate=False)

    pool = cp.get_default_memory_pool()
    for _ in range(10):
        call()
    cp.cuda.Device().synchronize()
    used0, total0 = pool.used_bytes(), pool.total_bytes()
    for _ in range(10_000):
        call()
    cp.cuda.Device().synchronize()
    for _ in range(1000):  # allocating calls return their output to the pool
        mla_cupy.mla_prefill(q, k, k, kr, vl, vl, q_max_seq_len=64, validate=False)
    cp.cuda.Device().synchronize()
    assert pool.used_bytes() == used0
    assert pool.total_bytes() <= total0 + out.nbytes * 2


def test_unvalidated_calls_still_reject_bad_input():
    """validate=False with q_max_seq_len reads nothing back from the device, yet every call checks
    its arguments (dtype, shape, alignment, keyword types), and a repeated call reads new data in
    the same buffers."""
    import cupy as cp

    sq, H = 33, 16
    x = small_problem(sq, H, seed=5)
    q, k, kr, vl, out = x["q"], x["k"], x["k_rope"], x["offsets"], x["out"]
    kw = dict(q_max_seq_len=sq, validate=False)
    mla_cupy.mla_prefill(q, k, k, kr, vl, vl, out=out, **kw)
    first = out.copy()
    mla_cupy.mla_prefill(q, k, k, kr, vl, vl, out=out, **kw)  # the same call again
    assert bool(cp.all(out == first)) and not bool(cp.isnan(out).any())
    q[...] = cp.flip(q, axis=0).copy()  # new data in the same buffer
    want = mla_cupy.mla_prefill(q, k, k, kr, vl, vl)
    mla_cupy.mla_prefill(q, k, k, kr, vl, vl, out=out, **kw)
    assert bool(cp.all(out == want)) and not bool(cp.all(out == first))
    with pytest.raises(TypeError, match="out"):
        mla_cupy.mla_prefill(q, k, k, kr, vl, vl, out=cp.empty((sq, H, 128), np.float16), **kw)
    with pytest.raises(ValueError, match="out"):
        mla_cupy.mla_prefill(q, k, k, kr, vl, vl, out=cp.empty((sq, H + 1, 128), BF16), **kw)
    with pytest.raises(ValueError, match="16-byte"):
        mla_cupy.mla_prefill(q, k, k, kr, vl, vl, out=cp.empty(sq * H * 128 + 1, BF16)[1:].reshape(sq, H, 128), **kw)
    with pytest.raises(ValueError, match="q_max_seq_len"):
        mla_cupy.mla_prefill(q, k, k, kr, vl, vl, out=out, q_max_seq_len=True, validate=False)
    with pytest.raises(ValueError, match="scale"):
        mla_cupy.mla_prefill(q, k, k, kr, vl, vl, out=out, scale=-1.0, **kw)

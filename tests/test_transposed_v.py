"""V^T made by the quantizer (``quantize_per_token(..., cache_row_offsets=)``, a
:class:`mla_cupy.fp8.TransposedV`) without a GPU: the host quantizer's V^T is the model's, and the
call paths that take one in place of ``v`` (one-shot, plan, plan cache; tests/_fake_gpu.py: the
device stubbed) launch the attention kernel alone, reading that V^T, and refuse one of another
call before any launch."""
import numpy as np
import pytest

import mla_cupy
from mla_cupy import fp8, plan_cache_clear, plan_cache_info, quant
from mla_cupy._plan_cache import DEFAULT_MAXSIZE
from mla_cupy.fp8 import TransposedV

from _cases import BF16, make_case
from _fake_gpu import fake_gpu, host_cupy, require_cupy

NAMES = ("q_nope", "q_rope", "q_scale", "k", "k_scales", "v", "k_rope")
FAST = dict(q_max_seq_len=5, validate=False)


# ------------------------------------------------------------------------------------------------
# the host quantizer

@pytest.mark.parametrize("e4m3_rope", [False, True], ids=["bf16-rope", "e4m3-rope"])
@pytest.mark.parametrize("sk,extra", [([5, 0, 37, 1, 16], 0), ([0], 3), ([], 2), ([20, 0], 7)],
                         ids=["ragged-empty", "one-empty", "no-sequence", "rows-past-the-last"])
def test_host_quantizer_writes_the_models_vt(e4m3_rope, sk, extra):
    """``"v_t"`` holds transpose_v_host of the quantized v for the offsets given (kept by
    reference); every other output is what the quantizer gives without offsets."""
    c = make_case([3] * len(sk), sk, 4, BF16, seed=len(sk), extra_keys=extra)
    plain = quant.quantize_per_token(c.q, c.k, c.v, c.k_rope, e4m3_rope=e4m3_rope)
    got = quant.quantize_per_token(c.q, c.k, c.v, c.k_rope, e4m3_rope=e4m3_rope, cache_row_offsets=c.cache_row_offsets)
    assert set(got) == set(plain) | {"v_t"}
    for n in plain:
        np.testing.assert_array_equal(np.asarray(got[n]).view(np.uint8), np.asarray(plain[n]).view(np.uint8))
    tv = got["v_t"]
    assert isinstance(tv, TransposedV) and tv.cache_row_offsets is c.cache_row_offsets
    assert (tv.num_heads, tv.num_keys, tv.batch) == (4, c.k.shape[0], len(sk))
    assert tv.data.dtype == np.uint8 and tv.data.shape == fp8.vt_shape(4, c.k.shape[0], len(sk))
    np.testing.assert_array_equal(tv.data, fp8.transpose_v_host(plain["v"], c.cache_row_offsets))
    # and back: the keys of the sequences (the rows past the last one are in no column)
    back = fp8.untranspose_v_host(tv.data, c.cache_row_offsets, tv.num_keys)
    end = int(c.cache_row_offsets[-1])
    np.testing.assert_array_equal(back[:end], plain["v"].view(np.uint8)[:end])
    assert not back[end:].any()


def test_host_quantizer_checks_the_offsets():
    c = make_case([2, 2], [3, 4], 2, BF16)
    args = (c.q, c.k, c.v, c.k_rope)
    with pytest.raises(ValueError, match=r"cache_row_offsets: the last offset must be <= Tk \(v.shape\[0\]\) = 7"):
        quant.quantize_per_token(*args, cache_row_offsets=np.array([0, 3, 8], np.uint32))
    with pytest.raises(ValueError, match="cache_row_offsets: offsets must be non-decreasing"):
        quant.quantize_per_token(*args, cache_row_offsets=np.array([0, 4, 3], np.uint32))
    with pytest.raises(TypeError, match="cache_row_offsets: expected dtype int32 or uint32, got int64"):
        quant.quantize_per_token(*args, cache_row_offsets=np.array([0, 3, 7], np.int64))


def test_transposed_v_checks_what_it_is_built_from():
    cro = np.array([0, 3, 7], np.uint32)
    good = np.zeros(fp8.vt_shape(2, 7, 2), np.uint8)
    tv = TransposedV(good, cro, 7)
    assert "num_heads=2, num_keys=7, batch=2" in repr(tv)
    with pytest.raises(ValueError, match=r"data: expected shape \[2, 128, 48\] \(\[H, 128, vt_columns\(Tk, B\)\] uint8 "
                                         r"with Tk = 40, B = 2\), got \[2, 128, 48\]|data: expected shape"):
        TransposedV(good, cro, 40)
    with pytest.raises(TypeError, match="data: expected dtype uint8, got int8"):
        TransposedV(good.view(np.int8), cro, 7)
    with pytest.raises(ValueError, match="num_keys: expected a non-negative int, got -1"):
        TransposedV(good, cro, -1)
    with pytest.raises(ValueError, match="cache_row_offsets: expected B \\+ 1 >= 1 offsets"):
        TransposedV(good, cro[:0], 7)


# ------------------------------------------------------------------------------------------------
# the call paths, on a fake GPU

@pytest.fixture
def gpu():
    require_cupy()
    plan_cache_clear()
    mla_cupy.set_plan_cache_size(DEFAULT_MAXSIZE)
    with fake_gpu("90") as g:
        yield g
    plan_cache_clear()


def fp8_call(sk=(6, 0, 3), heads=4, e4m3_rope=False, seed=0):
    """``(arrays by name, V^T, valid_length, cache_row_offsets, out)`` of a small fp8 call over host
    memory (tests/_fake_gpu.py), V^T from the host quantizer for these offsets."""
    sq = [5, 2, 3][:len(sk)]
    c = make_case(sq, list(sk), heads, BF16, seed=seed)
    f = quant.quantize_per_token(c.q, c.k, c.v, c.k_rope, e4m3_rope=e4m3_rope, cache_row_offsets=c.cache_row_offsets)
    a = {n: host_cupy(f[n].view(np.uint8) if f[n].dtype.itemsize == 1 else f[n]) for n in NAMES}
    cro = host_cupy(c.cache_row_offsets)
    tv = TransposedV(host_cupy(f["v_t"].data), cro, f["v_t"].num_keys)
    out = host_cupy(np.zeros((sum(sq), heads, 128), BF16))
    return a, tv, host_cupy(c.valid_length), cro, out


def args_with(a, v):
    return [v if n == "v" else a[n] for n in NAMES]


def tm_v_pointer(values) -> int:
    """The address the V tensor map was encoded with (the fake encoder writes it first)."""
    return int(np.frombuffer(values["tm_v"].tobytes(), np.uint64)[0])


def prefill_values(gpu, fn):
    """What ``fn()`` launched: (the kinds of launches, the prefill's argument values)."""
    n = len(gpu.launches)
    fn()
    kinds = ["prefill" if "num_heads" in pl.pack.names else "vt" for pl, _, _ in gpu.launches[n:]]
    return kinds, gpu.values(-1)


@pytest.mark.parametrize("e4m3_rope", [False, True], ids=["bf16-rope", "e4m3-rope"])
def test_one_shot_with_vt_launches_the_kernel_alone_on_that_vt(gpu, e4m3_rope):
    a, tv, vl, cro, out = fp8_call(e4m3_rope=e4m3_rope)
    kinds, plain = prefill_values(gpu, lambda: mla_cupy.mla_prefill_fp8(*args_with(a, a["v"]), vl, cro, out=out, **FAST))
    assert kinds == ["vt", "prefill"]
    for _ in range(2):  # packed, then from the plan cache
        kinds, given = prefill_values(gpu, lambda: mla_cupy.mla_prefill_fp8(*args_with(a, tv), vl, cro, out=out, **FAST))
        assert kinds == ["prefill"]  # no pre-pass
        assert tm_v_pointer(given) == tv.data.data.ptr
        for n in plain:  # everything else as with v, but the V map's address
            if n != "tm_v":
                assert plain[n].tobytes() == given[n].tobytes(), n
        vt_map, plain_map = (np.frombuffer(x["tm_v"].tobytes(), np.uint64) for x in (given, plain))
        np.testing.assert_array_equal(vt_map[1:], plain_map[1:])  # dtype, dims, strides, box: the same V^T layout
    assert plan_cache_info().hits == 1 and plan_cache_info().misses == 2  # v and V^T: two keys


def test_plan_run_with_vt_launches_the_kernel_alone(gpu):
    a, tv, vl, cro, out = fp8_call()
    pl = mla_cupy.plan(vl, cro, num_heads=4, dtype=BF16, fp8=True, q_max_seq_len=5, validate=False)
    ws = host_cupy(np.zeros(4 * 128 * 64, np.uint8))  # the fake GPU allocates no plan workspace
    kinds, plain = prefill_values(gpu, lambda: pl.run_fp8(*args_with(a, a["v"]), out=out, workspace=ws))
    assert kinds == ["vt", "prefill"]
    for _ in range(2):  # the first run of the layout, then its record
        kinds, given = prefill_values(gpu, lambda: pl.run_fp8(*args_with(a, tv), out=out))
        assert kinds == ["prefill"] and tm_v_pointer(given) == tv.data.data.ptr
    with pytest.raises(ValueError, match="workspace: a call given V.T"):
        pl.run_fp8(*args_with(a, tv), out=out, workspace=ws)
    kinds, again = prefill_values(gpu, lambda: pl.run_fp8(*args_with(a, a["v"]), out=out, workspace=ws))
    assert kinds == ["vt", "prefill"] and again["tm_v"].tobytes() == plain["tm_v"].tobytes()  # v again: the pre-pass again
    # a TransposedV over equal offsets in another array: a plan that read its offsets compares the
    # values, one that did not refuses it
    other = TransposedV(tv.data, host_cupy(np.asarray([0, 6, 6, 9], np.uint32)), tv.num_keys)
    with pytest.raises(ValueError, match="v: the TransposedV was laid out for another cache_row_offsets array"):
        pl.run_fp8(*args_with(a, other), out=out)
    read = mla_cupy.plan(vl, cro, num_heads=4, dtype=BF16, fp8=True)
    assert prefill_values(gpu, lambda: read.run_fp8(*args_with(a, other), out=out))[0] == ["prefill"]
    shifted = TransposedV(tv.data, host_cupy(np.asarray([0, 5, 6, 9], np.uint32)), tv.num_keys)
    with pytest.raises(ValueError, match=r"its offset \[1\] is 5, the call's 6"):
        read.run_fp8(*args_with(a, shifted), out=out)
    _, tv8, _, _, _ = fp8_call(heads=8)
    with pytest.raises(ValueError, match=r"v: a TransposedV of H = 8 heads, the call has H = 4"):
        pl.run_fp8(*args_with(a, TransposedV(tv8.data, cro, tv8.num_keys)), out=out)


def test_a_vt_of_another_call_is_refused_before_any_launch(gpu):
    a, tv, vl, cro, out = fp8_call()
    n = len(gpu.launches)

    def call(v, **kw):
        return mla_cupy.mla_prefill_fp8(*args_with(a, v), vl, kw.pop("cro", cro), out=out, **{**FAST, **kw})

    _, tv8, _, cro8, _ = fp8_call(heads=8)
    with pytest.raises(ValueError, match=r"v: a TransposedV of H = 8 heads, the call has H = 4 \(q_nope\)"):
        call(TransposedV(tv8.data, cro, tv8.num_keys))
    _, tv_more, _, cro_more, _ = fp8_call(sk=(6, 0, 4))
    with pytest.raises(ValueError, match=r"v: a TransposedV of Tk = 10 keys, the call's k has Tk = 9 rows"):
        call(tv_more)
    _, tv2, _, cro2, _ = fp8_call(sk=(6, 3))
    with pytest.raises(ValueError, match=r"v: a TransposedV of B = 2 sequences, the call has B = 3"):
        call(tv2)
    # equal offsets in another array: refused without validate, compared with it
    copy = host_cupy(np.asarray([0, 6, 6, 9], np.uint32))
    other = TransposedV(tv.data, copy, tv.num_keys)
    with pytest.raises(ValueError, match="v: the TransposedV was laid out for another cache_row_offsets array than the "
                                         "call's .* or validate=True to compare their values"):
        call(other)
    with pytest.raises(ValueError, match="workspace: a call given V.T .* needs no workspace"):
        call(tv, workspace=host_cupy(np.zeros(4 * 128 * 64, np.uint8)))
    assert len(gpu.launches) == n  # nothing launched
    call(other, validate=True)  # the same values: taken
    assert len(gpu.launches) == n + 1
    shifted = TransposedV(tv.data, host_cupy(np.asarray([0, 5, 6, 9], np.uint32)), tv.num_keys)
    with pytest.raises(ValueError, match=r"v: the TransposedV was laid out for other cache_row_offsets: its offset "
                                         r"\[1\] is 5, the call's 6"):
        call(shifted, validate=True)
    # a view of the same offsets' memory with another length is not the same offsets
    with pytest.raises(ValueError, match="B = 2 sequences, the call has B = 3"):
        call(TransposedV(tv2.data, cro[:3], tv2.num_keys))


def test_the_plan_cache_serves_a_vt_of_the_calls_offsets_only(gpu):
    """A hit needs the TransposedV's offsets to be the call's (same array or address); a
    TransposedV of other offsets (equal values) goes through the checks, never through the cache."""
    a, tv, vl, cro, out = fp8_call()
    mla_cupy.mla_prefill_fp8(*args_with(a, tv), vl, cro, out=out, q_max_seq_len=5)
    mla_cupy.mla_prefill_fp8(*args_with(a, tv), vl, cro, out=out, q_max_seq_len=5)
    assert (plan_cache_info().hits, plan_cache_info().misses) == (1, 1)
    other = TransposedV(tv.data, host_cupy(np.asarray([0, 6, 6, 9], np.uint32)), tv.num_keys)
    mla_cupy.mla_prefill_fp8(*args_with(a, other), vl, cro, out=out, q_max_seq_len=5)  # validate: values compared
    assert (plan_cache_info().hits, plan_cache_info().misses) == (1, 2)


def test_the_reference_refuses_a_transposed_v():
    c = make_case([2], [3], 2, BF16)
    f = quant.quantize_per_token(c.q, c.k, c.v, c.k_rope, cache_row_offsets=c.cache_row_offsets)
    with pytest.raises(TypeError, match="v: the reference takes v as"):
        mla_cupy.reference.mla_prefill_fp8(*[f["v_t"] if n == "v" else f[n] for n in NAMES], c.valid_length,
                                           c.cache_row_offsets)

"""The float64 reference makes every check the GPU call makes: each bad input runs through both,
the GPU side on fake device arrays (the checks run before anything needs a device; conftest's
``as_if_gpu``), the reference on the same data as NumPy arrays, and both raise the same exception
with the same message.

What the reference takes beyond the GPU call, by design (it is the float64 oracle): inputs in a
wider float dtype (there the kernels' dtype and layout checks do not apply; tested below), and
float64 results (``out``, ``out_dtype``, ``lse``), whose messages then also name float64; and e4m3
bytes as ml_dtypes' ``float8_e4m3fn`` beside uint8. What it never checks: where the data lives (the
device check)."""
import numpy as np
import pytest

import mla_cupy
from mla_cupy import PagedKVCache, reference

from _cases import BF16, FP16, make_case
from _fake import dev
from test_validation import BAD, base_args

#: BAD rows that are about where the data lives (host data where a device array is needed).
DEVICE_PLACEMENT = {i for i, (over, _, _) in enumerate(BAD)
                    if any(type(x) is np.ndarray for x in over.values())}
#: BAD rows the reference computes by design: a wider float dtype of q (the oracle's inputs).
WIDER_DTYPE = {i for i, (over, _, _) in enumerate(BAD)
               if "q" in over and np.dtype(over["q"].dtype) == np.float32 and over["q"].ndim == 3
               and over["q"].shape[-1] == 192}


def _host(x):
    """The host data under a fake device array, strides and address kept (what a reference caller
    has); other arguments as they are."""
    if isinstance(x, PagedKVCache):
        return PagedKVCache(_host(x.blocks), _host(x.lookup_table), x.page_size, x.rope_offset,
                            scales=None if x.scales is None else _host(x.scales))
    return x.view(np.ndarray) if isinstance(x, np.ndarray) else x


def _raised(fn, *args, **kw):
    with pytest.raises((TypeError, ValueError)) as info:
        fn(*args, **kw)
    return type(info.value), str(info.value)


def _same_error(gpu, ref):
    """The reference's error is the GPU call's; where a message lists dtypes, the reference's also
    names float64 (its own results) and ml_dtypes' float8_e4m3fn (e4m3 bytes on the host)."""
    assert ref[0] is gpu[0], (gpu, ref)
    assert ref[1].replace(" or float64", "").replace(" or float8_e4m3fn", "") == gpu[1], (gpu, ref)


def _call_both(api, ref_api, args: dict, kw: dict):
    names = list(args)
    gpu = _raised(api, *args.values(), **kw)
    host_args = [_host(args[n]) for n in names]
    ref = _raised(ref_api, *host_args, **{k: _host(v) for k, v in kw.items()})
    return gpu, ref


@pytest.mark.parametrize("i", [i for i in range(len(BAD)) if i not in DEVICE_PLACEMENT | WIDER_DTYPE],
                         ids=lambda i: f"{i}-{'-'.join(BAD[i][0])}")
def test_each_bad_input_raises_the_same_error_in_both(i, as_if_gpu):
    over, exc, _ = BAD[i]
    a, kw = base_args(), {}
    for name, val in over.items():
        (a if name in a else kw)[name] = val
    gpu, ref = _call_both(mla_cupy.mla_prefill, reference.mla_prefill, a, kw)
    assert gpu[0] is exc
    _same_error(gpu, ref)


def test_the_rows_left_out_are_the_placement_and_the_oracles_dtypes():
    """Two kinds of rows only are not compared above, and the reference computes the second."""
    assert DEVICE_PLACEMENT and WIDER_DTYPE and not DEVICE_PLACEMENT & WIDER_DTYPE
    for i in WIDER_DTYPE:
        c = make_case([5, 3], [6, 3], heads=4, dtype=np.float32, seed=1)
        out = reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets)
        assert out.dtype == np.float64 and np.isfinite(out).all()


def test_bf16_q_with_fp16_k_is_refused_by_both(as_if_gpu):
    """The case that ran on the reference and failed on the GPU."""
    a = base_args()
    a["k"] = dev(np.ones(a["k"].shape, FP16))
    gpu, ref = _call_both(mla_cupy.mla_prefill, reference.mla_prefill, a, {})
    assert gpu == (TypeError, "k: expected dtype bfloat16 (the dtype of q), got float16")
    _same_error(gpu, ref)


def _more_bad():
    """Bad inputs beyond test_validation's list: ropes, paged caches, results, positions."""
    a = base_args()
    tq, h = a["q"].shape[:2]
    tk = a["k"].shape[0]
    blocks = np.ones((4, 16, 1, 576), BF16)
    lut = np.zeros((2, 1), np.int32)
    yield "rope float32", dict(k_rope=dev(np.ones((tk, 1, 64), np.float32))), {}
    yield "rope misaligned view", dict(k_rope=dev(np.ones((tk, 1, 576 + 8), BF16))[:, :, 4:68]), {}
    yield "paged blocks fp16", dict(k_rope=PagedKVCache(dev(blocks.astype(FP16)), dev(lut), 16)), {}
    yield "paged table strided", dict(k_rope=PagedKVCache(dev(blocks), dev(np.zeros((2, 4), np.int32))[:, ::2], 16)), {}
    yield "paged block id", dict(k_rope=PagedKVCache(dev(blocks), dev(np.array([[0], [7]], np.int32)), 16)), {}
    yield "out float16", {}, dict(out=dev(np.ones((tq, h, 128), FP16)))
    yield "out strided", {}, dict(out=dev(np.ones((tq, h, 256), BF16))[:, :, ::2])
    yield "lse strided heads", {}, dict(lse=dev(np.ones((tq, 2 * h), np.float32))[:, ::2])
    yield "offsets strided", dict(valid_length=dev(np.array([0, 0, 5, 0, 8, 0], np.uint32))[::2]), {}
    yield "q_start_pos strided", {}, dict(q_start_pos=dev(np.array([0, 0, 1, 0], np.int64))[::2])
    yield "scale bool", {}, dict(scale=True)
    yield "kernel name", {}, dict(kernel="sm70")


@pytest.mark.parametrize("name,over,kw", list(_more_bad()), ids=[m[0] for m in _more_bad()])
def test_more_bad_inputs_raise_the_same_error_in_both(name, over, kw, as_if_gpu):
    a = dict(base_args(), **over)
    gpu, ref = _call_both(mla_cupy.mla_prefill, reference.mla_prefill, a, kw)
    _same_error(gpu, ref)


def _fp8_args():
    a = base_args()
    tq, h = a["q"].shape[:2]
    tk = a["k"].shape[0]
    return dict(q_nope=dev(np.zeros((tq, h, 128), np.uint8)), q_rope=dev(np.ones((tq, h, 64), BF16)),
                q_scale=dev(np.ones((tq, 1), np.float32)), k=dev(np.zeros((tk, h, 128), np.uint8)),
                k_scales=dev(np.ones((tk, 1), np.float32)), v=dev(np.zeros((tk, h, 128), np.uint8)),
                k_rope=a["k_rope"], valid_length=a["valid_length"], cache_row_offsets=a["cache_row_offsets"])


def _fp8_bad():
    f = _fp8_args()
    tq, h = f["q_rope"].shape[:2]
    tk = f["k"].shape[0]
    yield "q_nope bf16", dict(q_nope=dev(np.ones((tq, h, 128), BF16)))
    yield "k width", dict(k=dev(np.zeros((tk, h, 64), np.uint8)))
    yield "q_rope fp16", dict(q_rope=dev(np.ones((tq, h, 64), FP16)))
    yield "k_scales float64", dict(k_scales=dev(np.ones((tk, 1), np.float64)))
    yield "k_scales strided", dict(k_scales=dev(np.ones((tk, 2), np.float32))[:, :1])
    yield "k strided", dict(k=dev(np.zeros((tk, h, 256), np.uint8))[:, :, ::2])
    yield "q_scale negative", dict(q_scale=dev(np.full((tq, 1), -1, np.float32)))
    yield "ropes of two kinds", dict(k_rope=dev(np.zeros((tk, 1, 64), np.uint8)))


@pytest.mark.parametrize("name,over", list(_fp8_bad()), ids=[m[0] for m in _fp8_bad()])
def test_fp8_bad_inputs_raise_the_same_error_in_both(name, over, as_if_gpu):
    args = dict(_fp8_args(), **over)
    gpu, ref = _call_both(mla_cupy.mla_prefill_fp8, reference.mla_prefill_fp8, args, {})
    _same_error(gpu, ref)


def _merge_bad():
    t, h = 6, 2
    ok = dict(out_a=dev(np.ones((t, h, 128), np.float32)), lse_a=dev(np.zeros((t, h), np.float32)),
              out_b=dev(np.ones((t, h, 128), np.float32)), lse_b=dev(np.zeros((t, h), np.float32)))
    yield "out_b another dtype", dict(ok, out_b=dev(np.ones((t, h, 128), BF16)))
    yield "out_a strided", dict(ok, out_a=dev(np.ones((t, h, 256), np.float32))[:, :, ::2])
    yield "out_a width 6", dict(ok, out_a=dev(np.ones((t, h, 6), np.float32)), out_b=dev(np.ones((t, h, 6), np.float32)))
    yield "lse_b strided", dict(ok, lse_b=dev(np.zeros((t, 2 * h), np.float32))[:, ::2])
    yield "lse_a float16", dict(ok, lse_a=dev(np.zeros((t, h), np.float16)))


@pytest.mark.parametrize("name,args", list(_merge_bad()), ids=[m[0] for m in _merge_bad()])
def test_merge_bad_inputs_raise_the_same_error_in_both(name, args, as_if_gpu):
    gpu, ref = _call_both(mla_cupy.merge_states, reference.merge_states, args, {})
    _same_error(gpu, ref)

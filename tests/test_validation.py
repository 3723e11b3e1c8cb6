"""Every bad input is a clear TypeError/ValueError naming the argument, raised before any launch.
Runs without a GPU: inputs are fake device arrays that never reach a kernel."""
import numpy as np
import pytest

import mla_cupy
from mla_cupy import CausalMask, PagedKVCache, SlidingWindowCausalMask
from mla_cupy.validation import check_inputs

from _cases import BF16, FP16, make_case
from _fake import dev


def base_args(sq=(5, 3), sk=(6, 3), heads=4, dtype=BF16):
    c = make_case(list(sq), list(sk), heads=heads, dtype=dtype, seed=1)
    return dict(q=dev(c.q), k=dev(c.k), v=dev(c.v), k_rope=dev(c.k_rope), valid_length=dev(c.valid_length),
                cache_row_offsets=dev(c.cache_row_offsets))


def call(**over):
    a = base_args()
    kw = {}
    for name, val in over.items():
        if name in a:
            a[name] = val
        else:
            kw[name] = val
    return mla_cupy.mla_prefill(a["q"], a["k"], a["v"], a["k_rope"], a["valid_length"], a["cache_row_offsets"], **kw)


def test_valid_fake_inputs_pass_the_checks():
    a = base_args()
    p = check_inputs(*a.values(), scale=None, mask=None, q_max_seq_len=None, cache_offsets=None, q_start_pos=None,
                     out=None, out_dtype=None, validate=True, device=True, read_offsets=True)
    assert (p.batch, p.heads, p.tq, p.tk, p.max_sq) == (2, 4, 8, 9, 5)
    assert p.out_dtype == BF16 and isinstance(p.mask, CausalMask)


def test_each_rope_form_has_its_own_variant():
    """The 16-bit and the fp8 per-token inputs, each with a rope in q's dtype or in e4m3 (under
    per-key scales for the 16-bit inputs, under the per-token scales for the fp8 ones): four
    problems, four kernel variants, and a plan's ``fp8`` / ``fp8_rope`` give the same ones."""
    from mla_cupy import _registry as reg
    from mla_cupy._plan_checks import check_plan_args

    a = base_args()
    (tq, h), tk = a["q"].shape[:2], a["k"].shape[0]
    r8, rope_scales = dev(np.zeros((tk, 1, 64), np.uint8)), dev(np.ones((tk, 1, 1), np.float32))
    nope = dict(q=dev(np.zeros((tq, h, 128), np.uint8)), k=dev(np.zeros((tk, h, 128), np.uint8)),
                v=dev(np.zeros((tk, h, 128), np.uint8)))
    scales = (dev(np.ones((tq, 1), np.float32)), dev(np.ones((tk, 1), np.float32)))

    def problem(q_rope=None, k_rope_scales=None, **over):
        """The checked problem of the 16-bit inputs, or of the fp8 ones with this ``q_rope``."""
        fp8 = None if q_rope is None else (q_rope, *scales)
        args = dict(a, **over) if fp8 is None else dict(a, **nope, **over)
        return check_inputs(*args.values(), scale=None, mask=None, q_max_seq_len=None, cache_offsets=None,
                            q_start_pos=None, out=None, out_dtype=None, validate=True, device=True, read_offsets=True,
                            fp8=fp8, k_rope_scales=k_rope_scales)

    # (fp8, fp8_rope) -> (problem, variant, (fp8, rope_scaled_e4m3, all_e4m3, fp8_rope))
    cases = {(False, False): (problem(), reg.VARIANT_16, (False, False, False, False)),
             (False, True): (problem(k_rope=r8, k_rope_scales=rope_scales), reg.VARIANT_FP8_ROPE,
                             (False, True, False, True)),
             (True, False): (problem(dev(np.zeros((tq, h, 64), BF16))), reg.VARIANT_FP8, (True, False, False, False)),
             (True, True): (problem(dev(np.zeros((tq, h, 64), np.uint8)), k_rope=r8), reg.VARIANT_E4M3,
                            (True, False, True, True))}
    assert sorted(v for _, v, _ in cases.values()) == sorted(reg.SM90_VARIANTS)
    for (fp8, fp8_rope), (p, variant, reads) in cases.items():
        assert p.variant == variant
        assert (p.fp8, p.rope_scaled_e4m3, p.all_e4m3, p.fp8_rope) == reads
        layout = check_plan_args(a["valid_length"], a["cache_row_offsets"], num_heads=h, dtype=BF16, mask=None,
                                 scale=None, q_max_seq_len=None, kernel="auto", cache_offsets=None, q_start_pos=None,
                                 page_table=None, page_size=None, rope_offset=0, fp8=fp8, fp8_rope=fp8_rope,
                                 out_dtype=None, return_lse=False, accumulate=False, validate=True).problem
        assert layout.variant == variant


A = base_args()
BAD = [
    # (argument overrides, exception type, substrings the message must contain)
    (dict(q=dev(np.ones((8, 4), BF16))), ValueError, ["q:", "3-D", "2-D"]),
    (dict(q=dev(np.ones((8, 4, 128), BF16))), ValueError, ["q:", "192", "128"]),
    (dict(q=dev(np.ones((8, 4, 192), np.float32))), TypeError, ["q:", "bfloat16 or float16", "float32"]),
    (dict(k=dev(np.ones((9, 3, 128), BF16))), ValueError, ["k:", "H = 4", "[9, 3, 128]"]),
    (dict(k=dev(np.ones((9, 4, 96), BF16))), ValueError, ["k:", "Dv = 128", "[9, 4, 96]"]),
    (dict(v=dev(np.ones((9, 4, 128), FP16))), TypeError, ["v:", "bfloat16", "float16"]),
    (dict(v=dev(np.ones((7, 4, 128), BF16))), ValueError, ["v:", "[7, 4, 128]"]),
    (dict(k_rope=dev(np.ones((9, 4, 64), BF16))), ValueError, ["k_rope:", "[9, 1, 64]"]),
    (dict(k_rope=dev(np.ones((9, 1, 64), FP16))), TypeError, ["k_rope:", "bfloat16", "float16"]),
    (dict(q=A["q"].view(np.ndarray)), TypeError, ["q:", "NumPy", "cupy.asarray"]),
    (dict(valid_length=np.array([0, 5, 8], np.uint32)), TypeError, ["valid_length:", "NumPy"]),
    (dict(valid_length=dev(np.array([0, 5, 8], np.int64))), TypeError, ["valid_length:", "int32 or uint32", "int64"]),
    (dict(cache_row_offsets=dev(np.array([0, 6], np.uint32))), ValueError, ["cache_row_offsets:", "3 entries", "got 2"]),
    (dict(valid_length=dev(np.array([1, 5, 8], np.uint32))), ValueError, ["valid_length:", "starting at 0"]),
    (dict(valid_length=dev(np.array([0, 6, 5], np.uint32))), ValueError, ["valid_length:", "non-decreasing"]),
    (dict(valid_length=dev(np.array([0, 5, 9], np.uint32))), ValueError, ["valid_length:", "Tq", "9"]),
    (dict(cache_row_offsets=dev(np.array([0, 6, 10], np.uint32))), ValueError, ["cache_row_offsets:", "<= Tk", "10"]),
    (dict(cache_row_offsets=dev(np.array([0, 7, 6], np.uint32))), ValueError, ["cache_row_offsets:", "non-decreasing"]),
    (dict(cache_offsets=dev(np.array([0], np.uint32))), ValueError, ["cache_offsets:", "2 entries"]),
    (dict(cache_offsets=dev(np.array([0, -4], np.int32))), ValueError, ["cache_offsets:", "non-negative"]),
    (dict(q_start_pos=dev(np.array([0, 1], np.float32))), TypeError, ["q_start_pos:", "int32 or int64"]),
    (dict(mask="causal"), TypeError, ["mask:", "str"]),
    (dict(scale=float("nan")), TypeError, ["scale:"]),
    (dict(scale=-0.5), ValueError, ["scale:", "positive"]),
    (dict(accumulate=True), ValueError, ["accumulate:", "out=", "lse="]),
    (dict(accumulate="yes"), TypeError, ["accumulate:", "bool"]),
    (dict(lse=dev(np.ones((8, 4), np.float16))), TypeError, ["lse:", "float32", "float16"]),
    (dict(lse=dev(np.ones((8, 3), np.float32))), ValueError, ["lse:", "[8, 4]", "[8, 3]"]),
    (dict(accumulate=True, out=dev(np.ones((8, 4, 128), BF16)), lse=dev(np.ones((8, 4), np.float32))), TypeError,
     ["accumulate:", "float32", "bfloat16"]),
    (dict(scale=0.0), ValueError, ["scale:", "positive"]),
    (dict(out_dtype=np.float16), TypeError, ["out_dtype:", "float32", "float16"]),
    (dict(out=dev(np.ones((8, 4, 192), BF16))), ValueError, ["out:", "[8, 4, 128]"]),
    (dict(out=dev(np.ones((8, 4, 128), np.float32)), out_dtype=BF16), TypeError, ["out:", "bfloat16", "float32"]),
    (dict(q_max_seq_len=4), ValueError, ["q_max_seq_len:", "5 queries"]),
    (dict(q_max_seq_len=-1), ValueError, ["q_max_seq_len:"]),
    (dict(q=dev(np.ones((8, 4, 196), BF16))[:, :, :192]), ValueError, ["q:", "multiple of 16 bytes"]),
    (dict(k=dev(np.ones((9, 4, 256), BF16))[:, :, ::2]), ValueError, ["k:", "contiguous"]),
]


@pytest.mark.parametrize("over,exc,words", BAD, ids=[f"{i}-{'-'.join(b[0])}" for i, b in enumerate(BAD)])
def test_bad_input_is_named(over, exc, words, as_if_gpu):
    with pytest.raises(exc) as info:
        call(**over)
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


def test_mask_arguments_checked():
    with pytest.raises(ValueError, match="window must be >= 1"):
        SlidingWindowCausalMask(0)
    with pytest.raises(TypeError, match="window must be an int"):
        SlidingWindowCausalMask(2.5)


def _paged(blocks, lut, ps=16):
    return PagedKVCache(dev(blocks), dev(lut), ps)


def test_paged_cache_errors():
    a = base_args()
    blocks = np.ones((4, 16, 1, 576), BF16)
    with pytest.raises(ValueError, match="page_size"):
        PagedKVCache(dev(blocks), dev(np.zeros((2, 1), np.int32)), 24)
    with pytest.raises(ValueError, match="rope_offset"):
        PagedKVCache(dev(blocks), dev(np.zeros((2, 1), np.int32)), 16, rope_offset=500)
    kw = dict(q=a["q"], k=a["k"], v=a["v"], valid_length=a["valid_length"], cache_row_offsets=a["cache_row_offsets"])
    # block id out of range
    with pytest.raises(ValueError, match=r"block id 7 at \[1, 0\] is outside \[0, 4\)"):
        mla_cupy.mla_prefill(k_rope=_paged(blocks, np.array([[0], [7]], np.int32)), **kw)
    # table too narrow for cache_offsets + Sk
    with pytest.raises(ValueError, match="needs pages up to 1"):
        mla_cupy.mla_prefill(k_rope=_paged(blocks, np.array([[0], [1]], np.int32)), cache_offsets=dev(np.array([0, 20], np.uint32)), **kw)
    # wrong page_size vs blocks: refused when the cache is built
    with pytest.raises(ValueError, match=r"PagedKVCache.page_size: expected blocks.shape\[1\] = 16 .*got 32"):
        PagedKVCache(dev(blocks), dev(np.zeros((2, 1), np.int32)), 32)
    with pytest.raises(ValueError, match="k_rope.lookup_table: expected 2 rows"):
        mla_cupy.mla_prefill(k_rope=_paged(blocks, np.zeros((3, 1), np.int32)), **kw)
    with pytest.raises(TypeError, match="k_rope.blocks: expected dtype bfloat16"):
        mla_cupy.mla_prefill(k_rope=_paged(blocks.astype(np.float16), np.zeros((2, 1), np.int32)), **kw)
    # fp8 caches and their scales: scales only with uint8 blocks, and always with them
    lut = dev(np.zeros((2, 1), np.int32))
    sc = dev(np.ones((4, 16, 1, 9), np.float32))
    with pytest.raises(ValueError, match="k_rope.scales: only an fp8"):
        mla_cupy.mla_prefill(k_rope=PagedKVCache(dev(blocks), lut, 16, scales=sc), **kw)
    with pytest.raises(ValueError, match="k_rope.scales: an fp8"):
        mla_cupy.mla_prefill(k_rope=PagedKVCache(dev(blocks.view(np.uint8)[..., :576]), lut, 16), **kw)
    with pytest.raises(ValueError, match=r"k_rope.scales: expected shape \[4, 16, 1, 9\]"):
        mla_cupy.mla_prefill(k_rope=PagedKVCache(dev(blocks.view(np.uint8)[..., :576]), lut, 16, scales=sc[:, :, :, :3]), **kw)


def _host(x):
    """The host array under a fake device array (what a reference caller passes)."""
    return x.view(np.ndarray) if isinstance(x, np.ndarray) else x


def _on(api, x):
    return x if api == "kernel" else _host(x)


@pytest.mark.parametrize("api", ["kernel", "reference"])
def test_fp8_argument_errors(api):
    """fp8 data without scales, wrong dtypes and shapes: errors name the argument, with the same
    messages from the kernels' API and from the float64 references."""
    prefill = mla_cupy.mla_prefill if api == "kernel" else mla_cupy.reference.mla_prefill
    prefill_fp8 = mla_cupy.mla_prefill_fp8 if api == "kernel" else mla_cupy.reference.mla_prefill_fp8
    a = {n: _on(api, x) for n, x in base_args().items()}
    tq, h = a["q"].shape[:2]
    tk = a["k"].shape[0]
    kw = dict(valid_length=a["valid_length"], cache_row_offsets=a["cache_row_offsets"])
    r8 = _on(api, dev(np.zeros((tk, 1, 64), np.uint8)))
    with pytest.raises(ValueError, match="k_rope_scales: an fp8"):
        prefill(a["q"], a["k"], a["v"], r8, **kw)
    with pytest.raises(ValueError, match="k_rope_scales: only an fp8"):
        prefill(a["q"], a["k"], a["v"], a["k_rope"], k_rope_scales=_on(api, dev(np.ones((tk, 1, 1), np.float32))), **kw)
    with pytest.raises(ValueError, match=r"k_rope_scales: expected shape"):
        prefill(a["q"], a["k"], a["v"], r8, k_rope_scales=_on(api, dev(np.ones((tk, 1, 2), np.float32))), **kw)
    with pytest.raises(TypeError, match=r"k_rope_scales: expected dtype float32, got float64"):
        prefill(a["q"], a["k"], a["v"], r8, k_rope_scales=_on(api, dev(np.ones((tk, 1, 1), np.float64))), **kw)
    f8 = dict(q_nope=dev(np.zeros((tq, h, 128), np.uint8)), q_rope=dev(np.ones((tq, h, 64), BF16)),
              q_scale=dev(np.ones((tq, 1), np.float32)), k=dev(np.zeros((tk, h, 128), np.uint8)),
              k_scales=dev(np.ones((tk, 1), np.float32)), v=dev(np.zeros((tk, h, 128), np.uint8)), k_rope=dev(a["k_rope"]))
    for name, bad, exc, words in [
        ("q_nope", dev(np.ones((tq, h, 128), BF16)), TypeError, "q_nope: expected dtype uint8"),
        ("q_nope", dev(np.zeros((tq, h, 256), np.uint8)), ValueError, r"q_nope: expected shape \[\*, \*, 128\]"),
        ("k", dev(np.zeros((tk, h, 64), np.uint8)), ValueError, "k: expected shape"),
        ("v", dev(np.zeros((tk + 1, h, 128), np.uint8)), ValueError, "v: expected shape"),
        ("q_rope", dev(np.ones((tq, h, 64), np.float16)), TypeError, "q_rope: expected dtype bfloat16"),
        ("q_rope", dev(np.ones((tq + 1, h, 64), BF16)), ValueError, r"q_rope: expected shape \[8, 4, 64\]"),
        ("q_scale", dev(np.ones((tq,), np.float32)), ValueError, "q_scale: expected a 2-D array"),
        ("k_scales", dev(np.ones((tk, 1), np.float64)), TypeError, "k_scales: expected dtype float32"),
        ("k_scales", dev(np.ones((tk + 2, 1), np.float32)), ValueError, r"k_scales: expected shape \[9, 1\]"),
        ("k_rope", dev(np.ones((tk, 1, 64), np.float16)), TypeError, "k_rope: expected dtype bfloat16"),
        ("k_rope", dev(np.zeros((tk, 1, 64), np.uint8)), TypeError, "k_rope: expected bfloat16 like q_rope .*, got uint8"),
        # q_scale folds into each row's softmax scale: negative or NaN scales are refused
        ("q_scale", dev(np.full((tq, 1), -1, np.float32)), ValueError, r"q_scale: expected non-negative scales, got q_scale\[0\] = -1"),
        ("q_scale", dev(np.array([[1]] * (tq - 1) + [[np.nan]], np.float32)), ValueError,
         r"q_scale: expected non-negative scales, got q_scale\[7\] = nan"),
    ]:
        args = {n: _on(api, x) for n, x in dict(f8, **{name: bad}).items()}
        with pytest.raises(exc, match=words):
            prefill_fp8(args["q_nope"], args["q_rope"], args["q_scale"], args["k"], args["k_scales"],
                        args["v"], args["k_rope"], **kw)
    # the all-e4m3 mode: e4m3 q_rope and k_rope (plain), under the per-token scales
    e8 = dict(f8, q_rope=dev(np.zeros((tq, h, 64), np.uint8)), k_rope=dev(np.zeros((tk, 1, 64), np.uint8)))
    lut = dev(np.zeros((2, 1), np.int32))
    for name, bad, exc, words in [
        ("k_rope", dev(a["k_rope"]), TypeError, r"k_rope: expected e4m3 bytes \(uint8\) like q_rope .*, got bfloat16"),
        ("k_rope", dev(np.zeros((tk, 2, 64), np.uint8)), ValueError, r"k_rope: expected shape \[9, 1, 64\]"),
        ("k_rope", PagedKVCache(dev(np.zeros((2, 16, 1, 576), np.uint8)), lut, 16), ValueError,
         "k_rope: an e4m3 rope under the per-token scales .* a PagedKVCache is not supported"),
        ("q_rope", dev(np.zeros((tq, h, 32), np.uint8)), ValueError, r"q_rope: expected shape \[8, 4, 64\]"),
    ]:
        args = {n: x if isinstance(x, PagedKVCache) else _on(api, x) for n, x in dict(e8, **{name: bad}).items()}
        with pytest.raises(exc, match=words):
            prefill_fp8(args["q_nope"], args["q_rope"], args["q_scale"], args["k"], args["k_scales"],
                        args["v"], args["k_rope"], **kw)


def test_reference_validates_too():
    c = make_case([3], [3], heads=2, dtype=np.float64)
    with pytest.raises(ValueError, match="valid_length: the last offset must equal"):
        mla_cupy.reference.mla_prefill(c.q, c.k, c.v, c.k_rope, np.array([0, 2], np.uint32), c.cache_row_offsets)


def test_lse_layout_checks_the_head_stride_of_rows_only():
    """An lse without rows has no head stride to check (an empty view may report strides (0, 0));
    one with rows must have its heads contiguous."""
    from numpy.lib.stride_tricks import as_strided

    from mla_cupy.validation import check_lse_layout

    empty = as_strided(np.empty(0, np.float32), shape=(0, 16), strides=(0, 0))
    check_lse_layout(empty, 16)
    rows = np.empty((4, 32), np.float32)[:, ::2]
    with pytest.raises(ValueError, match=r"lse: the head dimension must be contiguous \(stride 4 bytes\), got strides \(128, 8\)"):
        check_lse_layout(rows, 16)

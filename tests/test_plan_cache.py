"""The one-shot calls' plan cache without a GPU (tests/_fake_gpu.py: the device stubbed, CuPy arrays
over host memory): what a hit launches equals what a fresh call packs, every change of what the
launch depends on misses, the counts, the bound and the switch, the checks a hit still makes, and
that an entry keeps no array alive."""
import gc
import weakref

import numpy as np
import pytest

import mla_cupy
from mla_cupy import NullMask, PagedKVCache, SlidingWindowCausalMask, plan_cache_clear, plan_cache_info
from mla_cupy._plan_cache import CACHE

from _cases import BF16, FP16, build_paged, make_case
from _fake_gpu import fake_gpu_empty_cache, host_array, host_cupy, require_cupy, write_host
from _threads import in_threads

require_cupy()  # the cases below are built at import from CuPy arrays over host memory

FAST = dict(q_max_seq_len=5, validate=False)


@pytest.fixture(params=["90", "80"], ids=["hopper", "portable"])
def gpu(request):
    """A fake GPU of compute capability 9.0 (``"auto"`` runs the Hopper kernel) or 8.0, and an
    empty plan cache of the default size."""
    with fake_gpu_empty_cache(request.param) as g:
        yield g


def arrays(sq=(5, 3), sk=(6, 3), heads=4, dtype=BF16, seed=0, out_dtype=None):
    """A problem's arrays as CuPy arrays over host memory, with an output buffer."""
    c = make_case(list(sq), list(sk), heads, dtype, seed=seed)
    d = {n: host_cupy(getattr(c, n)) for n in ("q", "k", "v", "k_rope", "valid_length", "cache_row_offsets")}
    d["out"] = host_cupy(np.zeros((sum(sq), heads, 128), out_dtype or dtype))
    d["case"] = c
    return d


def layer(d, seed):
    """Another layer of ``d``'s layout: new q, k, v, rope and out buffers, the same offsets."""
    e = arrays(seed=seed, sq=np.diff(d["case"].valid_length), sk=np.diff(d["case"].cache_row_offsets),
               heads=d["q"].shape[1], dtype=d["q"].dtype, out_dtype=d["out"].dtype)
    return dict(e, valid_length=d["valid_length"], cache_row_offsets=d["cache_row_offsets"])


def call(d, **kw):
    kw.setdefault("out", d["out"])
    return mla_cupy.mla_prefill(d["q"], d["k"], d["v"], kw.pop("k_rope", d["k_rope"]), d["valid_length"],
                                d["cache_row_offsets"], **kw)


def fp8_arrays():
    """``(inputs, valid_length, cache_row_offsets, out)`` of a small fp8 per-token call, over host memory."""
    c = make_case([5, 3], [6, 3], 4, BF16, seed=0)
    f = mla_cupy.quant.quantize_per_token(c.q, c.k, c.v, c.k_rope)
    a = [host_cupy(f[n].view(np.uint8) if f[n].dtype.itemsize == 1 else f[n])
         for n in ("q_nope", "q_rope", "q_scale", "k", "k_scales", "v", "k_rope")]
    return a, host_cupy(c.valid_length), host_cupy(c.cache_row_offsets), host_cupy(np.zeros((8, 4, 128), BF16))


def counts():
    i = plan_cache_info()
    return i.hits, i.misses


def fresh_launch(gpu, fn):
    """The buffers launched by ``fn()`` packed afresh (the cache not looked up; its entries kept)."""
    size, CACHE.maxsize = CACHE.maxsize, 0
    n = len(gpu.launches)
    try:
        fn()
    finally:
        CACHE.maxsize = size
    return [raw for _, _, raw in gpu.launches[n:]]


def launched(gpu, fn):
    n = len(gpu.launches)
    fn()
    return [raw for _, _, raw in gpu.launches[n:]]


# ------------------------------------------------------------------------------------------------
# hits launch what a fresh call packs

def test_a_hit_launches_what_a_fresh_call_packs(gpu):
    d = arrays()
    assert call(d, **FAST) is d["out"]
    assert counts() == (0, 1) and plan_cache_info().currsize == 1
    e = layer(d, seed=1)  # new data pointers, the same layout and offsets: a hit
    hit = launched(gpu, lambda: call(e, **FAST))
    assert counts() == (1, 1)
    assert hit == fresh_launch(gpu, lambda: call(e, **FAST))  # the pointers (and the tensor maps) rewritten
    assert gpu.values()["out"] == e["out"].data.ptr
    # and back to the first layer's buffers
    assert launched(gpu, lambda: call(d, **FAST)) == fresh_launch(gpu, lambda: call(d, **FAST))
    assert counts() == (2, 3) and gpu.packs == 3  # a record packed per miss (the fresh ones too), none per hit


def test_a_hit_needs_no_tensor_map_it_has_seen(gpu):
    d, e = arrays(), None
    call(d, **FAST)
    e = layer(d, seed=1)
    call(e, **FAST)
    n = gpu.encodes
    for x in (d, e, d, e):
        call(x, **FAST)
    assert gpu.encodes == n  # both pointer sets' maps are remembered by the entry


def test_results_allocated_by_a_hit_are_new_and_returned(gpu):
    d = arrays()
    kw = dict(FAST, return_lse=True)
    o1, l1 = call(d, out=None, **kw)
    o2, l2 = call(d, out=None, **kw)
    assert counts() == (1, 1)
    assert o1.data.ptr != o2.data.ptr and l1.data.ptr != l2.data.ptr
    assert o2.shape == (8, 4, 128) and l2.shape == (8, 4) and l2.dtype == np.float32
    v = gpu.values()
    assert (v["out"], v["lse"]) == (o2.data.ptr, l2.data.ptr)


def test_another_stream_is_a_hit_on_that_stream(gpu):
    d = arrays()
    call(d, stream=7, **FAST)
    call(d, stream=9, **FAST)
    assert counts() == (1, 1)
    assert [s for _, s, _ in gpu.launches[-1:]] == [9]


# ------------------------------------------------------------------------------------------------
# what the launch depends on is in the key

def _strided_out(d):
    big = host_cupy(np.zeros((8, 4, 256), BF16))
    return dict(d, out=big[:, :, :128])


def _f32(d):
    return dict(d, out=host_cupy(np.zeros((8, 4, 128), np.float32)))


def _lse(d):
    return host_cupy(np.zeros((8, 4), np.float32))


NEW_LSE = object()  # an lse buffer of the problem
MISSES = [
    # (what changes, the arrays, the keywords)
    ("Tq", lambda d: dict(d, q=host_cupy(np.zeros((9, 4, 192), BF16)), out=host_cupy(np.zeros((9, 4, 128), BF16))), {}),
    ("Tk", lambda d: dict(d, k=host_cupy(np.zeros((10, 4, 128), BF16)), v=host_cupy(np.zeros((10, 4, 128), BF16)),
                          k_rope=host_cupy(np.zeros((10, 1, 64), BF16))), {}),
    ("out strides", _strided_out, {}),
    ("dtype", lambda d: dict(arrays(dtype=FP16), valid_length=d["valid_length"],
                             cache_row_offsets=d["cache_row_offsets"]), {}),
    ("valid_length pointer", lambda d: dict(d, valid_length=host_cupy(host_array(d["valid_length"]))), {}),
    ("cache_row_offsets pointer", lambda d: dict(d, cache_row_offsets=host_cupy(host_array(d["cache_row_offsets"]))),
     {}),
    ("offsets dtype", lambda d: dict(d, valid_length=host_cupy(host_array(d["valid_length"]).astype(np.int32))), {}),
    ("cache_offsets", lambda d: d, dict(cache_offsets=host_cupy(np.array([0, 0], np.uint32)))),
    ("q_start_pos", lambda d: d, dict(q_start_pos=host_cupy(np.array([1, 0], np.int64)))),
    ("scale", lambda d: d, dict(scale=0.5)),
    ("scale type", lambda d: d, dict(scale=np.float32(1 / np.sqrt(192)))),
    ("mask", lambda d: d, dict(mask=NullMask())),
    ("mask size", lambda d: d, dict(mask=SlidingWindowCausalMask(4))),
    ("q_max_seq_len", lambda d: d, dict(q_max_seq_len=6)),
    ("q_max_seq_len read", lambda d: d, dict(q_max_seq_len=None)),
    ("out_dtype", _f32, dict(out_dtype=np.float32)),
    ("return_lse", lambda d: d, dict(return_lse=True)),
    ("lse given", lambda d: d, dict(lse=NEW_LSE)),
    ("accumulate", _f32, dict(accumulate=True, lse=NEW_LSE)),
    ("kernel", lambda d: d, dict(kernel="sm80")),
    ("validate", lambda d: d, dict(validate=True)),
]


@pytest.mark.parametrize("what,change,kw", MISSES, ids=[m[0] for m in MISSES])
def test_a_change_of_what_the_launch_depends_on_misses(gpu, what, change, kw):
    base = dict(FAST, mask=SlidingWindowCausalMask(3))
    d = arrays()
    call(d, **base)
    e = change(d)
    kw = {k: (_lse(d) if v is NEW_LSE else v) for k, v in kw.items()}
    call(e, **dict(base, **kw))
    assert counts() == (0, 2), what
    call(e, **dict(base, **kw))  # and the changed call is kept in turn
    assert counts() == (1, 2), what


def test_the_environment_switch_of_the_kernel_choice_misses(gpu, monkeypatch):
    d = arrays()
    call(d, **FAST)
    monkeypatch.setenv("MLA_CUPY_DISABLE_SM90", "1")
    call(d, **FAST)
    assert counts() == (0, 2)
    packed = gpu.launches[-1][0].pack.names
    assert ("q_st" in packed) is True  # the portable kernel's struct: "auto" follows the switch


def test_offsets_read_per_call_when_q_max_seq_len_is_not_given(gpu):
    """Without ``q_max_seq_len`` the grid follows the offsets' contents: a hit reads them and
    repacks (a miss) when their largest query count changed, even at the same address."""
    d = arrays(sq=(200, 100), sk=(200, 100), heads=1)
    call(d, validate=False)
    assert gpu.values()["num_m_blocks"] == 2
    call(d, validate=False)
    assert counts() == (1, 1)
    write_host(d["valid_length"], [0, 290, 300])  # same pointer, a sequence of 290 queries
    call(d, validate=False)
    assert counts() == (1, 2) and gpu.values()["num_m_blocks"] == 3
    call(d, validate=False)
    assert counts() == (2, 2) and plan_cache_info().currsize == 1


# ------------------------------------------------------------------------------------------------
# a hit still checks what the key cannot prove

def test_a_hit_checks_the_values_when_validating(gpu):
    d = arrays()
    call(d, q_max_seq_len=5)
    call(d, q_max_seq_len=5)
    assert counts() == (1, 1)
    write_host(d["valid_length"], [0, 6, 5])
    with pytest.raises(ValueError, match=r"^valid_length: offsets must be non-decreasing, got valid_length\[1\] = 6 > "):
        call(d, q_max_seq_len=5)
    write_host(d["valid_length"], [0, 6, 8])
    with pytest.raises(ValueError, match="^q_max_seq_len: a sequence has 6 queries, more than q_max_seq_len = 5"):
        call(d, q_max_seq_len=5)
    write_host(d["valid_length"], [0, 5, 8])
    call(d, q_max_seq_len=5)
    assert counts() == (2, 1)


def test_a_misaligned_pointer_on_a_hit_hears_the_checks(gpu):
    d = arrays()
    call(d, **FAST)
    raw = host_cupy(np.zeros(8 * 4 * 128 + 1, BF16))
    out = raw[1:].reshape(8, 4, 128)  # the layout of d's out, 2 bytes off
    with pytest.raises(ValueError, match="^out: the data must start at a 16-byte aligned address"):
        call(d, out=out, **FAST)
    assert counts() == (0, 1)


@pytest.mark.parametrize("cached,bad,exc,match", [
    (dict(scale=1.0), dict(scale=True), TypeError, "^scale: expected a finite float, got True"),
    (dict(accumulate=False), dict(accumulate=0), TypeError, "^accumulate: expected a bool, got int"),
    (dict(q_max_seq_len=1), dict(q_max_seq_len=True), ValueError, "^q_max_seq_len: expected a non-negative int"),
    (dict(kernel="auto"), dict(kernel=["auto"]), ValueError, r"^kernel: expected one of"),
    (dict(), dict(scale=-1.0), ValueError, "^scale: expected a positive float"),
    (dict(), dict(stream="0"), TypeError, "^stream: expected a cupy.cuda.Stream"),
])
def test_arguments_that_equal_a_cached_key_are_still_checked(gpu, cached, bad, exc, match):
    """Values equal to a cached key's (True == 1, 0 == False) but refused by the checks are refused."""
    d = arrays()
    call(d, **dict(FAST, **cached))
    with pytest.raises(exc, match=match):
        call(d, **dict(FAST, **bad))


# ------------------------------------------------------------------------------------------------
# the values a call reads back: every array of a call with one synchronization

def syncs_of(gpu, fn):
    """``(copies, syncs)`` of the device-to-host reads made by ``fn()``."""
    c, s = gpu.copies, gpu.syncs
    fn()
    return gpu.copies - c, gpu.syncs - s


def test_default_arguments_read_every_offset_with_one_synchronization(gpu):
    d = arrays()
    co = host_cupy(np.array([2, 0], np.int32))
    for _ in range(3):  # a miss, then hits
        assert syncs_of(gpu, lambda: call(d, cache_offsets=co)) == (3, 1)
    assert counts() == (2, 1)
    assert syncs_of(gpu, lambda: call(d, validate=False)) == (2, 1)  # the grid still follows the offsets
    assert syncs_of(gpu, lambda: call(d, **FAST)) == (0, 0)


def test_a_paged_table_and_fp8_scales_are_read_with_the_offsets(gpu):
    d = arrays(sk=(40, 3))
    blocks, lut = build_paged(d["case"], 16, seed=1)
    cache = PagedKVCache(host_cupy(blocks), host_cupy(lut), 16)
    for _ in range(2):
        assert syncs_of(gpu, lambda: call(d, k_rope=cache, q_max_seq_len=5)) == (3, 1)
    if gpu.capability != "90":
        return
    a, vl, cro, out = fp8_arrays()
    for _ in range(2):
        assert syncs_of(gpu, lambda: mla_cupy.mla_prefill_fp8(*a, vl, cro, out=out)) == (3, 1)
    write_host(a[2], np.full(8, -1, np.float32))
    with pytest.raises(ValueError, match=r"^q_scale: expected non-negative scales, got q_scale\[0\] = -1"):
        mla_cupy.mla_prefill_fp8(*a, vl, cro, out=out)


def test_read_back_equals_the_synchronous_reads(gpu):
    """Contiguous arrays of any kind and dtype read back as ``to_host`` reads them; a strided one
    is read by ``to_host`` (its own synchronous copy)."""
    from mla_cupy._arrays import read_back, to_host

    xs = [np.array([0, 7], np.uint32), np.arange(6, dtype=np.int64).reshape(2, 3), np.array([1.5], np.float32),
          np.zeros(0, np.int32), np.arange(9, dtype=np.int32)]
    devs = [host_cupy(x) for x in xs]
    n = gpu.syncs
    got = read_back([devs[0], None, devs[1], xs[2], devs[2], devs[3], devs[4][::2]])
    assert gpu.syncs - n == 2  # one for the staged copies, one for the strided array
    want = [xs[0], None, xs[1], xs[2], xs[2], xs[3], xs[4][::2]]
    for g, w in zip(got, want):
        assert (g is None and w is None) or (g.dtype == w.dtype and g.shape == w.shape and (g == w).all())
    again = read_back([devs[0]])[0]
    assert (again == got[0]).all() and not np.shares_memory(again, got[0])  # arrays of their own
    assert [to_host(x).tolist() for x in devs[:2]] == [xs[0].tolist(), xs[1].tolist()]


# ------------------------------------------------------------------------------------------------
# the variants

def test_int32_q_start_pos_is_widened_per_call(gpu, monkeypatch):
    from mla_cupy import _plan_cache

    widened, widen = [], _plan_cache.widened
    monkeypatch.setattr(_plan_cache, "widened", lambda q_start, sp: widened.append(widen(q_start, sp)) or widened[-1])
    d = arrays()
    q_start = host_cupy(np.array([1, 0], np.int32))
    for _ in range(3):
        call(d, q_start_pos=q_start, **FAST)
        assert gpu.values()["q_start_pos"] == widened[-1].data.ptr  # this call's int64 copy
    assert counts() == (2, 1) and len({w.data.ptr for w in widened}) == 3


def test_paged_rope(gpu):
    d = arrays(sk=(40, 3))
    blocks, lut = build_paged(d["case"], 16, seed=1)
    cache = PagedKVCache(host_cupy(blocks), host_cupy(lut), 16)
    call(d, k_rope=cache, q_max_seq_len=5)  # validate: the block ids are read
    call(d, k_rope=cache, q_max_seq_len=5)
    assert counts() == (1, 1)
    other = PagedKVCache(cache.blocks, host_cupy(lut), 16)  # another page table
    call(d, k_rope=other, q_max_seq_len=5)
    assert counts() == (1, 2)
    write_host(other.lookup_table, np.full(lut.shape, 10_000, np.int32))
    with pytest.raises(ValueError, match=r"^k_rope.lookup_table: block id 10000 at \[0, 0\] is outside"):
        call(d, k_rope=other, q_max_seq_len=5)


@pytest.mark.parametrize("via", ["call", "plan"])
def test_a_paged_rope_is_gathered_into_key_rows(gpu, monkeypatch, via):
    """Hopper: each paged launch is the gather (cache, table, offsets, key rows) and then the
    prefill, whose rope map reads those rows as a plain [Tk, 64] rope. One-shot calls allocate their
    rows per call; a plan keeps one buffer per stream it runs on. The portable kernel reads the
    pages itself."""
    from mla_cupy import _packing

    d = arrays(sk=(40, 3))
    blocks, lut = build_paged(d["case"], 16, seed=1)
    cache = PagedKVCache(host_cupy(blocks), host_cupy(lut), 16, rope_offset=0)
    rows, new_rows = [], _packing.scratch_on
    monkeypatch.setattr(_packing, "scratch_on", lambda shape, sp: rows.append(new_rows(shape, sp)) or rows[-1])
    tk = int(d["k"].shape[0])
    if via == "plan":
        pl = mla_cupy.plan(d["valid_length"], d["cache_row_offsets"], num_heads=4, dtype=BF16, q_max_seq_len=5,
                           page_table=cache.lookup_table, page_size=16, rope_offset=0)
        run = lambda stream: pl.run(d["q"], d["k"], d["v"], cache, out=d["out"], stream=stream)
    else:
        run = lambda stream: call(d, k_rope=cache, q_max_seq_len=5, stream=stream)
    kept = {}  # a plan's rows per stream
    for n, stream in enumerate([101, 101, 102, 101], 1):
        run(stream)
        if gpu.capability != "90":
            assert [pl.pack.names[0] for pl, _, _ in gpu.launches] == ["q"] * n and not rows
            continue
        (g, gs, g_raw), (_, ps, _) = gpu.launches[-2:]
        gv = np.frombuffer(g_raw, g.pack.dtype, count=1)[0]
        dst = int(gv["dst"])
        assert gs == ps == stream
        if via == "plan":
            assert kept.setdefault(stream, dst) == dst and len(rows) == len(kept) == len(set(kept.values()))
        else:
            assert len(rows) == n and dst == rows[-1].data.ptr  # this call's own
        assert rows[-1].nbytes == tk * 128 and int(gv["tk"]) == tk
        assert int(gv["rope_base"]) == cache.blocks.data.ptr and int(gv["lookup"]) == cache.lookup_table.data.ptr
        assert int(gv["kv_begin"]) == d["cache_row_offsets"].data.ptr and int(gv["batch"]) == 2
        assert int(gv["log2_page_size"]) == 4 and int(gv["num_blocks"]) == blocks.shape[0]
        assert g.grid[0] * g.grid[1] * 16 >= tk  # about one row per thread
        words = np.frombuffer(gpu.values()["tm_rope"].tobytes(), np.uint64)
        assert (int(words[0]), int(words[2]), int(words[3]), int(words[6])) == (dst, 64, tk, 128)
        assert int(gpu.values()["lookup"]) == cache.lookup_table.data.ptr  # the rope warp's flags


def test_fp8_takes_a_workspace_per_call(gpu, monkeypatch):
    from mla_cupy import _plan_cache

    if gpu.capability != "90":
        pytest.skip("the fp8 variant runs on the Hopper kernel")
    spaces, new_space = [], _plan_cache.workspace_on
    monkeypatch.setattr(_plan_cache, "workspace_on",
                        lambda shape, sp: spaces.append(new_space(shape, sp)) or spaces[-1])
    a, vl, cro, out = fp8_arrays()
    for _ in range(3):
        mla_cupy.mla_prefill_fp8(*a, vl, cro, out=out, **FAST)
        vt, _, vt_raw = gpu.launches[-2]  # the pre-pass, then the prefill
        assert int(np.frombuffer(vt_raw, vt.pack.dtype, count=1)[0]["vt"]) == spaces[-1].data.ptr
    assert counts() == (2, 1) and len(spaces) == 3  # each call's own workspace
    ws = host_cupy(np.zeros(4 * 128 * 64, np.uint8))
    mla_cupy.mla_prefill_fp8(*a, vl, cro, out=out, workspace=ws, **FAST)
    mla_cupy.mla_prefill_fp8(*a, vl, cro, out=out, workspace=ws, **FAST)
    assert counts() == (3, 2)
    vt, _, vt_raw = gpu.launches[-2]
    assert int(np.frombuffer(vt_raw, vt.pack.dtype, count=1)[0]["vt"]) == ws.data.ptr


def test_launches_of_checked_problems_are_cached(gpu):
    """``launch_checked`` (the chunks of mla_prefill_chunked): keyed by the problem, the offsets'
    pointers and the layouts."""
    from mla_cupy import _plan_cache
    from mla_cupy.prefill_plan import offsets_of
    from mla_cupy.validation import check_inputs

    d = arrays()
    p = check_inputs(d["q"], d["k"], d["v"], d["k_rope"], d["valid_length"], d["cache_row_offsets"], scale=None,
                         mask=None, q_max_seq_len=5, cache_offsets=None, q_start_pos=None, out=d["out"],
                         out_dtype=None, validate=False, device=True, read_offsets=False)
    cro = d["cache_row_offsets"].data.ptr
    o1 = offsets_of(d["valid_length"], cro, cro + 4, None, None)
    o2 = offsets_of(d["valid_length"], cro + 4, cro + 8, None, None)
    args = (d["q"], d["k"], d["v"], d["k_rope"], d["out"], None)
    for o in (o1, o1, o2, o2):
        _plan_cache.launch_checked(p, *args, o, "auto", False, 0)
    assert counts() == (2, 2)
    assert gpu.values()["kv_begin"] == cro + 4


# ------------------------------------------------------------------------------------------------
# the store

def test_counts_clear_and_size(gpu):
    a, b, c = arrays(), arrays(heads=2), arrays(heads=1)
    mla_cupy.set_plan_cache_size(2)
    for x, hit in [(a, 0), (b, 0), (a, 1), (c, 0), (a, 1), (b, 0), (c, 0)]:
        before = counts()
        call(x, **FAST)
        assert counts()[0] - before[0] == hit  # least recently used out first: b, then a
    assert plan_cache_info() == (2, 5, 2, 2)
    plan_cache_clear()
    assert plan_cache_info() == (0, 0, 2, 0)
    call(a, **FAST)
    assert counts() == (0, 1)
    mla_cupy.set_plan_cache_size(0)  # off: nothing kept, every call packs
    assert plan_cache_info().currsize == 0
    call(a, **FAST)
    call(a, **FAST)
    assert plan_cache_info() == (0, 3, 0, 0)
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="^maxsize: expected a non-negative int"):
            mla_cupy.set_plan_cache_size(bad)


def test_a_miss_reads_no_kernel_source(gpu, monkeypatch):
    """A call the cache does not serve checks and packs, but takes the kernels' constants from
    memory: no kernel source is searched per call (a miss costs a few hits, not a parse)."""
    import re
    from types import SimpleNamespace

    from mla_cupy import dims

    d = arrays()
    mla_cupy.set_plan_cache_size(0)
    call(d, **FAST)  # whatever the first call of a layout reads
    searches = []
    monkeypatch.setattr(dims, "re", SimpleNamespace(
        **{n: getattr(re, n) for n in ("compile", "escape", "MULTILINE", "DOTALL")},
        findall=lambda *a, **k: searches.append(a[0]) or re.findall(*a, **k)))
    for _ in range(3):
        call(d, **FAST)
    assert plan_cache_info().misses == 4
    assert searches == []


def test_an_entry_keeps_no_array_alive(gpu):
    d = arrays()
    call(d, cache_offsets=host_cupy(np.array([0, 0], np.uint32)), **FAST)
    refs = [weakref.ref(d[n]) for n in ("q", "k", "v", "k_rope", "valid_length", "cache_row_offsets", "out")]
    del d
    gpu.launches.clear()
    gc.collect()
    assert plan_cache_info().currsize == 1
    assert [r() for r in refs] == [None] * len(refs)


def test_threads_share_an_entry_and_launch_their_own_pointers(gpu):
    """Eight threads, each with its own stream and output, on one layout: every launch carries the
    pointer of the thread that made it (an entry launches under its lock)."""
    d = arrays()
    call(d, **FAST)
    outs = [host_cupy(np.zeros((8, 4, 128), BF16)) for _ in range(8)]
    gpu.pause = 1e-4

    def work(t):
        for _ in range(50):
            call(d, out=outs[t], stream=100 + t, **FAST)

    assert not in_threads(work)
    assert counts() == (400, 1)
    for i in range(-400, 0):
        t = gpu.launches[i][1] - 100
        assert gpu.values(i)["out"] == outs[t].data.ptr


def test_arrays_of_another_kind_are_read_through_their_interface(gpu):
    """``__cuda_array_interface__`` arrays (Numba-style; here host memory dressed as one) key and
    launch by their interface's pointer."""
    from _fake import dev

    c = make_case([5, 3], [6, 3], 4, BF16, seed=0)
    a = [dev(x) for x in (c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets)]
    outs = [dev(np.zeros((8, 4, 128), BF16)) for _ in range(2)]
    for out in outs + outs:
        assert mla_cupy.mla_prefill(*a, out=out, **FAST) is out
        assert gpu.values()["out"] == out.__cuda_array_interface__["data"][0]
    assert counts() == (3, 1)


def test_plan_run_reads_cupy_arrays_without_converting_them(gpu):
    from mla_cupy._arrays import pointers_and_layouts

    d, e = arrays(), None
    pl = mla_cupy.plan(d["valid_length"], d["cache_row_offsets"], num_heads=4, dtype=BF16, q_max_seq_len=5)
    e = layer(d, seed=3)
    for x in (d, e, d):
        assert pl.run(x["q"], x["k"], x["v"], x["k_rope"], out=x["out"]) is x["out"]
        assert gpu.values()["out"] == x["out"].data.ptr
    assert len(pl._records) == 1
    ptrs, layouts = pointers_and_layouts([d["q"], None, e["q"]])
    assert ptrs == [d["q"].data.ptr, 0, e["q"].data.ptr] and layouts[0] == layouts[2] and layouts[1] is None

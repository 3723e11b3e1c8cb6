"""The plan/run API on the GPU (pytest -m gpu): runs equal the one-shot calls bit for bit, a
captured run equals an eager one, repeated runs with out= allocate nothing, and the host time of a
run is measured (printed, and held under a loose bound)."""
import dataclasses
import time

import numpy as np
import pytest

import mla_cupy
from mla_cupy import PagedKVCache, SlidingWindowCausalMask, quant

from _cases import BF16, build_paged, make_case
from gpu_util import KERNELS, upload

pytestmark = pytest.mark.gpu


needs_hopper = pytest.mark.skipif("sm90" not in KERNELS, reason="the fp8 variants run on compute capability 9.0")


def _case(seed=0):
    return make_case([100, 1, 260], [120, 40, 300], 16, BF16, seed=seed, cache_offsets=[3, 0, 40],
                     q_start_pos=[20, 39, 80])


def _bits(x):
    return x.get().view(np.uint16) if x.dtype != np.float32 else x.get().view(np.uint32)


def _layer(c, seed):
    """Another layer's q, k, v and rope for the same layout (same shapes, new data, new buffers)."""
    import cupy as cp

    rng = np.random.default_rng(seed)
    return {n: cp.asarray(rng.standard_normal(getattr(c, n).shape).astype(BF16)) for n in ("q", "k", "v", "k_rope")}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("paged", [False, True], ids=["plain", "paged"])
def test_run_equals_mla_prefill_bit_for_bit(kernel, paged):
    """Two layers through one plan (new buffers each: the pointers are rewritten, the Hopper maps
    looked up again) and the first layer again, each equal to its one-shot call."""
    import cupy as cp

    c = _case(1)
    d = upload(c)
    mask = SlidingWindowCausalMask(70)
    kw = dict(mask=mask, cache_offsets=d["cache_offsets"], q_start_pos=d["q_start_pos"], kernel=kernel)
    layers = [dict((n, d[n]) for n in ("q", "k", "v", "k_rope")), _layer(c, 2)]
    if paged:  # one page table for every layer (the same seed: the same page order), each layer's own blocks
        lut = None
        for lay in layers:
            blocks, lut_h = build_paged(dataclasses.replace(c, k_rope=cp.asnumpy(lay["k_rope"])), 32, seed=11)
            lut = cp.asarray(lut_h) if lut is None else lut
            lay["cache"] = PagedKVCache(cp.asarray(blocks), lut, 32)
    pl = mla_cupy.plan(d["valid_length"], d["cache_row_offsets"], num_heads=16, dtype=BF16, return_lse=True,
                       page_table=layers[0]["cache"].lookup_table if paged else None, page_size=32 if paged else None,
                       **kw)
    for lay in layers + layers[:1]:
        rope = lay["cache"] if paged else lay["k_rope"]
        want, want_lse = mla_cupy.mla_prefill(lay["q"], lay["k"], lay["v"], rope, d["valid_length"],
                                              d["cache_row_offsets"], return_lse=True, **kw)
        out = cp.full(want.shape, np.nan, BF16)
        lse = cp.full(want_lse.shape, np.nan, cp.float32)
        got, got_lse = pl.run(lay["q"], lay["k"], lay["v"], rope.blocks if paged else rope, out=out, lse=lse)
        assert got is out and got_lse is lse
        np.testing.assert_array_equal(_bits(got), _bits(want))
        np.testing.assert_array_equal(_bits(got_lse), _bits(want_lse))
    fresh, fresh_lse = pl.run(layers[1]["q"], layers[1]["k"], layers[1]["v"],
                              layers[1]["cache"] if paged else layers[1]["k_rope"])  # results allocated
    want = mla_cupy.mla_prefill(layers[1]["q"], layers[1]["k"], layers[1]["v"],
                                layers[1]["cache"] if paged else layers[1]["k_rope"], d["valid_length"],
                                d["cache_row_offsets"], **kw)
    np.testing.assert_array_equal(_bits(fresh), _bits(want))
    assert fresh_lse.shape == (c.q.shape[0], 16)


def _fp8_inputs(c, layer_seed=None):
    import cupy as cp

    src = _layer(c, layer_seed) if layer_seed is not None else {n: cp.asarray(getattr(c, n))
                                                                    for n in ("q", "k", "v", "k_rope")}
    return quant.quantize_per_token(src["q"], src["k"], src["v"], src["k_rope"])


def _fp8_args(f):
    return (f["q_nope"], f["q_rope"], f["q_scale"], f["k"], f["k_scales"], f["v"])


@needs_hopper
@pytest.mark.parametrize("paged", [False, True], ids=["plain", "paged"])
def test_fp8_run_equals_mla_prefill_fp8_bit_for_bit(paged):
    """Per-token fp8: two layers and the first again, with the plan's own V^T workspace and with
    workspace= given."""
    import cupy as cp

    c = _case(3)
    d = upload(c)
    kw = dict(cache_offsets=d["cache_offsets"], q_start_pos=d["q_start_pos"])
    layers = [_fp8_inputs(c), _fp8_inputs(c, 4)]
    lut = None
    if paged:  # one page table for both layers (the same seed: the same page order)
        for f in layers:
            blocks, lut_h = build_paged(dataclasses.replace(c, k_rope=cp.asnumpy(f["k_rope"])), 64, seed=9)
            lut = cp.asarray(lut_h) if lut is None else lut
            f["cache"] = PagedKVCache(cp.asarray(blocks), lut, 64)
    pl = mla_cupy.plan(d["valid_length"], d["cache_row_offsets"], num_heads=16, dtype=BF16, fp8=True,
                       page_table=lut, page_size=64 if paged else None, **kw)
    ws = cp.empty(int(np.prod(mla_cupy.fp8.vt_shape(16, c.k.shape[0], 3))), cp.uint8)
    for f in layers + layers[:1]:
        rope = f["cache"] if paged else f["k_rope"]
        want = mla_cupy.mla_prefill_fp8(*_fp8_args(f), rope, d["valid_length"], d["cache_row_offsets"], **kw)
        for workspace in (None, ws):
            out = cp.full(want.shape, np.nan, BF16)
            got = pl.run_fp8(*_fp8_args(f), rope, out=out, workspace=workspace)
            assert got is out
            np.testing.assert_array_equal(_bits(got), _bits(want))
    assert pl.workspace is not None


def _capture(fn, stream):
    import cupy as cp

    with stream:
        stream.begin_capture()
        fn()
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    cp.cuda.Device().synchronize()


@pytest.mark.parametrize("variant", [k for k in KERNELS] + (["fp8"] if "sm90" in KERNELS else []))
def test_captured_run_equals_eager(variant):
    """plan.run (after one eager run of the layout) inside a CUDA graph, replayed, equals eager."""
    import cupy as cp

    c = _case(5)
    d = upload(c)
    s = cp.cuda.Stream(non_blocking=True)
    fp8 = variant == "fp8"
    pl = mla_cupy.plan(d["valid_length"], d["cache_row_offsets"], num_heads=16, dtype=BF16, fp8=fp8,
                       kernel="auto" if fp8 else variant, cache_offsets=d["cache_offsets"], q_start_pos=d["q_start_pos"])
    out = cp.full((c.q.shape[0], 16, 128), np.nan, BF16)
    if fp8:
        f = _fp8_inputs(c)

        def run():
            pl.run_fp8(*_fp8_args(f), f["k_rope"], out=out, stream=s)
    else:
        def run():
            pl.run(d["q"], d["k"], d["v"], d["k_rope"], out=out, stream=s)
    run()
    s.synchronize()
    eager = out.copy()
    out.fill(np.nan)
    cp.cuda.Device().synchronize()
    _capture(run, s)
    np.testing.assert_array_equal(_bits(out), _bits(eager))


def _allocation_counter():
    """A CuPy memory hook that counts every request to the memory pool and every device
    allocation while it is active (``with hook: ...``; ``hook.calls``)."""
    from cupy.cuda import memory_hook

    class Counter(memory_hook.MemoryHook):
        name = "count_allocations"

        def __init__(self):
            self.calls = 0

        def malloc_preprocess(self, **kwargs):
            self.calls += 1

        def alloc_preprocess(self, **kwargs):
            self.calls += 1

    return Counter()


def _allocations_in(fn, n: int = 50) -> int:
    """Memory-pool requests and device allocations (:func:`_allocation_counter`) of ``n`` calls of
    ``fn`` after a first one (which packs the launch and may allocate), the device idle around them."""
    import cupy as cp

    fn()
    cp.cuda.Device().synchronize()
    counter = _allocation_counter()
    with counter:
        for _ in range(n):
            fn()
    cp.cuda.Device().synchronize()
    return counter.calls


@pytest.mark.parametrize("variant", ["bf16", "bf16-lse", "fp8", "fp8-workspace"])
def test_repeated_runs_allocate_nothing(variant):
    import cupy as cp

    if variant.startswith("fp8") and "sm90" not in KERNELS:
        pytest.skip("the fp8 variants run on compute capability 9.0")
    c = _case(6)
    d = upload(c)
    fp8 = variant.startswith("fp8")
    lse_wanted = variant == "bf16-lse"
    pl = mla_cupy.plan(d["valid_length"], d["cache_row_offsets"], num_heads=16, dtype=BF16, fp8=fp8,
                       return_lse=lse_wanted, cache_offsets=d["cache_offsets"], q_start_pos=d["q_start_pos"])
    out = cp.empty((c.q.shape[0], 16, 128), BF16)
    lse = cp.empty((c.q.shape[0], 16), cp.float32) if lse_wanted else None
    if fp8:
        f = _fp8_inputs(c)
        ws = cp.empty(int(np.prod(mla_cupy.fp8.vt_shape(16, c.k.shape[0], 3))), cp.uint8) \
            if variant == "fp8-workspace" else None

        def run():
            pl.run_fp8(*_fp8_args(f), f["k_rope"], out=out, workspace=ws)
    else:
        def run():
            pl.run(d["q"], d["k"], d["v"], d["k_rope"], out=out, lse=lse)
    calls = _allocations_in(run)  # after the first run (it packs and may allocate the plan's workspace)
    assert calls == 0, f"{calls} allocations in 50 runs"
    counter = _allocation_counter()
    with counter:  # the hook does see an allocation (the check above can fail)
        cp.empty(16, cp.uint8)
    assert counter.calls > 0


def _host_us(fn, reps=200, rounds=5):
    """Best of ``rounds``: host wall time per call over ``reps`` calls (few enough that the launch
    queue never fills), after a warm-up; the device is synchronized outside the timed loop."""
    import cupy as cp

    fn()
    cp.cuda.Device().synchronize()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps * 1e6)
        cp.cuda.Device().synchronize()
    return best


def test_run_host_time(record_property, capsys):
    """Host time of plan.run per call, out= given: CuPy 16-bit (the measure held under 30 us,
    aimed at 10), torch 16-bit and CuPy fp8 beside it; the one-shot mla_prefill launched from the
    plan cache (held under 60 us)."""
    import cupy as cp

    c = make_case([64], [64], 16, BF16, seed=7)
    d = upload(c)
    pl = mla_cupy.plan(d["valid_length"], d["cache_row_offsets"], num_heads=16, dtype=BF16, q_max_seq_len=64)
    out = cp.empty((64, 16, 128), BF16)
    times = {"cupy 16-bit": _host_us(lambda: pl.run(d["q"], d["k"], d["v"], d["k_rope"], out=out))}
    times["one-shot mla_prefill (validate=False, from the plan cache)"] = _host_us(lambda: mla_cupy.mla_prefill(
        d["q"], d["k"], d["v"], d["k_rope"], d["valid_length"], d["cache_row_offsets"], out=out, q_max_seq_len=64,
        validate=False))
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        t = {n: torch.from_dlpack(d[n]) for n in ("q", "k", "v", "k_rope")}
        tout = torch.empty((64, 16, 128), dtype=torch.bfloat16, device="cuda")
        times["torch 16-bit"] = _host_us(lambda: pl.run(t["q"], t["k"], t["v"], t["k_rope"], out=tout))
    if "sm90" in KERNELS:
        f = _fp8_inputs(c)
        pl8 = mla_cupy.plan(d["valid_length"], d["cache_row_offsets"], num_heads=16, dtype=BF16, fp8=True,
                            q_max_seq_len=64)
        times["cupy fp8 (V^T pre-pass + kernel)"] = _host_us(lambda: pl8.run_fp8(*_fp8_args(f), f["k_rope"], out=out))
    with capsys.disabled():
        print()
        for name, us in times.items():
            print(f"host time, {name}: {us:.1f} us/call")
            record_property(f"host_us {name}", round(us, 2))
    assert times["cupy 16-bit"] < 30, times
    assert times["one-shot mla_prefill (validate=False, from the plan cache)"] < 60, times


# ------------------------------------------------------------------------------------------------
# the one-shot calls' plan cache

@pytest.fixture
def plan_cache():
    """An empty plan cache of the default size, emptied again after the test."""
    from mla_cupy._plan_cache import DEFAULT_MAXSIZE

    mla_cupy.set_plan_cache_size(DEFAULT_MAXSIZE)
    mla_cupy.plan_cache_clear()
    yield
    mla_cupy.set_plan_cache_size(DEFAULT_MAXSIZE)
    mla_cupy.plan_cache_clear()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bound", [True, False], ids=["q_max_seq_len", "offsets-read"])
@pytest.mark.parametrize("batch", [2, 3], ids=["same-batch", "other-batch"])
def test_plan_cache_offsets_freed_and_reallocated_at_the_same_address(kernel, bound, batch, plan_cache):
    """The offsets of a cached call freed, and new ones of another batch layout (other sequence
    lengths and key positions, the same Tq and Tk; the same or another batch size) allocated where
    they were: the call with them launches the cached record (the same batch size and
    ``q_max_seq_len`` given: the same key), or packs its own (the largest query count read from
    the new offsets differs; another batch size is another key), and its result is the
    reference's for the new layout (output poisoned with NaN first)."""
    import cupy as cp

    from gpu_util import check_result, reference_result

    mask = SlidingWindowCausalMask(90)
    a = make_case([100, 60], [120, 300], 16, BF16, seed=1, cache_offsets=[3, 0])
    b = make_case([30, 130], [300, 120], 16, BF16, seed=2, cache_offsets=[0, 40]) if batch == 2 else \
        make_case([50, 50, 60], [140, 140, 140], 16, BF16, seed=2, cache_offsets=[0, 10, 40])
    kw = dict(mask=mask, kernel=kernel, validate=False, q_max_seq_len=130 if bound else None, return_lse=True)
    offsets = ("valid_length", "cache_row_offsets", "cache_offsets")
    pool = cp.cuda.MemoryPool()  # the offsets' own pool: a block freed there is the one the next request gets
    with cp.cuda.using_allocator(pool.malloc):
        da = {n: cp.asarray(getattr(a, n)) for n in offsets}
    da.update({n: cp.asarray(getattr(a, n)) for n in ("q", "k", "v", "k_rope")})
    db = {n: cp.asarray(getattr(b, n)) for n in ("q", "k", "v", "k_rope")}

    def call(case, d):
        out = cp.full((160, 16, 128), np.nan, BF16)
        got, lse = mla_cupy.mla_prefill(d["q"], d["k"], d["v"], d["k_rope"], d["valid_length"],
                                        d["cache_row_offsets"], cache_offsets=d["cache_offsets"], out=out, **kw)
        ref, ref_lse = reference_result(case, mask=mask)
        check_result(case, got, lse, ref, ref_lse)

    call(a, da)
    before = mla_cupy.plan_cache_info()
    assert (before.misses, before.currsize) == (1, 1)
    for name in offsets:
        ptr = da[name].data.ptr
        with cp.cuda.using_allocator(pool.malloc):
            del da[name]  # back to the pool: the cache keeps no array alive
            db[name] = cp.asarray(getattr(b, name))  # the same byte size: the pool hands the block back
        if db[name].data.ptr != ptr:
            pytest.skip(f"the memory pool gave the new {name} another address ({db[name].data.ptr:#x}, the freed "
                        f"one was {ptr:#x}): no reused address to test")
    call(b, db)
    after = mla_cupy.plan_cache_info()
    hit = bound and batch == 2
    assert (after.hits - before.hits, after.misses - before.misses) == ((1, 0) if hit else (0, 1))
    assert after.currsize == (1 if batch == 2 else 2)


def _cache_layers(c, d, paged):
    """Three layers' q, k, v and rope of one layout (the first the case's own; paged: their caches
    over one page table)."""
    import cupy as cp

    layers = [dict((n, d[n]) for n in ("q", "k", "v", "k_rope")), _layer(c, 2), _layer(c, 3)]
    if paged:
        lut = None
        for lay in layers:
            blocks, lut_h = build_paged(dataclasses.replace(c, k_rope=cp.asnumpy(lay["k_rope"])), 32, seed=11)
            lut = cp.asarray(lut_h) if lut is None else lut
            lay["k_rope"] = PagedKVCache(cp.asarray(blocks), lut, 32)
    return layers


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("variant", ["plain", "paged", "int32-q_start_pos", "validate", "allocated"])
def test_plan_cache_hits_equal_uncached_calls(kernel, variant, plan_cache):
    """Three layers twice through the cache (one miss, then hits: new data pointers each layer)
    equal the same calls with the cache off, bit for bit."""
    import cupy as cp

    c = _case(1)
    d = upload(c)
    layers = _cache_layers(c, d, variant == "paged")
    q_start = d["q_start_pos"].astype(cp.int32) if variant == "int32-q_start_pos" else d["q_start_pos"]
    given = variant != "allocated"
    bound = None if variant == "validate" else 260

    def call(lay):
        out = cp.full((c.q.shape[0], 16, 128), np.nan, BF16) if given else None
        lse = cp.full((c.q.shape[0], 16), np.nan, cp.float32) if given else None
        return mla_cupy.mla_prefill(lay["q"], lay["k"], lay["v"], lay["k_rope"], d["valid_length"],
                                    d["cache_row_offsets"], mask=SlidingWindowCausalMask(70),
                                    cache_offsets=d["cache_offsets"], q_start_pos=q_start, out=out, lse=lse,
                                    return_lse=True, kernel=kernel, q_max_seq_len=bound,
                                    validate=variant == "validate")

    mla_cupy.set_plan_cache_size(0)
    wants = [call(lay) for lay in layers]
    mla_cupy.set_plan_cache_size(256)
    for _ in range(2):
        for lay, (want, want_lse) in zip(layers, wants):
            got, got_lse = call(lay)
            np.testing.assert_array_equal(_bits(got), _bits(want))
            np.testing.assert_array_equal(_bits(got_lse), _bits(want_lse))
    info = mla_cupy.plan_cache_info()
    assert (info.hits, info.misses - 3, info.currsize) == (5, 1, 1), info


@needs_hopper
@pytest.mark.parametrize("given", [False, True], ids=["workspace-per-call", "workspace-given"])
def test_plan_cache_fp8_hits_equal_uncached_calls(given, plan_cache):
    import cupy as cp

    c = _case(3)
    d = upload(c)
    layers = [_fp8_inputs(c), _fp8_inputs(c, 4)]
    ws = cp.empty(int(np.prod(mla_cupy.fp8.vt_shape(16, c.k.shape[0], 3))), cp.uint8) if given else None

    def call(f):
        return mla_cupy.mla_prefill_fp8(*_fp8_args(f), f["k_rope"], d["valid_length"], d["cache_row_offsets"],
                                        cache_offsets=d["cache_offsets"], q_start_pos=d["q_start_pos"],
                                        workspace=ws)

    mla_cupy.set_plan_cache_size(0)
    wants = [call(f) for f in layers]
    mla_cupy.set_plan_cache_size(256)
    for _ in range(2):
        for f, want in zip(layers, wants):
            np.testing.assert_array_equal(_bits(call(f)), _bits(want))
    info = mla_cupy.plan_cache_info()
    assert (info.hits, info.misses - 2) == (3, 1), info


@pytest.mark.parametrize("variant", ["bf16", "bf16-lse", "int64-q_start_pos"])
def test_repeated_one_shot_calls_allocate_nothing(variant, plan_cache):
    """A one-shot call launched from the plan cache, with out= (and lse=) given, q_max_seq_len and
    validate=False, allocates nothing (as plan.run: it can be captured in a CUDA graph)."""
    import cupy as cp

    c = _case(6)
    d = upload(c)
    out = cp.empty((c.q.shape[0], 16, 128), BF16)
    lse = cp.empty((c.q.shape[0], 16), cp.float32) if variant == "bf16-lse" else None
    q_start = d["q_start_pos"] if variant == "int64-q_start_pos" else None

    def call():
        mla_cupy.mla_prefill(d["q"], d["k"], d["v"], d["k_rope"], d["valid_length"], d["cache_row_offsets"],
                             cache_offsets=d["cache_offsets"], q_start_pos=q_start, out=out, lse=lse, q_max_seq_len=260,
                             validate=False)
    calls = _allocations_in(call)
    assert calls == 0, f"{calls} allocations in 50 calls"
    assert mla_cupy.plan_cache_info().hits == 50

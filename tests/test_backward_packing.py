"""The backward's way from a call to its launches without a GPU (tests/_fake_gpu.py: the device
stubbed, CuPy arrays over host memory): which kernels launch in which order, what each reads
(the arrays' pointers, the offsets, the parts of one workspace), what a plan's run and a one-shot
call share, what the plan cache serves, and what is refused before any launch."""
import numpy as np
import pytest

import mla_cupy
from mla_cupy import CausalMask, NullMask, plan_cache_info
from mla_cupy._backward import key_blocks_bound, tail_groups, workspace_parts
import mla_cupy._packing as packing
from mla_cupy.validation import Problem

from _cases import BF16, FP16, make_case
from _fake_gpu import fake_gpu_empty_cache, host_array, host_cupy, require_cupy, write_host

require_cupy()

GRADS = ("dq", "dk", "dv", "dk_rope")


@pytest.fixture(params=["90", "80"], ids=["hopper", "portable"])
def gpu(request):
    """A fake GPU of compute capability 9.0 (the Hopper backward) or 8.0 (the portable one), an
    empty plan cache of the default size."""
    with fake_gpu_empty_cache(request.param) as g:
        yield g


@pytest.fixture
def one_scratch(monkeypatch):
    """Every launch's workspace the same host buffer (so that launches packed apart compare equal)."""
    buf = host_cupy(np.zeros(1 << 20, np.uint8))
    monkeypatch.setattr(packing, "scratch_on", lambda shape, sp: buf)
    return buf


def problem(sq=(5, 3), sk=(6, 3), heads=4, dtype=BF16, seed=0, q_start_pos=None):
    """A backward's arrays over host memory: the forward's inputs and results, dout, the gradients."""
    c = make_case(list(sq), list(sk), heads, dtype, seed=seed)
    tq, tk = int(sum(sq)), int(sum(sk))
    d = {n: host_cupy(getattr(c, n)) for n in ("q", "k", "v", "k_rope", "valid_length", "cache_row_offsets")}
    d.update(dout=host_cupy(np.ones((tq, heads, 128), dtype)), out=host_cupy(np.ones((tq, heads, 128), dtype)),
             lse=host_cupy(np.zeros((tq, heads), np.float32)),
             dq=host_cupy(np.zeros((tq, heads, 192), dtype)), dk=host_cupy(np.zeros((tk, heads, 128), dtype)),
             dv=host_cupy(np.zeros((tk, heads, 128), dtype)), dk_rope=host_cupy(np.zeros((tk, 1, 64), dtype)))
    if q_start_pos is not None:
        d["q_start_pos"] = host_cupy(np.asarray(q_start_pos))
    return d


def backward(d, **kw):
    for n in GRADS:
        kw.setdefault(n, d[n])
    kw.setdefault("q_start_pos", d.get("q_start_pos"))
    return mla_cupy.mla_prefill_backward(d["dout"], d["q"], d["k"], d["v"], d["k_rope"], d["out"], d["lse"],
                                         d["valid_length"], d["cache_row_offsets"], **kw)


def run_backward(pl, d, **kw):
    return pl.run_backward(d["dout"], d["q"], d["k"], d["v"], d["k_rope"], d["out"], d["lse"],
                           **{n: d[n] for n in GRADS}, **kw)


def plan_of(d, **kw):
    return mla_cupy.plan(d["valid_length"], d["cache_row_offsets"], num_heads=d["q"].shape[1], dtype=d["q"].dtype,
                         **kw)


def launched(gpu, fn):
    """The kinds and argument values of the launches ``fn()`` makes."""
    n = len(gpu.launches)
    fn()
    kinds = gpu.backward_kernels()[n:]
    return kinds, [gpu.values(i) for i in range(n, len(gpu.launches))]


def raw(gpu, fn):
    n = len(gpu.launches)
    fn()
    return [r for _, _, r in gpu.launches[n:]]


def counts():
    i = plan_cache_info()
    return i.hits, i.misses


# ------------------------------------------------------------------------------------------------
# what each launch reads

def test_the_passes_launch_in_order_on_the_arrays_and_one_workspace(gpu):
    d = problem()
    kinds, (pre, main, dq, rope) = launched(gpu, lambda: backward(d, q_max_seq_len=5, validate=False))
    assert kinds == ["pre", "main", "dq", "rope"]
    ptr = {n: d[n].data.ptr for n in d}
    assert (pre["dout"], pre["out"], pre["lse"], pre["dlse"]) == (ptr["dout"], ptr["out"], ptr["lse"], 0)
    assert [main[n] for n in ("q", "k", "v", "k_rope", "dout", "dk", "dv")] == \
        [ptr[n] for n in ("q", "k", "v", "k_rope", "dout", "dk", "dv")]
    assert dq["dq"] == ptr["dq"] and (rope["dk_rope"], rope["dk"], rope["dv"]) == (ptr["dk_rope"], ptr["dk"], ptr["dv"])
    for launch in (pre, main, dq):
        assert launch["q_offsets"] == ptr["valid_length"]
    assert (main["kv_begin"], main["kv_end"]) == (ptr["cache_row_offsets"], ptr["cache_row_offsets"] + 4)
    assert rope["kv_end"] == ptr["cache_row_offsets"] + 4
    # one workspace: the parts each pass shares at the same address, at the offsets the layout gives
    assert pre["dq_accum"] == main["dq_accum"] == dq["dq_accum"]
    assert pre["lse_log2"] == main["lse_log2"] and pre["dpsum"] == main["dpsum"]
    assert main["rope_part"] == rope["rope_part"]
    base = int(main["lse_log2"])
    slots = int(rope["slots"])
    p = Problem(2, 4, 8, 9, BF16, BF16, CausalMask(), 1.0, 5, False)  # B, H, Tq, Tk as above
    _, parts = workspace_parts(p, slots, False)
    for name in ("lse_log2", "dpsum", "dq_accum", "rope_part"):
        assert main[name] == base + parts[name][0], name
    assert main["dq_sem"] == 0 and main["rope_sem"] == 0 and main["deterministic"] == 0  # no semaphores
    if gpu.capability == "90":  # one slot that every tile adds into, zeroed by the pre-pass
        assert slots == 1 and pre["rope_part"] == main["rope_part"] and pre["zeroed_f4"] == 9 * 64 // 4
    else:  # a slot per head group, each stored by its tiles: nothing to zero
        assert slots == -(-4 // main["heads_per_group"]) and pre["zeroed_f4"] == 0


def test_the_pre_pass_grid_covers_the_zeroed_rope_slot(gpu):
    """A long prefix of keys under few queries: the pre-pass's grid grows past the query blocks so that
    no thread zeroes more than a few float4s of the one rope slot (Hopper); on the portable kernel
    nothing is zeroed and the grid is the query blocks'."""
    d = problem(sq=(5,), sk=(40000,), heads=1)
    _, (pre, _, _, _) = launched(gpu, lambda: backward(d))
    grid = gpu.launches[-4][0].grid
    if gpu.capability == "90":
        assert pre["zeroed_f4"] == 40000 * 64 // 4
        assert grid[0] * grid[1] * grid[2] * 256 * 8 >= pre["zeroed_f4"] > (grid[0] - 1) * 256 * 8
    else:
        assert pre["zeroed_f4"] == 0 and grid == (1, 1, 1)


def test_the_key_blocks_span_the_longest_sequence(gpu):
    d = problem(sq=(5, 3), sk=(200, 3), heads=2)
    _, (_, main, _, _) = launched(gpu, lambda: backward(d))
    block_n = 96 if gpu.capability == "90" else 64
    assert main["num_n_blocks"] == -(-200 // block_n)
    grid = gpu.launches[-3][0].grid[0]
    work = main["num_n_blocks"] * 2 * -(-2 // main["heads_per_group"])
    assert grid == (min(work, 132) if gpu.capability == "90" else work)  # persistent on Hopper
    # Hopper: every head group in the tail (a few tiles, their rows far within the L2); the portable
    # kernel's one CTA per tile keeps key blocks fastest
    groups = -(-2 // main["heads_per_group"])
    assert main["tail_groups"] == (groups if gpu.capability == "90" else 0)


@pytest.mark.parametrize("heads, tq, hpg, expected", [
    (16, 4096, 2, 7),     # 8 groups of 43 key blocks: the last 7 hold 2 tiles per CTA, 37 MB of rows
    (16, 8192, 2, 4),     # 8 groups of 86: the last 4, 42 MB
    (128, 2048, 4, 0),    # 32 groups of 22: the last 12 would read 63 MB of rows, past the L2
    (128, 8192, 4, 0),    # 32 groups of 86: the last 4, 84 MB
    (16, 16384, 4, 0),    # 4 groups of 171: the last 2, 84 MB
])
def test_tail_groups_where_their_rows_fit_in_l2(heads, tq, hpg, expected):
    """The head groups handed out key blocks slowest at a Hopper launch's end (132 CTAs, a 50 MiB
    L2, one causal sequence of tq rows)."""
    n_blocks = -(-tq // 96)
    assert tail_groups(heads // hpg, n_blocks, 132, hpg, tq, 50 << 20) == expected
    assert tail_groups(heads // hpg, n_blocks, 132, hpg, tq, 1 << 40) == min(heads // hpg, -(-264 // n_blocks))
    assert tail_groups(0, n_blocks, 132, hpg, tq, 50 << 20) == tail_groups(heads // hpg, 0, 132, hpg, tq, 50 << 20) == 0


def test_without_read_back_tk_bounds_the_key_blocks(gpu, monkeypatch):
    """q_max_seq_len and validate=False: nothing is read back, on a miss or a hit; the key blocks
    span Tk; other key lengths of the same Tk launch the same record."""
    import mla_cupy._plan_cache as launch_services
    import mla_cupy.validation as validation

    d = problem(sq=(5, 3), sk=(200, 3), heads=2)
    reads = []

    def no_read(*a, **k):
        reads.append(a)
        raise AssertionError("the offsets were read back")

    monkeypatch.setattr(validation, "read_back", no_read)
    monkeypatch.setattr(launch_services, "check_values", no_read)
    kw = dict(q_max_seq_len=5, validate=False)
    _, (_, main, _, _) = launched(gpu, lambda: backward(d, **kw))
    block_n = 96 if gpu.capability == "90" else 64
    assert main["num_n_blocks"] == -(-203 // block_n)
    write_host(d["cache_row_offsets"], [0, 101, 203])
    _, (_, again, _, _) = launched(gpu, lambda: backward(d, **kw))
    assert counts() == (1, 1) and again["num_n_blocks"] == main["num_n_blocks"] and not reads


def test_deterministic_mode_and_dlse_reach_their_passes(gpu):
    d = problem()
    dlse = host_cupy(np.zeros((8, 4), np.float32))
    kinds, (pre, main, _, _) = launched(gpu, lambda: backward(d, deterministic=True, dlse=dlse))
    assert main["deterministic"] == 1 and main["dq_sem"] > main["rope_part"] and pre["dq_sem"] == main["dq_sem"]
    if gpu.capability == "90":  # the key blocks' semaphores right after the one rope slot, zeroed with it
        p = Problem(2, 4, 8, 9, BF16, BF16, CausalMask(), 1.0, 5, False)
        sems = -(-key_blocks_bound(p, 96) // 4) * 4
        assert main["rope_sem"] == main["rope_part"] + 9 * 64 * 4 and pre["zeroed_f4"] == (9 * 64 + sems) // 4
    else:
        assert main["rope_sem"] == 0 and pre["zeroed_f4"] == 0
    assert pre["dlse"] == dlse.data.ptr and pre["dlse_st"] == 4


def test_the_hopper_tensor_maps_follow_the_arrays(gpu):
    if gpu.capability != "90":
        pytest.skip("the portable kernel takes no tensor map")
    d = problem()
    backward(d)
    buf = gpu.launches[-3]
    pack = buf[0].pack
    words = np.frombuffer(buf[2], np.uint64)
    for m, n in (("tm_q", "q"), ("tm_k", "k"), ("tm_v", "v"), ("tm_rope", "k_rope"), ("tm_do", "dout")):
        assert words[pack.offsets[m] // 8] == d[n].data.ptr, m  # the fake encoder writes the pointer first


@pytest.mark.parametrize("sq, sk, want", [((), (), []), ((0, 0), (3, 2), ["rope"]), ((4, 1), (0, 0), ["pre", "dq"])])
def test_a_backward_with_nothing_to_attend_launches_what_zeroes_its_gradients(gpu, sq, sk, want):
    """No sequence: nothing; no query: the rope pass alone zeroes dk, dv and the rope's gradient;
    no key: the pre-pass zeroes dq's accumulator, the dq pass writes it (and nothing reads a key)."""
    d = problem(sq=sq, sk=sk, heads=2)
    kinds, values = launched(gpu, lambda: backward(d))
    assert kinds == want
    if want == ["rope"]:
        assert values[0]["batch"] == 0 and values[0]["tk"] == 5


# ------------------------------------------------------------------------------------------------
# plans and the plan cache

def test_a_plan_run_launches_what_a_one_shot_call_packs(gpu, one_scratch):
    d = problem()
    pl = plan_of(d, q_max_seq_len=5)
    planned = raw(gpu, lambda: run_backward(pl, d))
    assert len(planned) == 4
    assert raw(gpu, lambda: backward(d, q_max_seq_len=5)) == planned


def test_a_plan_packs_once_and_keeps_a_workspace_per_stream(gpu):
    d, e = problem(seed=0), problem(seed=1)
    pl = plan_of(d)
    _, first = launched(gpu, lambda: run_backward(pl, d))
    packs = gpu.packs
    _, second = launched(gpu, lambda: run_backward(pl, dict(e, valid_length=d["valid_length"],
                                                            cache_row_offsets=d["cache_row_offsets"])))
    assert gpu.packs == packs  # pointers rewritten, nothing packed
    assert second[1]["q"] == e["q"].data.ptr and second[2]["dq"] == e["dq"].data.ptr
    assert second[1]["dq_accum"] == first[1]["dq_accum"]  # the stream's workspace, kept
    _, other = launched(gpu, lambda: run_backward(pl, d, stream=0x6000))
    assert other[1]["dq_accum"] != first[1]["dq_accum"]


def test_a_plan_allocates_the_gradients_not_given(gpu):
    d = problem()
    pl = plan_of(d)
    dq, dk, dv, dk_rope = pl.run_backward(d["dout"], d["q"], d["k"], d["v"], d["k_rope"], d["out"], d["lse"],
                                          dk=d["dk"])
    assert dk is d["dk"] and dq.shape == (8, 4, 192) and dv.shape == (9, 4, 128) and dk_rope.shape == (9, 1, 64)
    assert dq.dtype == dk_rope.dtype == BF16


def test_the_cache_serves_a_call_of_the_same_layout(gpu, one_scratch):
    d = problem(seed=0)
    backward(d)
    assert counts() == (0, 1)
    e = dict(problem(seed=1), valid_length=d["valid_length"], cache_row_offsets=d["cache_row_offsets"])
    packs = gpu.packs
    hit = raw(gpu, lambda: backward(e))
    assert counts() == (1, 1) and gpu.packs == packs
    mla_cupy.set_plan_cache_size(0)
    assert raw(gpu, lambda: backward(e)) == hit  # what a fresh call packs


def test_other_key_lengths_under_the_same_layout_are_planned_again(gpu):
    d = problem(sq=(5, 3), sk=(200, 3), heads=2)
    _, (_, main, _, _) = launched(gpu, lambda: backward(d))
    write_host(d["cache_row_offsets"], [0, 101, 203])  # the same Tk, shorter sequences
    _, (_, again, _, _) = launched(gpu, lambda: backward(d))
    assert counts() == (0, 2)
    block_n = 96 if gpu.capability == "90" else 64
    assert (main["num_n_blocks"], again["num_n_blocks"]) == (-(-200 // block_n), -(-102 // block_n))


def test_an_int32_q_start_pos_is_widened_per_call(gpu, monkeypatch):
    import mla_cupy._plan_cache as launch_services

    made = []

    def widened(q_start_pos, raw_stream):  # the fake's host copy, each one kept (no address reused)
        made.append(host_cupy(host_array(q_start_pos).astype(np.int64)))
        return made[-1]

    monkeypatch.setattr(launch_services, "widened", widened)
    d = problem(q_start_pos=np.array([1, 6], np.int32))
    for _ in range(2):  # a miss, then a hit: each launch reads the copy made for it
        _, (_, main, _, _) = launched(gpu, lambda: backward(d))
        assert main["q_start_pos"] == made[-1].data.ptr
    assert counts() == (1, 1) and len(made) == 2
    e = problem(q_start_pos=np.array([1, 6], np.int64))
    _, (_, wide, _, _) = launched(gpu, lambda: backward(e))
    assert wide["q_start_pos"] == e["q_start_pos"].data.ptr and len(made) == 2


def test_the_gradients_not_given_are_new_arrays(gpu):
    d = problem(dtype=FP16)
    dq, dk, dv, dk_rope = backward(d, dq=None, dk=None, dv=None, dk_rope=None)
    again = backward(d, dq=None, dk=None, dv=None, dk_rope=None)
    assert counts() == (1, 1)
    assert dq.dtype == FP16 and dq.shape == (8, 4, 192) and dk_rope.shape == (9, 1, 64)
    assert again[0].data.ptr != dq.data.ptr
    assert gpu.values(-3)["dk"] == again[1].data.ptr


# ------------------------------------------------------------------------------------------------
# refused before any launch

def test_plans_the_backward_does_not_take_are_refused(gpu):
    d = problem()
    vl, cro = d["valid_length"], d["cache_row_offsets"]
    n = len(gpu.launches)
    with pytest.raises(ValueError, match="run_backward: .*accumulate"):
        run_backward(mla_cupy.plan(vl, cro, num_heads=4, dtype=BF16, out_dtype=np.float32, accumulate=True,
                                   return_lse=True), d)
    if gpu.capability == "90":
        with pytest.raises(TypeError, match="run_backward: the backward takes 16-bit inputs"):
            run_backward(mla_cupy.plan(vl, cro, num_heads=4, dtype=BF16, fp8=True), d)
    assert len(gpu.launches) == n


def test_a_run_against_another_layout_is_refused(gpu):
    d = problem()
    pl = plan_of(d)
    n = len(gpu.launches)
    with pytest.raises(ValueError, match="q: expected H = 4 heads"):
        run_backward(pl, problem(heads=2))
    with pytest.raises(TypeError, match="q: expected dtype bfloat16"):
        run_backward(pl, problem(dtype=FP16))
    assert len(gpu.launches) == n


def test_a_misaligned_gradient_is_refused_naming_it(gpu):
    d = problem()
    big = host_cupy(np.zeros((8 * 4 * 192 + 1,), BF16))
    dq = big[1:].reshape(8, 4, 192)
    n = len(gpu.launches)
    with pytest.raises(ValueError, match="dq"):
        backward(d, dq=dq)
    pl = plan_of(d)
    with pytest.raises(ValueError, match="dq"):
        pl.run_backward(d["dout"], d["q"], d["k"], d["v"], d["k_rope"], d["out"], d["lse"], dq=dq)
    assert len(gpu.launches) == n


def test_other_masks_key_other_plans(gpu):
    d = problem()
    backward(d)
    backward(d, mask=NullMask())
    assert counts() == (0, 2)

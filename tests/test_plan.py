"""Argument checks that a CPU machine can run: the order of the checks for host data (NumPy, torch
CPU), the checks of ``mla_cupy.plan`` on host offsets, the checks of a plan's runs, and the
package's import graph. No GPU: every case ends in an error before anything is launched."""
import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mla_cupy
from mla_cupy import CausalMask, PagedKVCache

from _cases import BF16, make_case
from _fake import dev

PKG = Path(mla_cupy.__file__).resolve().parent


def host_args(sq=(5, 3), sk=(6, 3), heads=4, dtype=BF16):
    """A valid problem as NumPy arrays (what a CPU user has at hand)."""
    c = make_case(list(sq), list(sk), heads=heads, dtype=dtype, seed=2)
    return dict(q=c.q, k=c.k, v=c.v, k_rope=c.k_rope, valid_length=c.valid_length,
                cache_row_offsets=c.cache_row_offsets)


def call(args, **kw):
    return mla_cupy.mla_prefill(args["q"], args["k"], args["v"], args["k_rope"], args["valid_length"],
                                args["cache_row_offsets"], **kw)


# ------------------------------------------------------------------------------------------------
# mla_prefill on host data: the real problem first, the device last

H = host_args()
HOST_BAD = [
    # (overrides, keywords, exception, words the message must contain)
    (dict(q=np.ones((8, 4, 128), BF16)), {}, ValueError, ["q:", "192", "got 128"]),
    (dict(k=np.ones((9, 3, 128), BF16), v=np.ones((9, 3, 128), BF16)), {}, ValueError, ["k:", "H = 4", "[9, 3, 128]"]),
    (dict(valid_length=np.array([0, 6, 5], np.uint32)), {}, ValueError, ["valid_length:", "non-decreasing"]),
    (dict(q=np.ones((8, 4, 192), np.float64)), {}, TypeError, ["q:", "bfloat16 or float16", "float64"]),
    (dict(q=np.ones((8, 192), BF16)), {}, ValueError, ["q:", "3-D", "2-D"]),
    ({}, dict(scale=-1.0), ValueError, ["scale:", "positive"]),
    ({}, dict(mask="causal"), TypeError, ["mask:", "str"]),
    ({}, dict(q_max_seq_len=2), ValueError, ["q_max_seq_len:", "5 queries"]),
    ({}, dict(kernel="sm70"), ValueError, ["kernel:", "sm70"]),
    ({}, dict(out=np.ones((8, 4, 64), BF16)), ValueError, ["out:", "[8, 4, 128]"]),
    ({}, dict(cache_offsets=np.array([0, -1], np.int32)), ValueError, ["cache_offsets:", "non-negative"]),
    # two problems: the first argument is named
    (dict(q=np.ones((8, 192), BF16), k=np.ones((9, 4, 96), BF16)), {}, ValueError, ["q:", "3-D"]),
]


@pytest.mark.parametrize("over,kw,exc,words", HOST_BAD, ids=[f"{i}" for i in range(len(HOST_BAD))])
def test_numpy_inputs_hear_the_real_problem(over, kw, exc, words):
    with pytest.raises(exc) as info:
        call(dict(H, **over), **kw)
    msg = str(info.value)
    assert "device array" not in msg, msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


def test_valid_numpy_inputs_are_told_how_to_move(as_if_gpu):
    """The device check comes last; on a GPU machine it names the first host array (q) and says what to do."""
    with pytest.raises(TypeError) as info:
        call(H)
    msg = str(info.value)
    assert msg.startswith("q:") and "NumPy" in msg and "cupy.asarray(q)" in msg and "mla_cupy.reference" in msg


def test_device_check_names_the_first_host_array(as_if_gpu):
    """Device q, k, v and a host k_rope: the rope is the argument named."""
    a = dict(H, q=dev(H["q"]), k=dev(H["k"]), v=dev(H["v"]))
    with pytest.raises(TypeError, match=r"^k_rope: .*NumPy.*cupy\.asarray\(k_rope\)"):
        call(a)


def test_without_a_gpu_valid_host_inputs_hear_that_the_call_needs_one(as_if_no_gpu):
    """After every argument check, a machine without a GPU gets the package's own message and
    the CPU function to call, not CuPy's driver traceback."""
    from mla_cupy import quant

    with pytest.raises(RuntimeError, match=r"^mla_prefill needs a CUDA GPU: none found \(CuPy sees no CUDA device\); "
                                           r"use mla_cupy\.reference\.mla_prefill on the CPU$"):
        call(H)
    with pytest.raises(ValueError, match="q: expected head size Dqk = 192"):  # the arguments still come first
        call(dict(H, q=np.ones((8, 4, 128), BF16)))
    c = make_case([5, 3], [6, 3], heads=4, dtype=BF16, seed=3)
    f = quant.quantize_per_token(c.q, c.k, c.v, c.k_rope)
    with pytest.raises(RuntimeError, match=r"^mla_prefill_fp8 needs a CUDA GPU: .*mla_cupy\.reference\.mla_prefill_fp8 on"):
        mla_cupy.mla_prefill_fp8(f["q_nope"], f["q_rope"], f["q_scale"], f["k"], f["k_scales"], f["v"], f["k_rope"],
                                 c.valid_length, c.cache_row_offsets)


def test_this_machine_without_a_gpu_gets_the_message():
    """No monkeypatching: what a CPU machine's user sees from the GPU API."""
    from conftest import gpu_count

    if gpu_count():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match=r"^mla_prefill needs a CUDA GPU: none found \(.+\); use mla_cupy\.reference"):
        call(H)


def test_without_cupy_the_gpu_api_says_how_to_install_it():
    code = ("import sys; sys.modules['cupy'] = None\n"
            "import numpy as np, ml_dtypes, mla_cupy\n"
            "bf = ml_dtypes.bfloat16\n"
            "q, k = np.ones((4, 2, 192), bf), np.ones((4, 2, 128), bf)\n"
            "o = np.array([0, 4], np.uint32)\n"
            "try:\n"
            "    mla_cupy.mla_prefill(q, k, k, np.ones((4, 1, 64), bf), o, o)\n"
            "except RuntimeError as e:\n"
            "    print(e)\n"
            "print(mla_cupy.reference.mla_prefill(q, k, k, np.ones((4, 1, 64), bf), o, o).shape)\n")
    assert run_python(code).splitlines() == [
        'mla_prefill needs a CUDA GPU: none found (CuPy is not installed: pip install ".[cuda13]" (CUDA 13 '
        'driver) or ".[cuda12]" (CUDA 12 driver) in the mla_cupy checkout); use mla_cupy.reference.mla_prefill on '
        'the CPU',
        "(4, 2, 128)"]


def test_torch_cpu_tensors_are_checked_like_numpy(as_if_gpu):
    torch = pytest.importorskip("torch")
    t = {n: torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16) if x.dtype == BF16 else torch.from_numpy(x)
         for n, x in H.items()}
    with pytest.raises(ValueError, match="q: expected head size Dqk = 192"):
        call(dict(t, q=t["q"][:, :, :128]))
    with pytest.raises(TypeError, match=r"^q: .*torch tensor on the CPU.*q\.cuda\(\)"):
        call(t)
    assert "torch" in sys.modules  # (imported by this test, never by the package: see below)


def test_fp8_numpy_inputs_hear_the_real_problem(as_if_gpu):
    from mla_cupy import quant

    c = make_case([5, 3], [6, 3], heads=4, dtype=BF16, seed=3)
    f = quant.quantize_per_token(c.q, c.k, c.v, c.k_rope)
    args = [f["q_nope"], f["q_rope"], f["q_scale"], f["k"], f["k_scales"], f["v"], f["k_rope"], c.valid_length,
            c.cache_row_offsets]
    bad = list(args)
    bad[2] = -f["q_scale"]
    with pytest.raises(ValueError, match=r"q_scale: expected non-negative scales, got q_scale\[0\]"):
        mla_cupy.mla_prefill_fp8(*bad)
    bad = list(args)
    bad[3] = f["k"][:, :2]
    with pytest.raises(ValueError, match=r"k: expected shape \[\*, 4, 128\]"):
        mla_cupy.mla_prefill_fp8(*bad)
    with pytest.raises(TypeError, match=r"^q_nope: .*NumPy.*cupy\.asarray\(q_nope\.view\(numpy\.uint8\)\)"):
        mla_cupy.mla_prefill_fp8(*args)


def test_paged_cache_page_size_is_checked_when_built():
    blocks = np.zeros((3, 32, 1, 576), BF16)
    with pytest.raises(ValueError, match=r"PagedKVCache.page_size: expected blocks.shape\[1\] = 32 .*got 16"):
        PagedKVCache(blocks, np.zeros((1, 2), np.int32), 16)
    assert PagedKVCache(blocks, np.zeros((1, 2), np.int32), 32).page_size == 32


# ------------------------------------------------------------------------------------------------
# mla_cupy.plan: the layout is checked when the plan is built, on host offsets too

VL = np.array([0, 5, 8], np.uint32)
CRO = np.array([0, 6, 9], np.uint32)


def make_plan(**over):
    kw = dict(num_heads=4, dtype=BF16)
    kw.update(over)
    vl = kw.pop("valid_length", VL)
    cro = kw.pop("cache_row_offsets", CRO)
    return mla_cupy.plan(vl, cro, **kw)


PLAN_BAD = [
    (dict(valid_length=np.array([0, 6, 5], np.uint32)), ValueError, "valid_length: offsets must be non-decreasing"),
    (dict(valid_length=np.array([1, 5, 8], np.uint32)), ValueError, "valid_length: expected offsets starting at 0"),
    (dict(valid_length=np.array([0, 5, 8], np.int64)), TypeError, "valid_length: expected dtype int32 or uint32"),
    (dict(cache_row_offsets=np.array([0, 6], np.uint32)), ValueError, "cache_row_offsets: expected 3 entries"),
    (dict(num_heads=0), ValueError, "num_heads: expected a positive int"),
    (dict(dtype=np.float32), TypeError, "dtype: expected bfloat16 or float16, got float32"),
    (dict(dtype=np.float16, fp8=True), TypeError, "dtype: expected bfloat16"),
    (dict(scale=-2.0), ValueError, "scale: expected a positive float"),
    (dict(mask="causal"), TypeError, "mask: expected a mla_cupy mask"),
    (dict(q_max_seq_len=4), ValueError, "q_max_seq_len: a sequence has 5 queries"),
    (dict(q_max_seq_len=-1), ValueError, "q_max_seq_len: expected a non-negative int"),
    (dict(kernel="hopper"), ValueError, "kernel: expected one of"),
    (dict(kernel="sm80", fp8=True), ValueError, "kernel: the fp8 variants run on the Hopper kernel only"),
    (dict(fp8=True, fp8_rope=True, page_table=np.zeros((2, 1), np.int32), page_size=16), ValueError,
     "page_table: an all-e4m3 plan"),
    (dict(cache_offsets=np.array([0, -3], np.int32)), ValueError, "cache_offsets: expected non-negative positions"),
    (dict(q_start_pos=np.array([0.0, 1.0])), TypeError, "q_start_pos: expected dtype int32 or int64"),
    (dict(page_table=np.zeros((2, 1), np.int32), page_size=24), ValueError, "page_size: expected a power of two"),
    (dict(page_table=np.zeros((3, 1), np.int32), page_size=16), ValueError, "page_table: expected 2 rows"),
    (dict(page_table=np.zeros((2, 1), np.int32), page_size=16, cache_offsets=np.array([0, 20], np.uint32)), ValueError,
     "page_table: sequence 1 needs pages up to 1"),
    (dict(page_table=np.array([[0], [-1]], np.int32), page_size=16), ValueError, r"page_table: block id -1 at \[1, 0\]"),
    (dict(page_size=16), ValueError, "page_size: only a paged plan"),
    (dict(out_dtype=np.float16), TypeError, r"out_dtype: expected bfloat16 \(the dtype of q\) or float32, got float16"),
    (dict(accumulate=True), TypeError, "accumulate: out must be float32"),
    (dict(accumulate=1), TypeError, "accumulate: expected a bool"),
    (dict(return_lse="yes"), TypeError, "return_lse: expected a bool"),
]


@pytest.mark.parametrize("over,exc,match", PLAN_BAD, ids=[str(i) for i in range(len(PLAN_BAD))])
def test_plan_checks_the_layout_on_host_offsets(over, exc, match):
    with pytest.raises(exc, match=match):
        make_plan(**over)


def test_plan_reads_device_offsets_too():
    with pytest.raises(ValueError, match="valid_length: offsets must be non-decreasing"):
        make_plan(valid_length=dev(np.array([0, 6, 5], np.uint32)), cache_row_offsets=dev(CRO))


def test_plan_accepts_torch_dtypes_and_cpu_offsets():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="valid_length: offsets must be non-decreasing"):
        make_plan(valid_length=torch.tensor([0, 6, 5], dtype=torch.int32), dtype=torch.bfloat16)


def test_a_valid_layout_needs_a_gpu_last():
    """Every check passes; only then does the plan ask for a device (none here)."""
    from conftest import gpu_count

    if gpu_count():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match=r"^plan needs a CUDA GPU: none found \(.+\); use mla_cupy\.reference"):
        make_plan(mask=CausalMask(), page_table=np.zeros((2, 1), np.int32), page_size=16)


# Which fp8 kernel a layout takes from its key offsets: the one that reads a key tile's scales in
# pairs where every sequence's first key row is even, the masks have three fp8 consumers and the rope
# is plain; else the one that reads them one at a time (offsets not read: the latter too).
SCALE_PAIRS = [
    (dict(fp8=True), True),
    (dict(fp8=True, fp8_rope=True), True),
    (dict(fp8=True, mask=mla_cupy.NullMask()), True),
    (dict(fp8=True, cache_row_offsets=np.array([0, 5, 8], np.uint32)), False),  # sequence 1 starts at row 5
    (dict(fp8=True, cache_row_offsets=np.array([0, 6, 9], np.uint32), valid_length=np.array([0, 5, 5], np.uint32)),
     True),  # an empty last sequence starting at 6; the keys end at an odd row: their ends do not matter
    (dict(fp8=True, mask=mla_cupy.SlidingWindowCausalMask(37)), False),  # two consumers
    (dict(fp8=True, mask=mla_cupy.ChunkedMask(64)), False),
    (dict(fp8=True, page_table=np.zeros((2, 1), np.int32), page_size=16), False),  # a paged rope
    (dict(fp8=True, validate=False, q_max_seq_len=5), False),  # offsets not read
    (dict(fp8=True, validate=False), True),  # read for the grid
    (dict(), False),  # 16-bit
    (dict(fp8_rope=True), False),
]


@pytest.mark.parametrize("over,pairs", SCALE_PAIRS, ids=[str(i) for i in range(len(SCALE_PAIRS))])
def test_fp8_layout_takes_the_scale_pairs_kernel_by_its_key_rows(over, pairs):
    from mla_cupy._plan_checks import check_plan_args

    kw = dict(num_heads=4, dtype=BF16, mask=None, scale=None, q_max_seq_len=None, kernel="auto", cache_offsets=None,
              q_start_pos=None, page_table=None, page_size=None, rope_offset=512, fp8=False, fp8_rope=False,
              out_dtype=None, return_lse=False, accumulate=False, validate=True)
    kw.update(over)
    vl, cro = kw.pop("valid_length", VL), kw.pop("cache_row_offsets", CRO)
    assert check_plan_args(vl, cro, **kw).problem.scale_pairs is pairs


def test_scale_pairs_names_its_own_kernels():
    from mla_cupy import _registry as reg

    name = reg.prefill_sm90_name(BF16, BF16, CausalMask(), False, reg.VARIANT_FP8, pairs=True)
    assert name.startswith("mla::sm90::mla_prefill_kernel<mla::sm90::EvenKeyRows<mla::sm90::VariantFp8>, ")
    fam = reg.prefill_sm90(BF16, CausalMask(), reg.VARIANT_E4M3, pairs=True)
    assert reg.family_label(fam) == "mla_prefill_sm90<bf16, CausalMask, e4m3-per-token, scale-pairs>"
    assert all(", false>" in n for n in fam[1] if reg.is_kernel(n))  # a plain rope only
    with pytest.raises(ValueError, match="pairs: the 'bf16' variant reads no key scales"):
        reg.prefill_sm90_name(BF16, BF16, CausalMask(), False, reg.VARIANT_16, pairs=True)


# ------------------------------------------------------------------------------------------------
# the runs of a plan: arrays checked against it the first time a layout is seen

def cpu_plan(fp8=False, paged=False, kernel="sm90", kv_total=9, tq=8, accumulate=False, return_lse=False):
    """A plan over fake device offsets, built without a GPU (its runs must fail before launching)."""
    from mla_cupy._run_args import Target
    from mla_cupy._plan_checks import RunBounds
    from mla_cupy.prefill_plan import PrefillPlan, offsets_of
    from mla_cupy.validation import Problem, variant_of

    vl, cro = dev(VL), dev(CRO)
    lut = dev(np.zeros((2, 1), np.int32)) if paged else None
    p = Problem(2, 4, tq, -1, BF16, np.dtype(np.float32) if accumulate else BF16, CausalMask(), 0.1, 5, paged,
                variant_of(fp8, False))
    t = Target(kernel, 0, offsets_of(vl, int(cro.ctypes.data), int(cro.ctypes.data) + 4, None, None, keep=(cro,)),
               accumulate, lut, 16 if paged else 0, 512 if paged else 0)
    return PrefillPlan(p, t, return_lse=return_lse, bounds=RunBounds(kv_total=kv_total))


def run_args(heads=4, tq=8, tk=9, dtype=BF16):
    return dict(q=dev(np.zeros((tq, heads, 192), dtype)), k=dev(np.zeros((tk, heads, 128), dtype)),
                v=dev(np.zeros((tk, heads, 128), dtype)), k_rope=dev(np.zeros((tk, 1, 64), dtype)),
                out=dev(np.zeros((tq, heads, 128), dtype)))


RUN_BAD = [
    (dict(heads=3), {}, ValueError, r"q: expected H = 4 heads \(the plan's num_heads\)"),
    (dict(dtype=np.float16), {}, TypeError, r"q: expected dtype bfloat16 \(the plan's dtype\), got float16"),
    (dict(tq=7), {}, ValueError, r"q: expected Tq = 8 rows"),
    (dict(tk=8), {}, ValueError, r"k: expected at least 9 rows"),
    ({}, dict(q=np.zeros((8, 4, 192), BF16)), TypeError, r"^q: .*NumPy"),
    ({}, dict(q=np.zeros((8, 4, 128), BF16)), ValueError, r"q: expected head size Dqk = 192"),
    ({}, dict(out=dev(np.zeros((8, 4, 128), np.float32))), TypeError, r"out: expected dtype bfloat16"),
    ({}, dict(k_rope=dev(np.zeros((9, 1, 64), np.float16))), TypeError, r"k_rope: expected dtype bfloat16"),
    ({}, dict(out=dev(np.zeros(8 * 4 * 128 + 1, BF16))[1:].reshape(8, 4, 128)), ValueError,
     "out: the data must start at a 16-byte"),
]


@pytest.mark.parametrize("shape,over,exc,match", RUN_BAD, ids=[str(i) for i in range(len(RUN_BAD))])
def test_run_checks_arrays_against_the_plan(shape, over, exc, match):
    a = dict(run_args(**shape), **over)
    with pytest.raises(exc, match=match):
        cpu_plan().run(a["q"], a["k"], a["v"], a["k_rope"], out=a["out"])


def test_run_without_out_checks_before_allocating():
    a = run_args(heads=3)
    with pytest.raises(ValueError, match="q: expected H = 4 heads"):
        cpu_plan().run(a["q"], a["k"], a["v"], a["k_rope"])
    a = run_args()
    with pytest.raises(ValueError, match="accumulate: needs out= and lse="):
        cpu_plan(accumulate=True).run(a["q"], a["k"], a["v"], a["k_rope"])


def test_a_layout_run_before_goes_straight_to_its_launch(monkeypatch):
    """The first run of a layout is checked (before its results are made, then with them) and
    packed; a later run of that layout makes new results and launches its record, unchecked; a run
    with out given is another layout. (Checks, packing and launch are stand-ins: no GPU here.)"""
    from mla_cupy import prefill_plan as pp

    seen = []
    monkeypatch.setattr(pp, "check_run", lambda p, t, bounds, arrays: seen.append(("check", arrays.out is None)))
    monkeypatch.setattr(pp, "pack", lambda *a: seen.append("pack") or object())
    monkeypatch.setattr(pp, "launch_record", lambda rec, ptrs, stream: seen.append(("launch", rec, ptrs[4])))
    monkeypatch.setattr(pp, "stream_ptr", lambda stream, torch_in: 0)
    monkeypatch.setattr(pp, "empty_result", lambda shape, dtype, torch_device, *name: dev(np.zeros(shape, dtype)))
    pl, a = cpu_plan(), run_args()
    pl._current_stream = lambda: type("S", (), {"ptr": 0})()
    first = pl.run(a["q"], a["k"], a["v"], a["k_rope"])
    assert seen[:3] == [("check", True), ("check", False), "pack"]
    rec = seen[3][1]
    assert seen[3] == ("launch", rec, first.ctypes.data) and first.shape == (8, 4, 128)
    del seen[:]
    second = pl.run(a["q"], a["k"], a["v"], a["k_rope"])
    assert second is not first and seen == [("launch", rec, second.ctypes.data)]
    del seen[:]
    assert pl.run(a["q"], a["k"], a["v"], a["k_rope"], out=a["out"]) is a["out"]
    assert seen[:2] == [("check", False), "pack"] and seen[2][2] == a["out"].ctypes.data


def test_run_kinds_and_paged_ropes():
    a = run_args()
    with pytest.raises(TypeError, match="run: this plan is for fp8 inputs"):
        cpu_plan(fp8=True).run(a["q"], a["k"], a["v"], a["k_rope"], out=a["out"])
    with pytest.raises(TypeError, match="run_fp8: this plan is for 16-bit inputs"):
        cpu_plan().run_fp8(a["q"], None, None, a["k"], None, a["v"], a["k_rope"])
    with pytest.raises(ValueError, match=r"k_rope.blocks: expected a 4-D array"):
        cpu_plan(paged=True).run(a["q"], a["k"], a["v"], a["k_rope"], out=a["out"])
    with pytest.raises(ValueError, match=r"k_rope.blocks: expected shape \[\*, 16, 1, \*\]"):
        cpu_plan(paged=True).run(a["q"], a["k"], a["v"], dev(np.zeros((4, 32, 1, 576), BF16)), out=a["out"])
    other = PagedKVCache(dev(np.zeros((4, 16, 1, 576), BF16)), dev(np.zeros((2, 1), np.int32)), 16)
    with pytest.raises(ValueError, match="k_rope.lookup_table: a paged plan reads the page table it was built with"):
        cpu_plan(paged=True).run(a["q"], a["k"], a["v"], other, out=a["out"])
    with pytest.raises(TypeError, match="this plan is for a plain"):
        cpu_plan().run(a["q"], a["k"], a["v"], other, out=a["out"])


def test_fp8_run_checks_its_arrays():
    a = run_args()
    tq, tk = 8, 9
    f8 = dict(q_nope=dev(np.zeros((tq, 4, 128), np.uint8)), q_rope=dev(np.zeros((tq, 4, 64), BF16)),
              q_scale=dev(np.ones((tq, 1), np.float32)), k=dev(np.zeros((tk, 4, 128), np.uint8)),
              k_scales=dev(np.ones((tk, 1), np.float32)), v=dev(np.zeros((tk, 4, 128), np.uint8)))
    with pytest.raises(TypeError, match="q_rope: expected dtype bfloat16"):
        cpu_plan(fp8=True).run_fp8(*dict(f8, q_rope=dev(np.zeros((tq, 4, 64), np.float16))).values(), a["k_rope"],
                                   out=a["out"])
    with pytest.raises(ValueError, match=r"k_scales: expected shape \[9, 1\]"):
        cpu_plan(fp8=True).run_fp8(*dict(f8, k_scales=dev(np.ones((tk + 1, 1), np.float32))).values(), a["k_rope"],
                                   out=a["out"])


# ------------------------------------------------------------------------------------------------
# the package's shape

def _imports(path: Path):
    """Modules of the package that ``path`` imports (relative imports, any depth)."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(a.name for a in node.names)
    return out


def test_one_stream_resolver():
    """Every entry point reads ``stream=`` through mla_cupy._arrays.stream_ptr: a raw int, an object
    with an int ``ptr`` (CuPy streams), one with ``cuda_stream`` (torch streams); anything else
    (a bool too) is a TypeError naming the argument."""
    from mla_cupy import _arrays, _plan_cache, prefill_plan

    class CupyLike:
        ptr = 0x1234

    class TorchLike:
        cuda_stream = 0x5678

    assert _arrays.stream_ptr(7, False) == 7 and _arrays.stream_ptr(CupyLike(), True) == 0x1234
    assert _arrays.stream_ptr(TorchLike(), False) == 0x5678
    for bad in (True, "0", 1.0):
        with pytest.raises(TypeError, match=r"^stream: expected a cupy.cuda.Stream, a torch.cuda.Stream or a raw "):
            _arrays.stream_ptr(bad, False)
    assert _plan_cache.stream_ptr is prefill_plan.stream_ptr is _arrays.stream_ptr


def test_raw_streams_become_cupy_streams_without_deprecated_classes():
    """A raw stream pointer (a torch stream's, a ``stream=`` int) becomes CuPy's stream object through
    the CUDA stream protocol (``Stream.from_external``), with the same pointer and without CuPy's
    DeprecationWarning for ``ExternalStream``; ``stream_of`` passes CuPy streams through as they are.
    No package module builds an ``ExternalStream`` itself."""
    import warnings

    cupy = pytest.importorskip("cupy", reason="CuPy's stream classes: needs CuPy (not a GPU)")

    from mla_cupy import _arrays

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        st = _arrays.cupy_stream(0x1234)
        assert isinstance(st, cupy.cuda.Stream) and st.ptr == 0x1234
        st7 = _arrays.stream_of(7, False)
        assert st7.ptr == 7
        assert _arrays.stream_of(st, False) is st
    root = Path(_arrays.__file__).parent
    builders = sorted(p.name for p in root.glob("*.py") if "ExternalStream(" in p.read_text())
    assert builders == ["_arrays.py"]  # cupy_stream's fallback for a CuPy without the protocol


def test_import_graph_is_acyclic():
    mods = {p.stem: p for p in PKG.glob("*.py")}
    graph = {m: {d for d in _imports(p) if d in mods and d != m} for m, p in mods.items() if m != "__init__"}
    state, order = {}, []

    def visit(m, stack):
        if state.get(m) == "done":
            return
        if state.get(m) == "open":
            cycle = stack[stack.index(m):] + [m]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        state[m] = "open"
        for d in sorted(graph.get(m, ())):
            visit(d, stack + [m])
        state[m] = "done"
        order.append(m)

    for m in sorted(graph):
        visit(m, [])
    assert len(order) == len(graph) >= 20


def test_cycle_detection_can_fail(tmp_path):
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("from . import a\n")
    assert _imports(tmp_path / "a.py") == {"b"} and _imports(tmp_path / "b.py") == {"a"}


def test_import_needs_no_torch_no_cupy_and_compiles_nothing():
    code = ("import sys, mla_cupy\n"
            "from mla_cupy import jit\n"
            "assert 'torch' not in sys.modules, 'torch'\n"
            "assert 'cupy' not in sys.modules, 'cupy'\n"
            "assert jit.compile_count() == 0\n"
            "print(mla_cupy.plan.__module__)\n")
    assert run_python(code).strip() == "mla_cupy.prefill_plan"


def run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter next to the package; its stdout (it must succeed)."""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent)
    assert res.returncode == 0, res.stderr
    return res.stdout

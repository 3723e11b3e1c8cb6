"""The reliability tooling on the CPU: the fuzz generator, shrinker, budget and resume logic
(_fuzz.py), the soak's drift check (_soak.py), the sanitizer log parser and the summary
(_verify.py), ``gpu.sh verify summary`` and the sanitizers' subset, the backward's gradient check
(gpu_util.py). The GPU checks themselves run in the GPU tests."""
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import _fuzz
import _soak
import _verify
import gpu_util

ROOT = Path(__file__).resolve().parent.parent


class FakeClock:
    """A clock that only moves when told to."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_draw_is_a_function_of_seed_and_index():
    forward = [_fuzz.draw(11, i) for i in range(30)]
    backward = [_fuzz.draw(11, i) for i in reversed(range(30))][::-1]
    assert forward == backward
    assert forward != [_fuzz.draw(12, i) for i in range(30)]
    for p in forward:
        assert _fuzz.Problem.from_json(p.to_json()) == p


def test_every_variant_kernel_and_mask_within_five_rounds():
    n = len(_fuzz.SCHEDULE) * len(_fuzz.MASK_TYPES)
    for start in (0, 7):
        problems = [_fuzz.draw(5, i) for i in range(start, start + n)]
        assert {(p.variant, p.kernel, p.mask[0]) for p in problems} == {
            (v, k, m) for v, k in _fuzz.SCHEDULE for m in _fuzz.MASK_TYPES}
    assert {"sm80", "sm90"} == {k for _, k in _fuzz.SCHEDULE}
    assert (len(_fuzz.SCHEDULE) + 1) % len(_fuzz.MASK_TYPES) != 0


#: The schedule before the backward variant came: the first round of every seed keeps these pairs.
FORWARD_SCHEDULE = (("plain", "sm80"), ("plain", "sm90"), ("paged", "sm80"), ("paged", "sm90"), ("chunked", "sm80"),
                    ("chunked", "sm90"), ("accumulate", "sm80"), ("accumulate", "sm90"), ("fp8", "sm90"),
                    ("fp8_rope", "sm90"), ("e4m3", "sm90"))


def test_the_backward_comes_last_in_the_schedule():
    """Problems 0 to 10 of every seed are those drawn before the backward variant came (its pairs
    come last, and a problem's data is drawn from (seed, index) and its variant alone); a problem
    written before it (JSON without its fields) reads back with its options off."""
    assert _fuzz.SCHEDULE[:len(FORWARD_SCHEDULE)] == FORWARD_SCHEDULE
    assert _fuzz.SCHEDULE[len(FORWARD_SCHEDULE):] == (("backward", "sm80"), ("backward", "sm90"))
    before = ('{"variant":"e4m3","kernel":"sm90","sq":[1],"sk":[38],"heads":128,"dtype":"bf16","mask":["NullMask",0],'
              '"cache_offsets":null,"q_start_pos":null,"out_f32":true,"lse":true,"page_size":0,"chunk_size":0,'
              '"split":null,"data_seed":548136401}')  # problem 10 of seed 3, as the fuzz printed it before
    p = _fuzz.Problem.from_json(before)
    assert p == _fuzz.draw(3, 10) and not p.deterministic and not p.dlse and not p.no_read_back
    assert json.loads(p.to_json()) == dict(json.loads(before), deterministic=False, dlse=False, no_read_back=False)


def test_problems_respect_their_variant():
    for i in range(600):
        p = _fuzz.draw(9, i)
        v = _fuzz.VARIANTS[p.variant]
        assert p.kernel in v.kernels and p.dtype in v.dtypes and len(p.sq) >= v.min_batch
        assert len(p.sq) == len(p.sk) and min(p.sq + p.sk, default=0) >= 0
        assert (p.page_size > 0) if v.paged == 1 else (p.page_size == 0) if v.paged == 0 else True
        if p.page_size:
            assert p.page_size in _fuzz.PAGE_SIZES and p.cache_offsets is not None
            aligned = all(c % p.page_size == 0 for c in p.cache_offsets)
            assert aligned == _fuzz.aligned(p)
        if p.variant == "accumulate":
            assert p.out_f32 and p.lse and all(0 <= s <= k for s, k in zip(p.split, p.sk))
        if p.variant == "chunked":
            assert p.chunk_size in _fuzz.CHUNK_SIZES
        if p.variant.startswith("fp8"):
            assert p.kernel == "sm90" and p.dtype == "bf16"
        if p.variant == "backward":  # a plain rope only: the backward refuses a paged one
            assert p.page_size == 0 and p.lse and p.chunk_size == 0 and p.split is None
        else:
            assert not p.deterministic and not p.dlse
    tags = set()
    backward = dict()
    for i in range(600):
        p = _fuzz.draw(9, i)
        tags.update(_fuzz.tags(p))
        if p.variant == "backward":
            for t in _fuzz.tags(p) + [p.kernel]:
                backward[t] = backward.get(t, 0) + 1
    for want in ("empty sequence", "cache_offsets", "q_start_pos", "ragged", "lse", "float32 out", "B=0",
                 "paged 16 aligned", "paged 64 gathered", "paged 512 aligned", "paged 512 gathered"):
        assert want in tags
    for want in ("sm80", "sm90", "bf16", "fp16", "empty sequence", "cache_offsets", "q_start_pos", "ragged",
                 "float32 out", "deterministic", "dlse", *_fuzz.MASK_TYPES):
        assert backward.get(want, 0) >= 3, (want, backward)


def test_split_keys_partitions_every_sequence():
    p = _fuzz.Problem("accumulate", "sm80", (3, 0, 5), (4, 6, 0), 1, "bf16", ("CausalMask", 0),
                      cache_offsets=(10, 0, 7), split=(1, 9, 0), data_seed=1)
    case = p.case()
    (rows_a, off_a, co_a), (rows_b, off_b, co_b) = _fuzz.split_keys(case, p.split)[0]
    q_start = _fuzz.split_keys(case, p.split)[1]
    assert list(rows_a) == [0, 4, 5, 6, 7, 8, 9] and list(off_a) == [0, 1, 7, 7]
    assert list(rows_b) == [1, 2, 3] and list(off_b) == [0, 3, 3, 3]
    assert list(co_a) == [10, 0, 7] and list(co_b) == [11, 6, 7]
    assert list(q_start) == [10 + 4 - 3, 0 + 6 - 0, 7 + 0 - 5]  # the whole problem's end-aligned queries


def _failing(p):
    """A fake check: fails while the problem has 10+ queries and 16+ heads."""
    return sum(p.sq) >= 10 and p.heads >= 16


def test_shrink_finds_the_smallest_failing_problem():
    p = _fuzz.Problem("paged", "sm90", (70, 0, 33, 129), (90, 5, 40, 129), 128, "bf16", ("ChunkedMask", 20),
                      cache_offsets=(64, 0, 128, 64), q_start_pos=(3, 4, 5, 6), lse=True, page_size=64, data_seed=3)
    small, checks = _fuzz.shrink(p, _failing, budget_s=60)
    assert _failing(small) and checks > 0
    assert small.heads == 16 and sum(small.sq) == 10 and set(small.sk) == {0} and 0 not in small.sq
    assert small.cache_offsets is None and small.q_start_pos is None and not small.lse
    assert small.page_size == 64  # the paged variant keeps its paged rope
    for c in _fuzz.candidates(small):  # nothing smaller still fails
        assert not _failing(c)


def test_shrink_drops_the_backward_options_that_do_not_matter():
    p = _fuzz.Problem("backward", "sm90", (70, 0, 33), (90, 5, 40), 16, "fp16", ("CausalMask", 0),
                      cache_offsets=(3, 0, 9), q_start_pos=(1, 2, 3), out_f32=True, lse=True, deterministic=True,
                      dlse=True, data_seed=3)

    def fails(c):  # a fake check: fails in deterministic mode with 10+ queries
        return c.deterministic and sum(c.sq) >= 10

    small, _ = _fuzz.shrink(p, fails, budget_s=60)
    assert small.deterministic and not small.dlse and not small.out_f32 and small.lse and small.heads == 1
    assert small.cache_offsets is None and small.q_start_pos is None and sum(small.sq) == 10
    assert "deterministic" in _fuzz.describe(small) and "dlse" not in _fuzz.describe(small)


def test_shrink_keeps_the_variants_batch_and_split_consistent():
    p = _fuzz.draw(2, 6)  # an accumulate problem
    assert p.variant == "accumulate"
    for c in _fuzz.candidates(p):
        assert len(c.sq) >= 1 and len(c.split) == len(c.sq) == len(c.sk)
        assert all(s <= k for s, k in zip(c.split, c.sk)) and c.out_f32 and c.lse


def test_shrink_stops_at_its_budget():
    clock = FakeClock()

    def fails(p):
        clock.t += 1.0
        return True  # everything fails: only the budget ends the search

    p = _fuzz.draw(1, 0)
    _, checks = _fuzz.shrink(p, fails, budget_s=5, clock=clock)
    assert checks == 5


def _run(seed, start, end, clock, fail=None, out=None, budget=10.0, skip=(), **kw):
    log = []

    def checker(p):
        clock.t += 1.0
        if fail is not None:
            fail(p)
        return 1e-3

    rec = _fuzz.run_range(seed, start, end, budget_s=budget, out_dir=out, checker=checker, clock=clock,
                          log=log.append, every=4, skip=skip, **kw)
    return rec, "\n".join(log)


def test_budget_stop_and_resume_cover_every_index_once(tmp_path):
    clock = FakeClock()
    rec, log = _run(4, 0, 20, clock, out=tmp_path)  # 1 s per problem, 10 s budget
    assert rec["stopped"] == "budget" and rec["next_start"] == 9  # 9 + 2 * 1 s would pass 10 s
    assert "verify fuzz 20 --seed 4 --start 9" in log and "fuzz seed 4 [0, 20): next 4" in log
    records = _verify.load_records(tmp_path, "fuzz")
    done = {i for (_, i) in _verify.fuzz_outcomes(records, 4)}
    assert done == set(range(9)) and _verify.resume_start(done, 20) == 9
    clock.t = 0.0
    rec2, _ = _run(4, 9, 20, clock, out=tmp_path, budget=100)
    assert rec2["stopped"] == "complete" and rec2["next_start"] == 20
    records = _verify.load_records(tmp_path, "fuzz")
    assert sorted(i for (_, i) in _verify.fuzz_outcomes(records, 4)) == list(range(20))
    assert _verify.resume_start({0, 1, 3}, 5) == 2 and _verify.resume_start(range(5), 5) == 5


def test_skipped_kernels_and_resume_skip_list():
    clock = FakeClock()
    rec, _ = _run(4, 0, 20, clock, kernels=("sm80",), skip={0, 2}, budget=1000)
    statuses = {i: s for i, _, s, _ in rec["problems"]}
    assert 0 not in statuses and 2 not in statuses
    assert all(s == ("ok" if _fuzz.draw(4, i).kernel == "sm80" else "skipped") for i, s in statuses.items())


def test_a_failure_is_reported_with_reproductions_and_shrunk(tmp_path):
    clock = FakeClock()

    def fail(p):
        assert not _failing(p), "wrong answer"

    rec, log = _run(8, 0, 10, clock, fail=fail, out=tmp_path, budget=1e6, shrink_s=1e5)
    assert rec["failures"], "seed 8 has problems with 16+ heads and 10+ queries in its first 10"
    f = rec["failures"][0]
    assert f["repro"] == f"python benchmarks/fuzz.py --seed 8 --index {f['index']}"
    assert _fuzz.draw(8, f["index"]) == _fuzz.Problem.from_json(f["problem"])
    assert f["shrunk_repro"] == _fuzz.repro_problem(_fuzz.Problem.from_json(f["shrunk"]))
    small = _fuzz.Problem.from_json(f["shrunk"])
    assert _failing(small) and sum(small.sq) == 10
    assert "!! FAILED problem" in log and "reproduce it: python benchmarks/fuzz.py --problem '" in log
    assert len(rec["failures"]) == sum(1 for _, _, s, _ in rec["problems"] if s == "failed")
    assert sum(1 for f in rec["failures"] if "shrunk" in f) == min(2, len(rec["failures"]))  # max_shrinks
    summary = _verify.summarize(_verify.load_records(tmp_path))
    assert summary["failed"] == len(rec["failures"]) and summary["problems"] == 10
    assert f["shrunk_repro"] in _verify.format_summary(summary)


def test_shrinking_stays_inside_the_budget():
    clock = FakeClock()

    def fail(p):
        raise AssertionError("wrong answer")  # every problem fails, every shrink step too

    rec, log = _run(8, 0, 100, clock, fail=fail, budget=12, shrink_s=1e5)  # 1 s per check
    assert rec["stopped"] == "budget" and rec["next_start"] == 2 and clock.t <= 12
    assert "shrunk" in rec["failures"][0]  # as far as 12 - 1 - 2 * 1 seconds took it
    assert "shrunk" not in rec["failures"][1] and "not shrunk: no time left" in log


def test_a_lost_cuda_context_ends_the_range():
    class CUDARuntimeError(RuntimeError):
        pass

    def fail(p):
        raise CUDARuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")

    rec, log = _run(1, 5, 20, FakeClock(), fail=fail, budget=1e6)
    assert rec["stopped"] == "fatal" and rec["next_start"] == 6 and rec["fatal"].startswith("problem 5")
    assert "shrunk" not in rec["failures"][0] and "--start 6" in log


def test_fuzz_cli_show_and_remaining(tmp_path, capsys):
    assert _fuzz.main(["--seed", "3", "--start", "7", "--count", "2", "--show"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"7: {_fuzz.describe(_fuzz.draw(3, 7))}\n8: ")
    _run(3, 0, 6, FakeClock(), out=tmp_path, budget=1e6)
    assert _fuzz.main(["--out", str(tmp_path), "--total", "10", "--remaining"]) == 0  # the records' seed
    assert capsys.readouterr().out.strip() == "4"
    # a record of another schedule (an older commit's) is not resumed from: its indices are other problems
    _verify.write_record(tmp_path, "fuzz-old.json", dict(kind="fuzz", seed=3, time=0, problems=[
        [i, "sm80/plain", "ok", ["CausalMask"]] for i in range(6, 10)], failures=[], fatal=None))
    assert _fuzz.main(["--out", str(tmp_path), "--seed", "3", "--total", "10", "--remaining"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == "4" and "1 record(s)" in captured.err and "another schedule" in captured.err
    assert "more than one schedule" in _verify.format_summary(_verify.summarize(_verify.load_records(tmp_path)))
    assert _fuzz.main(["--problem", _fuzz.draw(3, 1).to_json(), "--show"]) == 0
    assert _fuzz.draw(3, 1).to_json() in capsys.readouterr().out


MEMCHECK_LOG = """========= COMPUTE-SANITIZER
........                                                                 [100%]
44 passed, 3 deselected in 210.12s (0:03:30)
========= ERROR SUMMARY: 0 errors
"""
RACECHECK_LOG = """========= COMPUTE-SANITIZER
1 failed, 43 passed in 400.00s
========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
"""


def test_sanitizer_logs():
    assert _verify.parse_sanitizer_log(MEMCHECK_LOG) == dict(errors=0, hazards=None, passed=44, failed=0)
    assert _verify.parse_sanitizer_log(RACECHECK_LOG) == dict(errors=1, hazards=2, passed=43, failed=1)
    cut = _verify.parse_sanitizer_log("========= COMPUTE-SANITIZER\n....")  # stopped at the time limit
    assert cut["errors"] is None


def _backward_part(kernel, ok=True):
    return dict(kernel=kernel, ref_error=3e-3, serial_mismatches=0, thread_mismatches=0 if ok else 17, free_worst=4e-4,
                free_differ_bits=70, errors=[] if ok else ["a thread: RuntimeError: boom"], ok=ok)


def _soak_record(**drift):
    d = dict(pool_used=0, torch_allocated=0, device_free=-2 * 2**20, compiled_modules=0, plan_records=0, plan_cache=0,
             **drift)
    return dict(kind="soak", calls=10_000, drift=d, span={k: abs(v) for k, v in d.items()}, ok=True, failures=[],
                concurrency=dict(threads=8, runs_per_thread=140, mismatches=0, errors=[], ok=True),
                backward=dict(layout="auto", runs=100, threads=8, free_runs=10, ok=True,
                              kernels=[_backward_part("sm80"), _backward_part("sm90")]))


def test_soak_drift_and_judgement():
    samples = [dict(call=c, pool_used=u, pool_total=0, torch_allocated=None, device_free=f, compiled_modules=m,
                    plan_records=3, plan_cache=e) for c, u, f, m, e in ((100, 5, 900, 1, 1), (200, 9, 800, 7, 9),
                                                                        (300, 9, 700, 7, 9), (400, 8, 750, 7, 9))]
    dr, sp = _soak.drift(samples, warmup=200)
    assert dr == dict(pool_used=-1, torch_allocated=None, device_free=-50, compiled_modules=0, plan_records=0,
                      plan_cache=0)
    assert sp == dict(pool_used=1, torch_allocated=None, device_free=100, compiled_modules=0, plan_records=0,
                      plan_cache=0)
    rec = dict(span=dict(sp, compiled_modules=1, pool_used=2 * 2**20), mismatched_elements=0, errors=[])
    bad = _soak.judge(rec)
    assert len(bad) == 2 and bad[0].startswith("pool_used moved by 2,097,152") and "compiled_modules" in bad[1]
    assert _soak.judge(dict(span=sp, mismatched_elements=3, errors=["call 7: boom"])) == [
        "3 result elements differ from the first result of their layout", "call 7: boom"]


def test_summary_counts_each_problem_once_and_prints_a_table_row(tmp_path):
    base = dict(kind="fuzz", commit="abc1234", device="NVIDIA H200", failures=[], fatal=None)
    _verify.write_record(tmp_path, "fuzz-a.json", dict(base, seed=7, time=1, problems=[
        [i, "sm80/plain", "ok", ["CausalMask", "lse"]] for i in range(0, 600)]))
    _verify.write_record(tmp_path, "fuzz-b.json", dict(base, seed=7, time=2, problems=[
        [i, "sm90/fp8", "ok", ["NullMask", "bf16"]] for i in range(550, 1000)]
        + [[1000, "sm90/fp8", "skipped", ["NullMask"]]]))
    for tool in _verify.SANITIZER_TOOLS[:3]:
        _verify.write_record(tmp_path, f"sanitize-{tool}.json", dict(kind="sanitize", tool=tool, rc=0, errors=0,
                                                                    hazards=None, passed=44, failed=0,
                                                                    commit="abc1234", device="NVIDIA H200"))
    _verify.write_record(tmp_path, "soak.json", dict(_soak_record(), commit="abc1234", device="NVIDIA H200"))
    s = _verify.summarize(_verify.load_records(tmp_path))
    assert s["problems"] == 1000 and s["failed"] == 0 and s["skipped"] == 1 and s["ranges"] == {7: [[0, 999]]}
    text = _verify.format_summary(s)
    assert "fuzz: 1,000 problems (seed 7: 0-999), 0 mismatches" in text
    assert "by mask: CausalMask 600, NullMask 400" in text and "covering: bf16 400, lse 600" in text
    assert "memcheck 0, racecheck 0, synccheck 0, initcheck not run" in text
    row = _verify.markdown_row(s)
    assert row == ("| abc1234 | NVIDIA H200 | 1,000 (seed 7: 0-999) | 0 | memcheck 0, racecheck 0, synccheck 0, "
                   "initcheck not run | 10,000 calls: pool used +0 B, torch allocated +0 B, device free "
                   "-2.0 MiB, compiled modules +0, plan records +0, plan cache entries +0 | 8 threads x 140 runs: "
                   "bitwise equal to serial | sm80, sm90: deterministic 100 serial + 8 threads x 100 runs bitwise "
                   "equal; default mode 8 threads x 10 runs within 4.0e-04 of serial (140 of 160 differ in bits) |")
    assert row.count("|") == _verify.TABLE_HEADER.splitlines()[0].count("|")
    assert text.endswith(row) and "schedule" not in text
    soak = _soak_record()
    soak["backward"].update(ok=False, kernels=[_backward_part("sm80"), _backward_part("sm90", ok=False)])
    _verify.write_record(tmp_path, "soak.json", dict(soak, commit="abc1234", device="NVIDIA H200"))
    text = _verify.format_summary(_verify.summarize(_verify.load_records(tmp_path)))
    assert ("backward repeatability: sm80, sm90: FAILED (sm90: 0 + 17 elements differ, default mode worst 0.0004, "
            "1 errors)\n  sm90: a thread: RuntimeError: boom") in text


def test_gpu_sh_verify_summary_needs_no_gpu(tmp_path):
    _verify.write_record(tmp_path, "sanitize-memcheck.json",
                         dict(_verify.sanitizer_record("memcheck", tmp_path / "none.log", 124), commit="x", device="d"))
    res = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--out", str(tmp_path), "verify", "summary"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "memcheck incomplete (time limit)" in res.stdout and "| commit | GPU |" in res.stdout
    assert not (tmp_path / "env.txt").exists()  # a summary on another machine leaves the GPU's records alone
    assert (tmp_path / "summary.txt").read_text() == res.stdout.split("logs: ")[0]


def test_the_sanitizer_subset_names_tests_that_exist_and_holds_the_backward():
    """Every test name in gpu.sh's sanitizer subset selects a test of its files (a renamed test
    would drop out of the sanitizers silently), and the backward is in it: both main kernels
    (gpu_util.KERNELS: the Hopper one joins on a Hopper GPU) at every mask in bf16 and at a mask in
    fp16 (the passes of both dtypes), float32 out with dlse, deterministic mode (key blocks that no
    query sees among its layouts)."""
    text = (ROOT / "benchmarks" / "gpu.sh").read_text()
    subset = re.search(r"^SANITIZER_SUBSET='([^']*)'$", text, re.M).group(1)
    files = re.search(r"^SANITIZER_FILES=\(([^)]*)\)$", text, re.M).group(1).split()
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                          *files, "-k", subset], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    ids = [line for line in res.stdout.splitlines() if "::" in line]
    assert ids, res.stdout + res.stderr
    for name in set(re.findall(r"[a-z0-9]+(?:_[a-z0-9]+)+", subset)):
        assert any(name in i for i in ids), f"{name}: the sanitizer subset names no test"
    bwd = [i for i in ids if i.startswith("tests/test_gpu_backward.py::")]
    for kernel in gpu_util.KERNELS:
        for mask in _fuzz.MASK_TYPES:
            assert f"test_every_mask_and_dtype[{kernel}-bf16-{mask}]" in "\n".join(bwd)
        assert f"test_every_mask_and_dtype[{kernel}-fp16-CausalMask]" in "\n".join(bwd)
        for layout in ("end-aligned", "keys-past-every-query"):
            assert f"test_deterministic_mode_repeats_bits[{layout}-{kernel}]" in "\n".join(bwd)
        for dtype in ("bf16", "fp16"):
            assert f"test_float32_out_dlse_deterministic[{kernel}-{dtype}]" in "\n".join(bwd)
    assert len(bwd) == 10 * len(gpu_util.KERNELS), bwd


# ------------------------------------------------------------------------------------------------
# The variants' runners end to end on the CPU: CuPy replaced by NumPy and the kernels by the float64
# reference, so what is tested is the harness (inputs, positions, key splits, paged and fp8 caches,
# outputs, checks), not the kernels.


def _decoded_cache(cache):
    """A float64 PagedKVCache of a cache's rope values (an fp8 cache's bytes decoded and scaled)."""
    from mla_cupy import PagedKVCache
    from mla_cupy._arrays import FP8_E4M3

    ro = cache.rope_offset
    part = cache.blocks[..., ro:ro + 64]
    if cache.scales is not None:
        part = part.view(FP8_E4M3).astype(np.float64) * cache.scales[..., ro // 64, None]
    return PagedKVCache(np.asarray(part, np.float64), cache.lookup_table, cache.page_size, rope_offset=0)


def _plain_rope(k_rope, vl, cro, co, tk):
    """A paged rope as the plain ``[Tk, 1, 64]`` rows it stands for."""
    from mla_cupy import PagedKVCache, reference

    if not isinstance(k_rope, PagedKVCache):
        return k_rope
    cache, rows = _decoded_cache(k_rope), np.zeros((tk, 1, 64))
    for b in range(len(cro) - 1):
        sk = int(cro[b + 1] - cro[b])
        rows[cro[b]:cro[b] + sk, 0] = reference.rope_rows(cache, b, int(cro[b]), 0 if co is None else int(co[b]), sk)[0]
    return rows


class ReferenceKernels:
    """``mla_prefill``, ``mla_prefill_chunked``, ``mla_prefill_fp8`` and ``mla_prefill_backward``
    computed by the reference (``ignore``: keyword arguments it drops, to make it wrong on purpose)."""

    def __init__(self, ignore=()):
        self.ignore = set(ignore)
        self.calls = 0

    def _finish(self, o, l, out, lse, out_dtype, return_lse, accumulate, q):
        self.calls += 1
        if accumulate:
            m = np.maximum(lse, l)
            m = np.where(np.isfinite(m), m, 0.0)
            wa, wb = np.exp(lse - m), np.exp(l - m)
            s = wa + wb
            o = np.where(s[..., None] > 0, (wa[..., None] * out + wb[..., None] * o) / np.where(s > 0, s, 1)[..., None], 0)
            l = np.where(s > 0, m + np.log(np.where(s > 0, s, 1)), -np.inf)
        if out is None:
            out = np.empty(o.shape, np.dtype(out_dtype) if out_dtype is not None else q.dtype)
        out[...] = o
        if lse is None and return_lse:
            lse = np.empty(l.shape, np.float32)
        if lse is not None:
            lse[...] = l
        return (out, lse) if return_lse else out

    def _kw(self, kw):
        return {n: kw.get(n) for n in ("mask", "cache_offsets", "q_start_pos") if n not in self.ignore}

    def mla_prefill(self, q, k, v, k_rope, vl, cro, *, out=None, lse=None, out_dtype=None, return_lse=False,
                    accumulate=False, k_rope_scales=None, **kw):
        from mla_cupy import quant, reference
        from mla_cupy._arrays import FP8_E4M3

        rope = _plain_rope(k_rope, vl, cro, kw.get("cache_offsets"), k.shape[0])
        if k_rope_scales is not None:
            rope = quant.dequantize_rope_blocks(rope.view(FP8_E4M3), k_rope_scales)
        f64 = [np.asarray(x, np.float64) for x in (q, k, v, rope)]
        o, l = reference.mla_prefill(*f64, vl, cro, return_lse=True, **self._kw(kw))
        return self._finish(o, l, out, lse, out_dtype, return_lse, accumulate, q)

    def mla_prefill_chunked(self, q, k, v, k_rope, vl, cro, *, chunk_size, **kw):
        assert chunk_size >= 1
        return self.mla_prefill(q, k, v, k_rope, vl, cro, **kw)

    def mla_prefill_fp8(self, q_nope, q_rope, q_scale, k, k_scales, v, k_rope, vl, cro, *, out=None, lse=None,
                        out_dtype=None, return_lse=False, accumulate=False, **kw):
        from mla_cupy import reference

        from mla_cupy._arrays import BF16

        # the rope as the fp8 call takes it: bfloat16 rows (a paged cache's values are bfloat16), or
        # e4m3 bytes as they are (the all-e4m3 mode, plain only)
        rope = np.asarray(_plain_rope(k_rope, vl, cro, kw.get("cache_offsets"), k.shape[0]))
        rope = rope if rope.dtype == np.uint8 else rope.astype(BF16)
        o, l = reference.mla_prefill_fp8(q_nope, q_rope, q_scale, k, k_scales, v, rope, vl, cro, return_lse=True,
                                         **self._kw(kw))
        return self._finish(o, l, out, lse, out_dtype, return_lse, accumulate, np.zeros(0, BF16))

    def mla_prefill_backward(self, *args, **kw):
        from mla_cupy import reference

        self.calls += 1
        return reference.mla_prefill_backward(*args, **{n: x for n, x in kw.items() if n not in self.ignore})


@pytest.fixture
def on_the_cpu(monkeypatch):
    """CuPy as NumPy; returns a function that installs reference kernels."""
    import types

    import mla_cupy
    import mla_cupy._arrays

    fake = types.ModuleType("cupy")
    fake.__getattr__ = lambda name: getattr(np, name)  # cupy.full, cupy.float32, ... are NumPy's
    fake.asnumpy = np.asarray
    fake.get_array_module = lambda *arrays: np
    monkeypatch.setitem(sys.modules, "cupy", fake)
    # NumPy arrays stay host arrays to the argument checks (whose cache of array kinds would
    # otherwise take them for CuPy's, as fake.ndarray is NumPy's, when this test runs first)
    monkeypatch.setitem(mla_cupy._arrays._KINDS, np.ndarray, mla_cupy._arrays._OTHER)

    def install(kernels):
        for name in ("mla_prefill", "mla_prefill_chunked", "mla_prefill_fp8", "mla_prefill_backward"):
            monkeypatch.setattr(mla_cupy, name, getattr(kernels, name))
        return kernels
    return install


def _small(p):
    """The problem with 1 head and at most 40 queries and keys per sequence (fast on the CPU)."""
    sk = tuple(min(s, 40) for s in p.sk)
    split = None if p.split is None else tuple(min(s, k) for s, k in zip(p.split, sk))
    return dataclasses.replace(p, heads=1, sq=tuple(min(s, 40) for s in p.sq), sk=sk, split=split)


def test_every_runner_passes_with_reference_kernels(on_the_cpu):
    kernels = on_the_cpu(ReferenceKernels())
    n = 2 * len(_fuzz.SCHEDULE)
    for i in range(n):
        p = _small(_fuzz.draw(21, i))
        assert _fuzz.check(p) < 1e-2, _fuzz.describe(p)
    assert kernels.calls >= n  # the accumulate variant calls twice, the backward its forward too


def test_the_backward_runner_passes_its_options_and_poisons_the_gradients(on_the_cpu, monkeypatch):
    """The backward's runner: the drawn mode, dlse and output dtype reach the calls; gradients that
    a kernel leaves unwritten (NaN) or gets wrong fail, and so does a forward that leaves its out
    unwritten."""
    kernels = on_the_cpu(ReferenceKernels())
    seen = []
    backward, forward = kernels.mla_prefill_backward, kernels.mla_prefill

    def spy(*args, **kw):
        seen.append((kw["deterministic"], kw["dlse"] is not None, args[5].dtype, kw["kernel"]))
        return backward(*args, **kw)

    monkeypatch.setattr("mla_cupy.mla_prefill_backward", spy)
    p = _fuzz.Problem("backward", "sm90", (20, 0, 30), (35, 4, 40), 2, "fp16", ("SlidingWindowCausalMask", 9),
                      cache_offsets=(50, 0, 70), q_start_pos=(65, 0, 80), out_f32=True, deterministic=True, dlse=True,
                      data_seed=4)
    assert _fuzz.check(p) < 2e-3
    assert seen == [(True, True, np.float32, "sm90")]

    def skips_a_row(*args, **kw):
        grads = backward(*args, **kw)
        grads[1][3] = np.nan
        return grads

    monkeypatch.setattr("mla_cupy.mla_prefill_backward", skips_a_row)
    with pytest.raises(AssertionError, match="dk: 256 NaN"):
        _fuzz.check(p)

    def off(*args, **kw):
        grads = backward(*args, **kw)
        grads[3][...] *= 1.01
        return grads

    monkeypatch.setattr("mla_cupy.mla_prefill_backward", off)
    with pytest.raises(AssertionError, match="dk_rope: relative error"):
        _fuzz.check(p)

    def unwritten(*args, out=None, **kw):
        res = forward(*args, out=out, **kw)
        out[-1] = np.nan
        return res

    monkeypatch.setattr("mla_cupy.mla_prefill", unwritten)
    with pytest.raises(AssertionError, match="the forward left 256 elements of out unwritten"):
        _fuzz.check(p)


def test_the_gradient_error_floor():
    """A gradient whose reference is 0 (every row sees one key: dS = 0 exactly) against the kernels'
    float32 rounding noise passes; garbage there, or an error where the reference is not 0, fails."""
    rng = np.random.default_rng(0)
    zero = np.zeros((5, 16, 192))
    noise = rng.standard_normal(zero.shape) * 1e-5 / np.sqrt(192)  # 1e-5 per row: the worst measured
    assert gpu_util.gradient_error(noise, zero) < 2e-3 and gpu_util.gradient_error(zero, zero) == 0.0
    assert gpu_util.gradient_error(noise * 1e3, zero) > 1e-2
    ref = rng.standard_normal(zero.shape)
    assert gpu_util.gradient_error(ref * 1.01, ref) == pytest.approx(1e-2)
    rope = np.zeros((5, 1, 64))
    rope_noise = rng.standard_normal(rope.shape) * 1e-5 * np.sqrt(128 / 64)  # 128 heads' noise summed
    assert gpu_util.gradient_error(rope_noise, rope, per_slice=128) < 2e-3 < gpu_util.gradient_error(rope_noise, rope)


def test_a_wrong_kernel_fails_through_the_runners(on_the_cpu):
    """Kernels that drop cache_offsets (keys at the wrong positions) fail in every variant."""
    on_the_cpu(ReferenceKernels(ignore=("cache_offsets",)))
    for variant, kernel in _fuzz.SCHEDULE:
        i = _fuzz.SCHEDULE.index((variant, kernel))
        p = dataclasses.replace(_fuzz.draw(21, i), heads=1, sq=(20, 30), sk=(35, 40), cache_offsets=(50, 70),
                                q_start_pos=(65, 80), mask=("CausalMask", 0),
                                split=(10, 20) if variant == "accumulate" else None)
        with pytest.raises(AssertionError):
            _fuzz.check(p)


class _Stream:
    """A CUDA stream on the CPU: a context and nothing to wait for."""

    def __init__(self, non_blocking=False):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


def test_the_backward_repeatability_harness(on_the_cpu, monkeypatch):
    """_soak.backward_repeatability with the reference as kernels (every run the same bits): it
    passes; a deterministic run in a thread that differs in one bit, a default-mode run off the
    serial one, a NaN, or a raising call fail it, each named in the record and the summary."""
    import types

    import mla_cupy

    kernels = on_the_cpu(ReferenceKernels())
    monkeypatch.setattr(sys.modules["cupy"], "cuda", types.SimpleNamespace(Stream=_Stream), raising=False)
    small = _soak.Layout((9, 0, 4), (12, 3, 4), 2, _soak.CausalMask())
    logs = []

    def run(**kw):
        return _soak.backward_repeatability(runs=3, threads=3, free_runs=2, kernels=("sm80", "sm90"), layout=small,
                                            log=logs.append, **kw)

    rec = run()
    assert rec["ok"] and [p["kernel"] for p in rec["kernels"]] == ["sm80", "sm90"]
    for p in rec["kernels"]:
        assert p["serial_mismatches"] == p["thread_mismatches"] == 0 and p["free_worst"] == 0.0 and not p["errors"]
        assert p["free_differ_bits"] == 0 and p["ref_error"] < 1e-2
    assert kernels.calls == 2 * (1 + 1 + 3 + 1 + 3 * (3 + 2))  # per kernel: forward, first, serial, default, threads
    assert "3 serial + 3 threads x 3 runs: 0 + 0 elements differ" in logs[0]

    backward = kernels.mla_prefill_backward
    calls = []

    def flips_a_bit(*args, **kw):  # in one deterministic run of a thread on sm90
        grads = backward(*args, **kw)
        if kw["deterministic"] and kw["stream"] is not None and kw["kernel"] == "sm90":
            calls.append(1)
            if len(calls) == 5:
                grads[2].view(np.uint16)[0, 0, 0] ^= 1
        return grads

    monkeypatch.setattr(mla_cupy, "mla_prefill_backward", flips_a_bit)
    rec = run()
    assert not rec["ok"] and rec["kernels"][0]["ok"]
    bad = rec["kernels"][1]
    assert (bad["serial_mismatches"], bad["thread_mismatches"], bad["errors"]) == (0, 1, [])

    def off_when_free(*args, **kw):
        grads = backward(*args, **kw)
        if not kw["deterministic"] and kw["stream"] is not None:
            grads[0][...] *= 1.05 if kw["kernel"] == "sm80" else np.nan
        return grads

    monkeypatch.setattr(mla_cupy, "mla_prefill_backward", off_when_free)
    rec = run()
    assert [p["ok"] for p in rec["kernels"]] == [False, False]
    assert 0.03 < rec["kernels"][0]["free_worst"] < 0.07 and rec["kernels"][1]["free_worst"] == np.inf
    assert all(p["thread_mismatches"] == 0 and p["free_differ_bits"] == 6 for p in rec["kernels"])

    def raises_in_a_thread(*args, **kw):
        if kw["stream"] is not None and kw["kernel"] == "sm80":
            raise RuntimeError("boom")
        return backward(*args, **kw)

    monkeypatch.setattr(mla_cupy, "mla_prefill_backward", raises_in_a_thread)
    rec = run()
    assert set(rec["kernels"][0]["errors"]) == {"a thread: RuntimeError: boom"} and rec["kernels"][1]["ok"]
    summary = _verify.summarize([dict(_soak_record(), backward=rec)])
    assert "sm80: a thread: RuntimeError: boom" in _verify.format_summary(summary)

"""benchmarks/sass.py: the SASS parser, the loop finder and the opcode classes on a hand-written
listing (no tools needed), and the whole path on a real family when cuobjdump is installed."""
import json
import shutil

import pytest
from _scripts import load_script

sass = load_script("benchmarks/sass.py", "sass_tool")

# An outer loop (0x20-0xb0) around an inner one (0x30-0x90) whose mbarrier wait retries out of line
# (0x100-0x120, a small self loop that jumps back into the inner loop), then the exit and the
# unreachable self branch ptxas puts after it.
LISTING = """
\tcode for sm_90a
\t\tFunction : k
\t.headerflags\t@"EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                       /* 0x00000a00ff017b82 */
                                                                                /* 0x000fe20000000800 */
        /*0010*/                   S2R R0, SR_TID.X ;                           /* 0x0000000000007919 */
        /*0020*/                   IADD3 R2, R2, 0x1, RZ ;                      /* 0x0 */
        /*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3 ;  /* 0x0 */
        /*0040*/               @!P0 BRA 0x100 ;                                 /* 0x0 */
        /*0050*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], R24 ;  /* 0x0 */
        /*0060*/                   MUFU.EX2 R5, R5 ;                            /* 0x0 */
        /*0070*/                   FFMA R6, R5, R7, R6 ;                        /* 0x0 */
        /*0080*/                   ISETP.NE.AND P1, PT, R2, R9, PT ;            /* 0x0 */
        /*0090*/               @P1 BRA 0x30 ;                                   /* 0x0 */
        /*00a0*/                   ISETP.NE.AND P2, PT, R2, R10, PT ;           /* 0x0 */
        /*00b0*/               @P2 BRA 0x20 ;                                   /* 0x0 */
        /*00c0*/                   EXIT ;                                       /* 0x0 */
        /*00d0*/                   BRA 0xd0 ;                                   /* 0x0 */
        /*0100*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3 ;  /* 0x0 */
        /*0110*/               @!P0 BRA 0x100 ;                                 /* 0x0 */
        /*0120*/                   BRA 0x50 ;                                   /* 0x0 */
\t\t..........
"""


def _loops():
    funcs = sass.parse_sass(LISTING)
    assert list(funcs) == ["k"] and len(funcs["k"]) == 17
    return {lp.start: lp for lp in sass.find_loops(funcs["k"])}


def test_parse_keeps_predicates_opcodes_and_operands():
    ins = sass.parse_sass(LISTING)["k"]
    assert ins[4] == sass.Instr(0x40, "@!P0", "BRA", "0x100")
    assert ins[5].opcode == "HGMMA.64x128x16.F32.BF16" and ins[5].operands == "R24, gdesc[UR20], R24"


def test_natural_loops_nesting_and_cold_blocks():
    loops = _loops()
    assert sorted(loops) == [0x20, 0x30, 0x100]  # the jump back from the retry path is no loop
    outer, inner, retry = loops[0x20], loops[0x30], loops[0x100]
    assert (outer.end, outer.total, outer.cold, outer.depth) == (0xb0, 10, 3, 0)
    assert (inner.end, inner.total, inner.cold, inner.depth) == (0x90, 7, 3, 1)
    assert (retry.end, retry.total, retry.cold, retry.depth) == (0x110, 2, 0, 2)
    assert retry.small and not inner.small and not outer.small  # <= 16 instructions and no MMA
    assert inner.innermost and not outer.innermost and not retry.innermost  # small loops do not count
    assert inner.gmma == 1 and inner.max_register == 24


def test_loop_classes():
    inner = _loops()[0x30]
    want = {"GMMA": 1, "EX2": 1, "FFMA": 1, "INT": 1, "SYNC": 1, "BRA": 2}
    assert inner.classes == {c: want.get(c, 0) for c in sass.CLASSES}
    assert inner.opcodes["SYNCS.PHASECHK.TRANS64.TRYWAIT"] == 1 and sum(inner.opcodes.values()) == inner.total


def test_ways_round_a_loop_skip_the_retry_path_and_count_inner_loops_once():
    loops = _loops()
    inner, outer = loops[0x30], loops[0x20]
    # inner: the wait (2) and the body (5); the longest way takes the out-of-line retry (2 + 1)
    assert (inner.path_min, inner.path_max) == (7, 10)
    assert inner.path_classes == {c: {"GMMA": 1, "EX2": 1, "FFMA": 1, "INT": 1, "SYNC": 1, "BRA": 2}.get(c, 0)
                                  for c in sass.CLASSES}
    # outer: its head (1), the inner loop's way once (7 or 10), its own test and branch (2)
    assert (outer.path_min, outer.path_max) == (10, 13)


@pytest.mark.parametrize("opcode, cls", [
    ("HGMMA.64x128x16.F32.BF16", "GMMA"), ("QGMMA.64x128x32.F32.E4M3.E4M3", "GMMA"), ("HMMA.16816.F32.BF16", "GMMA"),
    ("MUFU.EX2", "EX2"), ("MUFU.RCP", "MUFU"), ("FFMA.FTZ", "FFMA"), ("FMNMX", "FMNMX"), ("LDSM.16.M88.4", "LDS/STS"),
    ("STSM.16.M88.4", "LDS/STS"), ("LDG.E.128", "LDG/STG"), ("STL.64", "LDL/STL"), ("R2UR", "R2UR"),
    ("UIADD3", "U*"), ("UTMALDG.2D", "U*"), ("S2UR", "U*"), ("IMAD.WIDE.U32", "INT"), ("LOP3.LUT", "INT"),
    ("SYNCS.ARRIVE.TRANS64.RED.A1T0", "SYNC"), ("BAR.SYNC.DEFER_BLOCKING", "SYNC"), ("WARPGROUP.ARRIVE", "SYNC"),
    ("BRA.U.ANY", "BRA"), ("EXIT", "BRA"), ("MOV", "other"), ("FSEL", "other")])
def test_classify(opcode, cls):
    assert sass.classify(opcode) == cls


def test_main_loop_prefers_most_gmma_then_the_shortest():
    def loop(start, gmma, total, innermost=True):
        return sass.LoopReport(start, start + 16 * total, total, 0, gmma, 1, innermost, False, 10, {}, {})

    rep = sass.KernelReport("k", "k", "t", {}, None, [], [], 10, 100, {},
                            [loop(0x100, 20, 631), loop(0x900, 20, 488), loop(0x2000, 0, 40), loop(0x10, 40, 2000, False)])
    assert sass.main_loop(rep).start == 0x900  # the mask-free copy
    assert sass.main_loop(rep, 0x100).start == 0x100
    with pytest.raises(ValueError, match="no loop starts at 0x123"):
        sass.main_loop(rep, 0x123)


def test_main_loop_is_the_innermost_with_mma_around_a_cold_loop():
    # the step loop (0x2570) holds a zeroing loop without MMA (0x4190), so it is not innermost
    def loop(start, end, gmma, total, depth, innermost):
        return sass.LoopReport(start, end, total, 0, gmma, depth, innermost, False, 10, {}, {})

    rep = sass.KernelReport("k", "k", "t", {}, None, [], [], 10, 100, {},
                            [loop(0x0e70, 0xbbd0, 46, 2775, 0, False), loop(0x1740, 0xb5d0, 46, 2538, 1, False),
                             loop(0x2570, 0x5d70, 46, 897, 2, False), loop(0x4190, 0x4630, 0, 75, 3, True),
                             loop(0xe7f0, 0xea10, 0, 35, 3, True)])
    assert sass.main_loop(rep).start == 0x2570


def test_res_usage_per_elf():
    text = """
Fatbin elf code:
================
arch = sm_90a

Resource usage:
 Common:
  GLOBAL:11 CONSTANT[4]:88
 Function _Z1av:
  REG:168 STACK:24 SHARED:1024 LOCAL:0 CONSTANT[0]:3200 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _Z1bv:
  REG:32 STACK:0 SHARED:0 LOCAL:8 CONSTANT[0]:900 TEXTURE:0 SURFACE:0 SAMPLER:0

Fatbin elf code:
================
arch = sm_80

Resource usage:
 Function _Z1cv:
  REG:64 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:900 TEXTURE:0 SURFACE:0 SAMPLER:0
"""
    elves = sass.parse_res_usage(text)
    assert [list(e) for e in elves] == [["_Z1av", "_Z1bv"], ["_Z1cv"]]
    assert elves[0]["_Z1av"]["REG"] == 168 and elves[0]["_Z1av"]["STACK"] == 24 and elves[0]["_Z1bv"]["LOCAL"] == 8


def test_family_end_to_end(capsys):
    """A real family through NVRTC, cuobjdump and the loop finder: the spin kernel waits in one loop
    (reading the global timer until its time is up)."""
    pytest.importorskip("cupy")
    try:
        sass.find_tool("cuobjdump")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    assert sass.main(["--family", "bench_spin", "--json"]) == 0
    (rep,) = json.loads(capsys.readouterr().out)
    assert rep["label"] == "mla::spin_kernel" and rep["resources"]["REG"] > 0 and rep["ptxas"]["stack_frame"] == 0
    (loop,) = rep["loops"]
    assert loop["small"] and loop["classes"]["BRA"] == 1 and loop["total"] == sum(loop["classes"].values())
    assert sass.main(["--family", "bench_spin"]) == 0
    assert loop["where"] not in capsys.readouterr().out  # small loops only with --all-loops
    assert sass.main(["--family", "bench_spin", "--all-loops"]) == 0
    assert loop["where"] in capsys.readouterr().out
    assert sass.main(["--family", "no such family"]) == 2
    assert "families for sm_90a match" in capsys.readouterr().err


def test_demangle_leaves_names_without_cxxfilt(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert sass.demangle(["_Z1av"]) == ["_Z1av"]


def test_fa4_rejects_an_unknown_direction_and_reports_a_failed_compile():
    with pytest.raises(ValueError, match="fwd or bwd"):
        sass.analyze_fa4("backward")
    with pytest.raises(RuntimeError, match="did not compile"):
        sass.analyze_fa4("bwd", python="/bin/false")

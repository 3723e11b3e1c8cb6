"""benchmarks/trace_tiles.py without a GPU: the split of a consumer's cycles from synthetic stamps laid
out as kernels/sm90/trace.cuh writes them."""
import numpy as np
import pytest
from _scripts import load_script

tt = load_script("benchmarks/trace_tiles.py", "trace_tiles_tool")

A, B, WAIT, EPI, GAP, IDLE = 900, 3000, 40, 700, 10, 250  # cycles: per work tile, per key tile, ...


def synthetic(tiles_per_consumer, ctas=2, slots=3, kept=8):
    t = np.zeros((ctas, slots, 1 + kept, 6), np.uint64)
    totals = dict(wait=0, loop=0, epi=0, idle=0, span=0)
    for c in range(ctas):
        for s in range(slots):
            clock = 1000 * (c + 1)
            start = clock
            rows = tiles_per_consumer(c, s)
            for i, nt in enumerate(rows):
                r = t[c, s, 1 + i]
                r[0] = clock
                r[1] = clock + WAIT
                if nt is None:  # a tile without this consumer's rows
                    r[2] = r[3] = r[1] + IDLE
                    r[4] = 1 << 32
                    totals["idle"] += IDLE
                else:
                    r[2] = r[1] + A + B * nt
                    r[3] = r[2] + EPI
                    r[4] = nt
                    totals["loop"] += A + B * nt
                    totals["epi"] += EPI
                totals["wait"] += WAIT
                clock = int(r[3]) + GAP
            if len(rows) < kept:  # the take that found no tile (kept as the kernel keeps it)
                last = t[c, s, 1 + len(rows)]
                last[0], last[1] = clock, clock + WAIT
                totals["wait"] += WAIT
            t[c, s, 0] = [1, start, 10 * start, clock + WAIT + 5, 10 * (clock + WAIT + 5), 0]
            totals["span"] += clock + WAIT + 5 - start
    return t, totals


def test_summarize_recovers_the_fit_and_the_shares():
    t, tot = synthetic(lambda c, s: [3 + c + s, 7, None, 12 - s] if s != 2 else [5, 1 + c])
    r = tt.summarize(t)
    assert r["consumers"] == 6 and r["busy_tiles"] == 4 * 3 + 2 * 2  # an idle tile each in four
    assert r["cycles_per_key_tile"] == pytest.approx(B) and r["cycles_per_work_tile"] == pytest.approx(A)
    assert r["share_wait"] == pytest.approx(tot["wait"] / tot["span"])
    assert r["share_epilogue"] == pytest.approx(tot["epi"] / tot["span"])
    assert r["share_idle_tiles"] == pytest.approx(tot["idle"] / tot["span"])
    assert r["share_loop_residual"] == pytest.approx(0, abs=1e-9)
    shares = [v for k, v in r.items() if k.startswith("share_")]
    assert sum(shares) == pytest.approx(1.0)
    assert r["share_other"] > 0  # the gaps between tiles and the exit


def test_summarize_end_of_launch_and_refusals():
    t, _ = synthetic(lambda c, s: [4, 8] if c == 0 else [4])  # CTA 1 exits first
    ends = t[:, :, 0, 4].max(axis=1).astype(np.float64)  # each CTA's exit (globaltimer)
    r = tt.summarize(t, ends)
    assert 0 < r["end_launch"] < 1
    with pytest.raises(ValueError, match="MLA_SM90_TRACE"):
        tt.summarize(np.zeros_like(t))
    many, _ = synthetic(lambda c, s: [2] * 8, kept=8)
    many[0, 0, 0, 5] = 1  # took more tiles than were kept
    with pytest.raises(ValueError, match="more work tiles than the 8 kept"):
        tt.summarize(many)


def test_table_row_names_every_share():
    t, _ = synthetic(lambda c, s: [4, 8])
    r = tt.summarize(t, t[:, :, 0, 4].max(axis=1).astype(np.float64))
    r.update(case="1x8192", impl="ours")
    row = tt.format_row(r)
    assert row.count("|") == tt.HEADER.splitlines()[0].count("|")


def test_tiles_of_one_length_give_the_mean_not_a_fit():
    t, tot = synthetic(lambda c, s: [70, 72, 71, 70])
    r = tt.summarize(t)
    assert not r["fitted"] and r["cycles_per_work_tile"] == 0
    assert r["cycles_per_key_tile"] == pytest.approx(tot["loop"] / (4 * 6 * 70.75))
    assert r["share_loop_per_key_tile"] == pytest.approx(tot["loop"] / tot["span"])
    r.update(case="ctx", impl="ours")
    assert "tiles of one length" in tt.format_row(r)

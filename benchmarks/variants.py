"""Time launch-time variants of the Hopper kernel in one process (GPU time, bench.time_ms):
L2 head sections on/off, persistent grid vs one CTA per tile. Prints a table.

    PYTHONPATH=. python3 benchmarks/variants.py
"""
import sys

import cupy as cp

import mla_cupy
from mla_cupy import api
from mla_cupy.bench import DEFAULT_CASES, _inputs, time_ms

ORIG_HPS = api.heads_per_section
ORIG_SM = api._sm_count_and_l2


def variant(name):
    api.heads_per_section = ORIG_HPS
    api._sm_count_and_l2 = ORIG_SM
    if name in ("no-sections", "no-sections+grid=tiles"):
        api.heads_per_section = lambda p, dev: p.heads
    if name in ("grid=tiles", "no-sections+grid=tiles"):
        api._sm_count_and_l2 = lambda dev: (1 << 30, ORIG_SM(dev)[1])
    if name == "sections/2":
        api.heads_per_section = lambda p, dev: max(1, ORIG_HPS(p, dev) // 2)


def main(cases=("1x512", "1x4096", "1x8192", "16x512", "H16-1x8192")):
    names = ["default", "no-sections", "grid=tiles", "no-sections+grid=tiles", "sections/2"]
    print("| case | " + " | ".join(names) + " |  (ms, GPU time)")
    for c in cases:
        case = DEFAULT_CASES[c]
        sets = [_inputs(case, s) for s in range(2)]
        outs = [cp.empty((sum(case.sq), case.heads, 128), sets[0]["q"].dtype) for _ in sets]
        row = []
        for name in names:
            variant(name)
            api._PROBLEMS.clear()
            api._PLANS.clear()
            f = lambda i: mla_cupy.mla_prefill(**sets[i], mask=case.mask, q_max_seq_len=max(case.sq), validate=False,
                                               out=outs[i])
            row.append(time_ms(f, len(sets), reps=10))
        variant("default")
        print(f"| {c} | " + " | ".join(f"{ms:.3f}" for ms in row) + " |", flush=True)


if __name__ == "__main__":
    main(*([sys.argv[1].split(",")] if len(sys.argv) > 1 else []))

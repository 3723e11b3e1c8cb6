"""Run one bench case's kernel a few times so `ncu` can profile the last launch.

    ncu --clock-control none -k regex:prefill --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python3 benchmarks/ncu_case.py 1x512
"""
import sys

import cupy as cp

import mla_cupy
from mla_cupy.bench import DEFAULT_CASES, make_inputs


def main(name: str, kernel: str = "auto") -> None:
    case = DEFAULT_CASES[name]
    x = make_inputs(case, 0)
    for _ in range(3):
        mla_cupy.mla_prefill(**x, mask=case.mask, q_max_seq_len=max(case.sq), validate=False, kernel=kernel)
    cp.cuda.Device().synchronize()


if __name__ == "__main__":
    main(*sys.argv[1:])

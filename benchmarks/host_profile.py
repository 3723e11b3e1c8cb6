"""Where the host time of one mla_prefill call goes (validate=False, out= given, small problem).

    PYTHONPATH=. python3 benchmarks/host_profile.py
"""
import cProfile
import pstats
import time

import cupy as cp

import mla_cupy
from mla_cupy._arrays import BF16
from mla_cupy.bench import BenchCase, make_inputs


def main(n: int = 5000) -> None:
    case = BenchCase("host-1x64-H16", (64,), (64,), heads=16)
    x = make_inputs(case, 0)
    out = cp.empty((64, 16, 128), BF16)

    def call():
        mla_cupy.mla_prefill(**x, out=out, q_max_seq_len=64, validate=False)

    for _ in range(20):
        call()
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    us = (time.perf_counter() - t0) / n * 1e6
    cp.cuda.Device().synchronize()
    print(f"host time per call: {us:.1f} us over {n} calls")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        call()
    pr.disable()
    cp.cuda.Device().synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()

"""Where the host time of one mla_prefill call goes (validate=False, out= given, small problem).

    PYTHONPATH=. python3 benchmarks/host_profile.py
"""
import cProfile
import pstats
import time

import numpy as np

import cupy as cp

import mla_cupy
from mla_cupy._arrays import BF16


def main(n: int = 5000) -> None:
    rng = np.random.default_rng(0)
    sq, h = 64, 16
    q = cp.asarray(rng.standard_normal((sq, h, 192)).astype(BF16))
    k = cp.asarray(rng.standard_normal((sq, h, 128)).astype(BF16))
    kr = cp.asarray(rng.standard_normal((sq, 1, 64)).astype(BF16))
    vl = cp.asarray(np.array([0, sq], np.uint32))
    out = cp.empty((sq, h, 128), BF16)

    def call():
        mla_cupy.mla_prefill(q, k, k, kr, vl, vl, out=out, q_max_seq_len=sq, validate=False)

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

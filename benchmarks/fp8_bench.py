"""Issue-6 timings on one GPU, one process: the fp8 per-token variant against our bf16 Hopper kernel
(causal, H = 128, one sequence of 4096 / 8192 / 16384 tokens), median GPU time of 20 calls after
warm-up (mla_cupy.bench.time_ms); fp8 inputs from the package's device quantizers. Prints a table.

    PYTHONPATH=. python3 benchmarks/fp8_bench.py
"""
import numpy as np

import cupy as cp

import mla_cupy
from mla_cupy import quant
from mla_cupy._arrays import BF16
from mla_cupy.bench import time_ms


def rand(rng, *shape):
    return rng.standard_normal(shape, dtype=cp.float32).astype(BF16)


def main():
    rng = cp.random.default_rng(0)
    h = 128
    rows = []
    for s in (4096, 8192, 16384):
        q, k, v, kr = rand(rng, s, h, 192), rand(rng, s, h, 128), rand(rng, s, h, 128), rand(rng, s, 1, 64)
        vl = cp.asarray(np.array([0, s], np.uint32))
        out = cp.empty((s, h, 128), BF16)
        f = quant.quantize_per_token(q, k, v, kr)  # the package's device quantizers
        t_bf16 = time_ms(lambda i: mla_cupy.mla_prefill(q, k, v, kr, vl, vl, out=out, q_max_seq_len=s, validate=False), 1)
        t_fp8 = time_ms(lambda i: mla_cupy.mla_prefill_fp8(f["q_nope"], f["q_rope"], f["q_scale"], f["k"], f["k_scales"],
                                                           f["v"], f["k_rope"], vl, vl, out=out, q_max_seq_len=s,
                                                           validate=False), 1)
        flops = 4 * h * (s * (s + 1) / 2) * 160  # causal: (192 + 128) / 2 per key-query pair, x2 flops
        rows.append((f"1x{s} causal H=128", t_bf16, flops / t_bf16 / 1e9, t_fp8, flops / t_fp8 / 1e9, t_bf16 / t_fp8))
        del q, k, v, kr, out, f
        cp.get_default_memory_pool().free_all_blocks()
    print("| case | bf16 ms | bf16 TFLOP/s | fp8 ms | fp8 TFLOP/s (bf16-equivalent) | fp8 speed-up |")
    print("|------|---------|--------------|--------|-------------------------------|--------------|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.3f} | {r[2]:.0f} | {r[3]:.3f} | {r[4]:.0f} | {r[5]:.2f}x |")


if __name__ == "__main__":
    main()

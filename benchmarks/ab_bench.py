"""Two kernel versions in one process on one GPU: our bf16 Hopper kernel and the fp8 per-token
variant (causal, H = 128, one sequence of 4096 / 8192 / 16384 tokens), each timed with the kernels
of an older version (a directory of .cu/.cuh files) and with the working tree's, interleaved per
size so that clock drift hits both alike. Median of 20 calls after warm-up (mla_cupy.bench.time_ms).

    git archive <commit> kernels | tar -x -C /tmp/old      # then:
    PYTHONPATH=.:benchmarks python3 benchmarks/ab_bench.py /tmp/old/kernels
"""
import sys

import numpy as np

import cupy as cp

import mla_cupy
from mla_cupy import quant
from mla_cupy._arrays import BF16
from mla_cupy.bench import time_ms

from _variant import restore, use_sources


def main(old_dir: str, sizes=(4096, 8192, 16384)):
    rng = cp.random.default_rng(0)
    h = 128
    print("| case | old bf16 ms | new bf16 ms | old fp8 ms | new fp8 ms | old fp8/bf16 | new fp8/bf16 | new bf16 TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    for s in sizes:
        rand = lambda *shape: rng.standard_normal(shape, dtype=cp.float32).astype(BF16)
        q, k, v, kr = rand(s, h, 192), rand(s, h, 128), rand(s, h, 128), rand(s, 1, 64)
        vl = cp.asarray(np.array([0, s], np.uint32))
        out = cp.empty((s, h, 128), BF16)
        f = quant.quantize_per_token(q, k, v, kr)
        bf16 = lambda i: mla_cupy.mla_prefill(q, k, v, kr, vl, vl, out=out, q_max_seq_len=s, validate=False)
        fp8 = lambda i: mla_cupy.mla_prefill_fp8(f["q_nope"], f["q_rope"], f["q_scale"], f["k"], f["k_scales"], f["v"],
                                                 f["k_rope"], vl, vl, out=out, q_max_seq_len=s, validate=False)
        t = {}
        for rnd in range(2):  # old, new, old, new: the better of each pair's two medians
            saved = use_sources(old_dir)
            t_old = (time_ms(bf16, 1), time_ms(fp8, 1))
            restore(saved)
            t_new = (time_ms(bf16, 1), time_ms(fp8, 1))
            for key, val in (("old", t_old), ("new", t_new)):
                t[key] = val if key not in t else tuple(min(a, b) for a, b in zip(t[key], val))
        flops = 4 * h * (s * (s + 1) / 2) * 160
        (ob, of), (nb, nf) = t["old"], t["new"]
        print(f"| 1x{s} | {ob:.3f} | {nb:.3f} | {of:.3f} | {nf:.3f} | {ob / of:.2f}x | {nb / nf:.2f}x | {flops / nb / 1e9:.0f} |",
              flush=True)
        del q, k, v, kr, out, f
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main(sys.argv[1])

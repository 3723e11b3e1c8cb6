"""Runs the fp8 per-token (``e4m3``: in the all-e4m3 mode; or the bf16, or the bf16 with a paged rope: ``paged``
in shuffled pages of 64, ``pagedP`` of P)
Hopper kernel on 1x8192 causal, H = 128, three times, so that `ncu` can profile the last launch
(what bounds the fp8 kernel; where the paged rope loses to the plain one):

    ncu --clock-control none -k regex:mla_prefill_kernel --launch-skip 2 --launch-count 1 --set full \
        -o fp8 python3 benchmarks/ncu_fp8.py fp8
"""
import sys

import numpy as np

import cupy as cp

import mla_cupy
from mla_cupy import quant
from mla_cupy._arrays import BF16


def main(mode: str = "fp8", s: int = 8192, h: int = 128) -> None:
    rng = cp.random.default_rng(0)
    rand = lambda *shape: rng.standard_normal(shape, dtype=cp.float32).astype(BF16)
    q, k, v, kr = rand(s, h, 192), rand(s, h, 128), rand(s, h, 128), rand(s, 1, 64)
    vl = cp.asarray(np.array([0, s], np.uint32))
    out = cp.empty((s, h, 128), BF16)
    f = quant.quantize_per_token(q, k, v, kr, e4m3_rope=mode == "e4m3")
    if mode.startswith("paged"):  # the same rope rows, in shuffled pages of ps of a [blocks, ps, 1, 64] cache
        ps = int(mode[len("paged"):] or 64)
        perm = np.random.default_rng(1).permutation(s // ps)
        blocks = cp.empty((s // ps, ps, 1, 64), BF16)
        blocks[cp.asarray(perm)] = kr.reshape(s // ps, ps, 1, 64)
        kr = mla_cupy.PagedKVCache(blocks, cp.asarray(perm[None, :].astype(np.int32)), ps, rope_offset=0)
    for _ in range(3):
        if mode in ("fp8", "e4m3"):
            mla_cupy.mla_prefill_fp8(f["q_nope"], f["q_rope"], f["q_scale"], f["k"], f["k_scales"], f["v"], f["k_rope"],
                                     vl, vl, out=out, q_max_seq_len=s, validate=False)
        else:
            mla_cupy.mla_prefill(q, k, v, kr, vl, vl, out=out, q_max_seq_len=s, validate=False)
    cp.cuda.Device().synchronize()


if __name__ == "__main__":
    main(*sys.argv[1:2])

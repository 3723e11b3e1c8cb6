"""The fp8 kernels' rounding of P, emulated on the CPU: what a way of making P's e4m3 bytes costs in
accuracy, before any GPU time.

The fp8 kernels compute ``2^N P`` (N = 8: ``kernels/sm90/fp8.cuh: kLog2PScale``) and round it to
e4m3 before P V; the row sums are of the same bytes. How they round (``kernels/e4m3.cuh``):

* ``exp2``: 2^x rounded to nearest e4m3, in the key tiles on a mask's edge (and everywhere with
  ``MLA_SM90_FP8_EXP_BYTES`` 0);
* ``bytes``: the byte straight from the exponent, its mantissa linear in x's fraction (2^f taken as
  its chord, bias -0.4585), in the tiles that a 64-row consumer sees whole (the three-consumer
  kernels under the causal mask and no mask).

against the exact running maximum of each row. This script follows the kernels' geometry (consumers of 64 rows counted from each
sequence's end, warps of 16, key tiles of 128 from the sequence's first key, a work tile's first key
tile always on the exp2 path) and reports each rule's per-slice errors against the float64 reference
of the dequantized inputs, the contract's measure (bound 3e-2 on slices of 64 keys or more), on the
inputs of ``tests/test_gpu_fp8.py``'s long-row case. What it leaves out: the kernels' float32 and
e4m3-accumulator arithmetic around P (the GPU tests' errors run a little above the emulated ones).

Usage (CPU only)::

    PYTHONPATH=.:tests python benchmarks/p_rounding.py
"""
from __future__ import annotations

import argparse
from typing import Dict, List, Optional, Sequence

import numpy as np

from mla_cupy._registry import VARIANT_FP8, sm90_schedule
from mla_cupy.dims import DQK, kernel_float, kernel_int
from mla_cupy.masks import CausalMask

# the kernels' own constants, so that the emulation follows them
EXP_BYTE_BIAS = kernel_float("e4m3.cuh", "kExpByteBias")
LOG2_PSCALE = kernel_int("sm90/fp8.cuh", "kLog2PScale")
_SCHEDULE = sm90_schedule(VARIANT_FP8, CausalMask())  # the three-consumer fp8 kernels'
CONSUMER_ROWS, WARP_ROWS = _SCHEDULE.q_rows, 16  # a consumer warpgroup's rows, a warp's rows of them
KEY_TILE = _SCHEDULE.block_n
E4M3_MAX = 448.0

# the tests' case of long rows after cached keys (tests/test_gpu_fp8.py: LONG_FIRST_BLOCKS), 16 heads
LONG_ROWS = dict(sq=[40, 250, 0, 385, 129], sk=[1000, 1150, 40, 1300, 129], cache_offsets=[0, 900, 0, 915, 3],
                 heads=16, seed=31)


def _e4m3_values() -> np.ndarray:
    import ml_dtypes

    return np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def exp2_e4m3(x: np.ndarray) -> np.ndarray:
    """2^x rounded to the nearest e4m3 (finite: saturated at 448, as cvt.rn.satfinite)."""
    import ml_dtypes

    y = np.minimum(np.exp2(x), E4M3_MAX)
    return y.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _byte(x: np.ndarray) -> np.ndarray:
    """round(8 x + 56 + bias): the byte of 2^x before its clamp (the carrier's integer)."""
    return np.floor(8.0 * x + 56.0 + EXP_BYTE_BIAS + 0.5)


def exp_bytes(x: np.ndarray) -> np.ndarray:
    """The bytes' values: round(8 x + 56 + bias) clamped below at 0 (-inf included); past byte 126
    (e4m3's 448) raises: the kernels never make such a byte (the exact maximum keeps x <= 8)."""
    b = np.where(np.isneginf(x), 0.0, _byte(x))
    if (b > 126).any():
        raise OverflowError("a byte past e4m3's range")
    return _e4m3_values()[np.clip(b, 0, 126).astype(np.int64)]


def _unrounded(x: np.ndarray) -> np.ndarray:
    return np.exp2(x)


ENCODINGS = {"bytes": exp_bytes, "exp2": exp2_e4m3, "exact": _unrounded}


def emulate_rows(s: np.ndarray, vis: np.ndarray, v: np.ndarray, *, encoding: str = "bytes") -> np.ndarray:
    """The output rows of one (sequence, head): ``s`` [rows, keys] scores times the softmax scale in
    log2 units, ``vis`` the mask, ``v`` [keys, Dv]. ``encoding``: the mask-free tiles' rounding
    (``bytes``, ``exp2``, or ``exact``: P unrounded everywhere, the emulation's own check)."""
    rows, keys = s.shape
    log2p = LOG2_PSCALE
    edge = _unrounded if encoding == "exact" else exp2_e4m3
    inner = ENCODINGS[encoding]
    out = np.zeros((rows, v.shape[1]))
    first = rows % CONSUMER_ROWS - CONSUMER_ROWS if rows % CONSUMER_ROWS else 0  # blocks from the end
    for c0 in range(first, rows, CONSUMER_ROWS):
        r = np.arange(max(c0, 0), c0 + CONSUMER_ROWS)
        m = np.full(len(r), -np.inf)
        l = np.zeros(len(r))
        o = np.zeros((len(r), v.shape[1]))
        for t in range((keys + KEY_TILE - 1) // KEY_TILE):
            cols = np.arange(t * KEY_TILE, min((t + 1) * KEY_TILE, keys))
            seen = vis[np.ix_(r, cols)]
            st = np.where(seen, s[np.ix_(r, cols)], -np.inf)
            mask_free = t > 0 and len(cols) == KEY_TILE and seen.all()
            x = _step(st, m, l, o) + log2p
            p = inner(x) if mask_free else edge(x)
            o += p @ v[cols]
            l += p.sum(1)
        out[r] = o / np.where(l > 0, l, 1.0)[:, None]
    return out


def _step(st, m, l, o):
    """The exact online-softmax step of the running state: new maxima, O and the sums rescaled in
    place; returns the scores' exponents against the new references (before 2^N)."""
    mx = np.maximum(m, st.max(1))
    ref = np.where(np.isneginf(mx), 0.0, mx)
    corr = np.exp2(np.where(np.isneginf(m), -np.inf, m) - ref)
    o *= corr[:, None]
    l *= corr
    m[...] = mx
    return st - ref[:, None]


def slice_errors(case: Dict = LONG_ROWS, *, encoding: str = "bytes") -> List[float]:
    """Per-slice errors (causal mask) of the emulated kernel against the float64 reference of the
    dequantized inputs, for a ``make_case`` case quantized per token (``mla_cupy.quant``)."""
    from _cases import make_case
    from mla_cupy import quant

    c = make_case(case["sq"], case["sk"], case["heads"], seed=case["seed"], cache_offsets=case["cache_offsets"])
    fq = quant.quantize_per_token(c.q, c.k, c.v, c.k_rope)
    f64 = {n: np.asarray(fq[n]).astype(np.float64) for n in ("q_nope", "q_rope", "q_scale", "k", "k_scales", "v", "k_rope")}
    vl, cro = c.valid_length.astype(np.int64), c.cache_row_offsets.astype(np.int64)
    co = np.zeros(len(case["sq"]), np.int64) if c.cache_offsets is None else c.cache_offsets.astype(np.int64)
    scale_log2 = np.log2(np.e) / np.sqrt(float(DQK))
    errs = []
    for b in range(len(case["sq"])):
        q0, q1, k0, k1 = vl[b], vl[b + 1], cro[b], cro[b + 1]
        if q1 == q0:
            continue
        vis = np.arange(k1 - k0)[None, :] <= np.arange(q1 - q0)[:, None] + co[b]
        for h in range(case["heads"]):
            # the true scores: q_scale[i] k_scales[j] (q_nope . k + q_rope . k_rope), as the reference's
            dot = f64["q_nope"][q0:q1, h] @ f64["k"][k0:k1, h].T + f64["q_rope"][q0:q1, h] @ f64["k_rope"][k0:k1, 0].T
            s = scale_log2 * f64["q_scale"][q0:q1, :1] * f64["k_scales"][k0:k1, 0][None, :] * dot
            v = f64["v"][k0:k1, h]
            se = np.where(vis, s, -np.inf)
            p = np.exp2(se - se.max(1, keepdims=True))
            ref = (p / p.sum(1, keepdims=True)) @ v
            got = emulate_rows(s, vis, v, encoding=encoding)
            errs.append(float(np.linalg.norm(got - ref) / np.linalg.norm(ref)))
    return errs


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.parse_args(argv)
    print("| mask-free tiles | worst slice | mean |\n| --- | --- | --- |")
    for enc in ("exp2", "bytes"):
        e = np.array(slice_errors(encoding=enc))
        print(f"| {enc} | {e.max():.4f} | {e.mean():.4f} |")


if __name__ == "__main__":
    main()

"""Issue 6: what bounds the fp8 per-token kernel. Times compile-time variants of it against the bf16
kernel in one process (1x8192, H = 128, causal). Variants change the consumers' schedule or drop
per-score work; a variant that drops work gives WRONG results (timing only, never shipped):

  default      the shipped kernel
  no-pingpong  the two consumers issue their GEMMs whenever ready (no turns)
  no-dequant   S is not multiplied by k_scales[j] (the one FMUL per score left)
  k-ahead      the producer loads K of tile t before V of tile t - 1 (FlashAttention-3's order), so
               a K stage is not held back by the later release of the V stage beside it
  no-exp       ex2.approx replaced by a multiply (is the MUFU pipe the bound?)
  no-softmax   no online softmax at all: the GEMM pipeline's own bound
  late-scales  the key scales read after the S wait (v5.1's place) instead of before it
  chain-max    the row maximum by v5.1's dependent chain instead of v5.2's tree
  pscale-mul   v5.1's 256x P scale: a multiply per score before the e4m3 conversion instead of the
               exponent offset (timing only: the row sums then lack the factor, results are wrong)
  poly2, poly4 2 or 4 of the 16 n-tiles' exp2 computed by a degree-3 polynomial on the FMA pipe
               (FlashAttention-4's emulation; accurate to ~1e-4, i.e. a candidate, not wrong)

    PYTHONPATH=.:benchmarks python3 benchmarks/fp8_variants.py [variant ...]
"""
import sys

import numpy as np

import cupy as cp

import mla_cupy
from mla_cupy import quant
from mla_cupy._arrays import BF16
from mla_cupy.bench import time_ms

from _variant import restore, use_variant

# Edits of the shipped kernel (v5.1: q_scale folded into the row scale, consumers in pingpong).
# Session 5's first runs measured, on the v5 kernel (q_scale multiplied per score, no pingpong):
# "no-dequant", "no-pscale", "k-only" and "lds" (RESULTS.md, "v5").
ANCHOR = '        for (int t = 0; t < k.num_tiles; ++t, ++it) {\n          const int s = it % kS;\n          const u32 empty_parity = ((it / kS) & 1) ^ 1;  // the first pass over the ring does not wait'
LAMBDA = '        auto load_v = [&](int t, int it) {\n          const int s = it % kS;\n          const u32 empty_parity = ((it / kS) & 1) ^ 1;\n          const int row = static_cast<int>(w.kv_row0 + k.n_begin + t * kBlockN);\n          mbar_wait(v_empty(s), empty_parity);\n          mbar_expect_tx(v_full(s), kVBytes<kFp8>);\n          if constexpr (kFp8) {\n            tma_load_3d(sV(s), &tm_v, v_full(s), static_cast<int>(vt_col + t * kBlockN), 0, w.h);\n          } else {\n            for (int c = 0; c < 2; ++c) tma_load_3d(sV(s) + c * kBlk, &tm_v, v_full(s), c * kColBlock, w.h, row);\n          }\n        };\n        for (int t = 0; t < k.num_tiles; ++t, ++it) {\n          const int s = it % kS;\n          const u32 empty_parity = ((it / kS) & 1) ^ 1;  // the first pass over the ring does not wait'
OLD_LOOP = '          mbar_wait(v_empty(s), empty_parity);\n          mbar_expect_tx(v_full(s), kVBytes<kFp8>);\n          if constexpr (kFp8) {  // V^T: 128 values x 128 key columns (16-byte aligned: the tile starts on a group)\n            tma_load_3d(sV(s), &tm_v, v_full(s), static_cast<int>(vt_col + t * kBlockN), 0, w.h);\n          } else {\n            for (int c = 0; c < 2; ++c) tma_load_3d(sV(s) + c * kBlk, &tm_v, v_full(s), c * kColBlock, w.h, row);\n          }\n        }'
NEW_LOOP = '          if (t > 0) load_v(t - 1, it - 1);\n        }\n        load_v(k.num_tiles - 1, it - 1);'
EXP_ASM = 'asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));'
EXP_CALL = "s[nt][e] = fast_exp2(fmaf(s[nt][e], scale_log2[r], -ref));"
# 2^x = 2^floor(x) * p(frac(x)): floor by adding 1.5 * 2^23 rounding down, p of degree 3, the integer
# part added to p's exponent bits.
POLY = """
__device__ __forceinline__ float exp2_poly(float x) {
  x = fmaxf(x, -127.f);
  float xr;
  asm("add.rm.f32 %0, %1, %2;" : "=f"(xr) : "f"(x), "f"(12582912.f));
  const float f = x - (xr - 12582912.f);
  const float p = fmaf(fmaf(fmaf(0.0771190897f, f, 0.2275643945f), f, 0.6951461434f), f, 1.f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(xr) << 23));
}
struct OnlineSoftmax {"""


def poly(every):
    return [("struct OnlineSoftmax {", POLY),
            (EXP_CALL, f"s[nt][e] = nt % {every} == {every - 1} ? exp2_poly(fmaf(s[nt][e], scale_log2[r], -ref))"
                       f" : fast_exp2(fmaf(s[nt][e], scale_log2[r], -ref));")]


EDITS = {
    "late-scales": [("load_key_scales(t, it);\n        wgmma_wait<1>();", "wgmma_wait<1>();\n        load_key_scales(t, it);"),
                    ("load_key_scales(0, it);\n      wgmma_wait<0>();", "wgmma_wait<0>();\n      load_key_scales(0, it);")],
    "chain-max": [("""      float m[kSTiles];
#pragma unroll
      for (int nt = 0; nt < kSTiles; ++nt) m[nt] = fmaxf(s[nt][2 * r], s[nt][2 * r + 1]);
#pragma unroll
      for (int step = 1; step < kSTiles; step *= 2)
#pragma unroll
        for (int i = 0; i + step < kSTiles; i += 2 * step) m[i] = fmaxf(m[i], m[i + step]);""",
                   """      float m[1] = {s[0][2 * r]};
#pragma unroll
      for (int nt = 0; nt < kSTiles; ++nt) m[0] = fmaxf(m[0], fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));""")],
    "pscale-mul": [("const float ref_p = ref - static_cast<float>(kLog2P);", "const float ref_p = ref;")] + [
        (f"a[{i}] = e4m3x4(s[j{a}][{b}], s[j{a}][{c}], s[j{d}][{b}], s[j{d}][{c}]);",
         f"a[{i}] = e4m3x4(kPScale * s[j{a}][{b}], kPScale * s[j{a}][{c}], kPScale * s[j{d}][{b}], kPScale * s[j{d}][{c}]);")
        for i, a, d, b, c in ((0, "", " + 1", 0, 1), (1, "", " + 1", 2, 3), (2, " + 2", " + 3", 0, 1), (3, " + 2", " + 3", 2, 3))],
    "k-ahead": [(ANCHOR, LAMBDA), (OLD_LOOP, NEW_LOOP)],
    "no-exp": [(EXP_ASM, "y = x * 0.999f;")],
    "no-softmax": [("sm.update_scores(sacc, row_scale, corr);", "corr[0] = corr[1] = 1.f;")],
    "poly2": poly(8),
    "poly4": poly(4),
    "no-pingpong": [("constexpr bool kPingpong = kFp8;", "constexpr bool kPingpong = false;")],
    "no-dequant": [(f"sacc[nt][{e}] *= b{e % 2};", "") for e in range(4)],
}


def main():
    rng = cp.random.default_rng(0)
    s, h = 8192, 128
    rand = lambda *shape: rng.standard_normal(shape, dtype=cp.float32).astype(BF16)
    q, k, v, kr = rand(s, h, 192), rand(s, h, 128), rand(s, h, 128), rand(s, 1, 64)
    vl = cp.asarray(np.array([0, s], np.uint32))
    out = cp.empty((s, h, 128), BF16)
    f = quant.quantize_per_token(q, k, v, kr)
    fp8 = lambda i: mla_cupy.mla_prefill_fp8(f["q_nope"], f["q_rope"], f["q_scale"], f["k"], f["k_scales"], f["v"],
                                             f["k_rope"], vl, vl, out=out, q_max_seq_len=s, validate=False)
    t_bf16 = time_ms(lambda i: mla_cupy.mla_prefill(q, k, v, kr, vl, vl, out=out, q_max_seq_len=s, validate=False), 1)
    vt = time_ms(lambda i: quant._transpose_v_device(f["v"], vl.data.ptr, vl.data.ptr + 4, 1), 1)  # no host reads
    print(f"bf16 kernel: {t_bf16:.3f} ms; the V^T pre-pass alone: {vt:.3f} ms")
    print("| fp8 variant | ms | fp8 / bf16 speed |")
    print("|---|---|---|")
    for variant in sys.argv[1:] or ("default", "no-pingpong", "no-dequant"):
        use_variant("mla_prefill_sm90.cu", EDITS.get(variant, []), paged=(False,))
        t = time_ms(fp8, 1)
        print(f"| {variant} | {t:.3f} | {t_bf16 / t:.2f}x |", flush=True)
    restore()


if __name__ == "__main__":
    main()

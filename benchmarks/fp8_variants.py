"""Issue 6: what bounds the fp8 per-token kernel. Times compile-time variants of it against the bf16
kernel in one process (1x8192, H = 128, causal). Variants remove per-element ALU work from the
consumers' softmax phase; their RESULTS ARE WRONG (timing only, never shipped):

  default      the shipped kernel
  no-dequant   S is not multiplied by q_scale[i] k_scales[j] (2 FMUL per score)
  no-pscale    P is not multiplied by 256 before the e4m3 pack (1 FMUL per probability)
  both         the two together: the softmax phase of the bf16 kernel plus the e4m3 pack

    PYTHONPATH=.:benchmarks python3 benchmarks/fp8_variants.py
"""
import numpy as np

import cupy as cp

import mla_cupy
from mla_cupy import quant
from mla_cupy._arrays import BF16
from mla_cupy.bench import time_ms

from _variant import restore, use_variant

EDITS = {
    "no-dequant": [(f"sacc[nt][{e}] *= qsc[{e // 2}] * b{e % 2};", "") for e in range(4)],
    "no-pscale": [("const float c = kPScale;", "const float c = 1.f;")],
}
EDITS["both"] = EDITS["no-dequant"] + EDITS["no-pscale"]
# k scales only (q_scale not applied: 1 FMUL per score instead of 2)
EDITS["k-only"] = [(f"sacc[nt][{e}] *= qsc[{e // 2}] * b{e % 2};", f"sacc[nt][{e}] *= b{e % 2};") for e in range(4)]
# the scales read with ld.shared from a 32-bit shared address instead of a generic pointer
EDITS["lds"] = [("const float b0 = ksc[nt * 8 + 2 * (lane & 3)], b1 = ksc[nt * 8 + 2 * (lane & 3) + 1];",
                 "const u32 ka = sKScales(it % kS) + 4 * static_cast<u32>((w.kv_row0 + n0) & 3) + 4 * (nt * 8 + 2 * (lane & 3));"
                 " const float b0 = __uint_as_float(lds32(ka)), b1 = __uint_as_float(lds32(ka + 4));")]


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
    for variant in ("default", "no-dequant", "k-only", "lds", "both"):
        use_variant("mla_prefill_sm90.cu", EDITS.get(variant, []), paged=(False,))
        t = time_ms(fp8, 1)
        print(f"| {variant} | {t:.3f} | {t_bf16 / t:.2f}x |", flush=True)
    restore()


if __name__ == "__main__":
    main()

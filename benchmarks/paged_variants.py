"""Issue 3: where the paged path's extra time goes. Times compile-time variants of the Hopper
kernel's paged path against the plain path in one process (1x8192, H = 128, causal, page 64,
cache offset 0: every key tile copied by TMA page runs). Variants are text edits of the kernel
source, compiled for this run only (measurement, never shipped). For v5.3 (the rope warp writes
into the K stage; session 6: the consumers' full-tile loop is 567 SASS instructions paged against
536 plain, among them the flag loads below):

  default       the shipped kernel
  regs40/232    setmaxnreg 40 / 232 with the rope warp (instead of 56 / 224)
  always-fence  the consumers fence every tile instead of reading the "gathered" flag first (an
                LDS between the K wait and the first wgmma)
  early-bad     the "unreadable key" tile flag read right after the GEMMs are issued instead of
                after the S wait
  all           the three together
  no-lookup     the rope warp computes block ids as position / page size instead of reading the
                page table (timing only: the benchmark's shuffled table makes the result wrong,
                shown in the last column); tells whether the lookups' latency delays the K stage
  lookahead-2   the page-table reads two tiles ahead instead of one (a candidate fix if no-lookup
                is much faster)

Session 5 measured v5 (with the rope ring): regs40/232 and no flag read/fence together took
paged/plain from 1.135 to 1.102.

    PYTHONPATH=.:benchmarks python3 benchmarks/paged_variants.py
"""
import numpy as np

import cupy as cp

import mla_cupy
from mla_cupy._arrays import BF16
from mla_cupy.bench import time_ms

from _variant import restore, use_variant

EDITS = {
    "regs40/232": [("kProducerRegs = kBusy ? 56 : 24", "kProducerRegs = kBusy ? 40 : 24"),
                   ("kConsumerRegs = kBusy ? 224 : 240", "kConsumerRegs = kBusy ? 232 : 240")],
    "always-fence": [("if (kRopeWarp && key_ok[s * kFlagBytes + kBlockN + 1]) fence_proxy_async();",
                      "if (kRopeWarp) fence_proxy_async();")],
    "early-bad": [("      auto issue_qk = [&](int it) {", "      bool bad_pre = false;\n      auto issue_qk = [&](int it) {"),
                  ("        fence_operands(sacc);\n        const unsigned long long dk",
                   "        if (kRopeWarp) bad_pre = key_ok[s * kFlagBytes + kBlockN];\n        fence_operands(sacc);\n"
                   "        const unsigned long long dk"),
                  ("const bool tile_bad = kRopeWarp && ok[kBlockN];", "const bool tile_bad = kRopeWarp && bad_pre;")],
}
EDITS["all"] = EDITS["regs40/232"] + EDITS["always-fence"] + EDITS["early-bad"]
EDITS["lookahead-2"] = [
    ("        u32 blk[kRopeRows];\n        auto lookup_rows = [&](int t) {",
     "        u32 blk[kRopeRows], blk2[kRopeRows];\n        auto lookup_rows = [&](int t, u32 (&dst)[kRopeRows]) {"),
    ("            blk[i] = j >= k.n_end ? kNoBlock : (kPaged ? Paged::block(ra, w.b, w.k_pos0 + j) : 0u);",
     "            dst[i] = j >= k.n_end ? kNoBlock : (kPaged ? Paged::block(ra, w.b, w.k_pos0 + j) : 0u);"),
    ("        lookup_rows(0);\n", "        lookup_rows(0, blk);\n        if (k.num_tiles > 1) lookup_rows(1, blk2);\n"),
    ("          if (t + 1 < k.num_tiles) lookup_rows(t + 1);",
     "#pragma unroll\n          for (int i = 0; i < kRopeRows; ++i) blk[i] = blk2[i];\n"
     "          if (t + 2 < k.num_tiles) lookup_rows(t + 2, blk2);"),
]
EDITS["no-lookup"] = [("kPaged ? Paged::block(ra, w.b, w.k_pos0 + j) : 0u",
                       "kPaged ? static_cast<u32>((w.k_pos0 + j) >> log2_page_size) : 0u")]


def main():
    rng = cp.random.default_rng(0)
    s, h, ps = 8192, 128, 64
    rand = lambda *shape: rng.standard_normal(shape, dtype=cp.float32).astype(BF16)
    q, k, v, latent = rand(s, h, 192), rand(s, h, 128), rand(s, h, 128), rand(s, 1, 576)
    vl = cp.asarray(np.array([0, s], np.uint32))
    perm = np.random.default_rng(1).permutation(s // ps)
    blocks = cp.empty((s // ps, ps, 1, 576), BF16)
    blocks[cp.asarray(perm)] = latent.reshape(s // ps, ps, 1, 576)
    cache = mla_cupy.PagedKVCache(blocks, cp.asarray(perm[None, :].astype(np.int32)), ps)
    out, out2 = cp.empty((s, h, 128), BF16), cp.empty((s, h, 128), BF16)
    print("| variant | plain ms | paged ms | paged/plain | paged == plain |")
    print("|---|---|---|---|---|")
    for variant in ("default", "regs40/232", "always-fence", "early-bad", "all", "no-lookup", "lookahead-2"):
        use_variant("mla_prefill_sm90.cu", EDITS.get(variant, []))
        f_plain = lambda i: mla_cupy.mla_prefill(q, k, v, latent[:, :, 512:], vl, vl, out=out, q_max_seq_len=s, validate=False)
        f_paged = lambda i: mla_cupy.mla_prefill(q, k, v, cache, vl, vl, out=out2, q_max_seq_len=s, validate=False)
        t_plain, t_paged = time_ms(f_plain, 1), time_ms(f_paged, 1)
        t_plain2 = time_ms(f_plain, 1)  # again, after the paged runs (drift check)
        same = bool(cp.all(out == out2))
        print(f"| {variant} | {t_plain:.3f} / {t_plain2:.3f} | {t_paged:.3f} | {t_paged / min(t_plain, t_plain2):.3f} | {same} |",
              flush=True)
    restore()


if __name__ == "__main__":
    main()

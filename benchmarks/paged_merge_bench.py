"""Timings on one GPU, one process: paged vs plain rope (1x8192, H=128, causal) and the
cost of merge_states against the attention of the 8k-key chunk it merges. Prints a table.

    PYTHONPATH=. python3 benchmarks/paged_merge_bench.py
"""
import numpy as np

import cupy as cp

import mla_cupy
from mla_cupy import NullMask, PagedKVCache
from mla_cupy._arrays import BF16
from mla_cupy.bench import time_ms


def rand(rng, *shape):
    return rng.standard_normal(shape, dtype=cp.float32).astype(BF16)


def main():
    rng = cp.random.default_rng(0)
    rows = []
    # --- paged vs plain: 1 x 8192, H = 128, causal; pages in shuffled order. The sequence starts
    # at cache offset 0 (key tiles on page boundaries: the Hopper kernel copies page runs by TMA)
    # or at offset 8 (no tile on a boundary: every tile gathered row by row).
    s, h = 8192, 128
    q, k, v = rand(rng, s, h, 192), rand(rng, s, h, 128), rand(rng, s, h, 128)
    latent = rand(rng, s, 1, 576)
    vl = cp.asarray(np.array([0, s], np.uint32))
    kr = latent[:, :, 512:576]
    out = cp.empty((s, h, 128), BF16)

    def paged_cache(ps, offset):
        npages = -(-(s + offset) // ps)
        perm = np.random.default_rng(ps).permutation(npages)
        flat = cp.zeros((npages * ps, 1, 576), BF16)
        flat[offset:offset + s] = latent
        blocks = cp.empty((npages, ps, 1, 576), BF16)
        blocks[cp.asarray(perm)] = flat.reshape(npages, ps, 1, 576)
        return PagedKVCache(blocks, cp.asarray(perm[None, :].astype(np.int32)), ps), cp.asarray(np.array([offset], np.uint32))

    for kernel in ("sm90", "sm80"):
        try:
            t_plain = time_ms(lambda i: mla_cupy.mla_prefill(q, k, v, kr, vl, vl, out=out, q_max_seq_len=s, validate=False, kernel=kernel), 1)
        except ValueError as exc:
            print(f"{kernel}: {exc}")
            continue
        rows.append((f"1x8192 H=128 plain rope [{kernel}]", t_plain, ""))
        for ps, offset in ((64, 0), (16, 0), (256, 0), (64, 8)):
            cache, co = paged_cache(ps, offset)
            t_paged = time_ms(lambda i: mla_cupy.mla_prefill(q, k, v, cache, vl, vl, cache_offsets=co, out=out, q_max_seq_len=s,
                                                            validate=False, kernel=kernel), 1)
            rows.append((f"1x8192 H=128 paged rope, page {ps}, cache offset {offset} [{kernel}]", t_paged,
                         f"paged/plain = {t_paged / t_plain:.3f}"))
            del cache
    del q, k, v, latent, out
    cp.get_default_memory_pool().free_all_blocks()

    # --- merge cost vs the attention of one 8k-key chunk (1024 queries, H = 128) ---
    sq, sk = 1024, 8192
    q, k, v, kr = rand(rng, sq, h, 192), rand(rng, sk, h, 128), rand(rng, sk, h, 128), rand(rng, sk, 1, 64)
    vlq = cp.asarray(np.array([0, sq], np.uint32))
    cro = cp.asarray(np.array([0, sk], np.uint32))
    part = cp.empty((sq, h, 128), cp.float32)
    part_lse = cp.empty((sq, h), cp.float32)
    t_attn = time_ms(lambda i: mla_cupy.mla_prefill(q, k, v, kr, vlq, cro, mask=NullMask(), out=part, lse=part_lse,
                                                   q_max_seq_len=sq, validate=False), 1)
    t_fused = time_ms(lambda i: mla_cupy.mla_prefill(q, k, v, kr, vlq, cro, mask=NullMask(), out=part, lse=part_lse,
                                                    q_max_seq_len=sq, validate=False, accumulate=True), 1)
    oa, la = mla_cupy.mla_prefill(q, k, v, kr, vlq, cro, mask=NullMask(), out_dtype=np.float32, return_lse=True)
    ob, lb = oa.copy(), la.copy()
    t_merge = time_ms(lambda i: mla_cupy.merge_states(oa, la, ob, lb, out=oa, lse_out=la), 1)
    rows.append(("attention of one 8k-key chunk, 1024 queries, H=128 (fp32 out + lse)", t_attn, ""))
    rows.append(("merge_states of its [1024, 128, 128] fp32 result", t_merge, f"merge/attention = {t_merge / t_attn:.3%}"))
    rows.append(("the same attention merging into out/lse in its epilogue (accumulate=True)", t_fused,
                 f"merge cost = {(t_fused - t_attn) / t_attn:.3%}"))
    t_one = time_ms(lambda i: mla_cupy.mla_prefill(q, k, v, kr, vlq, cro, q_max_seq_len=sq, validate=False), 1)
    t_ch = time_ms(lambda i: mla_cupy.mla_prefill_chunked(q, k, v, kr, vlq, cro, chunk_size=2048), 1)
    rows.append(("1024 queries after 7168 keys of context, one shot (causal)", t_one, ""))
    rows.append(("the same, mla_prefill_chunked(chunk_size=2048)", t_ch, f"chunked/one-shot = {t_ch / t_one:.2f}"))
    w = max(len(r[0]) for r in rows)
    print(f"| {'what'.ljust(w)} | ms | ratio |\n|{'-' * (w + 2)}|----|-------|")
    for name, ms, note in rows:
        print(f"| {name.ljust(w)} | {ms:.3f} | {note} |")


if __name__ == "__main__":
    main()

"""Random ragged MLA problems on the host, shared by the CPU and GPU tests."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Sequence

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
FP16 = np.dtype(np.float16)


@dataclass
class Case:
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    k_rope: np.ndarray
    valid_length: np.ndarray
    cache_row_offsets: np.ndarray
    cache_offsets: Optional[np.ndarray] = None
    q_start_pos: Optional[np.ndarray] = None


def make_case(sq: Sequence[int], sk: Sequence[int], heads: int, dtype=BF16, seed: int = 0,
              cache_offsets: Optional[Sequence[int]] = None, q_start_pos: Optional[Sequence[int]] = None,
              offset_dtype=np.uint32, extra_keys: int = 0) -> Case:
    """Fresh normal(0, 1) inputs (never zeros). ``extra_keys`` appends unused key rows, so the
    last cache_row_offset ends before Tk."""
    rng = np.random.default_rng(seed)
    tq, tk = int(sum(sq)), int(sum(sk)) + extra_keys
    q = rng.standard_normal((tq, heads, 192)).astype(dtype)
    k = rng.standard_normal((tk, heads, 128)).astype(dtype)
    v = rng.standard_normal((tk, heads, 128)).astype(dtype)
    k_rope = rng.standard_normal((tk, 1, 64)).astype(dtype)
    vl = np.concatenate([[0], np.cumsum(sq)]).astype(offset_dtype)
    cro = np.concatenate([[0], np.cumsum(sk)]).astype(offset_dtype)
    co = None if cache_offsets is None else np.asarray(cache_offsets, np.uint32)
    q_start = None if q_start_pos is None else np.asarray(q_start_pos, np.int64)
    return Case(q, k, v, k_rope, vl, cro, co, q_start)


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (den if den > 0 else 1.0))


def per_slice_errors(out, ref, valid_length) -> List[float]:
    """SPEC accuracy: relative Frobenius error over each (sequence, head) slice."""
    vl = np.asarray(valid_length, np.int64)
    errs = []
    for b in range(len(vl) - 1):
        for h in range(ref.shape[1]):
            r = ref[vl[b]:vl[b + 1], h]
            if r.size and np.linalg.norm(r) > 0:
                errs.append(rel_err(out[vl[b]:vl[b + 1], h], r))
    return errs


def build_paged(case, page_size, seed=0, shuffle=True, spare_blocks=3, dc=576, rope_offset=512):
    """A paged cache holding the case's rope rows at their absolute positions, pages shuffled.
    Latent columns get random data (never read)."""
    rng = np.random.default_rng(seed)
    cro = case.cache_row_offsets.astype(np.int64)
    sk = np.diff(cro)
    b_ = len(sk)
    co = np.zeros(b_, np.int64) if case.cache_offsets is None else case.cache_offsets.astype(np.int64)
    pages = [int((co[b] + sk[b] + page_size - 1) // page_size) for b in range(b_)]
    nblocks = sum(pages) + spare_blocks
    order = rng.permutation(nblocks) if shuffle else np.arange(nblocks)
    blocks = rng.standard_normal((nblocks, page_size, 1, dc)).astype(case.k_rope.dtype)
    lut = np.full((b_, max(pages + [1])), nblocks + 100, np.int32)  # unused entries out of range on purpose
    used = 0
    for b in range(b_):
        for p in range(pages[b]):
            lut[b, p] = order[used]
            used += 1
        for j in range(sk[b]):
            t = co[b] + j
            blocks[lut[b, t // page_size], t % page_size, 0, rope_offset:rope_offset + 64] = case.k_rope[cro[b] + j, 0]
    return blocks, lut


def build_paged_fp8_rope(case, page_size, seed=0):
    """An fp8 paged cache of the case's rope (MAX's layout for an e4m3 rope): uint8 blocks with the
    e4m3 bytes at columns 512..575 (random bytes elsewhere) and float32 scales ``[num_blocks,
    page_size, 1, 9]`` holding the rope's scale at column 512 / 64 = 8.

    Returns
    -------
    blocks8, lut, scales, r8, sc
        The cache's arrays, and the plain fp8 rope with its scales
        (:func:`mla_cupy.quant.quantize_rope_blocks` of ``case.k_rope``) that the cache holds.
    """
    from mla_cupy import quant

    r8, sc = quant.quantize_rope_blocks(case.k_rope)
    as_float = dataclasses.replace(case, k_rope=r8.view(np.uint8).astype(np.float32))
    blocks, lut = build_paged(as_float, page_size, seed=seed)
    blocks8 = np.random.default_rng(1).integers(0, 255, blocks.shape).astype(np.uint8)
    blocks8[..., 512:576] = blocks[..., 512:576].astype(np.uint8)
    sc_full = dataclasses.replace(case, k_rope=np.repeat(sc, 64, axis=2).astype(np.float32))
    sblocks, _ = build_paged(sc_full, page_size, seed=seed)
    scales = np.ascontiguousarray(sblocks[..., ::64]).astype(np.float32)
    return blocks8, lut, scales, r8, sc

"""Random ragged MLA problems on the host, shared by the CPU and GPU tests."""
from __future__ import annotations

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
    qs = None if q_start_pos is None else np.asarray(q_start_pos, np.int64)
    return Case(q, k, v, k_rope, vl, cro, co, qs)


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

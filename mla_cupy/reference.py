"""Float64 reference of MLA prefill: the SPEC to the letter, written for clarity, not speed.

It is the oracle of every test and the CLI's fallback without a GPU. It takes NumPy arrays (any
float dtype, ``ml_dtypes.bfloat16`` included) and also CuPy arrays, in which case the same code
runs on the GPU in float64 (useful for large checks).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import numpy as np

from ._arrays import to_host
from .masks import CausalMask, Mask
from .paged import PagedKVCache
from .validation import DR, DV, check_inputs

__all__ = ["mla_prefill", "mla_prefill_fp8", "mla_prefill_fp8_rope", "rope_rows", "visible_pairs"]

#: Scores materialized at once per head group (float64 elements) before the loop splits heads.
_BLOCK_ELEMS = 1 << 25


def _xp(x):
    try:
        import cupy

        return cupy.get_array_module(x)
    except ImportError:
        return np


def rope_rows(k_rope: Union[Any, PagedKVCache], b: int, kv_row0: int, k_pos0: int, sk: int):
    """The rope vectors of sequence ``b``'s ``sk`` keys as float64 ``[sk, Dr]``, and a boolean
    ``[sk]`` that is False for keys whose paged-cache page is unreadable (treated as masked)."""
    if not isinstance(k_rope, PagedKVCache):
        xp = _xp(k_rope)
        return k_rope[kv_row0:kv_row0 + sk, 0, :].astype(np.float64), xp.ones(sk, dtype=bool)
    blocks = k_rope.blocks
    xp = _xp(blocks)
    lut = to_host(k_rope.lookup_table).astype(np.int64)
    t = k_pos0 + np.arange(sk, dtype=np.int64)
    page_idx = t // k_rope.page_size
    ok = page_idx < lut.shape[1]
    ids = np.where(ok, lut[b, np.minimum(page_idx, lut.shape[1] - 1)], 0)
    ok &= (ids >= 0) & (ids < blocks.shape[0])
    ids = np.where(ok, ids, 0)
    ro = k_rope.rope_offset
    rows = blocks[xp.asarray(ids), xp.asarray(t % k_rope.page_size), 0, ro:ro + DR].astype(np.float64)
    ok_x = xp.asarray(ok)
    return xp.where(ok_x[:, None], rows, 0.0), ok_x


def positions(b: int, sq: int, sk: int, cache_offsets, q_start_pos) -> Tuple[np.ndarray, np.ndarray]:
    """Absolute query and key positions of sequence ``b`` (int64), per the SPEC."""
    k_pos0 = 0 if cache_offsets is None else int(cache_offsets[b])
    q_pos0 = k_pos0 + sk - sq if q_start_pos is None else int(q_start_pos[b])
    return q_pos0 + np.arange(sq, dtype=np.int64), k_pos0 + np.arange(sk, dtype=np.int64)


def visible_pairs(valid_length, cache_row_offsets, mask: Optional[Mask] = None, cache_offsets=None, q_start_pos=None) -> int:
    """Number of visible (query, key) pairs of one head: what a FLOP count should use."""
    mask = CausalMask() if mask is None else mask
    vl, cro = to_host(valid_length).astype(np.int64), to_host(cache_row_offsets).astype(np.int64)
    co = None if cache_offsets is None else to_host(cache_offsets).astype(np.int64)
    qs = None if q_start_pos is None else to_host(q_start_pos).astype(np.int64)
    total = 0
    for b in range(len(vl) - 1):
        sq, sk = int(vl[b + 1] - vl[b]), int(cro[b + 1] - cro[b])
        qp, kp = positions(b, sq, sk, co, qs)
        for i0 in range(0, sq, 1024):  # rows in blocks: bounded memory for long sequences
            total += int(mask.visible(qp[i0:i0 + 1024, None], kp[None, :]).sum())
    return total


def mla_prefill(
    q, k, v, k_rope, valid_length, cache_row_offsets, *, scale: Optional[float] = None, mask: Optional[Mask] = None,
    q_max_seq_len: Optional[int] = None, cache_offsets=None, q_start_pos=None, out=None, out_dtype=None,
    return_lse: bool = False, stream=None, validate: bool = True,
):
    """Reference MLA prefill in float64; same signature and semantics as :func:`mla_cupy.mla_prefill`.

    Differences: inputs are NumPy (or CuPy) arrays of any float dtype; the output is float64
    unless ``out_dtype`` or ``out`` say otherwise; ``stream`` and ``q_max_seq_len`` are accepted
    and ignored (``q_max_seq_len`` is still checked when ``validate``).

    Returns
    -------
    out : ``[Tq, H, Dv]``
    lse : ``[Tq, H]`` float64, natural-log log-sum-exp of the scaled scores (only with ``return_lse``)
    """
    p = check_inputs(q, k, v, k_rope, valid_length, cache_row_offsets, scale=scale, mask=mask,
                     q_max_seq_len=q_max_seq_len, cache_offsets=cache_offsets, q_start_pos=q_start_pos, out=out,
                     out_dtype=out_dtype, validate=validate, device=False, read_offsets=True)
    xp = _xp(q)
    vl, cro = to_host(valid_length).astype(np.int64), to_host(cache_row_offsets).astype(np.int64)
    co = None if cache_offsets is None else to_host(cache_offsets).astype(np.int64)
    qs = None if q_start_pos is None else to_host(q_start_pos).astype(np.int64)
    H = p.heads
    o64 = xp.zeros((p.tq, H, DV), dtype=np.float64)
    lse = xp.full((p.tq, H), -np.inf, dtype=np.float64)
    for b in range(p.batch):
        q0, sq = int(vl[b]), int(vl[b + 1] - vl[b])
        kv0, sk = int(cro[b]), int(cro[b + 1] - cro[b])
        if sq == 0 or sk == 0:
            continue
        qp, kp = positions(b, sq, sk, co, qs)
        rope, readable = rope_rows(k_rope, b, kv0, int(kp[0]), sk)
        vis = xp.asarray(p.mask.visible(qp[:, None], kp[None, :])) & readable[None, :]
        qb = q[q0:q0 + sq].astype(np.float64)
        kb = k[kv0:kv0 + sk].astype(np.float64)
        vb = v[kv0:kv0 + sk].astype(np.float64)
        kt = kb.transpose(1, 2, 0)                      # [H, Dv, Sk]
        vt = vb.transpose(1, 0, 2)                      # [H, Sk, Dv]
        hstep = max(1, _BLOCK_ELEMS // max(1, sq * sk))
        qstep = max(1, _BLOCK_ELEMS // max(1, sk * min(H, hstep)))
        for h0 in range(0, H, hstep):
            hs = slice(h0, min(H, h0 + hstep))
            for i0 in range(0, sq, qstep):
                rs = slice(i0, min(sq, i0 + qstep))
                qh = qb[rs, hs].transpose(1, 0, 2)      # [h, rows, Dqk]
                s = xp.matmul(qh[..., :DV], kt[hs])     # per-head part
                s += xp.matmul(qh[..., DV:], rope.T)    # the rope part, shared by all heads
                s = xp.where(vis[None, rs], s * p.scale, -np.inf)
                m = s.max(axis=-1)
                m_safe = xp.where(xp.isfinite(m), m, 0.0)
                e = xp.exp(s - m_safe[..., None])
                l = e.sum(axis=-1)
                o = xp.matmul(e, vt[hs])                # [h, rows, Dv]
                l_ = l[..., None]
                o = xp.where(l_ > 0, o / xp.where(l_ > 0, l_, 1.0), 0.0)
                o64[q0 + rs.start:q0 + rs.stop, hs] = o.transpose(1, 0, 2)
                lse[q0 + rs.start:q0 + rs.stop, hs] = xp.where(l > 0, m_safe + xp.log(xp.where(l > 0, l, 1.0)), -np.inf).T
    result = o64.astype(p.out_dtype) if p.out_dtype != np.float64 else o64
    if out is not None:
        out[...] = result
        result = out
    return (result, lse) if return_lse else result


def _fp8_host(x, name: str) -> np.ndarray:
    """fp8 data as float64: ml_dtypes.float8_e4m3fn arrays, or their uint8 bytes."""
    from ._arrays import FP8_E4M3

    x = to_host(x)
    if x.dtype == np.uint8:
        x = x.view(FP8_E4M3)
    if x.dtype != FP8_E4M3:
        raise TypeError(f"{name}: expected float8_e4m3fn data (or its uint8 bytes), got {x.dtype.name}")
    return x.astype(np.float64)


def _rope_host(x, name: str) -> np.ndarray:
    """A rope part as float64: 16-bit or wider values as they are; e4m3 data (or its uint8 bytes)
    decoded, never read as integers."""
    from ._arrays import FP8_E4M3

    h = to_host(x)
    if h.dtype == np.uint8 or (FP8_E4M3 is not None and h.dtype == FP8_E4M3):
        return _fp8_host(h, name)
    return h.astype(np.float64)


def _scales_host(x, name: str, shape) -> np.ndarray:
    if x is None:
        raise ValueError(f"{name}: fp8 data needs its float32 scales")
    x = to_host(x)
    if x.dtype != np.float32 or tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected float32 of shape {list(shape)}, got {x.dtype.name} {list(x.shape)}")
    return x.astype(np.float64)


def mla_prefill_fp8(q_nope, q_rope, q_scale, k, k_scales, v, k_rope, valid_length, cache_row_offsets, **kw):
    """Reference of the fp8 per-token variant (SPEC "Data types"): the true query is
    ``q_scale[i] * concat(q_nope, q_rope)``, the true key ``k_scales[j] * concat(k, rope_j)``, V is
    used as stored; then :func:`mla_prefill` in float64. ``q_nope``, ``k``, ``v``: e4m3 (or uint8
    bytes); scales float32 ``[T, 1]``. ``q_rope``, ``k_rope``: 16-bit or wider (MAX's semantics), or
    e4m3 / uint8 bytes too (all of Q K^T in e4m3: the same per-token scales then cover all 192
    values). Plain k_rope only."""
    qn, kn, vv = _fp8_host(q_nope, "q_nope"), _fp8_host(k, "k"), _fp8_host(v, "v")
    qs = _scales_host(q_scale, "q_scale", (qn.shape[0], 1))
    ks = _scales_host(k_scales, "k_scales", (kn.shape[0], 1))
    qt = qs[:, :, None] * np.concatenate([qn, _rope_host(q_rope, "q_rope")], axis=-1)
    rope = ks[:, :, None] * _rope_host(k_rope, "k_rope")
    return mla_prefill(qt, ks[:, :, None] * kn, vv, rope, valid_length, cache_row_offsets, **kw)


def mla_prefill_fp8_rope(q, k, v, k_rope, k_rope_scales, valid_length, cache_row_offsets, **kw):
    """Reference of the fp8-rope variant: ``k_rope`` e4m3 (or uint8 bytes) ``[Tk, 1, 64]`` with
    float32 ``k_rope_scales[Tk, 1, 1]`` (one per 64 values), dequantized, then :func:`mla_prefill`."""
    from .quant import dequantize_rope_blocks

    r = _fp8_host(k_rope, "k_rope")
    sc = _scales_host(k_rope_scales, "k_rope_scales", (r.shape[0], 1, r.shape[-1] // 64))
    return mla_prefill(q, k, v, dequantize_rope_blocks(r, sc.astype(np.float32)), valid_length, cache_row_offsets, **kw)

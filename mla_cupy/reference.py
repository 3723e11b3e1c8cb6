"""Float64 reference of MLA prefill: docs/contract.md to the letter, NaN and Inf included.

It is the oracle of every test and what runs without a GPU. It takes NumPy arrays (any float
dtype for the 16-bit variant, ``ml_dtypes.bfloat16`` included) and also CuPy arrays, in which
case the same code runs on the GPU in float64 (useful for large checks). The arguments are those
of the kernels' API (:func:`mla_cupy.mla_prefill`, :func:`mla_cupy.mla_prefill_fp8`,
:func:`mla_cupy.merge_states`, :func:`mla_cupy.mla_prefill_chunked`), checked by the same functions
with the same messages.

How the computation runs: each sequence's keys in blocks of :data:`KEY_BLOCK` with an online
softmax in float64, a few heads and query rows at a time, so the working memory stays bounded
(:data:`WORK_BYTES` beside the inputs and the result) whatever the number of keys; keys that no
query of a step sees are skipped. Only IEEE arithmetic decides where NaN and Inf go, never a BLAS shortcut:
rows and columns with a non-finite value are multiplied out element by element.

Non-finite inputs (the contract's rule, which the kernels follow):

* a score is masked by replacing it with ``-inf``, so a NaN in ``q`` row i reaches row i only (of
  that head), and a NaN in a key's ``k`` (one head) or rope (every head) reaches exactly the rows
  that see that key;
* ``P V`` runs over every key of a query block's span, as the Hopper kernel of the call's variant
  cuts the work (:func:`~mla_cupy._registry.sm90_schedule`, held to the kernel's exported geometry
  by a CPU test): a NaN (or Inf) in key j's ``v`` reaches every row of each 128-row block of the
  sequence whose visible key span holds key j (``0 * NaN``), rows that see no key included; the
  fp8 variants (per token, all-e4m3) start the span on a multiple of 16 keys, and under the causal
  mask and no mask their blocks are 192 rows counted from each sequence's end, a 64-row third of
  such a block stopping (causal) at the key tile that holds its last row's last visible key. In the
  16-bit variants under a mask bounded above, a 64-row half of a block whose last row would see no
  key position past the middle of the span's last 128-key tile ends its span there.
  This is the upper bound of the contract's reach, which the Hopper kernel meets exactly; the
  portable kernel reaches the rows that see the key and part of the rest;
* a row whose visible scores are all ``-inf`` (or that sees no key) gives 0 and lse ``-inf``; a row
  with a NaN score gives NaN, and its lse is NaN.

The backward, :func:`mla_prefill_backward`: the gradients of the 16-bit forward's result with
respect to q, k, v and k_rope, from ``dout`` and the forward's ``out`` and ``lse`` as given, in
float64 over key blocks of :data:`BACKWARD_KEY_BLOCK`, a group of heads at a time; a pair that the
mask removes takes part in no product, so NaN and Inf reach exactly the gradients that
docs/contract.md ("The backward") lists.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple, Union

import numpy as np

from ._arrays import FP8_E4M3, to_host
from ._progress import Progress
from ._registry import VARIANT_16, Schedule, sm90_schedule
from .dims import DQK, DR, DV
from .fp8 import fp8_bytes
from .masks import CausalMask, Mask
from .paged import PagedKVCache
from .validation import Problem, check_backward_inputs, check_inputs, check_merge_inputs, check_merge_outputs

__all__ = ["mla_prefill", "mla_prefill_fp8", "mla_prefill_fp8_rope", "mla_prefill_chunked", "merge_states",
           "mla_prefill_backward", "rope_rows", "positions", "visible_pairs", "KEY_BLOCK", "BACKWARD_KEY_BLOCK",
           "WORK_BYTES"]

#: Keys per step of the online softmax.
KEY_BLOCK = 2048
#: Scores (query rows x heads x keys) computed in one step.
_STEP_ELEMS = 1 << 21
#: Elements of the running output kept for the rows and heads in flight.
_STATE_ELEMS = 1 << 21
#: Bytes of working memory a call needs beside its inputs and its result: 65-115 MiB measured with
#: tracemalloc from 2k to 16k keys and 1 to 128 heads (tests/test_reference.py::test_working_memory_is_bounded).
WORK_BYTES = 160 << 20
#: Estimated seconds per (query row, head, key) pair of float64 work (about 35-40 ns on one busy
#: core); a call whose estimate passes _PROGRESS_AFTER_S reports its progress.
_SECONDS_PER_PAIR = 40e-9
_PROGRESS_AFTER_S = 5.0


def _xp(x):
    """The array module of ``x``: NumPy for host arrays, CuPy for CuPy arrays."""
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy.get_array_module(x)


# ---------------------------------------------------------------------------------------------
# positions, visible keys and the key span of each query block


def positions(b: int, sq: int, sk: int, cache_offsets, q_start_pos) -> Tuple[np.ndarray, np.ndarray]:
    """Absolute query and key positions of sequence ``b`` (int64), per the contract."""
    k_pos0 = 0 if cache_offsets is None else int(cache_offsets[b])
    q_pos0 = k_pos0 + sk - sq if q_start_pos is None else int(q_start_pos[b])
    return q_pos0 + np.arange(sq, dtype=np.int64), k_pos0 + np.arange(sk, dtype=np.int64)


def _clamped_range(mask: Mask, q_lo, q_hi, k_pos0: int, sk: int) -> Tuple[np.ndarray, np.ndarray]:
    """``mask.key_range(q_lo, q_hi)`` as key indices of the sequence, clamped to ``[0, Sk]`` with
    ``hi >= lo`` (``visible_key_span`` of kernels/tile_scheduler.cuh)."""
    k_lo, k_hi = mask.key_range(q_lo, q_hi)
    lo = np.clip(np.asarray(k_lo, np.int64) - k_pos0, 0, sk)
    return lo, np.clip(np.asarray(k_hi, np.int64) - k_pos0, lo, sk)


def _row_blocks(sq: int, qb: int, end_aligned: bool) -> np.ndarray:
    """First rows of a sequence's ``qb``-row query blocks, ascending: from its start, or
    (``end_aligned``) from its end, the first block then starting before row 0 (a sequence of one
    block keeps its rows at the block's start)."""
    nb = -(-sq // qb)
    if not end_aligned or sq <= qb:
        return np.arange(nb, dtype=np.int64) * qb
    return sq - (np.arange(nb, dtype=np.int64)[::-1] + 1) * qb


def _pv_spans(mask: Mask, q_pos: np.ndarray, k_pos0: int, sk: int, sched: Schedule) -> Tuple[np.ndarray, np.ndarray]:
    """``[begin, end)`` key indices over which each query row of a sequence takes part in ``P V``
    (int64 arrays, one entry per row), as the Hopper kernel cuts the work (``sched``: its
    :class:`~mla_cupy._registry.Schedule` for the call's variant and mask). A row's query block of
    ``block_m`` rows computes the span of keys its rows may see, its start rounded down to
    ``key_align`` keys, in ``block_n``-key tiles; each ``q_rows``-row group of the block (a consumer
    warpgroup's rows) runs ``P V`` over the whole span, or over less:

    * ``half_tiles``: over the last tile's first half only when the group's last row sees no key
      position at or past that tile's middle;
    * ``skip_tail``: up to the tile that holds its last row's last visible key (at least one tile).

    (A query's last visible key never decreases, so no row of the group sees past its last row.)"""
    sq = len(q_pos)
    begin, end = np.zeros(sq, np.int64), np.zeros(sq, np.int64)
    tile = sched.block_n
    for m0 in _row_blocks(sq, sched.block_m, sched.end_aligned):
        first, last = max(int(m0), 0), min(int(m0) + sched.block_m, sq) - 1
        lo, hi = (int(x) for x in _clamped_range(mask, q_pos[first], q_pos[last], k_pos0, sk))
        lo -= lo % sched.key_align
        tiles = -(-(hi - lo) // tile)
        for g0 in range(int(m0), int(m0) + sched.block_m, sched.q_rows):
            r0, r1 = max(g0, 0), min(g0 + sched.q_rows, sq)
            if r0 >= r1:
                continue
            e = hi
            if tiles > 0 and (sched.half_tiles or sched.skip_tail):
                _, k_hi = mask.key_range(q_pos[r1 - 1], q_pos[r1 - 1])  # positions, whether keys sit there or not
                seen = int(k_hi) - (k_pos0 + lo)  # one past the group's last visible key, from the span's start
                if sched.half_tiles and seen <= (tiles - 1) * tile + tile // 2:
                    e = min(hi, lo + (tiles - 1) * tile + tile // 2)
                elif sched.skip_tail and seen < tiles * tile:
                    e = min(hi, lo + max(1, -(-seen // tile)) * tile)
            begin[r0:r1], end[r0:r1] = lo, e
    return begin, end


def visible_pairs(valid_length, cache_row_offsets, mask: Optional[Mask] = None, cache_offsets=None, q_start_pos=None) -> int:
    """Number of visible (query, key) pairs of one head: what a FLOP count should use."""
    mask = CausalMask() if mask is None else mask
    vl, cro = to_host(valid_length).astype(np.int64), to_host(cache_row_offsets).astype(np.int64)
    co = None if cache_offsets is None else to_host(cache_offsets).astype(np.int64)
    q_start = None if q_start_pos is None else to_host(q_start_pos).astype(np.int64)
    total = 0
    for b in range(len(vl) - 1):
        sq, sk = int(vl[b + 1] - vl[b]), int(cro[b + 1] - cro[b])
        qp, kp = positions(b, sq, sk, co, q_start)
        lo, hi = _clamped_range(mask, qp, qp, int(kp[0]) if sk else 0, sk)
        total += int((hi - lo).sum())
    return total


# ---------------------------------------------------------------------------------------------
# the inputs, read in float64 a block at a time


def _e4m3(x) -> np.ndarray:
    """e4m3 data (``ml_dtypes.float8_e4m3fn``, or its uint8 bytes) as float64."""
    x = to_host(x)
    return (x.view(FP8_E4M3) if x.dtype == np.uint8 else x).astype(np.float64)


def rope_rows(k_rope: Union[Any, PagedKVCache], b: int, kv_row0: int, k_pos0: int, sk: int, k_rope_scales=None):
    """The rope vectors of ``sk`` keys of sequence ``b`` (from row ``kv_row0`` of a plain
    ``k_rope``, or from position ``k_pos0`` of a paged cache) as float64 ``[sk, Dr]``, and a
    boolean ``[sk]`` that is False for keys whose paged-cache page is unreadable (a block id
    outside the cache, possible with ``validate=False``: such keys are masked). An fp8 rope
    (uint8 or e4m3 data) is dequantized with ``k_rope_scales`` (plain) or the cache's ``scales``."""
    from .quant import dequantize_rope_blocks

    if not isinstance(k_rope, PagedKVCache):
        rows = k_rope[kv_row0:kv_row0 + sk, 0, :]
        xp = _xp(rows)
        if k_rope_scales is None:
            return rows.astype(np.float64), xp.ones(sk, dtype=bool)
        sc = to_host(k_rope_scales)[kv_row0:kv_row0 + sk]
        return xp.asarray(dequantize_rope_blocks(_e4m3(rows)[:, None, :], sc)[:, 0, :]), xp.ones(sk, dtype=bool)
    blocks = k_rope.blocks
    xp = _xp(blocks)
    lut = to_host(k_rope.lookup_table).astype(np.int64)
    t = k_pos0 + np.arange(sk, dtype=np.int64)
    page_idx = t // k_rope.page_size
    ok = page_idx < lut.shape[1]
    ids = np.where(ok, lut[b, np.minimum(page_idx, lut.shape[1] - 1)], 0)
    ok &= (ids >= 0) & (ids < blocks.shape[0])
    ids = np.where(ok, ids, 0)
    ro, slot = k_rope.rope_offset, t % k_rope.page_size
    if k_rope.scales is None:
        rows = blocks[xp.asarray(ids), xp.asarray(slot), 0, ro:ro + DR].astype(np.float64)
    else:
        raw = _e4m3(to_host(blocks)[ids, slot, 0, ro:ro + DR])
        sc = to_host(k_rope.scales)[ids, slot, 0, ro // DR]
        rows = xp.asarray(dequantize_rope_blocks(raw[:, None, :], sc[:, None, None])[:, 0, :])
    ok_x = xp.asarray(ok)
    return xp.where(ok_x[:, None], rows, 0.0), ok_x


@dataclass
class _Inputs:
    """Where the float64 blocks of one call come from: ``q(r0, r1, hs)`` -> ``[h, rows, 192]``,
    ``k`` / ``v(j0, j1, hs)`` -> ``[h, keys, 128]`` (rows of k / v), ``rope(b, j0, pos0, n)`` ->
    ``([n, 64], readable[n])``."""

    xp: Any
    q: Callable
    k: Callable
    v: Callable
    rope: Callable


def _plain_inputs(q, k, v, k_rope, k_rope_scales) -> _Inputs:
    xp = _xp(q)

    def rows(a):
        return lambda r0, r1, hs: a[r0:r1, hs].astype(np.float64).transpose(1, 0, 2)

    return _Inputs(xp, rows(q), rows(k), rows(v),
                   lambda b, j0, pos0, n: rope_rows(k_rope, b, j0, pos0, n, k_rope_scales))


def _fp8_inputs(q_nope, q_rope, q_scale, k, k_scales, v, k_rope) -> _Inputs:
    """The per-token variant: true query ``q_scale[i] * concat(q_nope, q_rope)``, true key
    ``k_scales[j] * concat(k, rope_j)``, V as stored (e4m3 decoded on the host). The rope parts are
    bfloat16, or e4m3 bytes (the all-e4m3 mode: a plain k_rope, decoded here once)."""
    qn, qr, qsc, kn, ksc, vv = (to_host(x) for x in (q_nope, q_rope, q_scale, k, k_scales, v))
    paged = isinstance(k_rope, PagedKVCache)
    rope = (PagedKVCache(to_host(k_rope.blocks), to_host(k_rope.lookup_table), k_rope.page_size, k_rope.rope_offset)
            if paged else to_host(k_rope))
    if not paged and rope.dtype in (np.uint8, FP8_E4M3):
        rope = _e4m3(rope)
    q_rope_of = _e4m3 if qr.dtype in (np.uint8, FP8_E4M3) else (lambda x: x.astype(np.float64))

    def q_rows(r0, r1, hs):
        full = np.concatenate([_e4m3(qn[r0:r1, hs]), q_rope_of(qr[r0:r1, hs])], axis=-1)
        return (qsc[r0:r1, :, None].astype(np.float64) * full).transpose(1, 0, 2)

    def k_rows(j0, j1, hs):
        return (ksc[j0:j1, :, None].astype(np.float64) * _e4m3(kn[j0:j1, hs])).transpose(1, 0, 2)

    def rope_of(b, j0, pos0, n):
        r, ok = rope_rows(rope, b, j0, pos0, n)
        return ksc[j0:j0 + n].astype(np.float64) * r, ok

    return _Inputs(np, q_rows, k_rows, lambda j0, j1, hs: _e4m3(vv[j0:j1, hs]).transpose(1, 0, 2), rope_of)


# ---------------------------------------------------------------------------------------------
# the arithmetic


def _matmul_ieee(xp, a, b):
    """``a @ b`` (``[G, m, k] @ [G or 1, k, n]``) where every product with a NaN or Inf follows IEEE
    (``0 * NaN = NaN``): the finite parts through BLAS, the rows of ``a`` and the columns of ``b``
    holding a non-finite value recomputed element by element."""
    fa, fb = xp.isfinite(a), xp.isfinite(b)
    rows_ok, cols_ok = fa.all(axis=-1), fb.all(axis=-2)
    if bool(rows_ok.all()) and bool(cols_ok.all()):
        return xp.matmul(a, b)
    c = xp.matmul(xp.where(fa, a, 0.0), xp.where(fb, b, 0.0))
    kk, n, g_count = a.shape[-1], b.shape[-1], a.shape[0]
    g, r = xp.nonzero(~rows_ok)
    per = max(1, _STEP_ELEMS // max(1, kk * n))
    for i in range(0, len(g), per):
        gi, ri = g[i:i + per], r[i:i + per]
        bb = b[gi] if b.shape[0] > 1 else b[:1]
        c[gi, ri] = (a[gi, ri][:, :, None] * bb).sum(axis=1)
    gb, j = xp.nonzero(~cols_ok)
    if b.shape[0] == 1 and len(j):  # a column shared by every group of a
        gb, j = xp.repeat(xp.arange(g_count), len(j)), xp.tile(j, g_count)
    per = max(1, _STEP_ELEMS // max(1, kk * a.shape[1]))
    for i in range(0, len(j), per):
        gi, ji = gb[i:i + per], j[i:i + per]
        col = b[gi if b.shape[0] > 1 else xp.zeros_like(gi), :, ji]  # [p, k]
        c[gi, :, ji] = (a[gi] * col[:, None, :]).sum(axis=-1)
    return c


def _masked(xp, s, vis):
    """Scores ``s[g, rows, keys]`` with the pairs ``vis[rows, keys]`` leaves out set to ``-inf``
    (in place on the host)."""
    if xp is np:
        s[:, ~vis] = -np.inf
        return s
    return xp.where(vis[None], s, -np.inf)


def _nanless_max(xp, s):
    """Row maxima ignoring NaN (CUDA's fmaxf): -inf for rows of -inf, NaN only for all-NaN rows."""
    if xp is np:
        return np.fmax.reduce(s, axis=-1)
    return xp.where(xp.isnan(s), -np.inf, s).max(axis=-1)


class _Softmax:
    """Online softmax state of ``rows`` query rows of ``g`` heads, as the kernels keep it: the
    running maximum ignores NaN; a row with nothing visible yet uses 0 as its reference."""

    def __init__(self, xp, g: int, rows: int):
        self.xp = xp
        self.m = xp.full((g, rows), -np.inf)
        self.l = xp.zeros((g, rows))
        self.acc = xp.zeros((g, rows, DV))

    def update(self, rs: slice, s, v_finite):
        """Fold the masked, scaled scores ``s[g, rows, keys]`` of rows ``rs`` in; returns the
        probabilities (``s``, overwritten)."""
        xp = self.xp
        m_old = self.m[:, rs]
        m_new = xp.fmax(m_old, _nanless_max(xp, s))
        ref = xp.where(m_new == -np.inf, 0.0, m_new)
        corr = xp.exp(m_old - ref)
        s -= ref[..., None]
        p = xp.exp(s, out=s)
        self.l[:, rs] = self.l[:, rs] * corr + p.sum(axis=-1)
        self.acc[:, rs] = self.acc[:, rs] * corr[..., None] + _matmul_ieee(xp, p, v_finite)
        self.m[:, rs] = m_new
        return p

    def finish(self):
        """``(out[g, rows, Dv], lse[g, rows])`` (``out`` is the accumulator, normalized in place):
        ``acc * (1 / l)``, or ``acc * 0`` where ``l`` is 0 or NaN (0, or NaN where P V met a NaN or
        Inf), as the kernels' epilogue; lse ``-inf`` for ``l = 0`` and NaN for ``l = NaN``."""
        xp = self.xp
        pos = self.l > 0
        safe = xp.where(pos, self.l, 1.0)
        self.acc *= xp.where(pos, 1.0 / safe, 0.0)[..., None]
        lse = xp.where(pos, self.m + xp.log(safe), xp.where(xp.isnan(self.l), np.nan, -np.inf))
        return self.acc, lse


def _v_reach(xp, st: _Softmax, p, p_col0: int, v_bad, bad_cols, rows: Tuple[int, int], state_row0: int, spans,
             j0: int) -> None:
    """P V over the non-finite values of ``v`` (``v_bad``: those values, 0 elsewhere) at the keys
    ``j0 + bad_cols`` of a key block, for the sequence rows ``rows``: each row takes the keys of its
    ``P V`` span (``spans``: _pv_spans), its probability times the value (``0 * NaN`` is NaN). ``p``
    holds the rows' probabilities of the block's keys ``p_col0 ...`` (None: the rows saw none of the
    block)."""
    begin, end = (x[rows[0]:rows[1]] for x in spans)
    keys = j0 + bad_cols
    reach = (keys[None, :] >= begin[:, None]) & (keys[None, :] < end[:, None])  # [rows, bad keys]
    g = st.acc.shape[0]
    width = p.shape[-1] if p is not None else 0
    per = max(1, _STEP_ELEMS // (g * DV))  # rows per update
    for i in np.flatnonzero(reach.any(axis=0)):
        col = int(bad_cols[i])
        vals = v_bad[:, col][:, None, :]  # [g, 1, Dv]
        hit = np.flatnonzero(reach[:, i])
        for c0 in range(0, len(hit), per):
            rr = hit[c0:c0 + per]
            pr = (p[:, xp.asarray(rr), col - p_col0] if p_col0 <= col < p_col0 + width
                  else xp.zeros((g, len(rr))))
            st.acc[:, xp.asarray(rr + rows[0] - state_row0)] += pr[..., None] * vals


def merge_states(out_a, lse_a, out_b, lse_b, *, out=None, lse_out=None, stream=None):
    """Float64 :func:`mla_cupy.merge_states` (the contract's formula) on NumPy (or CuPy) arrays.

    ``out = (e^(lse_a - m) out_a + e^(lse_b - m) out_b) / (e^(lse_a - m) + e^(lse_b - m))`` with
    ``m = max(lse_a, lse_b)``, ``lse = m + log(...)``. A side with ``lse = -inf`` contributes nothing
    (even if its output holds NaN); two empty sides give 0 and ``-inf``; a NaN lse gives NaN.

    Parameters
    ----------
    out_a, out_b : ``[T, H, Dv]`` arrays of any float dtype (the same shape)
    lse_a, lse_b : ``[T, H]`` float32 or float64, natural-log lse
    out, lse_out : optional arrays to write the result into (``out=out_a`` folds in place)
    stream : accepted for the kernel's signature; no meaning on the CPU

    Returns
    -------
    (out, lse_out) : float64 unless ``out`` / ``lse_out`` are given
    """
    check_merge_inputs(out_a, lse_a, out_b, lse_b, device=False)
    t, h, dv = (int(n) for n in out_a.shape)
    check_merge_outputs(out, lse_out, (t, h, dv), device=False)
    xp = _xp(out_a)
    o, lse = _merge(xp, *(x.astype(np.float64) for x in (out_a, lse_a, out_b, lse_b)))
    if out is None:
        out = o
    else:
        out[...] = o
    if lse_out is None:
        lse_out = lse
    else:
        lse_out[...] = lse
    return out, lse_out


def _merge(xp, oa, la, ob, lb):
    """The merge of :func:`merge_states` in float64."""
    m = xp.maximum(la, lb)  # NaN propagates
    empty = (la == -np.inf) & (lb == -np.inf)
    ms = xp.where(empty, 0.0, m)
    wa, wb = xp.exp(la - ms), xp.exp(lb - ms)
    tot = wa + wb
    num = (xp.where((la == -np.inf)[..., None], 0.0, wa[..., None] * oa)
           + xp.where((lb == -np.inf)[..., None], 0.0, wb[..., None] * ob))
    out = xp.where(empty[..., None], 0.0, num / xp.where(empty, 1.0, tot)[..., None])
    return out, xp.where(empty, -np.inf, ms + xp.log(xp.where(empty, 1.0, tot)))


# ---------------------------------------------------------------------------------------------
# one call


@dataclass
class _Layout:
    """Per sequence (host int64): query rows, key rows, and the positions of the first query and key."""

    q_row0: np.ndarray
    sq: np.ndarray
    kv_row0: np.ndarray
    sk: np.ndarray
    q_pos0: np.ndarray
    k_pos0: np.ndarray


def _layout(p: Problem, valid_length, cache_row_offsets, cache_offsets, q_start_pos) -> _Layout:
    vl, cro = to_host(valid_length).astype(np.int64), to_host(cache_row_offsets).astype(np.int64)
    sq, sk = np.diff(vl)[:p.batch], np.diff(cro)[:p.batch]
    k_pos0 = np.zeros(p.batch, np.int64) if cache_offsets is None else to_host(cache_offsets).astype(np.int64)
    q_pos0 = k_pos0 + sk - sq if q_start_pos is None else to_host(q_start_pos).astype(np.int64)
    return _Layout(vl[:-1], sq, cro[:-1], sk, q_pos0, k_pos0)


def _work(p: Problem, lay: _Layout, sched: Schedule) -> float:
    """(query row, head, key) pairs the call computes: the work a progress report counts."""
    total = 0
    for b in range(p.batch):
        q_pos = lay.q_pos0[b] + np.arange(lay.sq[b], dtype=np.int64)
        begin, end = _pv_spans(p.mask, q_pos, int(lay.k_pos0[b]), int(lay.sk[b]), sched)
        total += int((end - begin).sum())
    return float(total * p.heads)


def _attend(p: Problem, src: _Inputs, lay: _Layout, res, res_lse, accumulate: bool, sched: Schedule,
            bar: Progress) -> None:
    """The attention of every sequence, written into ``res`` (and ``res_lse``), merged into what
    they hold when ``accumulate``."""
    qb = sched.block_m
    xp, H = src.xp, p.heads
    for b in range(p.batch):
        q0, sq, kv0, sk = int(lay.q_row0[b]), int(lay.sq[b]), int(lay.kv_row0[b]), int(lay.sk[b])
        if sq == 0:
            continue
        k_pos0 = int(lay.k_pos0[b])
        q_pos = lay.q_pos0[b] + np.arange(sq, dtype=np.int64)
        k_pos = k_pos0 + np.arange(sk, dtype=np.int64)
        lo, hi = _clamped_range(p.mask, q_pos, q_pos, k_pos0, sk)
        spans = _pv_spans(p.mask, q_pos, k_pos0, sk, sched)
        kb = max(1, min(KEY_BLOCK, sk))
        hg = max(1, min(H, _STEP_ELEMS // (qb * kb)))
        state_rows = max(qb, _STATE_ELEMS // (hg * DV) // qb * qb)
        step_rows = max(qb, _STEP_ELEMS // (hg * kb) // qb * qb)
        for h0 in range(0, H, hg):
            hs = slice(h0, min(H, h0 + hg))
            g = hs.stop - hs.start
            for s0 in range(0, sq, state_rows):
                s1 = min(sq, s0 + state_rows)
                b_begin, b_end = spans[0][s0:s1], spans[1][s0:s1]
                live = b_end > b_begin
                k_begin, k_end = (int(b_begin[live].min()), int(b_end[live].max())) if live.any() else (0, 0)
                st = _Softmax(xp, g, s1 - s0)
                for j0 in range(k_begin, k_end, kb):
                    j1 = min(k_end, j0 + kb)
                    rope, readable = src.rope(b, kv0 + j0, k_pos0 + j0, j1 - j0)
                    keys = xp.concatenate([src.k(kv0 + j0, kv0 + j1, hs), xp.broadcast_to(rope[None], (g, j1 - j0, DR))],
                                          axis=-1).transpose(0, 2, 1)  # [g, Dqk, keys]: concat(k, rope) per head
                    vv = src.v(kv0 + j0, kv0 + j1, hs)                    # [g, keys, Dv]
                    v_ok = xp.isfinite(vv)
                    bad_cols = np.flatnonzero(to_host(~v_ok.all(axis=(0, 2))) if xp is not np else ~v_ok.all(axis=(0, 2)))
                    v_fin = vv if not len(bad_cols) else xp.where(v_ok, vv, 0.0)
                    v_bad = None if not len(bad_cols) else xp.where(v_ok, 0.0, vv)
                    for r0 in range(s0, s1, step_rows):
                        r1 = min(s1, r0 + step_rows)
                        live = hi[r0:r1] > lo[r0:r1]  # the keys these rows see: [c0, c1) of this block
                        c0 = max(j0, int(lo[r0:r1][live].min())) if live.any() else j1
                        c1 = min(j1, int(hi[r0:r1][live].max())) if live.any() else j0
                        p_step = None
                        if c1 > c0:
                            vis = xp.asarray(p.mask.visible(q_pos[r0:r1, None], k_pos[None, c0:c1]))
                            vis &= readable[None, c0 - j0:c1 - j0]
                            s = _matmul_ieee(xp, src.q(q0 + r0, q0 + r1, hs), keys[..., c0 - j0:c1 - j0])
                            s *= p.scale
                            if not bool(vis.all()):  # replaced, not multiplied: a masked NaN is gone
                                s = _masked(xp, s, vis)
                            p_step = st.update(slice(r0 - s0, r1 - s0), s, v_fin[:, c0 - j0:c1 - j0])
                        if len(bad_cols):
                            _v_reach(xp, st, p_step, c0 - j0, v_bad, bad_cols, (r0, r1), s0, spans, j0)
                    del keys, vv, v_ok, v_fin, v_bad  # before the next block's arrays exist
                    done = np.clip(np.minimum(b_end, j1) - np.maximum(b_begin, j0), 0, None)
                    bar.update(float(done.sum()) * g)
                o, lse_new = st.finish()
                rows = slice(q0 + s0, q0 + s1)
                if accumulate:
                    o, lse_new = _merge(xp, res[rows, hs].astype(np.float64).transpose(1, 0, 2),
                                        res_lse[rows, hs].astype(np.float64).T, o, lse_new)
                res[rows, hs] = o.transpose(1, 0, 2).astype(res.dtype, copy=False)
                if res_lse is not None:
                    res_lse[rows, hs] = lse_new.T.astype(res_lse.dtype, copy=False)


def _run(p: Problem, src: _Inputs, lay: _Layout, out, lse, return_lse: bool, accumulate: bool,
         progress: Optional[bool], desc: str):
    """The attention of a call, blocked as the Hopper kernel of its variant computes it
    (:func:`~mla_cupy._registry.sm90_schedule`)."""
    sched = sm90_schedule(p.variant, p.mask)
    xp = src.xp
    res = out if out is not None else xp.zeros((p.tq, p.heads, DV), p.out_dtype)
    res_lse = lse if lse is not None else (xp.full((p.tq, p.heads), -np.inf) if return_lse else None)
    work = _work(p, lay, sched)
    show = work * _SECONDS_PER_PAIR > _PROGRESS_AFTER_S if progress is None else bool(progress)
    with np.errstate(invalid="ignore", over="ignore"), Progress(work, desc, show) as bar:
        _attend(p, src, lay, res, res_lse, accumulate, sched, bar)
    return (res, res_lse) if return_lse else res


def _check_progress(progress) -> None:
    if progress is not None and not isinstance(progress, (bool, np.bool_)):
        raise TypeError(f"progress: expected None, True or False, got {progress!r}")


def mla_prefill(
    q, k, v, k_rope: Union[Any, PagedKVCache], valid_length, cache_row_offsets, *, scale: Optional[float] = None,
    mask: Optional[Mask] = None, q_max_seq_len: Optional[int] = None, cache_offsets=None, q_start_pos=None, out=None,
    out_dtype=None, return_lse: bool = False, lse=None, accumulate: bool = False, stream=None, validate: bool = True,
    kernel: str = "auto", k_rope_scales=None, progress: Optional[bool] = None,
):
    """Reference MLA prefill in float64: the arguments and the result of :func:`mla_cupy.mla_prefill`.

    Parameters
    ----------
    q, k, v, k_rope, valid_length, cache_row_offsets
        As in :func:`mla_cupy.mla_prefill`, as NumPy (or CuPy) arrays of any float dtype
        (``ml_dtypes.bfloat16`` included), any strides; ``k_rope`` plain or a :class:`PagedKVCache`.
    scale, mask, cache_offsets, q_start_pos
        As in :func:`mla_cupy.mla_prefill`.
    q_max_seq_len, validate
        Checked as the kernels check them (``validate=True``: offset values, block ids,
        ``q_max_seq_len`` against the longest sequence); no other meaning here. With
        ``validate=False`` a block id outside the cache masks its keys, as on the GPU.
    out, out_dtype
        The result is float64 unless ``out_dtype`` (any float dtype) or ``out`` (written in place
        and returned) say otherwise.
    return_lse, lse
        Also return the natural-log lse ``[Tq, H]`` (float64, or written into ``lse=``, float32 or
        float64). A row that sees no key gets output 0 and lse ``-inf``.
    accumulate
        ``out`` and ``lse`` (float32 or float64) hold a partial result of these queries over other
        keys: this call's result is merged into them as :func:`merge_states` merges.
    k_rope_scales
        With an fp8 ``k_rope`` (uint8 bytes or ``ml_dtypes.float8_e4m3fn``, ``[Tk, 1, 64]``): its
        float32 scales ``[Tk, 1, 1]``; the rope of key j is ``k_rope[j] * k_rope_scales[j]``. A paged
        fp8 cache carries its scales in :class:`PagedKVCache` ``scales``.
    stream, kernel
        Accepted (``kernel`` is checked) so that a call written for the kernels runs here
        unchanged; no meaning on the CPU: one reference stands for every kernel.
    progress : bool, optional
        Report progress on stderr (tqdm's bar when installed). Default: when the call is estimated
        to take more than a few seconds.

    Returns
    -------
    out : ``[Tq, H, 128]``
    lse : ``[Tq, H]``, with ``return_lse=True``

    Notes
    -----
    Working memory: at most :data:`WORK_BYTES` (160 MiB; 65-115 MiB measured) beside the inputs and
    the result, whatever the number of keys (keys in blocks of :data:`KEY_BLOCK`). A causal
    sequence of 8192 queries and keys with 128 heads (4.3e9 visible pairs, 2.8 TFLOP) took 73 s on
    two CPU cores with 116 MiB of working memory, beside 0.9 GiB of bf16 inputs and its result
    (1 GiB in float64; ``out_dtype=numpy.float32``: half). NaN and Inf reach exactly what the
    contract says (the module's docstring).
    """
    _check_progress(progress)
    p = check_inputs(q, k, v, k_rope, valid_length, cache_row_offsets, scale=scale, mask=mask,
                     q_max_seq_len=q_max_seq_len, cache_offsets=cache_offsets, q_start_pos=q_start_pos, out=out,
                     out_dtype=out_dtype, validate=validate, device=False, read_offsets=True,
                     k_rope_scales=k_rope_scales, lse=lse, accumulate=accumulate, kernel=kernel)
    src = _plain_inputs(q, k, v, k_rope, k_rope_scales)
    lay = _layout(p, valid_length, cache_row_offsets, cache_offsets, q_start_pos)
    return _run(p, src, lay, out, lse, return_lse, accumulate, progress, "mla_cupy.reference.mla_prefill")


def mla_prefill_fp8(
    q_nope, q_rope, q_scale, k, k_scales, v, k_rope: Union[Any, PagedKVCache], valid_length, cache_row_offsets, *,
    scale: Optional[float] = None, mask: Optional[Mask] = None, q_max_seq_len: Optional[int] = None,
    cache_offsets=None, q_start_pos=None, out=None, out_dtype=None, return_lse: bool = False, lse=None,
    accumulate: bool = False, stream=None, validate: bool = True, kernel: str = "auto", workspace=None,
    progress: Optional[bool] = None,
):
    """Reference of the fp8 per-token variant: the arguments and checks of
    :func:`mla_cupy.mla_prefill_fp8`, computed in float64 from the dequantized inputs.

    The true query is ``q_scale[i] * concat(q_nope[i], q_rope[i])``, the true key
    ``k_scales[j] * concat(k[j], rope_j)``, V is used as stored.

    Parameters
    ----------
    q_nope, k, v : ``[T, H, 128]`` e4m3 data: ``ml_dtypes.float8_e4m3fn`` arrays or their uint8 bytes
    q_rope : ``[Tq, H, 64]`` bfloat16, or e4m3 data (the all-e4m3 mode)
    q_scale : ``[Tq, 1]`` float32, non-negative (checked with ``validate=True``, as on the GPU)
    k_scales : ``[Tk, 1]`` float32
    k_rope : ``[Tk, 1, 64]`` bfloat16 array or bfloat16 :class:`PagedKVCache`; with an e4m3
        ``q_rope``, ``[Tk, 1, 64]`` e4m3 data (plain only), also under ``k_scales``
    valid_length, cache_row_offsets, and the keywords
        As in :func:`mla_prefill`; ``workspace`` (the GPU's V^T buffer) is accepted and unused.

    Returns
    -------
    out : ``[Tq, H, 128]`` float64 (or ``out_dtype`` / ``out``), and ``lse`` with ``return_lse``.

    Notes
    -----
    The kernel's key spans start on multiples of 16 keys (V^T's layout), so a NaN in the ``v`` of a
    key also reaches query blocks whose visible keys start up to 15 keys after it; the reference
    does the same.
    """
    _check_progress(progress)
    q_nope, k, v = fp8_bytes(q_nope, "q_nope"), fp8_bytes(k, "k"), fp8_bytes(v, "v")
    q_rope, k_rope = fp8_bytes(q_rope, "q_rope"), fp8_bytes(k_rope, "k_rope")
    p = check_inputs(q_nope, k, v, k_rope, valid_length, cache_row_offsets, scale=scale, mask=mask,
                     q_max_seq_len=q_max_seq_len, cache_offsets=cache_offsets, q_start_pos=q_start_pos, out=out,
                     out_dtype=out_dtype, validate=validate, device=False, read_offsets=True,
                     fp8=(q_rope, q_scale, k_scales), lse=lse, accumulate=accumulate, kernel=kernel)
    for x, name in ((out, "out"), (lse, "lse")):
        if x is not None and not isinstance(x, np.ndarray):
            raise TypeError(f"{name}: the fp8 reference computes on the host; expected a NumPy array, got "
                            f"{type(x).__name__}")
    src = _fp8_inputs(q_nope, q_rope, q_scale, k, k_scales, v, k_rope)
    lay = _layout(p, valid_length, cache_row_offsets, cache_offsets, q_start_pos)
    return _run(p, src, lay, out, lse, return_lse, accumulate, progress, "mla_cupy.reference.mla_prefill_fp8")


def mla_prefill_fp8_rope(q, k, v, k_rope, k_rope_scales, valid_length, cache_row_offsets, **kw):
    """Reference of the fp8-rope variant: :func:`mla_prefill` with ``k_rope`` e4m3 ``[Tk, 1, 64]``
    (uint8 bytes or ``ml_dtypes.float8_e4m3fn``) and its float32 ``k_rope_scales[Tk, 1, 1]``."""
    return mla_prefill(q, k, v, k_rope, valid_length, cache_row_offsets, k_rope_scales=k_rope_scales, **kw)


def mla_prefill_chunked(
    q, k, v, k_rope, valid_length, cache_row_offsets, *, chunk_size: int, scale: Optional[float] = None,
    mask: Optional[Mask] = None, cache_offsets=None, q_start_pos=None, out=None, out_dtype=None,
    return_lse: bool = False, stream=None, validate: bool = True, kernel: str = "auto", progress: Optional[bool] = None,
):
    """Float64 :func:`mla_cupy.mla_prefill_chunked`: each sequence's keys in chunks of
    ``chunk_size``, each attended with the true query and key positions and merged into a float64
    accumulator as :func:`merge_states` merges. Equal to :func:`mla_prefill` within float64
    rounding; the arguments are those of :func:`mla_prefill` plus ``chunk_size`` (keys per chunk)."""
    check_chunk_size(chunk_size)
    _check_progress(progress)
    p = check_inputs(q, k, v, k_rope, valid_length, cache_row_offsets, scale=scale, mask=mask, q_max_seq_len=None,
                     cache_offsets=cache_offsets, q_start_pos=q_start_pos, out=out, out_dtype=out_dtype,
                     validate=validate, device=False, read_offsets=True, kernel=kernel)
    src = _plain_inputs(q, k, v, k_rope, None)
    full = _layout(p, valid_length, cache_row_offsets, cache_offsets, q_start_pos)
    acc = src.xp.zeros((p.tq, p.heads, DV))
    acc_lse = src.xp.full((p.tq, p.heads), -np.inf)
    chunks = range(0, max(int(full.sk.max()) if p.batch else 0, 1), chunk_size)
    sched = sm90_schedule(VARIANT_16, p.mask)
    work = _work(p, full, sched)
    show = work * _SECONDS_PER_PAIR > _PROGRESS_AFTER_S if progress is None else bool(progress)
    with np.errstate(invalid="ignore", over="ignore"), Progress(work, "mla_cupy.reference.mla_prefill_chunked", show) as bar:
        for c0 in chunks:
            start = np.minimum(full.sk, c0)
            part = _Layout(full.q_row0, full.sq, full.kv_row0 + start, np.minimum(full.sk, c0 + chunk_size) - start,
                           full.q_pos0, full.k_pos0 + start)
            _attend(p, src, part, acc, acc_lse, True, sched, bar)
    res = acc.astype(p.out_dtype) if out is None else out
    if out is not None:
        out[...] = acc
    return (res, acc_lse) if return_lse else res


def check_chunk_size(chunk_size) -> None:
    """``chunk_size``: a positive int (keys per chunk)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")



# ---------------------------------------------------------------------------------------------
# the backward (training)

#: Keys of one block of the backward: its dk / dv accumulate over every query block that sees it.
BACKWARD_KEY_BLOCK = 1024
#: Query rows of one step of the backward (at most). Blocks of 1024 x 1024 ran about twice as fast
#: as 512 x 512 on two cores (BLAS on larger matrices), the causal mask's wasted half-tiles included.
_BWD_ROWS = 1024
#: Elements of the float64 arrays that one group of heads keeps across its steps: the dq accumulator
#: of its rows (``Sq x 192`` a head) and its key block's keys, values and their accumulators
#: (``832`` a key and head).
_BWD_GROUP_ELEMS = 1 << 22
#: Estimated seconds per (query row, head, visible key) of the backward's float64 work (56-64 ns of
#: CPU time measured on one core, 1024 and 4096 causal queries).
_BWD_SECONDS_PER_PAIR = 60e-9


def _matmul_visible(a, b, vis):
    """``a @ b`` (``[G, m, k] @ [G, k, n]``, host arrays) over the terms ``a[m, k] * b[k, n]`` of the
    visible pairs ``vis[G, m, k]`` only (None: all), ``a`` being 0 at the others: IEEE arithmetic in
    every visible term (``0 * NaN`` is NaN), none in the others, so that a NaN or Inf of ``b``
    reaches through visible pairs only. The finite values go through BLAS; each term with a
    non-finite factor is then added to the sum it belongs to (a non-finite term absorbs a finite
    sum, so the order does not matter)."""
    fa, fb = np.isfinite(a), np.isfinite(b)
    if fa.all() and fb.all():
        return np.matmul(a, b)
    c = np.matmul(np.where(fa, a, 0.0), np.where(fb, b, 0.0))
    m, n = a.shape[1], b.shape[2]
    g, i, t = np.nonzero(~fa)  # a's non-finite values: at visible pairs, times all of b's row
    per = max(1, _STEP_ELEMS // max(1, n))
    for s in range(0, len(g), per):
        gs, ms, ts = g[s:s + per], i[s:s + per], t[s:s + per]
        np.add.at(c, (gs, ms), a[gs, ms, ts][:, None] * b[gs, ts])
    g, t, j = np.nonzero(~fb)  # b's non-finite values, times a's finite values at visible pairs
    per = max(1, _STEP_ELEMS // max(1, m))
    for s in range(0, len(g), per):
        gs, ts, js = g[s:s + per], t[s:s + per], j[s:s + per]
        terms = a[gs, :, ts] * b[gs, ts, js][:, None]  # [p, m]
        keep = fa[gs, :, ts] if vis is None else fa[gs, :, ts] & vis[gs, :, ts]
        terms[~keep] = 0.0
        np.add.at(c, (gs[:, None], np.arange(m)[None, :], js[:, None]), terms)
    return c


def _host_rows(a, r0: int, r1: int, hs: slice) -> np.ndarray:
    """Rows ``r0:r1`` of the heads ``hs`` of a ``[T, H, D]`` host array as float64 ``[h, rows, D]``."""
    return a[r0:r1, hs].astype(np.float64).transpose(1, 0, 2)


def _row_steps(sees: np.ndarray, whole: np.ndarray, rows: int):
    """``(r0, r1)`` steps over the rows from the first to the last that ``sees`` a key block: up to
    ``rows`` rows a step where every row sees the ``whole`` block, a quarter of that where rows
    see part of it (along a mask's edge, where a step computes the pairs of its rows' span: smaller
    steps waste fewer)."""
    idx = np.flatnonzero(sees)
    r, end = int(idx[0]), int(idx[-1]) + 1
    while r < end:
        full = bool(whole[r])
        run = np.flatnonzero(whole[r:end] != full)  # the run of rows like row r
        stop = end if not len(run) else r + int(run[0])
        n = rows if full else max(1, rows // 4)
        for r0 in range(r, stop, n):
            yield r0, min(stop, r0 + n)
        r = stop


def _backward_sequence(p: Problem, lay: _Layout, b: int, arrays, res, bar: Progress) -> None:
    """The gradients of sequence ``b``, written into ``res = (dq, dk, dv, dk_rope)`` (zero where
    nothing reaches). Per group of heads: the keys in blocks of :data:`BACKWARD_KEY_BLOCK`, each
    with the query rows that see it in steps; a pair that the mask removes, or of a row whose lse
    is ``-inf``, takes part in no product (:func:`_matmul_visible`)."""
    dout, q, k, v, k_rope, out, lse, dlse = arrays
    dq, dk, dv, dk_rope = res
    H = p.heads
    q0, sq, kv0, sk = int(lay.q_row0[b]), int(lay.sq[b]), int(lay.kv_row0[b]), int(lay.sk[b])
    if sq == 0 or sk == 0:
        return
    k_pos0 = int(lay.k_pos0[b])
    q_pos = lay.q_pos0[b] + np.arange(sq, dtype=np.int64)
    k_pos = k_pos0 + np.arange(sk, dtype=np.int64)
    lo, hi = _clamped_range(p.mask, q_pos, q_pos, k_pos0, sk)
    kb = min(BACKWARD_KEY_BLOCK, sk)
    hg = max(1, min(H, _STEP_ELEMS // (kb * min(sq, _BWD_ROWS)), _BWD_GROUP_ELEMS // (sq * DQK + kb * (3 * DQK + 2 * DV))))
    rb = max(1, min(_BWD_ROWS, _STEP_ELEMS // (hg * kb)))
    rope_acc = np.zeros((sk, DR))  # dk_rope: the sum over every head
    for h0 in range(0, H, hg):
        hs = slice(h0, min(H, h0 + hg))
        g = hs.stop - hs.start
        lse_g = lse[q0:q0 + sq, hs].astype(np.float64).T  # [g, sq]
        active = lse_g != -np.inf
        dlse_g = None if dlse is None else dlse[q0:q0 + sq, hs].astype(np.float64).T  # [g, sq]
        dq_acc = np.zeros((g, sq, DQK))
        for j0 in range(0, sk, kb):
            j1 = min(sk, j0 + kb)
            sees = (hi > lo) & (lo < j1) & (hi > j0)  # the rows that see a key of the block
            if not sees.any():
                continue
            rope = k_rope[kv0 + j0:kv0 + j1, 0, :].astype(np.float64)
            keys = np.concatenate([_host_rows(k, kv0 + j0, kv0 + j1, hs), np.broadcast_to(rope[None], (g, j1 - j0, DR))],
                                  axis=-1)  # [g, keys, Dqk]: concat(k, rope) per head
            keys_t = np.ascontiguousarray(keys.transpose(0, 2, 1))  # [g, Dqk, keys], as BLAS takes a right operand
            vals_t = np.ascontiguousarray(v[kv0 + j0:kv0 + j1, hs].astype(np.float64).transpose(1, 2, 0))  # [g, Dv, keys]
            dkey_acc, dv_acc = np.zeros((g, j1 - j0, DQK)), np.zeros((g, j1 - j0, DV))
            for r0, r1 in _row_steps(sees, (lo <= j0) & (hi >= j1), rb):
                live = sees[r0:r1]
                if not live.any():
                    continue
                c0, c1 = max(j0, int(lo[r0:r1][live].min())), min(j1, int(hi[r0:r1][live].max()))
                bar.update(float(np.clip(np.minimum(hi[r0:r1], c1) - np.maximum(lo[r0:r1], c0), 0, None).sum()) * g)
                vis = p.mask.visible(q_pos[r0:r1, None], k_pos[None, c0:c1])[None] & active[:, r0:r1, None]
                if not vis.any():
                    continue
                whole = bool(vis.all())
                cols = slice(c0 - j0, c1 - j0)
                qr, do = _host_rows(q, q0 + r0, q0 + r1, hs), _host_rows(dout, q0 + r0, q0 + r1, hs)
                d_row = (do * _host_rows(out, q0 + r0, q0 + r1, hs)).sum(axis=-1)  # D_i = dout_i . out_i
                if dlse_g is not None:  # the loss also reads lse: dS = P (dP - (D - dlse))
                    d_row -= dlse_g[:, r0:r1]
                pr = _matmul_ieee(np, qr, keys_t[..., cols])
                pr *= p.scale
                pr -= lse_g[:, r0:r1, None]
                np.exp(pr, out=pr)  # P = exp(S - lse)
                if not whole:  # replaced, not multiplied: a pair that is not visible holds 0, whatever S was
                    pr[~vis] = 0.0
                ds = _matmul_ieee(np, do, vals_t[..., cols])  # dP = dout . v
                ds -= d_row[..., None]
                ds *= pr  # dS = P (dP - D)
                if not whole:
                    ds[~vis] = 0.0
                vis_t = None if whole else vis.transpose(0, 2, 1)
                dv_acc[:, cols] += _matmul_visible(pr.transpose(0, 2, 1), do, vis_t)
                dq_acc[:, r0:r1] += _matmul_visible(ds, keys[:, cols], None if whole else vis)
                dkey_acc[:, cols] += _matmul_visible(ds.transpose(0, 2, 1), qr, vis_t)
                del pr, ds, vis, vis_t, qr, do, d_row
            dkey_acc *= p.scale
            dk[kv0 + j0:kv0 + j1, hs] = dkey_acc[..., :DV].transpose(1, 0, 2)
            dv[kv0 + j0:kv0 + j1, hs] = dv_acc.transpose(1, 0, 2)
            rope_acc[j0:j1] += dkey_acc[..., DV:].sum(axis=0)
            del keys, keys_t, vals_t, dkey_acc, dv_acc
        dq_acc *= p.scale
        dq[q0:q0 + sq, hs] = dq_acc.transpose(1, 0, 2)
    dk_rope[kv0:kv0 + sk, 0] = rope_acc


def mla_prefill_backward(
    dout, q, k, v, k_rope, out, lse, valid_length, cache_row_offsets, *, scale: Optional[float] = None,
    mask: Optional[Mask] = None, q_max_seq_len: Optional[int] = None, cache_offsets=None, q_start_pos=None, dq=None,
    dk=None, dv=None, dk_rope=None, deterministic: bool = False, stream=None, validate: bool = True,
    kernel: str = "auto", progress: Optional[bool] = None, dlse=None,
):
    """Reference MLA prefill backward in float64: the gradients of :func:`mla_prefill`'s result
    with respect to ``q``, ``k``, ``v`` and ``k_rope``, given the gradient ``dout`` of that result
    and the forward's ``out`` and ``lse`` (used as given, not recomputed).

    Parameters
    ----------
    dout : ``[Tq, H, 128]``
        The gradient of the forward's result (of the loss with respect to ``out``).
    q, k, v, k_rope, valid_length, cache_row_offsets
        The forward's inputs, as in :func:`mla_prefill`: NumPy arrays of any float dtype of 16 bits
        or more (``ml_dtypes.bfloat16`` included), any strides; ``k_rope`` a plain ``[Tk, 1, 64]``
        array. A :class:`PagedKVCache` ``k_rope`` (``ValueError``) and fp8 data (``TypeError``) are
        refused, as the GPU backward refuses them.
    out : ``[Tq, H, 128]``
        The forward's result (q's dtype or float32 from the kernels; any float dtype here).
    lse : ``[Tq, H]`` float32 (or float64)
        The forward's natural-log lse. A row whose lse is ``-inf`` gets zero gradients and
        contributes nothing.
    scale, mask, q_max_seq_len, cache_offsets, q_start_pos, validate
        As in :func:`mla_prefill` (the forward's values).
    dq, dk, dv, dk_rope : optional
        NumPy arrays ``[Tq, H, 192]``, ``[Tk, H, 128]``, ``[Tk, H, 128]``, ``[Tk, 1, 64]`` of any
        float dtype to write the results into (every element is written) and return; the others
        are returned as new float64 arrays.
    deterministic, stream, kernel
        Accepted and checked (``deterministic`` a bool, ``kernel`` a kernel name) so that a call
        written for the GPU runs here unchanged; no meaning on the CPU (the reference is
        deterministic).
    progress : bool, optional
        Report progress on stderr. Default: when the call is estimated to take more than a few
        seconds.
    dlse : ``[Tq, H]`` float32 (or float64), optional
        The gradient of the loss with respect to the forward's ``lse``, when the loss reads it:
        since ``d lse_i / d S_ij = P_ij``, it enters as ``dS = P (dP - D + dlse)``.

    Returns
    -------
    (dq, dk, dv, dk_rope)
        ``dq[Tq, H, 192]`` (the rope part of each query's gradient in its last 64 values),
        ``dk[Tk, H, 128]``, ``dv[Tk, H, 128]`` and ``dk_rope[Tk, 1, 64]``: the gradient of each
        key's shared rope vector, the sum over every head of the last 64 values of that head's key
        gradient. Key rows outside every sequence, and keys no query sees, get 0.

    Notes
    -----
    With ``S_ij = scale * q_i . key_j``, ``P_ij = exp(S_ij - lse_i)``, ``D_i = dout_i . out_i``,
    ``dP_ij = dout_i . v_j`` and ``dS_ij = P_ij (dP_ij - D_i)``, over the visible pairs only:
    ``dv_j = sum_i P_ij dout_i``, ``dq_i = scale sum_j dS_ij key_j``, ``dkey_j = scale sum_i dS_ij
    q_i`` (``dk_j`` its first 128 values). A pair that the mask removes takes part in no product
    (not ``0 * x``), so NaN and Inf reach exactly what docs/contract.md ("The backward") says;
    every visible term is IEEE arithmetic.

    Working memory: keys in blocks of :data:`BACKWARD_KEY_BLOCK`, up to 1024 query rows a step, a
    group of heads at a time (a float64 dq accumulator of the group's rows), at most
    :data:`WORK_BYTES` beside the inputs and the results (tests/test_reference_backward.py). One
    causal sequence of 4096 with 128 heads (1.07e9 visible pairs): 72 MiB measured with tracemalloc,
    beside 0.8 GiB of bf16 inputs (float32 ``out``) and 1.8 GiB of float64 results; with one
    OpenBLAS thread on a shared two-core machine 98 s (60 s of CPU time), where the forward took
    35 s; with two threads there 160 s (132 s of CPU time; OpenBLAS's threads wait on each other
    when other processes hold the cores).
    """
    _check_progress(progress)
    p = check_backward_inputs(dout, q, k, v, k_rope, out, lse, valid_length, cache_row_offsets, scale=scale, mask=mask,
                              q_max_seq_len=q_max_seq_len, cache_offsets=cache_offsets, q_start_pos=q_start_pos,
                              dq=dq, dk=dk, dv=dv, dk_rope=dk_rope, deterministic=deterministic, validate=validate,
                              device=False, read_offsets=True, kernel=kernel, dlse=dlse)
    given = (("dq", dq, (p.tq, p.heads, DQK)), ("dk", dk, (p.tk, p.heads, DV)), ("dv", dv, (p.tk, p.heads, DV)),
             ("dk_rope", dk_rope, (p.tk, 1, DR)))
    for name, x, _ in given:
        if x is not None and not isinstance(x, np.ndarray):
            raise TypeError(f"{name}: the reference computes on the host; expected a NumPy array, got {type(x).__name__}")
    res = []
    for _, x, shape in given:
        if x is None:
            x = np.zeros(shape)
        else:
            x[...] = 0
        res.append(x)
    arrays = [to_host(x) for x in (dout, q, k, v, k_rope, out, lse)] + [None if dlse is None else to_host(dlse)]
    lay = _layout(p, valid_length, cache_row_offsets, cache_offsets, q_start_pos)
    pairs = 0.0
    for b in range(p.batch):
        q_pos = lay.q_pos0[b] + np.arange(lay.sq[b], dtype=np.int64)
        lo, hi = _clamped_range(p.mask, q_pos, q_pos, int(lay.k_pos0[b]), int(lay.sk[b]))
        pairs += float((hi - lo).sum()) * p.heads
    show = pairs * _BWD_SECONDS_PER_PAIR > _PROGRESS_AFTER_S if progress is None else bool(progress)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"), \
            Progress(pairs, "mla_cupy.reference.mla_prefill_backward", show) as bar:
        for b in range(p.batch):
            _backward_sequence(p, lay, b, arrays, res, bar)
    return tuple(res)

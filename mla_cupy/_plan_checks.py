"""The checks of a plan: of its layout when it is built (:func:`check_plan_args`), and of a run's
arrays against it the first time a run sees their layout (:func:`check_run`). Both use the checks
of :mod:`mla_cupy.validation`, in the same three steps (metadata and values, then the device,
then the layout)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import numpy as np

from ._arrays import BF16, FP32, checkable, to_host
from ._checks import OFFSET_DTYPES, U8, check_array, check_layout, check_shape, dtype_of
from ._run_args import BackwardArrays, PrefillArrays, Target
from ._select import check_kernel_name
from .fp8 import TransposedV, check_no_workspace
from .paged import PagedKVCache, check_page_geometry
from .validation import (DEVICE_DTYPES, Problem, check_accumulate, check_backward_arrays, check_backward_layouts,
                         check_backward_rope, check_fp8_arrays, check_fp8_layout, check_grid,
                         check_lse_and_accumulate, check_lse_layout, check_offset_values, check_offsets, check_out,
                         check_out_dtype,
                         check_paged_table, check_positions, check_qkv, check_rope, check_rope_layout,
                         check_same_device, check_scalars, require_devices, rope_arrays, variant_of,
                         with_key_offsets)

__all__ = ["PlanArgs", "RunBounds", "check_plan_args", "check_run", "check_backward_run"]


@dataclass(frozen=True)
class RunBounds:
    """What a plan knows of its layout on the host, for checking runs without reading the device:
    Tq and the keys used (None when the offsets were not read), the page table, key positions and
    key counts (paged plans with ``validate``), the key offsets (None when not read)."""

    kv_total: Optional[int] = None
    table: Optional[np.ndarray] = None
    cache_offsets: Optional[np.ndarray] = None
    kv_sizes: Optional[np.ndarray] = None
    cache_row_offsets: Optional[np.ndarray] = None


@dataclass(frozen=True)
class PlanArgs:
    """A checked plan layout: the problem (Tk = -1; Tq = -1 when unknown), what the host knows of
    it, and the offset arguments as the checks read them (device or host arrays)."""

    problem: Problem
    bounds: RunBounds
    valid_length: Any
    cache_row_offsets: Any
    cache_offsets: Any
    q_start_pos: Any
    page_table: Any


def check_plan_args(valid_length, cache_row_offsets, *, num_heads, dtype, mask, scale, q_max_seq_len, kernel,
                    cache_offsets, q_start_pos, page_table, page_size, rope_offset, fp8, fp8_rope, out_dtype,
                    return_lse, accumulate, validate) -> PlanArgs:
    """Every argument of :func:`mla_cupy.plan`, in argument order; offsets on the host or the device."""
    d_vl, d_cro = checkable(valid_length, "valid_length"), checkable(cache_row_offsets, "cache_row_offsets")
    d_co = None if cache_offsets is None else checkable(cache_offsets, "cache_offsets")
    d_qs = None if q_start_pos is None else checkable(q_start_pos, "q_start_pos")
    d_lut = None if page_table is None else checkable(page_table, "page_table")
    batch = check_offsets(d_vl, d_cro)
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
        raise ValueError(f"num_heads: expected a positive int, got {num_heads!r}")
    dt = _dtype_arg(dtype)
    allowed = (BF16,) if fp8 or fp8_rope else DEVICE_DTYPES
    if dt not in allowed:
        what = " (fp8 plans take bfloat16 for their 16-bit parts)" if fp8 or fp8_rope else ""
        raise TypeError(f"dtype: expected {' or '.join(d.name for d in allowed)}{what}, got {dt.name}")
    scale, mask = check_scalars(scale, mask, q_max_seq_len)
    check_kernel_name(kernel)
    if (fp8 or fp8_rope) and kernel == "sm80":
        raise ValueError("kernel: the fp8 variants run on the Hopper kernel only (kernel='auto' or 'sm90'), got 'sm80'")
    check_positions(d_co, d_qs, batch)
    paged = d_lut is not None
    if fp8 and fp8_rope and paged:
        raise ValueError("page_table: an all-e4m3 plan (fp8=True, fp8_rope=True) reads a plain [Tk, 1, 64] e4m3 rope; "
                         "a paged cache is not supported in this mode (use fp8=True alone for a bfloat16 paged rope)")
    if paged:
        check_array(d_lut, "page_table", 2, OFFSET_DTYPES)
        if d_lut.shape[0] != batch:
            raise ValueError(f"page_table: expected {batch} rows (B), got {d_lut.shape[0]}")
        check_page_geometry(page_size, rope_offset)
    elif page_size is not None:
        raise ValueError("page_size: only a paged plan (page_table=...) has a page size")
    out_dtype = check_out_dtype(None, out_dtype, dt, device=True)
    check_accumulate(accumulate)
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    if accumulate and out_dtype != FP32:
        raise TypeError(f"accumulate: out must be float32 (partial results are merged in float32), got {out_dtype.name}")

    max_sq = None if q_max_seq_len is None else int(q_max_seq_len)
    tq, kv_total, lut_h, co_h, sk_h, cro_h = -1, None, None, None, None, None
    if validate or max_sq is None:
        observed, vl_h, cro_h, co_h = check_offset_values(d_vl, d_cro, d_co, tq=None, tk=None, q_max_seq_len=max_sq,
                                                          validate=validate)
        tq, kv_total, sk_h = int(vl_h[-1]) if batch else 0, int(cro_h[-1]), np.diff(cro_h)
        if paged:
            lut_h = to_host(d_lut).astype(np.int64)
            if validate:
                check_paged_table(lut_h, page_size, None, co_h, sk_h, name="page_table")
        if max_sq is None:
            max_sq = observed
    variant = variant_of(bool(fp8), bool(fp8_rope))
    check_grid(max_sq, batch, num_heads, variant, mask)
    layout = with_key_offsets(Problem(batch, int(num_heads), tq, -1, dt, out_dtype, mask, scale, max_sq, paged,
                                      variant), cro_h)
    bounds = RunBounds(kv_total, lut_h if validate else None, co_h, sk_h, cro_h)
    return PlanArgs(layout, bounds, d_vl, d_cro, d_co, d_qs, d_lut)



def check_run(p: Problem, t: Target, bounds: RunBounds, arrays: PrefillArrays) -> Problem:
    """The arrays of a run (as :func:`~mla_cupy._arrays.checkable` gives them; v of an fp8 run may
    be a :class:`~mla_cupy.fp8.TransposedV` over such data, whose offsets the plan checks) against
    the plan's problem ``p``, in argument order, then on the device. Returns the problem of the run
    (its Tq and Tk, and whether v is V^T)."""
    a = arrays
    if p.fp8:
        tq, heads, tk = check_fp8_arrays(a.q, a.q_rope, a.q_scale, a.k, a.k_scales, a.v)
        dtype = BF16
        qname = "q_nope"
    else:
        tq, heads, tk, dtype = check_qkv(a.q, a.k, a.v, device=True)
        qname = "q"
    if heads != p.heads:
        raise ValueError(f"{qname}: expected H = {p.heads} heads (the plan's num_heads), got shape {list(a.q.shape)}")
    if dtype != p.dtype:
        raise TypeError(f"{qname}: expected dtype {p.dtype.name} (the plan's dtype), got {dtype.name}")
    if p.tq >= 0 and tq != p.tq:
        raise ValueError(f"{qname}: expected Tq = {p.tq} rows (valid_length[-1] of the plan), got shape "
                         f"{list(a.q.shape)}")
    if bounds.kv_total is not None and tk < bounds.kv_total:
        raise ValueError(f"k: expected at least {bounds.kv_total} rows (cache_row_offsets[-1] of the plan), got shape "
                         f"{list(a.k.shape)}")
    if p.fp8 and (dtype_of(a.q_rope) == U8) != p.all_e4m3:
        raise TypeError(f"q_rope: the plan was built for {'e4m3' if p.all_e4m3 else 'bfloat16'} rope parts (fp8_rope="
                        f"{p.fp8_rope}), got dtype {dtype_of(a.q_rope).name}")
    rope = _rope_view(p, t, a.k_rope, a.k_rope_scales)
    if check_rope(rope, a.k_rope_scales, tk, dtype, device=True, fp8=p.fp8, all_e4m3=p.all_e4m3) != p.fp8_rope:
        raise TypeError(f"k_rope: the plan was built for {'an fp8' if p.fp8_rope else 'a 16-bit'} rope (fp8_rope="
                        f"{p.fp8_rope}), got dtype {dtype_of(rope.blocks if p.paged else rope).name}")
    check_out(a.out, p.out_dtype, tq, heads)
    vt = isinstance(a.v, TransposedV)
    if vt:
        check_no_workspace(a.workspace)
    run_p = replace(p, tq=tq, tk=tk, v_transposed=vt)
    check_lse_and_accumulate(run_p, a.out, a.lse, t.accumulate)
    if p.paged and bounds.table is not None:
        check_paged_table(bounds.table, t.page_size, int(rope.blocks.shape[0]), bounds.cache_offsets, bounds.kv_sizes)
    named = [(qname, a.q)]
    named += [("q_rope", a.q_rope), ("q_scale", a.q_scale), ("k", a.k), ("k_scales", a.k_scales)] if p.fp8 else [("k", a.k)]
    named += [("v.data", a.v.data) if vt else ("v", a.v)]
    named += [(n, x) for n, x in rope_arrays(rope, a.k_rope_scales) if n != "k_rope.lookup_table"]
    named += [("out", a.out), ("lse", a.lse), ("workspace", a.workspace)]
    require_devices(named)
    if p.fp8:
        check_fp8_layout(a.q, a.q_rope, a.k, a.k_scales, a.v)
    else:
        for name in ("q", "k", "v"):
            check_layout(getattr(a, name), name)
    check_rope_layout(rope)
    if a.out is not None:
        check_layout(a.out, "out")
    check_lse_layout(a.lse, heads)
    check_same_device([x for _, x in named] + [t.page_table])
    return run_p


def check_backward_run(p: Problem, t: Target, bounds: RunBounds, arrays: BackwardArrays) -> Problem:
    """The arrays of a backward run (as :func:`~mla_cupy._arrays.checkable` gives them) against the
    plan's problem ``p``, with the backward's rules (:func:`mla_cupy.validation.check_backward_inputs`),
    in argument order, then on the device. Refused: the plans the backward does not take (fp8, a
    paged or fp8 rope, ``accumulate``). Returns the problem of the run (its Tq, Tk and largest key
    count, when the plan read its key offsets)."""
    if p.fp8 or p.fp8_rope:
        raise TypeError("run_backward: the backward takes 16-bit inputs; this plan is for fp8 ones")
    if p.paged:
        raise ValueError("run_backward: the backward takes a plain [Tk, 1, 64] rope; this plan is for a paged cache")
    if t.accumulate:
        raise ValueError("run_backward: this plan merges into partial results (accumulate=True); its backward is that "
                         "of each part, from a plan without accumulate")
    a = arrays
    tq, heads, tk, dtype = check_qkv(a.q, a.k, a.v, device=True)
    if heads != p.heads:
        raise ValueError(f"q: expected H = {p.heads} heads (the plan's num_heads), got shape {list(a.q.shape)}")
    if dtype != p.dtype:
        raise TypeError(f"q: expected dtype {p.dtype.name} (the plan's dtype), got {dtype.name}")
    if p.tq >= 0 and tq != p.tq:
        raise ValueError(f"q: expected Tq = {p.tq} rows (valid_length[-1] of the plan), got shape {list(a.q.shape)}")
    if bounds.kv_total is not None and tk < bounds.kv_total:
        raise ValueError(f"k: expected at least {bounds.kv_total} rows (cache_row_offsets[-1] of the plan), got shape "
                         f"{list(a.k.shape)}")
    check_backward_rope(a.k_rope, dtype, True)
    check_shape(a.k_rope, "k_rope", (tk, 1, 64), f"[Tk, 1, Dr] with Tk = {tk} from k")
    named = check_backward_arrays(a.dout, a.out, a.lse, a.dq, a.dk, a.dv, a.dk_rope, a.dlse, tq=tq, heads=heads, tk=tk,
                                  dtype=dtype, device=True)
    forward = [("q", a.q), ("k", a.k), ("v", a.v), ("k_rope", a.k_rope), ("lse", a.lse)]
    require_devices(forward)
    for name in ("q", "k", "v"):
        check_layout(getattr(a, name), name)
    check_rope_layout(a.k_rope)
    check_lse_layout(a.lse, heads)
    check_backward_layouts(named, a.q, heads)
    cro = bounds.cache_row_offsets
    max_sk = int(np.diff(cro).max()) if cro is not None and len(cro) > 1 else (0 if cro is not None else None)
    return replace(p, tq=tq, tk=tk, max_sk=max_sk)


def _rope_view(p: Problem, t: Target, k_rope, scales):
    """A paged plan's blocks as the PagedKVCache the checks read; a plain rope as it is."""
    if not p.paged:
        if isinstance(k_rope, PagedKVCache):
            raise TypeError("k_rope: this plan is for a plain [Tk, 1, 64] rope, got a PagedKVCache")
        return k_rope
    check_array(k_rope, "k_rope.blocks", 4)
    check_shape(k_rope, "k_rope.blocks", (None, t.page_size, 1, None),
                f"[num_blocks, page_size, 1, Dc] with the plan's page_size = {t.page_size}")
    return PagedKVCache(k_rope, t.page_table, t.page_size, t.rope_offset, scales)


def _dtype_arg(dtype) -> np.dtype:
    """A NumPy dtype from a NumPy / ml_dtypes dtype, its name, or a torch dtype."""
    if type(dtype).__module__.startswith("torch"):
        name = str(dtype).replace("torch.", "")
        dtype = BF16 if name == "bfloat16" else name
    try:
        return np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"dtype: expected a dtype (bfloat16 or float16), got {dtype!r}") from exc

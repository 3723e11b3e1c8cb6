"""Exact merging of partial attention results over disjoint key sets, and chunked prefill."""
from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import numpy as np

from . import _registry as reg
from . import reference
from ._arrays import FP32, Array, Stream, as_device, device_pointer, is_device, is_torch, result_wrapper, stream_of
from ._plan_cache import checkable_args, launch_checked
from .dims import DV
from .jit import get_function
from .masks import Mask
from .paged import PagedKVCache
from .prefill_plan import offsets_of
from .reference import check_chunk_size
from .validation import Problem, check_inputs, check_merge_inputs, check_merge_outputs
from .workspace import empty_result

__all__ = ["merge_states", "mla_prefill_chunked"]


def merge_states(out_a: Array, lse_a: Array, out_b: Array, lse_b: Array, *, out: Optional[Array] = None,
                 lse_out: Optional[Array] = None, stream: Stream = None) -> Tuple[Array, Array]:
    """Merge two partial attention results over disjoint key sets.

    ``out = (exp(lse_a - m) out_a + exp(lse_b - m) out_b) / (exp(lse_a - m) + exp(lse_b - m))`` with
    ``m = max(lse_a, lse_b)``, and ``lse = m + log(...)``: exact in float32 arithmetic (keep partial
    outputs in float32 when they will be merged). A side with ``lse = -inf`` (it saw no key)
    contributes nothing, even if its output holds NaN; two empty sides give 0 and ``-inf``.

    NumPy inputs run the float64 merge of :func:`mla_cupy.reference.merge_states` on the host
    (float64 results unless ``out`` / ``lse_out`` are given).

    Parameters
    ----------
    out_a, out_b : ``[T, H, Dv]`` float32, bfloat16 or float16 device arrays (same dtype)
    lse_a, lse_b : ``[T, H]`` float32, natural-log lse (as returned with ``return_lse=True``)
    out : optional ``[T, H, Dv]`` result (float32 or the input dtype); ``out=out_a`` folds in place
    lse_out : optional ``[T, H]`` float32 result; ``lse_out=lse_a`` folds in place

    Returns
    -------
    (out, lse_out)
    """
    if _on_host(out_a):
        return reference.merge_states(out_a, lse_a, out_b, lse_b, out=out, lse_out=lse_out, stream=stream)
    torch_device = out_a.device if is_torch(out_a) else None  # torch in, torch out
    wrap = result_wrapper(out_a)
    a, b = as_device(out_a, "out_a"), as_device(out_b, "out_b")
    la, lb = as_device(lse_a, "lse_a"), as_device(lse_b, "lse_b")
    check_merge_inputs(a, la, b, lb, device=True)
    t, h, dv = (int(n) for n in a.shape)
    s = stream_of(stream, torch_device is not None)
    with s:
        out = None if out is None else as_device(out, "out")
        lse_out = None if lse_out is None else as_device(lse_out, "lse_out")
        check_merge_outputs(out, lse_out, (t, h, dv), device=True)
        if out is None:
            out = empty_result((t, h, dv), a.dtype, torch_device)
        if lse_out is None:
            lse_out = empty_result((t, h), FP32, torch_device, "lse_out")
    if t * h:
        fn = get_function(*reg.merge_family(), reg.merge_name(a.dtype, out.dtype))
        ia, io = np.dtype(a.dtype).itemsize, np.dtype(out.dtype).itemsize
        i64 = np.int64
        args = (device_pointer(a), device_pointer(la), device_pointer(b), device_pointer(lb), device_pointer(out),
                device_pointer(lse_out), i64(t), np.int32(h), np.int32(dv),
                i64(a.strides[0] // ia), i64(a.strides[1] // ia), i64(b.strides[0] // ia), i64(b.strides[1] // ia),
                i64(out.strides[0] // io), i64(out.strides[1] // io), i64(la.strides[0] // 4), i64(lb.strides[0] // 4),
                i64(lse_out.strides[0] // 4))
        rows = fn.max_threads_per_block // 32  # one warp per (token, head) row (the kernel's launch bounds)
        with s:
            fn(((t * h + rows - 1) // rows,), (rows * 32,), args)
    return wrap(out), wrap(lse_out)


def _on_host(x: Any) -> bool:
    """A NumPy array (not a device array dressed as one): the float64 reference runs."""
    return isinstance(x, np.ndarray) and not is_device(x)


def mla_prefill_chunked(
    q: Array, k: Array, v: Array, k_rope: Union[Array, PagedKVCache], valid_length: Array, cache_row_offsets: Array, *,
    chunk_size: int, scale: Optional[float] = None, mask: Optional[Mask] = None, cache_offsets: Optional[Array] = None,
    q_start_pos: Optional[Array] = None, out: Optional[Array] = None, out_dtype: Any = None, return_lse: bool = False,
    stream: Stream = None, validate: bool = True, kernel: str = "auto",
) -> Union[Array, Tuple[Array, Array]]:
    """``mla_prefill`` over each sequence's keys in chunks of ``chunk_size``, merged exactly.

    Chunk ``c`` covers keys ``[c * chunk_size, (c + 1) * chunk_size)`` of every sequence, with the
    TRUE query positions (those of the one-shot call) and key positions; the kernel's epilogue
    merges its result into a float32 accumulator in place (``mla_prefill(..., accumulate=True)``,
    the :func:`merge_states` formula without a separate pass). The result equals the one-shot
    call within float32 rounding. Extra device memory: one float32 ``[Tq, H, 128]`` accumulator
    and its ``[Tq, H]`` lse, whatever the number of keys.

    Takes the same arguments as :func:`mla_prefill`, plus ``chunk_size`` (keys per chunk, >= 1).
    NumPy inputs run :func:`mla_cupy.reference.mla_prefill_chunked` (float64, on the host).
    """
    check_chunk_size(chunk_size)
    if _on_host(q):
        return reference.mla_prefill_chunked(q, k, v, k_rope, valid_length, cache_row_offsets, chunk_size=chunk_size,
                                             scale=scale, mask=mask, cache_offsets=cache_offsets,
                                             q_start_pos=q_start_pos, out=out, out_dtype=out_dtype,
                                             return_lse=return_lse, stream=stream, validate=validate, kernel=kernel)
    import cupy as cp

    torch_device = q.device if is_torch(q) else None  # torch in, torch out
    wrap = result_wrapper(q)
    q, k, v, k_rope, vl, cro, co, q_start, out, _, _, _ = checkable_args(q, k, v, k_rope, valid_length,
                                                                         cache_row_offsets, cache_offsets, q_start_pos, out)
    p = check_inputs(q, k, v, k_rope, vl, cro, scale=scale, mask=mask, q_max_seq_len=None, cache_offsets=co,
                     q_start_pos=q_start, out=out, out_dtype=out_dtype, validate=validate, device=True, read_offsets=True,
                     kernel=kernel, api="mla_prefill_chunked")
    s = stream_of(stream, torch_device is not None)
    with s:
        vl64, cro64 = cp.asarray(vl).astype(cp.int64), cp.asarray(cro).astype(cp.int64)
        sk = cro64[1:] - cro64[:-1]
        sq = vl64[1:] - vl64[:-1]
        k_pos0 = cp.zeros(p.batch, cp.int64) if co is None else cp.asarray(co).astype(cp.int64)
        q_pos0 = (k_pos0 + sk - sq) if q_start is None else cp.asarray(q_start).astype(cp.int64)
        max_sk = int(sk.max().get()) if p.batch else 0
        acc = cp.zeros((p.tq, p.heads, DV), cp.float32)
        acc_lse = cp.full((p.tq, p.heads), -np.inf, cp.float32)
    part_p = _with_f32_output(p)
    for i, c0 in enumerate(range(0, max(max_sk, 1), chunk_size)):
        with s:
            begin = (cro64[:-1] + cp.minimum(sk, c0)).astype(cp.uint32)
            end = (cro64[:-1] + cp.minimum(sk, c0 + chunk_size)).astype(cp.uint32)
            chunk_co = (k_pos0 + cp.minimum(sk, c0)).astype(cp.uint32)
        offsets = offsets_of(vl, device_pointer(begin), device_pointer(end), chunk_co, q_pos0)
        launch_checked(part_p, q, k, v, k_rope, acc, acc_lse, offsets, kernel, i > 0, s.ptr)
    with s:
        if out is None:
            out = empty_result((p.tq, p.heads, DV), p.out_dtype, torch_device)
        out[...] = acc.astype(out.dtype, copy=False)
    return (wrap(out), wrap(acc_lse)) if return_lse else wrap(out)


def _with_f32_output(p: Problem) -> Problem:
    """The same problem with a float32 output (partial results are merged in float32)."""
    from dataclasses import replace

    return replace(p, out_dtype=FP32)

"""The backward of :func:`mla_cupy.mla_prefill`: ``mla_prefill_backward``."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ._arrays import checkable, device_pointer, is_torch, result_wrapper, stream_ptr
from ._backward import BackwardShape, backward_launch
from ._checks import dtype_of
from ._select import choose_kernel, device_id
from .masks import Mask
from .prefill_plan import _q_start_i64
from .validation import check_backward_inputs
from .workspace import empty_result

__all__ = ["mla_prefill_backward"]


def mla_prefill_backward(dout, q, k, v, k_rope, out, lse, valid_length, cache_row_offsets, *,
                         scale: Optional[float] = None, mask: Optional[Mask] = None,
                         q_max_seq_len: Optional[int] = None, cache_offsets=None, q_start_pos=None, dq=None,
                         dk=None, dv=None, dk_rope=None, deterministic: bool = False, stream=None,
                         validate: bool = True, kernel: str = "auto", dlse=None):
    """Gradients of :func:`mla_cupy.mla_prefill` with respect to q, k, v and the shared rope.

    Parameters
    ----------
    dout : ``[Tq, H, 128]``, q's dtype
        The gradient of the loss with respect to the forward's ``out``.
    q, k, v, k_rope, valid_length, cache_row_offsets
        The forward's inputs (``k_rope`` a plain ``[Tk, 1, 64]`` array: a paged cache is refused).
    out, lse
        The forward's results: ``out`` ``[Tq, H, 128]`` (q's dtype or float32) and its natural-log
        ``lse`` ``[Tq, H]`` float32 (``mla_prefill(..., return_lse=True)``).
    scale, mask, q_max_seq_len, cache_offsets, q_start_pos, stream, validate, kernel
        As in :func:`mla_cupy.mla_prefill`.
    dq, dk, dv, dk_rope : device arrays, optional
        Where to write the gradients (``[Tq, H, 192]``, ``[Tk, H, 128]`` twice, ``[Tk, 1, 64]``, q's
        dtype); allocated when not given.
    deterministic : bool
        dq summed over key blocks in a fixed order: the same bits on every run (slower).
    dlse : ``[Tq, H]`` float32 device array, optional
        The gradient of the loss with respect to the forward's ``lse``, when the loss reads it
        (``d lse_i / d S_ij = P_ij``: it enters as ``dS = P (dP - D + dlse)``).

    Returns
    -------
    dq, dk, dv, dk_rope
        ``dk_rope`` is the sum over heads of the rope part of each key's gradient.
    """
    launch, pointers, results, sp = prepare_backward(
        dout, q, k, v, k_rope, out, lse, valid_length, cache_row_offsets, scale=scale, mask=mask,
        q_max_seq_len=q_max_seq_len, cache_offsets=cache_offsets, q_start_pos=q_start_pos, dq=dq, dk=dk, dv=dv,
        dk_rope=dk_rope, deterministic=deterministic, stream=stream, validate=validate, kernel=kernel, dlse=dlse)
    launch.launch(pointers, sp)
    wrap = result_wrapper(q)
    given = (dq, dk, dv, dk_rope)
    return tuple(g if g is not None else wrap(r) for g, r in zip(given, results))




def prepare_backward(dout, q, k, v, k_rope, out, lse, valid_length, cache_row_offsets, *, scale, mask, q_max_seq_len,
                     cache_offsets, q_start_pos, dq, dk, dv, dk_rope, deterministic, stream, validate, kernel,
                     dlse=None):
    """The checked call's launches, its data pointers, its result arrays (device views) and stream."""
    like = q if is_torch(q) else None
    dout_c, q_c, k_c, v_c, rope_c, out_c, lse_c = (checkable(x, n) for x, n in (
        (dout, "dout"), (q, "q"), (k, "k"), (v, "v"), (k_rope, "k_rope"), (out, "out"), (lse, "lse")))
    vl, cro = checkable(valid_length, "valid_length"), checkable(cache_row_offsets, "cache_row_offsets")
    co = None if cache_offsets is None else checkable(cache_offsets, "cache_offsets")
    qs = None if q_start_pos is None else checkable(q_start_pos, "q_start_pos")
    given = [None if x is None else checkable(x, n) for x, n in ((dq, "dq"), (dk, "dk"), (dv, "dv"),
                                                                    (dk_rope, "dk_rope"))]
    dlse_c = None if dlse is None else checkable(dlse, "dlse")
    p = check_backward_inputs(dout_c, q_c, k_c, v_c, rope_c, out_c, lse_c, vl, cro, scale=scale, mask=mask,
                              q_max_seq_len=q_max_seq_len, cache_offsets=co, q_start_pos=qs, dq=given[0], dk=given[1],
                              dv=given[2], dk_rope=given[3], deterministic=deterministic, validate=validate,
                              device=True, read_offsets=True, kernel=kernel, api="mla_prefill_backward",
                              dlse=dlse_c)
    dtype = p.dtype
    max_sk = int(p.max_sk or 0)
    dev = device_id()
    kern = choose_kernel(kernel, False, dev)
    sp = stream_ptr(stream, like is not None)
    results = [g if g is not None else empty_result(shape, dtype, like, name) for g, shape, name in
               zip(given, ((p.tq, p.heads, 192), (p.tk, p.heads, 128), (p.tk, p.heads, 128), (p.tk, 1, 64)),
                   ("dq", "dk", "dv", "dk_rope"))]
    dq_c, dk_c, dv_c, dkr_c = results
    qs64 = _q_start_i64(qs)
    cro_ptr = device_pointer(cro)
    offsets = dict(q_offsets=device_pointer(vl), kv_begin=cro_ptr, kv_end=cro_ptr + 4, kv_end_last=cro_ptr + 4,
                   cache_offsets=0 if co is None else device_pointer(co),
                   q_start=0 if qs64 is None else device_pointer(qs64))
    shape = BackwardShape(p.heads, p.tq, p.tk, p.batch, int(p.max_sq or 0), max_sk, dtype, dtype_of(out_c), p.mask,
                          float(p.scale), kern, bool(deterministic), dev)
    arrays = dict(q=q_c, k=k_c, v=v_c, k_rope=rope_c, dout=dout_c, out=out_c, lse=lse_c, dq=dq_c, dk=dk_c, dv=dv_c,
                  dk_rope=dkr_c)
    if dlse_c is not None:
        arrays["dlse"] = dlse_c
    launch = backward_launch(shape, arrays, offsets)
    # qs64 (an int32 q_start_pos widened) is kept alive by the launch's reference
    launch.keep = (qs64,)
    return launch, {n: device_pointer(a) for n, a in arrays.items()}, results, sp

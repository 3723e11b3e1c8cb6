"""The public one-shot entry points, ``mla_prefill`` and ``mla_prefill_fp8``: check every
argument, pack the launch of the call (:mod:`mla_cupy.prefill_plan`) and launch it, or launch the
record of a call seen before from the plan cache (:mod:`mla_cupy._plan_cache`)."""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple, Union

import numpy as np

from . import _select
from ._arrays import (FP32, checkable, cupy_stream, device_pointer, is_torch, optional_ptr, pointers_and_layouts,
                      result_wrapper, stream_ptr)
from ._plan_cache import CACHE, MAPS_MAX, CallEntry
from ._run_args import KS, LSE, OUT, QR, ROPE, SLOTS, WS, K, Offsets, Q, V
from ._select import choose_kernel, heads_per_section  # noqa: F401  (also reached through this module)
from .dims import DV
from .fp8 import TransposedV, check_no_workspace, fp8_bytes, same_offsets, vt_shape
from .masks import Mask
from .paged import PagedKVCache
from .prefill_plan import _q_start_i64, call_record, offsets_of, workspace_on
from .validation import Problem, check_inputs, check_values, with_key_offsets  # noqa: F401  (check_inputs: also reached through here)
from .workspace import empty_result

__all__ = ["mla_prefill", "mla_prefill_fp8"]


def mla_prefill(
    q, k, v, k_rope: Union[Any, PagedKVCache], valid_length, cache_row_offsets, *,
    scale: Optional[float] = None, mask: Optional[Mask] = None, q_max_seq_len: Optional[int] = None,
    cache_offsets=None, q_start_pos=None, out=None, out_dtype=None, return_lse: bool = False,
    lse=None, accumulate: bool = False, stream=None, validate: bool = True, kernel: str = "auto",
    k_rope_scales=None,
):
    """Multi-head Latent Attention prefill over a ragged batch (MAX's ``flare_mla_prefill``).

    Parameters
    ----------
    q : ``[Tq, H, 192]`` bfloat16 or float16 device array
        Queries of all sequences, packed. The last 64 values of each head are its rope part.
    k, v : ``[Tk, H, 128]``, same dtype
        Per-head ("nope") part of the keys, and the values, packed.
    k_rope : ``[Tk, 1, 64]`` array (any row stride, e.g. ``latent[:, :, 512:576]``) or :class:`PagedKVCache`
        The rotary part of the keys: one vector per key, shared by every head. Read once per key
        tile; the full ``[Tk, H, 192]`` keys are never built.
    valid_length : ``[B + 1]`` int32/uint32 device array
        Row offsets of each sequence in ``q`` (0, ..., Tq). Despite its name, offsets, as in MAX.
    cache_row_offsets : ``[B + 1]`` int32/uint32 device array
        Row offsets of each sequence's keys in ``k``/``v`` (and a plain ``k_rope``); last <= Tk.
    scale : float, optional
        Score scale; default ``1 / sqrt(192)``.
    mask : Mask, optional
        ``CausalMask()`` (default), ``NullMask()``, ``SlidingWindowCausalMask(w)``, ``ChunkedMask(c)``
        or ``ChunkedCausalMask(c)``, on absolute positions.
    q_max_seq_len : int, optional
        Upper bound on any sequence's query count. Sizes the grid without reading offsets back to
        the host; with ``validate=False`` the call then does no device-to-host copy (CUDA-graph
        capturable once its kernel is compiled). A bound below the true maximum leaves rows
        unwritten (checked when ``validate``).
    cache_offsets : ``[B]`` int32/uint32 device array, optional
        Absolute position of each sequence's first key (default 0).
    q_start_pos : ``[B]`` int32/int64 device array, optional
        Absolute position of each sequence's first query. Default ``cache_offsets + Sk - Sq``:
        queries aligned to the end of the keys (bottom-right causal).
    out : ``[Tq, H, 128]`` device array, optional
        Written in place (any 16-byte-aligned strides, last dim contiguous).
    out_dtype : dtype, optional
        ``q.dtype`` (default) or ``numpy.float32``.
    return_lse : bool
        Also return ``lse[Tq, H]`` float32: the NATURAL-log log-sum-exp of the scaled scores
        (``-inf`` for rows that see no key). Base e, not base 2 as in FlashInfer/TRT-LLM.
    lse : ``[Tq, H]`` float32 device array, optional
        Where to write the lse (heads contiguous); implies it is computed.
    accumulate : bool
        ``out`` (float32) and ``lse`` already hold a partial result of these queries over OTHER
        keys (an earlier chunk of the context): this call's result is merged into them in place,
        exactly as :func:`merge_states` would, inside the kernel's epilogue (no extra pass).
    stream : cupy / torch stream or raw ``cudaStream_t`` int, optional
        Default: CuPy's current stream, or torch's current stream for torch inputs.
    validate : bool
        Check offset values and paged block ids on the host (small device-to-host copies, one
        synchronization in all).
    kernel : {"auto", "sm80", "sm90"}
        ``"auto"`` runs the Hopper TMA + wgmma kernel on compute capability 9.0 (plain or paged
        k_rope) and the portable mma.sync kernel elsewhere; the others force one.
    k_rope_scales : ``[Tk, 1, 1]`` float32 device array, optional
        With an fp8 rope (MAX's ``k_rope_scales`` overload): ``k_rope`` holds float8_e4m3fn bytes
        (uint8) and key j's rope is ``k_rope[j] * k_rope_scales[j]``; q, k, v bfloat16, Hopper
        only. A paged fp8 cache carries its scales in :class:`PagedKVCache` ``scales``.

    Returns
    -------
    out : ``[Tq, H, 128]``, same kind of array as ``q`` (CuPy in, CuPy out; torch in, torch out)
    lse : ``[Tq, H]`` float32, only with ``return_lse=True``

    Notes
    -----
    A query row that sees no key gets output 0 and lse ``-inf`` (MAX would return the mean of V).
    Inputs are read in place; nothing is copied except an int32 ``q_start_pos`` (widened).

    Every argument is checked before anything runs, in argument order: shapes, dtypes and values
    first (also for NumPy data, so a CPU caller hears about the real problem), then that the arrays
    are on the device, then their layout. Valid host arrays on a machine without a GPU (or without
    CuPy) raise ``RuntimeError`` naming :func:`mla_cupy.reference.mla_prefill`, which takes these
    same arguments on the CPU. This is a one-shot wrapper of :func:`mla_cupy.plan`: to run many
    layers of one batch layout, build the plan once and call its ``run``.

    A call is kept in the plan cache (:func:`mla_cupy.plan_cache_info`): a later call with the same
    arrays' kinds, shapes, strides, dtypes and devices, the same offset arrays (pointers) and the
    same other arguments skips the checks that these prove and the packing, and launches as
    ``plan.run`` does; the offsets' values are still read per call without ``q_max_seq_len`` and
    checked per call with ``validate``.
    """

    return _one_shot(q, k, v, k_rope, valid_length, cache_row_offsets, scale=scale, mask=mask,
                     q_max_seq_len=q_max_seq_len, cache_offsets=cache_offsets, q_start_pos=q_start_pos, out=out,
                     out_dtype=out_dtype, return_lse=return_lse, lse=lse, accumulate=accumulate, stream=stream,
                     validate=validate, kernel=kernel, k_rope_scales=k_rope_scales)


def mla_prefill_fp8(
    q_nope, q_rope, q_scale, k, k_scales, v, k_rope: Union[Any, PagedKVCache], valid_length, cache_row_offsets, *,
    scale: Optional[float] = None, mask: Optional[Mask] = None, q_max_seq_len: Optional[int] = None,
    cache_offsets=None, q_start_pos=None, out=None, out_dtype=None, return_lse: bool = False,
    lse=None, accumulate: bool = False, stream=None, validate: bool = True, kernel: str = "auto", workspace=None,
):
    """MLA prefill with fp8 per-token inputs (MAX's ``q_nope, q_rope, q_scale, k, k_scales``
    overload), on the Hopper kernel: Q K^T of the nope part and P V on the e4m3 tensor cores.

    Parameters
    ----------
    q_nope : ``[Tq, H, 128]`` float8_e4m3fn as uint8 (a torch float8_e4m3fn tensor is viewed as uint8)
    q_rope : ``[Tq, H, 64]`` bfloat16, or e4m3 bytes (uint8 / torch float8_e4m3fn: the all-e4m3 mode)
    q_scale : ``[Tq, 1]`` float32, non-negative (checked with ``validate=True``)
        The true query is ``q_scale[i] * concat(q_nope[i], q_rope[i])``. The kernel folds
        ``q_scale[i]`` into row i's softmax scale, which needs it non-negative (the quantizers give
        ``amax / 448``, or 1 for an all-zero row).
    k : ``[Tk, H, 128]`` float8_e4m3fn as uint8
        The nope keys.
    v : ``[Tk, H, 128]`` float8_e4m3fn as uint8, or :class:`mla_cupy.fp8.TransposedV`
        The values (used as stored, no scale). Or V^T made ahead for this call's
        ``cache_row_offsets`` (``quant.quantize_per_token(..., cache_row_offsets=cro)["v_t"]``):
        the call then launches the attention kernel alone, no V^T pre-pass (see Notes).
    k_scales : ``[Tk, 1]`` float32, contiguous
        The true key is ``k_scales[j] * concat(k[j], rope_j)``.
    k_rope : ``[Tk, 1, 64]`` bfloat16 array or bfloat16 :class:`PagedKVCache`
        The shared rope, stored divided by ``k_scales`` as MAX's per-token cache holds it. With an
        e4m3 ``q_rope`` (all-e4m3 mode): ``[Tk, 1, 64]`` e4m3 bytes, quantized under ``k_scales``
        (``quant.quantize_per_token(..., e4m3_rope=True)``), and Q K^T is one 192-deep e4m3 GEMM; a
        PagedKVCache is refused in this mode (``ValueError`` naming ``k_rope``).
    valid_length, cache_row_offsets, and the keywords
        As in :func:`mla_prefill` (``scale`` defaults to ``1 / sqrt(192)``; ``kernel`` must be
        ``"auto"`` or ``"sm90"``).
    workspace : uint8 device array, optional
        Where V^T is written: contiguous, at least ``prod(mla_cupy.fp8.vt_shape(H, Tk, B))``
        bytes. Default: a workspace from CuPy's pool for the call. Refused with a TransposedV.

    Returns
    -------
    out : ``[Tq, H, 128]`` bfloat16 (or ``out_dtype`` float32), and ``lse`` with ``return_lse=True``.

    Notes
    -----
    P (times 256) is rounded to e4m3 for P V (as in FlashAttention-3's fp8 path): to nearest in the
    key tiles on a mask's edge; under the causal mask and no mask, in the key tiles that a 64-row
    group of queries sees whole, its byte is made from the exponent, with a mantissa linear between
    powers of 2 (``docs/contract.md``, Accuracy). The row sums are those of the e4m3 P under the
    causal mask and no mask, of the float32 P under the others.
    :func:`mla_cupy.quant.quantize_per_token` produces these inputs from bf16 ones (on the host for
    NumPy data, on the device for CuPy data).

    Each call writes V transposed (:func:`mla_cupy.fp8.transpose_v`, the layout the e4m3 tensor
    cores read) into a workspace of about V's size: ``workspace=``, or one taken from CuPy's memory
    pool on the call's stream and returned to it when the call returns; the transpose is part of the
    call's time. A plan (``mla_cupy.plan(..., fp8=True)``) keeps its workspace across runs.
    Given V^T instead (``v`` a :class:`~mla_cupy.fp8.TransposedV`, which the device quantizer
    writes as it casts V), the call launches the attention kernel alone and reads that V^T. It is
    checked before any launch: its data a contiguous, 16-byte aligned uint8 device array of shape
    ``vt_shape(H, Tk, B)``; its H, Tk and B the call's; its ``cache_row_offsets`` the call's (the
    same array, or one of the same length at the same device address; else, with
    ``validate=True``, equal values, read back; without, a ``ValueError`` naming ``v``).
    Key tiles start on multiples of 16 keys of a sequence, so a NaN in the v of a key also reaches
    query blocks whose visible keys start up to 15 keys after it (never another sequence).
    """
    return _one_shot(fp8_bytes(q_nope, "q_nope"), fp8_bytes(k, "k"), fp8_bytes(v, "v"), fp8_bytes(k_rope, "k_rope"), valid_length,
                     cache_row_offsets, scale=scale, mask=mask, q_max_seq_len=q_max_seq_len, cache_offsets=cache_offsets,
                     q_start_pos=q_start_pos, out=out, out_dtype=out_dtype, return_lse=return_lse, lse=lse,
                     accumulate=accumulate, stream=stream, validate=validate, kernel=kernel,
                     fp8=(fp8_bytes(q_rope, "q_rope"), q_scale, k_scales), workspace=workspace)


def checkable_args(q, k, v, k_rope, valid_length, cache_row_offsets, cache_offsets, q_start_pos, out, lse=None,
                   k_rope_scales=None, fp8: Optional[tuple] = None):
    """Every array argument as something the checks read without moving it (device arrays as
    zero-copy views, host arrays as they are; :func:`mla_cupy._arrays.checkable`)."""
    def opt(x, name):
        return None if x is None else checkable(x, name)

    if isinstance(k_rope, PagedKVCache):
        k_rope = PagedKVCache(checkable(k_rope.blocks, "k_rope.blocks"),
                              checkable(k_rope.lookup_table, "k_rope.lookup_table"), k_rope.page_size,
                              k_rope.rope_offset, opt(k_rope.scales, "k_rope.scales"))
    else:
        k_rope = checkable(k_rope, "k_rope")
    qname = "q_nope" if fp8 is not None else "q"
    fp8 = None if fp8 is None else tuple(checkable(x, n) for x, n in zip(fp8, ("q_rope", "q_scale", "k_scales")))
    v = v.with_data(checkable(v.data, "v.data")) if isinstance(v, TransposedV) else checkable(v, "v")
    return (checkable(q, qname), checkable(k, "k"), v, k_rope, checkable(valid_length, "valid_length"),
            checkable(cache_row_offsets, "cache_row_offsets"), opt(cache_offsets, "cache_offsets"),
            opt(q_start_pos, "q_start_pos"), opt(out, "out"), opt(lse, "lse"), opt(k_rope_scales, "k_rope_scales"), fp8)


def launch_call(p: Problem, q, k, v, k_rope, out, lse, offsets: Offsets, kernel: str, accumulate: bool,
                stream_ptr: int, *, fp8: Optional[tuple] = None, k_rope_scales=None, workspace=None) -> None:
    """Launch one checked call (device arrays, ``out`` and ``lse`` given) with the offsets ``offsets``.

    The launch record comes from the plan cache when a call of this problem, these offsets and
    array layouts was packed before (the key: ``p``, the offsets' pointers, the kernel argument and
    device, ``accumulate``, a paged rope's table and geometry, and every array's layout; ``p`` says
    whether v is V^T, a checked :class:`~mla_cupy.fp8.TransposedV`)."""
    paged = isinstance(k_rope, PagedKVCache)
    rope, rsc, lut = (k_rope.blocks, k_rope.scales, k_rope.lookup_table) if paged else (k_rope, k_rope_scales, None)
    v = v.data if isinstance(v, TransposedV) else v
    qr, qs, ks = fp8 if fp8 is not None else (None, None, None)
    arrays = (q, k, v, rope, out, lse, rsc, qr, qs, ks, workspace)
    key = None
    if CACHE.maxsize > 0:
        ptrs, layouts = pointers_and_layouts(arrays + (lut,))
        key = (p, offsets.q_offsets, offsets.kv_begin, offsets.kv_end, offsets.cache_offsets, offsets.q_start, kernel,
               _select.device_id(), kernel == "auto" and _select.sm90_disabled(), bool(accumulate),
               (k_rope.page_size, k_rope.rope_offset) if paged else None, ptrs[-1], *layouts)
        entry = CACHE.get(key)
        if entry is not None:
            _launch_cached(entry, ptrs, stream_ptr)
            return
    _launch_new(p, arrays, offsets, kernel, accumulate, stream_ptr, k_rope, workspace_given=workspace is not None,
                key=key)


def _launch_new(p: Problem, arrays: tuple, offsets: Offsets, kernel: str, accumulate: bool, sp: int, k_rope, *,
                workspace_given: bool, widen_q_start: bool = False, key=None) -> None:
    """Pack the launch record of a checked call (device ``arrays`` in :data:`SLOTS` order, results
    given; the fp8 variant's workspace allocated here unless given or v is V^T, its data in slot
    V), launch it, and keep it in the plan cache under ``key`` (None: not kept)."""
    arrays = list(arrays)
    workspace_shape = None
    # a workspace per call, from the pool, returned when the call returns
    if p.fp8 and not p.v_transposed and arrays[WS] is None:
        workspace_shape = vt_shape(p.heads, p.tk, p.batch)
        arrays[WS] = workspace_on(workspace_shape, sp)
    paged = isinstance(k_rope, PagedKVCache)
    rec = call_record(p, offsets, kernel, arrays, sp, accumulate=accumulate,
                      page_table=k_rope.lookup_table if paged else None, page_size=k_rope.page_size if paged else 0,
                      rope_offset=k_rope.rope_offset if paged else 0, maps_max=MAPS_MAX)
    # what the checks require aligned (a later call with a misaligned pointer is checked again)
    align = tuple(i for i in (Q, K, V, ROPE, OUT, QR) if arrays[i] is not None and math.prod(arrays[i].shape))
    align += ((KS,) if p.fp8 and p.tk else ()) + ((WS,) if workspace_given else ())
    entry = CallEntry(p, rec, align, workspace_shape if rec.vt is not None else None, widen_q_start)
    CACHE.count(False)
    entry.launch([optional_ptr(x) for x in arrays], sp)
    if key is not None:
        CACHE.put(key, entry)


def _launch_cached(entry: CallEntry, ptrs: list, sp: int, q_start: Optional[int] = None, new_workspace=None) -> None:
    """Launch a cached entry on the pointers ``ptrs`` (:data:`SLOTS` order first), with the fp8
    variant's workspace of the call allocated here (``new_workspace(shape, sp)``, default CuPy's
    pool) when the entry takes one per call, and by the same allocator a paged rope's key rows."""
    ws = None
    if entry.workspace_shape is not None:
        ws = (new_workspace or workspace_on)(entry.workspace_shape, sp)
        ptrs[WS] = device_pointer(ws)
    CACHE.count(True)
    entry.launch(ptrs, sp, q_start, new_workspace)


def cached_call(q, k, v, k_rope, valid_length, cache_row_offsets, *, scale, mask, q_max_seq_len, cache_offsets,
                q_start_pos, out, out_dtype, return_lse, lse, accumulate, stream, validate, kernel, fp8=None,
                k_rope_scales=None, workspace=None, new_workspace=None) -> Tuple[bool, Any]:
    """The one-shot call from the plan cache: ``(True, result)`` when a cached launch served it,
    else ``(False, key)`` with the key to keep its record under (None: not to be kept). Takes the
    arguments of :func:`checked_call`, as the caller passed them (CuPy arrays, torch tensors...);
    ``new_workspace(shape, stream_ptr)`` allocates the fp8 variant's per-call workspace (and a
    paged rope's key rows).

    The key holds everything the checks and the record depend on: the variant (16-bit or fp8; v
    given as V^T, a :class:`~mla_cupy.fp8.TransposedV`, with its key count, its data's layout in
    v's place), a paged rope's page size and rope offset, the current device, the kernel argument (with
    ``MLA_CUPY_DISABLE_SM90`` for ``"auto"``), the scalars (``scale``, ``mask``, ``q_max_seq_len``
    and ``accumulate`` with their types, ``out_dtype``, ``return_lse``, ``validate``), the layout
    of every array (kind, shape, strides, dtype, device; None when not given), and the pointers of
    the arrays the record bakes in: the offsets and the page table. The data pointers of the other
    arrays are rewritten at every launch, and the contents of the offsets are read by the kernel at
    every launch, so an entry never launches stale arguments; what the host derives from their
    contents is read again per call (the largest query count when ``q_max_seq_len`` is not given,
    every value check with ``validate``, and then the fp8 kernel the key offsets take) or made per
    call (an int32 ``q_start_pos`` widened, an fp8 workspace). A TransposedV is served only when
    its offsets are the call's ``cache_row_offsets`` (:func:`~mla_cupy.fp8.same_offsets`, no value
    read) and no workspace is given; else the checks decide."""
    if CACHE.maxsize <= 0:
        return False, None
    paged = isinstance(k_rope, PagedKVCache)
    if paged:
        rope, rsc, lut, geometry = k_rope.blocks, k_rope.scales, k_rope.lookup_table, (k_rope.page_size,
                                                                                        k_rope.rope_offset)
    else:
        rope, rsc, lut, geometry = k_rope, k_rope_scales, None, None
    qr, qsc, ks = fp8 if fp8 is not None else (None, None, None)
    vt_keys = None  # v given as V^T: its key count (its data's layout holds H and the columns)
    if type(v) is TransposedV:
        if workspace is not None or not same_offsets(v, cache_row_offsets):  # the checks say what is wrong, or
            return False, None  # compare the offsets' values
        vt_keys, v = v.num_keys, v.data
    try:
        ptrs, layouts = pointers_and_layouts((q, k, v, rope, out, lse, rsc, qr, qsc, ks, workspace, valid_length,
                                              cache_row_offsets, cache_offsets, q_start_pos, lut,
                                              k_rope_scales if paged else None))
        key = (fp8 is not None, geometry, _select.device_id(), kernel, kernel == "auto" and _select.sm90_disabled(),
               scale.__class__, scale, mask, q_max_seq_len.__class__, q_max_seq_len, out_dtype, not return_lse,
               accumulate.__class__, accumulate, not validate, vt_keys, *layouts, *ptrs[len(SLOTS):])
        entry = CACHE.get(key)
    except Exception:  # an argument that cannot be a key (unhashable...): the checks say what is wrong with it
        return False, None
    if entry is None:
        return False, key
    acc = 0
    for i in entry.align:
        acc |= ptrs[i]
    if acc & 15:  # misaligned data: the checks name the argument
        return False, None
    p = entry.problem
    if validate or q_max_seq_len is None:
        observed, cro = check_values(valid_length, cache_row_offsets, cache_offsets, k_rope, qsc, tq=p.tq, tk=p.tk,
                                     q_max_seq_len=None if q_max_seq_len is None else p.max_sq, validate=validate)
        # another grid, or another kernel for the key offsets: packed again, kept under this key
        if (q_max_seq_len is None and observed != p.max_sq) or with_key_offsets(p, cro) != p:
            return False, key
    torch_in = is_torch(q)
    sp = stream_ptr(stream, torch_in)
    like = q if torch_in else None
    res_out, res_lse = out, lse
    if out is None:
        out = empty_result((p.tq, p.heads, DV), p.out_dtype, like)
        ptrs[OUT] = device_pointer(out)
    if lse is None and return_lse:
        lse = empty_result((p.tq, p.heads), FP32, like, "lse")
        ptrs[LSE] = device_pointer(lse)
    q_start, qs64 = None, None  # qs64: alive until the launch is enqueued
    if entry.widen_q_start:
        qs64 = _widened(checkable(q_start_pos, "q_start_pos"), sp)
        q_start = device_pointer(qs64)
    _launch_cached(entry, ptrs, sp, q_start, new_workspace)
    if res_out is None or (return_lse and res_lse is None):
        wrap = result_wrapper(q)
        res_out = wrap(out) if res_out is None else res_out
        res_lse = wrap(lse) if res_lse is None else res_lse
    return True, ((res_out, res_lse) if return_lse else res_out)


def _widened(q_start_pos, sp: int):
    """An int32 ``q_start_pos`` (checked device array) widened to int64 on stream ``sp``."""
    with cupy_stream(sp):
        return _q_start_i64(q_start_pos)


def checked_call(q, k, v, k_rope, valid_length, cache_row_offsets, *, scale, mask, q_max_seq_len, cache_offsets,
                 q_start_pos, out, out_dtype, return_lse, lse, accumulate, stream, validate, kernel, fp8=None,
                 k_rope_scales=None, workspace=None, key=None):
    """The body of :func:`mla_prefill` and :func:`mla_prefill_fp8` (``fp8 = (q_rope, q_scale,
    k_scales)``, with q / k / v the e4m3 nope parts): checks, results, the launch record of the
    call, the launch; the record is kept in the plan cache under ``key`` (from :func:`cached_call`)."""
    like = q if is_torch(q) else None  # torch callers get results from torch's allocator
    torch_in = like is not None
    wrap = result_wrapper(q)
    out_given, lse_given = out, lse
    q, k, v, k_rope, vl, cro, co, qs, out, lse, k_rope_scales, fp8 = checkable_args(
        q, k, v, k_rope, valid_length, cache_row_offsets, cache_offsets, q_start_pos, out, lse, k_rope_scales, fp8)
    if isinstance(v, TransposedV):
        check_no_workspace(workspace)
    p = check_inputs(q, k, v, k_rope, vl, cro, scale=scale, mask=mask, q_max_seq_len=q_max_seq_len, cache_offsets=co,
                     q_start_pos=qs, out=out, out_dtype=out_dtype, validate=validate, device=True,
                     read_offsets=q_max_seq_len is None, fp8=fp8, k_rope_scales=k_rope_scales, lse=lse,
                     accumulate=accumulate, kernel=kernel, api="mla_prefill_fp8" if fp8 is not None else "mla_prefill")
    sp = stream_ptr(stream, torch_in)
    if out is None:
        out = empty_result((p.tq, p.heads, DV), p.out_dtype, like)
    if lse is None and return_lse:
        lse = empty_result((p.tq, p.heads), FP32, like, "lse")
    qs64 = qs
    if qs is not None and np.dtype(qs.dtype) != np.int64:
        qs64 = _widened(qs, sp)
    cro_ptr = device_pointer(cro)
    offsets = offsets_of(vl, cro_ptr, cro_ptr + 4, co, qs64, keep=(cro,))
    paged = isinstance(k_rope, PagedKVCache)
    rope, rsc = (k_rope.blocks, k_rope.scales) if paged else (k_rope, k_rope_scales)
    qr, qsc, ks = fp8 if fp8 is not None else (None, None, None)
    v = v.data if isinstance(v, TransposedV) else v
    _launch_new(p, (q, k, v, rope, out, lse, rsc, qr, qsc, ks, workspace), offsets, kernel, accumulate, sp, k_rope,
                workspace_given=workspace is not None, widen_q_start=qs64 is not qs, key=key)
    res_out = out_given if out_given is not None else wrap(out)
    if not return_lse:
        return res_out
    return res_out, (lse_given if lse_given is not None else wrap(lse))


def _one_shot(q, k, v, k_rope, valid_length, cache_row_offsets, **kw):
    """A one-shot call: from the plan cache (:func:`cached_call`), else checked, packed and kept
    (:func:`checked_call`)."""
    served, res = cached_call(q, k, v, k_rope, valid_length, cache_row_offsets, **kw)
    if served:
        return res
    return checked_call(q, k, v, k_rope, valid_length, cache_row_offsets, key=res, **kw)

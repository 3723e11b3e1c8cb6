"""The launch services: every one-shot call's way from its arguments to a launch, and the plan cache
that keeps it short.

A one-shot call (:func:`mla_cupy.mla_prefill`, :func:`mla_cupy.mla_prefill_fp8`,
:func:`mla_cupy.mla_prefill_backward`, and what is built on them: the torch ops, the chunks of :func:`mla_cupy.mla_prefill_chunked`) is a cached plan: its
key is looked up (:func:`from_cache`); a call seen before launches the record that its first call
packed, only its data pointers rewritten, as :meth:`PrefillPlan.run
<mla_cupy.prefill_plan.PrefillPlan.run>` does; any other call is checked in argument order, planned
(its checked problem on its target, :func:`mla_cupy.prefill_plan.call_target`, what
:func:`mla_cupy.plan` fixes), packed, launched and kept under its key (:func:`checked_call`,
:class:`CachedCall`). Runs of a plan and one-shot calls share one packing
(:func:`~mla_cupy._packing.pack`), one alignment rule (the record's) and one launch step
(:func:`~mla_cupy._packing.launch_record`).

What the key holds, and why a cached plan can never launch stale arguments, is told at
:func:`from_cache` and in the README ("The one-shot calls' plan cache"). The store is bounded,
least recently used first out (:func:`set_plan_cache_size`), and counted (:func:`plan_cache_info`).
"""
from __future__ import annotations

import threading
from collections import OrderedDict, namedtuple
from typing import Any, Callable, Hashable, NamedTuple, Optional, Tuple

import numpy as np

from . import _select
from ._arrays import (FP32, checkable, cupy_stream, device_pointer, is_torch, pointers_and_layouts, result_wrapper,
                      stream_ptr)
from ._backward import GRADIENTS, new_gradients, pack_backward
from ._packing import Record, launch_record, pack
from ._run_args import BackwardArrays, Offsets, PrefillArrays
from .dims import DV
from .fp8 import TransposedV, check_no_workspace, same_offsets, vt_shape
from .paged import PagedKVCache
from .prefill_plan import call_target, offsets_of, q_start_i64, workspace_on
from .validation import Problem, check_backward_inputs, check_inputs, check_values, with_key_offsets
from .workspace import empty_result

__all__ = ["PlanCacheInfo", "CACHE", "plan_cache_info", "plan_cache_clear", "set_plan_cache_size", "DEFAULT_MAXSIZE",
           "prefill", "from_cache", "checked_call", "checkable_args", "launch_checked", "backward"]

#: Entries kept unless :func:`set_plan_cache_size` says otherwise.
DEFAULT_MAXSIZE = 256

PlanCacheInfo = namedtuple("PlanCacheInfo", ["hits", "misses", "maxsize", "currsize"])
PlanCacheInfo.__doc__ = """The counts of the plan cache (as ``functools``' ``cache_info``): calls launched from a cached
record (``hits``), calls that checked their arguments and packed a record (``misses``), the bound
(``maxsize``) and the entries held (``currsize``)."""


class CachedCall(NamedTuple):
    """A call kept in the plan cache, its plan: the checked problem, the launch record packed for it
    on the call's target (:func:`~mla_cupy.prefill_plan.call_target`: kernel, device, offsets'
    pointers), and what each call makes afresh: the fp8 variant's V^T workspace (its shape, when
    the call allocates one) and an int64 copy of an int32 ``q_start_pos`` (``widen_q_start``). It
    holds no array and no value read from one."""

    problem: Problem
    record: Record
    workspace_shape: Optional[tuple]
    widen_q_start: bool


class PlanCache:
    """A bounded map of keys to :class:`CachedCall`, least recently used first out, safe to share
    between threads; ``maxsize=0`` keeps nothing."""

    def __init__(self, maxsize: int = DEFAULT_MAXSIZE):
        self._entries: "OrderedDict[Hashable, CachedCall]" = OrderedDict()
        self._lock = threading.Lock()
        self.maxsize = maxsize
        self.hits = self.misses = 0

    def get(self, key: Hashable) -> Optional[CachedCall]:
        """The entry of ``key`` (now the most recently used), or None. Raises ``TypeError`` for an
        unhashable key."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: Hashable, entry: CachedCall) -> None:
        with self._lock:
            if self.maxsize <= 0:
                return
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)

    def count(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1

    def info(self) -> PlanCacheInfo:
        with self._lock:
            return PlanCacheInfo(self.hits, self.misses, self.maxsize, len(self._entries))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0

    def resize(self, maxsize: int) -> None:
        with self._lock:
            self.maxsize = maxsize
            while len(self._entries) > max(maxsize, 0):
                self._entries.popitem(last=False)


#: The cache of every one-shot call of the process.
CACHE = PlanCache()


def plan_cache_info() -> PlanCacheInfo:
    """The counts of the one-shot calls' plan cache.

    Returns
    -------
    PlanCacheInfo
        A named tuple ``(hits, misses, maxsize, currsize)``, as ``functools``' ``cache_info``:
        calls of :func:`mla_cupy.mla_prefill` (and of what is built on it: ``mla_prefill_fp8``,
        the chunks of ``mla_prefill_chunked``, the torch ops, ``flash_attn_varlen_func``, the
        transformers and context-parallel backends) that launched a cached record, calls that
        checked their arguments and packed one, the bound and the entries held.

    Notes
    -----
    An entry is a plan and its launch record (host memory: its packed arguments and up to 64 sets
    of tensor maps), never an array: the cache holds no device memory and keeps no array alive.
    """
    return CACHE.info()


def plan_cache_clear() -> None:
    """Drop every entry of the one-shot calls' plan cache and reset its counts."""
    CACHE.clear()


def set_plan_cache_size(maxsize: int) -> None:
    """Bound the one-shot calls' plan cache to ``maxsize`` entries (default 256), dropping the least
    recently used ones beyond it; ``0`` disables it (every call checks its arguments and packs its
    launch, as a :func:`mla_cupy.plan` built and dropped per call).

    Parameters
    ----------
    maxsize : int
        A non-negative int.
    """
    if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 0:
        raise ValueError(f"maxsize: expected a non-negative int, got {maxsize!r}")
    CACHE.resize(maxsize)


# ---------------------------------------------------------------------------------------------
# A one-shot call

#: The arrays of a one-shot call that its key and its launch read: its run's (the fields of
#: :class:`~mla_cupy._run_args.PrefillArrays`, in their order: the record's slots), then its offsets,
#: a paged rope's page table, and the ``k_rope_scales`` given beside a paged rope (the checks refuse
#: them).
CallArrays = namedtuple("CallArrays", PrefillArrays._fields + (
    "valid_length", "cache_row_offsets", "cache_offsets", "q_start_pos", "page_table", "paged_rope_scales"),
    defaults=(None,) * 6)
#: Where a call's results and fp8 workspace go in its pointers when the call allocates them.
_OUT, _LSE, _WORKSPACE = (PrefillArrays._fields.index(name) for name in ("out", "lse", "workspace"))
_RUN_SLOTS = len(PrefillArrays._fields)


def prefill(q, k, v, k_rope, valid_length, cache_row_offsets, *, scale, mask, q_max_seq_len, cache_offsets,
            q_start_pos, out, out_dtype, return_lse, lse, accumulate, stream, validate, kernel, fp8=None,
            k_rope_scales=None, workspace=None):
    """A one-shot call (the body of :func:`mla_cupy.mla_prefill` and :func:`mla_cupy.mla_prefill_fp8`,
    with their keywords): from the plan cache (:func:`from_cache`), else checked, planned, launched
    and kept (:func:`checked_call`)."""
    served, result = from_cache(q, k, v, k_rope, valid_length, cache_row_offsets, scale=scale, mask=mask,
                                q_max_seq_len=q_max_seq_len, cache_offsets=cache_offsets, q_start_pos=q_start_pos,
                                out=out, out_dtype=out_dtype, return_lse=return_lse, lse=lse, accumulate=accumulate,
                                stream=stream, validate=validate, kernel=kernel, fp8=fp8, k_rope_scales=k_rope_scales,
                                workspace=workspace)
    if served:
        return result
    return checked_call(q, k, v, k_rope, valid_length, cache_row_offsets, scale=scale, mask=mask,
                        q_max_seq_len=q_max_seq_len, cache_offsets=cache_offsets, q_start_pos=q_start_pos, out=out,
                        out_dtype=out_dtype, return_lse=return_lse, lse=lse, accumulate=accumulate, stream=stream,
                        validate=validate, kernel=kernel, fp8=fp8, k_rope_scales=k_rope_scales, workspace=workspace,
                        key=result)


def from_cache(q, k, v, k_rope, valid_length, cache_row_offsets, *, scale, mask, q_max_seq_len, cache_offsets,
               q_start_pos, out, out_dtype, return_lse, lse, accumulate, stream, validate, kernel, fp8=None,
               k_rope_scales=None, workspace=None, new_workspace=None) -> Tuple[bool, Any]:
    """The one-shot call from the plan cache: ``(True, result)`` when a cached plan served it, else
    ``(False, key)`` with the key to keep its plan under (None: not to be kept). Takes the
    arguments of :func:`checked_call`, as the caller passed them (CuPy arrays, torch tensors...);
    ``new_workspace(shape, raw_stream)`` allocates the fp8 variant's per-call workspace (and a
    paged rope's key rows).

    The key holds everything the checks and the plan depend on: the variant (16-bit or fp8; v
    given as V^T, a :class:`~mla_cupy.fp8.TransposedV`, with its key count, its data's layout in
    v's place), a paged rope's page size and rope offset, the current device, the kernel argument (with
    ``MLA_CUPY_DISABLE_SM90`` for ``"auto"``), the scalars (``scale``, ``mask``, ``q_max_seq_len``
    and ``accumulate`` with their types, ``out_dtype``, ``return_lse``, ``validate``), the layout
    of every array (kind, shape, strides, dtype, device; None when not given), and the pointers of
    the arrays the record bakes in: the offsets and the page table. The data pointers of the other
    arrays are rewritten at every launch, and the contents of the offsets are read by the kernel at
    every launch, so a cached plan never launches stale arguments; what the host derives from their
    contents is read again per call (the largest query count when ``q_max_seq_len`` is not given,
    every value check with ``validate``, and then the fp8 kernel the key offsets take) or made per
    call (an int32 ``q_start_pos`` widened, an fp8 workspace). A TransposedV is served only when
    its offsets are the call's ``cache_row_offsets`` (:func:`~mla_cupy.fp8.same_offsets`, no value
    read) and no workspace is given; else the checks decide."""
    if CACHE.maxsize <= 0:
        return False, None
    paged = isinstance(k_rope, PagedKVCache)
    if paged:
        rope, rope_scales, page_table, geometry = (k_rope.blocks, k_rope.scales, k_rope.lookup_table,
                                                   (k_rope.page_size, k_rope.rope_offset))
    else:
        rope, rope_scales, page_table, geometry = k_rope, k_rope_scales, None, None
    q_rope, q_scale, k_scales = fp8 if fp8 is not None else (None, None, None)
    vt_keys = None  # v given as V^T: its key count (its data's layout holds H and the columns)
    if type(v) is TransposedV:
        if workspace is not None or not same_offsets(v, cache_row_offsets):  # the checks say what is wrong, or
            return False, None  # compare the offsets' values
        vt_keys, v = v.num_keys, v.data
    arrays = CallArrays(q, k, v, rope, out, lse, rope_scales, q_rope, q_scale, k_scales, workspace, valid_length,
                        cache_row_offsets, cache_offsets, q_start_pos, page_table, k_rope_scales if paged else None)
    try:
        ptrs, layouts = pointers_and_layouts(arrays)
        key = (fp8 is not None, geometry, _select.device_id(), kernel, kernel == "auto" and _select.sm90_disabled(),
               scale.__class__, scale, mask, q_max_seq_len.__class__, q_max_seq_len, out_dtype, not return_lse,
               accumulate.__class__, accumulate, not validate, vt_keys, *layouts, *ptrs[_RUN_SLOTS:])
        entry = CACHE.get(key)
    except Exception:  # an argument that cannot be a key (unhashable...): the checks say what is wrong with it
        return False, None
    if entry is None:
        return False, key
    misaligned = 0
    for i in entry.record.align:  # what the checks require aligned: a misaligned pointer hears them
        misaligned |= ptrs[i]
    if misaligned & 15:
        return False, None
    p = entry.problem
    if validate or q_max_seq_len is None:
        observed, key_offsets = check_values(valid_length, cache_row_offsets, cache_offsets, k_rope, q_scale, tq=p.tq,
                                             tk=p.tk, q_max_seq_len=None if q_max_seq_len is None else p.max_sq,
                                             validate=validate)
        # another grid, or another kernel for the key offsets: planned again, kept under this key
        if (q_max_seq_len is None and observed != p.max_sq) or with_key_offsets(p, key_offsets) != p:
            return False, key
    torch_in = is_torch(q)
    raw_stream = stream_ptr(stream, torch_in)
    given_out, given_lse = out, lse
    if out is None or (lse is None and return_lse):
        torch_device = q.device if torch_in else None  # torch in, torch out
        if out is None:
            out = empty_result((p.tq, p.heads, DV), p.out_dtype, torch_device)
            ptrs[_OUT] = device_pointer(out)
        if lse is None and return_lse:
            lse = empty_result((p.tq, p.heads), FP32, torch_device, "lse")
            ptrs[_LSE] = device_pointer(lse)
    q_start, q_start_64 = None, None  # q_start_64: alive until the launch is enqueued
    if entry.widen_q_start:
        q_start_64 = widened(checkable(q_start_pos, "q_start_pos"), raw_stream)
        q_start = device_pointer(q_start_64)
    _launch_cached(entry, ptrs, raw_stream, q_start, new_workspace)
    if given_out is None or (return_lse and given_lse is None):
        wrap = result_wrapper(q)
        given_out = wrap(out) if given_out is None else given_out
        given_lse = wrap(lse) if given_lse is None else given_lse
    return True, ((given_out, given_lse) if return_lse else given_out)


def _launch_cached(entry: CachedCall, ptrs: list, raw_stream: int, q_start: Optional[int],
                   new_workspace: Optional[Callable]) -> None:
    """Launch a cached call's record on the pointers of its arrays (its run's first), with the fp8
    variant's workspace of the call allocated here (``new_workspace(shape, raw_stream)``, default
    CuPy's pool) when the call takes one per call, and a paged rope's key rows by the same allocator."""
    ws = None  # alive until the launch is enqueued
    if entry.workspace_shape is not None:
        ws = (new_workspace or workspace_on)(entry.workspace_shape, raw_stream)
        ptrs[_WORKSPACE] = device_pointer(ws)
    CACHE.count(True)
    launch_record(entry.record, ptrs, raw_stream, q_start, new_workspace)


def widened(q_start_pos, raw_stream: int):
    """An int32 ``q_start_pos`` (checked device array) widened to int64 on the raw stream ``raw_stream``."""
    with cupy_stream(raw_stream):
        return q_start_i64(q_start_pos)


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


def checked_call(q, k, v, k_rope, valid_length, cache_row_offsets, *, scale, mask, q_max_seq_len, cache_offsets,
                 q_start_pos, out, out_dtype, return_lse, lse, accumulate, stream, validate, kernel, fp8=None,
                 k_rope_scales=None, workspace=None, key=None, new_workspace=None):
    """A one-shot call checked (every argument, in argument order: :func:`mla_cupy.validation.check_inputs`),
    its results allocated, planned and launched (``fp8 = (q_rope, q_scale, k_scales)``, with q / k /
    v the e4m3 nope parts); its plan is kept in the plan cache under ``key`` (from
    :func:`from_cache`; None: not kept)."""
    torch_in = is_torch(q)
    torch_device = q.device if torch_in else None  # torch callers get results from torch's allocator
    wrap = result_wrapper(q)
    given_out, given_lse = out, lse
    (q, k, v, k_rope, valid_length, cache_row_offsets, cache_offsets, q_start_pos, out, lse, k_rope_scales,
     fp8) = checkable_args(q, k, v, k_rope, valid_length, cache_row_offsets, cache_offsets, q_start_pos, out, lse,
                           k_rope_scales, fp8)
    if isinstance(v, TransposedV):
        check_no_workspace(workspace)
    p = check_inputs(q, k, v, k_rope, valid_length, cache_row_offsets, scale=scale, mask=mask,
                     q_max_seq_len=q_max_seq_len, cache_offsets=cache_offsets, q_start_pos=q_start_pos, out=out,
                     out_dtype=out_dtype, validate=validate, device=True, read_offsets=q_max_seq_len is None, fp8=fp8,
                     k_rope_scales=k_rope_scales, lse=lse, accumulate=accumulate, kernel=kernel,
                     api="mla_prefill_fp8" if fp8 is not None else "mla_prefill")
    raw_stream = stream_ptr(stream, torch_in)
    if out is None:
        out = empty_result((p.tq, p.heads, DV), p.out_dtype, torch_device)
    if lse is None and return_lse:
        lse = empty_result((p.tq, p.heads), FP32, torch_device, "lse")
    q_start_64 = q_start_pos
    if q_start_pos is not None and np.dtype(q_start_pos.dtype) != np.int64:
        q_start_64 = widened(q_start_pos, raw_stream)
    kv_begin = device_pointer(cache_row_offsets)
    offsets = offsets_of(valid_length, kv_begin, kv_begin + 4, cache_offsets, q_start_64)
    launch_checked(p, q, k, v, k_rope, out, lse, offsets, kernel, accumulate, raw_stream, fp8=fp8,
                   k_rope_scales=k_rope_scales, workspace=workspace, widen_q_start=q_start_64 is not q_start_pos,
                   key=key, new_workspace=new_workspace)
    result = given_out if given_out is not None else wrap(out)
    if not return_lse:
        return result
    return result, (given_lse if given_lse is not None else wrap(lse))


def launch_checked(p: Problem, q, k, v, k_rope, out, lse, offsets: Offsets, kernel: str, accumulate: bool,
                   raw_stream: int, *, fp8: Optional[tuple] = None, k_rope_scales=None, workspace=None,
                   widen_q_start: bool = False, key=None, new_workspace=None) -> None:
    """Plan and launch a checked call (device arrays, ``out`` and ``lse`` given) with ``offsets``
    (its own, or a chunk's of :func:`mla_cupy.mla_prefill_chunked`) and keep its plan under ``key``
    (None: with the key of a checked call, ``p`` and the offsets' pointers standing for the checks
    and the offsets, looked up first). The plan's record is packed as a plan's run packs one
    (:func:`~mla_cupy._packing.pack`, on the call's :func:`~mla_cupy.prefill_plan.call_target`);
    the fp8 variant's workspace is allocated here unless given or v is V^T."""
    paged = isinstance(k_rope, PagedKVCache)
    rope, rope_scales = (k_rope.blocks, k_rope.scales) if paged else (k_rope, k_rope_scales)
    q_rope, q_scale, k_scales = fp8 if fp8 is not None else (None, None, None)
    arrays = CallArrays(q, k, v.data if isinstance(v, TransposedV) else v, rope, out, lse, rope_scales, q_rope,
                        q_scale, k_scales, workspace, page_table=k_rope.lookup_table if paged else None)
    ptrs, layouts = pointers_and_layouts(arrays)
    if key is None and CACHE.maxsize > 0:
        key = (p, offsets.q_offsets, offsets.kv_begin, offsets.kv_end, offsets.cache_offsets, offsets.q_start, kernel,
               _select.device_id(), kernel == "auto" and _select.sm90_disabled(), bool(accumulate),
               (k_rope.page_size, k_rope.rope_offset) if paged else None, *ptrs[_RUN_SLOTS:], *layouts)
        entry = CACHE.get(key)
        if entry is not None:
            _launch_cached(entry, ptrs, raw_stream, None, new_workspace)
            return
    workspace_shape = None
    if p.fp8 and not p.v_transposed and workspace is None:  # a workspace per call, from the pool
        workspace_shape = vt_shape(p.heads, p.tk, p.batch)
        workspace = (new_workspace or workspace_on)(workspace_shape, raw_stream)
        arrays = arrays._replace(workspace=workspace)
        ptrs[_WORKSPACE] = device_pointer(workspace)
    target = call_target(p, offsets, kernel, accumulate, page_table=arrays.page_table,
                         page_size=k_rope.page_size if paged else 0, rope_offset=k_rope.rope_offset if paged else 0)
    record = pack(target, p, arrays, raw_stream, one_shot=True)
    CACHE.count(False)
    launch_record(record, ptrs, raw_stream, None, new_workspace)
    if key is not None:
        CACHE.put(key, CachedCall(p, record, workspace_shape if record.reads(_WORKSPACE) else None, widen_q_start))


# ---------------------------------------------------------------------------------------------
# A one-shot backward

#: The arrays of a one-shot backward that its key and its launch read: its run's (the fields of
#: :class:`~mla_cupy._run_args.BackwardArrays`, in their order: the record's slots), then its offsets.
BackwardCallArrays = namedtuple("BackwardCallArrays", BackwardArrays._fields + (
    "valid_length", "cache_row_offsets", "cache_offsets", "q_start_pos"))
_BWD_SLOTS = len(BackwardArrays._fields)
_GRADIENT_SLOTS = tuple(BackwardArrays._fields.index(name) for name in GRADIENTS)


def backward(dout, q, k, v, k_rope, out, lse, valid_length, cache_row_offsets, *, scale, mask, q_max_seq_len,
             cache_offsets, q_start_pos, dq, dk, dv, dk_rope, dlse, deterministic, stream, validate, kernel):
    """A one-shot backward (the body of :func:`mla_cupy.mla_prefill_backward`, with its keywords):
    from the plan cache when a call of the same key was planned before, else checked, planned,
    launched and kept. Returns ``(dq, dk, dv, dk_rope)``.

    The key is that of a forward call (:func:`from_cache`) for the backward's arguments, with
    ``deterministic``. A call that reads its key offsets back (:func:`reads_offsets`) sizes the
    grid by the longest sequence's key blocks, and one whose longest sequence (or, without
    ``q_max_seq_len``, longest query count) differs from its cached plan's is planned again under
    the same key; with ``validate`` the values are checked too. With ``q_max_seq_len`` and without
    ``validate`` nothing is read back, as in the forward."""
    return _backward_call(BackwardCallArrays(dout, q, k, v, k_rope, out, lse, dq, dk, dv, dk_rope, dlse, valid_length,
                                             cache_row_offsets, cache_offsets, q_start_pos),
                          scale=scale, mask=mask, q_max_seq_len=q_max_seq_len, deterministic=deterministic,
                          stream=stream, validate=validate, kernel=kernel)


def _backward_call(arrays, *, scale, mask, q_max_seq_len, deterministic, stream, validate, kernel):
    """:func:`backward` on its arrays (a ``BackwardCallArrays``)."""
    key = None
    if CACHE.maxsize > 0 and not isinstance(arrays.k_rope, PagedKVCache):
        try:
            ptrs, layouts = pointers_and_layouts(arrays)
            key = ("backward", _select.device_id(), kernel, kernel == "auto" and _select.sm90_disabled(),
                   scale.__class__, scale, mask, q_max_seq_len.__class__, q_max_seq_len, deterministic.__class__,
                   deterministic, not validate, *layouts, *ptrs[_BWD_SLOTS:])
            entry = CACHE.get(key)
        except Exception:  # an argument that cannot be a key: the checks say what is wrong with it
            key = entry = None
        if entry is not None:
            served = _cached_backward(entry, arrays, ptrs, q_max_seq_len, validate, stream)
            if served is not None:
                return served
    return _checked_backward(arrays, scale=scale, mask=mask, q_max_seq_len=q_max_seq_len,
                             deterministic=deterministic, stream=stream, validate=validate, kernel=kernel, key=key)


def reads_offsets(q_max_seq_len, validate: bool) -> bool:
    """Whether a one-shot backward reads its offsets back (one synchronization) to size its grid by
    the longest sequence's key blocks: unless ``q_max_seq_len`` is given and ``validate`` is off,
    when Tk's key blocks bound the grid (a sequence's blocks past its own end decode to nothing)
    and nothing is read, so that the call can be captured in a CUDA graph."""
    return bool(validate) or q_max_seq_len is None


def _results(q, given: tuple, new: list) -> tuple:
    wrap = result_wrapper(q)
    return tuple(g if g is not None else wrap(n) for g, n in zip(given, new))


def _cached_backward(entry: CachedCall, arrays, ptrs: list, q_max_seq_len, validate: bool, stream):
    """The launch of a cached backward, or None where the call must be checked and planned again
    (a misaligned pointer, other key offsets' longest sequence)."""
    misaligned = 0
    for i in entry.record.align:
        misaligned |= ptrs[i]
    if misaligned & 15:
        return None
    p = entry.problem
    if reads_offsets(q_max_seq_len, validate):
        observed, key_offsets = check_values(arrays.valid_length, arrays.cache_row_offsets, arrays.cache_offsets,
                                             arrays.k_rope, None, tq=p.tq, tk=p.tk,
                                             q_max_seq_len=None if q_max_seq_len is None else p.max_sq,
                                             validate=validate)
        max_sk = int(np.diff(key_offsets).max()) if len(key_offsets) > 1 else 0
        if (q_max_seq_len is None and observed != p.max_sq) or max_sk != p.max_sk:
            return None
    q = arrays.q
    raw_stream = stream_ptr(stream, is_torch(q))
    given = tuple(getattr(arrays, name) for name in GRADIENTS)
    new = new_gradients(q, p.tk, p.dtype, given)
    for slot, n in zip(_GRADIENT_SLOTS, new):
        if n is not None:
            ptrs[slot] = device_pointer(n)
    q_start, q_start_64 = None, None  # q_start_64: alive until the launch is enqueued
    if entry.widen_q_start:
        q_start_64 = widened(checkable(arrays.q_start_pos, "q_start_pos"), raw_stream)
        q_start = device_pointer(q_start_64)
    CACHE.count(True)
    launch_record(entry.record, ptrs, raw_stream, q_start)
    return _results(q, given, new)


def _checked_backward(arrays, *, scale, mask, q_max_seq_len, deterministic, stream, validate, kernel, key):
    """A one-shot backward checked (every argument, in argument order:
    :func:`mla_cupy.validation.check_backward_inputs`), its gradients allocated where not given,
    planned and launched; its plan kept under ``key`` (None: not kept)."""
    q = arrays.q
    c = BackwardCallArrays(*(None if x is None else checkable(x, name)
                             for name, x in zip(BackwardCallArrays._fields, arrays)))
    p = check_backward_inputs(c.dout, c.q, c.k, c.v, c.k_rope, c.out, c.lse, c.valid_length, c.cache_row_offsets,
                              scale=scale, mask=mask, q_max_seq_len=q_max_seq_len, cache_offsets=c.cache_offsets,
                              q_start_pos=c.q_start_pos, dq=c.dq, dk=c.dk, dv=c.dv, dk_rope=c.dk_rope,
                              deterministic=deterministic, validate=validate, device=True,
                              read_offsets=reads_offsets(q_max_seq_len, validate),
                              kernel=kernel, api="mla_prefill_backward", dlse=c.dlse)
    raw_stream = stream_ptr(stream, is_torch(q))
    given = tuple(getattr(arrays, name) for name in GRADIENTS)
    new = new_gradients(q, p.tk, p.dtype, given)
    run = BackwardArrays(*c[:_BWD_SLOTS])._replace(**{name: n for name, n in zip(GRADIENTS, new) if n is not None})
    q_start_64 = c.q_start_pos
    if q_start_64 is not None and np.dtype(q_start_64.dtype) != np.int64:
        q_start_64 = widened(q_start_64, raw_stream)
    kv_begin = device_pointer(c.cache_row_offsets)
    offsets = offsets_of(c.valid_length, kv_begin, kv_begin + 4, c.cache_offsets, q_start_64)
    target = call_target(p, offsets, kernel, False)
    record = pack_backward(target, p, run, deterministic=bool(deterministic), one_shot=True)
    ptrs, _ = pointers_and_layouts(run)
    CACHE.count(False)
    launch_record(record, ptrs, raw_stream)
    if key is not None:
        CACHE.put(key, CachedCall(p, record, None, q_start_64 is not c.q_start_pos))
    return _results(q, given, new)

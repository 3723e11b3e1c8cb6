"""Plan once, run per layer: the prefill of one batch layout, prepared for repeated launches.

A :class:`PrefillPlan` is built by :func:`plan` from a batch's layout (offsets, positions, mask,
heads, dtype, kernel choice) and checked then. :meth:`PrefillPlan.run` launches it on a layer's
q, k, v and rope: the first run with a given set of array shapes, strides and dtypes checks those
arrays against the plan and packs the kernel's arguments; every later run with the same layout
only rewrites the data pointers (and, on Hopper, looks up the tensor maps of those pointers) and
launches. A run copies nothing to or from the host and, with ``out=`` (and ``lse=`` where the
plan returns it) given, allocates nothing: it can be captured in a CUDA graph. The fp8 plan owns
the V^T workspace its pre-pass writes (or takes ``workspace=``).
"""
from __future__ import annotations

import math
import threading
from dataclasses import replace
from typing import Any, Callable, Dict, Generic, Optional, Tuple, TypeVar, Union, overload

import numpy as np

from ._arrays import (FP32, INSTALL_GPU, Array, Stream, as_device, checkable, cupy_or_none, device_pointer, is_torch,
                      optional_ptr, pointers_and_layouts, require_gpu, result_wrapper, stream_ptr)
from ._checks import check_offsets_layout, dtype_of
from ._backward import GRADIENTS, new_gradients, pack_backward
from ._packing import Record, launch_record, pack
from ._plan_checks import RunBounds, check_backward_run, check_plan_args, check_run
from ._run_args import BackwardArrays, Offsets, PrefillArrays, Target, backward_arrays, prefill_arrays
from . import _select
from ._select import choose_kernel
from .dims import DV
from .fp8 import TransposedV, check_transposed_v_offsets, fp8_bytes
from .masks import Mask
from .paged import PagedKVCache
from .validation import Problem, check_deterministic, check_same_device
from .workspace import allocate_on, check_workspace, empty_result

__all__ = ["plan", "PrefillPlan"]

_RECORDS_MAX = 256  # array layouts remembered per plan


def q_start_i64(q_start_pos):
    """The kernels read int64 positions: an int32 array is widened (a B-element copy, at plan time)."""
    if q_start_pos is None or dtype_of(q_start_pos) == np.int64:
        return q_start_pos
    import cupy

    return cupy.asarray(q_start_pos).astype(cupy.int64)


def _require_gpu() -> None:
    require_gpu("plan")


def _no_stream() -> Any:
    raise RuntimeError(f"plan: needs CuPy for its runs' default stream: {INSTALL_GPU}")


def _upload(x, name: str):
    """An offsets argument on the device: device arrays in place, host arrays (NumPy, torch CPU) copied."""
    if x is None:
        return None
    import cupy

    if isinstance(x, np.ndarray) and not hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(np.ascontiguousarray(x))
    x = as_device(x, name)
    check_offsets_layout(x, name) if len(x.shape) == 1 else None
    return x


_T = TypeVar("_T")


class _FromProblem(Generic[_T]):
    """A read-only attribute of a plan that its :class:`~mla_cupy.validation.Problem` holds, typed
    as what ``get`` returns."""

    __slots__ = ("get",)

    def __init__(self, get: Callable[[Problem], _T]):
        self.get = get

    @overload
    def __get__(self, plan: None, owner: Any = None) -> _FromProblem[_T]: ...

    @overload
    def __get__(self, plan: PrefillPlan, owner: Any = None) -> _T: ...

    def __get__(self, plan: Optional[PrefillPlan], owner: Any = None) -> Union[_T, _FromProblem[_T]]:
        return self if plan is None else self.get(plan._p)

    def __set__(self, plan: PrefillPlan, value: Any) -> None:
        raise AttributeError("a plan's attributes are read-only")


class PrefillPlan:
    """The prefill of one batch layout, built by :func:`plan`; run it with :meth:`run` (or, for an
    fp8 plan, :meth:`run_fp8`) once per layer.

    Attributes
    ----------
    batch, num_heads : int
    dtype, out_dtype : numpy.dtype
        16-bit dtype of q / k / v (of the rope parts for an fp8 plan) and of the result.
    mask : Mask
    scale : float
    q_max_seq_len : int
        The grid's bound on any sequence's query count.
    num_queries : int or None
        Tq (``valid_length[-1]``) when the offsets were read at plan time.
    kernel : str
        ``'sm80'`` or ``'sm90'``, the kernel every run launches.
    paged, fp8, fp8_rope, return_lse, accumulate : bool

    Notes
    -----
    A plan keeps references to its offset arrays and reads them at every launch: change their
    contents only for a layout with the same maximum query count and still valid for the plan
    (for an fp8 plan whose ``scale_pairs`` is true, every sequence's first key row still even).
    Runs of one plan may come from several threads; runs that can overlap on different streams
    must not share the plan's own V^T workspace (pass ``workspace=`` to each).
    """

    def __init__(self, layout: Problem, target: Target, *, return_lse: bool, bounds: RunBounds = RunBounds(),
                 cache_row_offsets: tuple = (None, None)):
        self._p = layout
        self._cro = cache_row_offsets  # (as given to plan(), as the kernels read it): a TransposedV's must be one
        self._t = target
        self._bounds = bounds
        self._fp8 = layout.fp8
        self.kernel = target.kernel
        self.accumulate = bool(target.accumulate)
        self.return_lse = bool(return_lse)
        self.page_size, self.rope_offset = target.page_size, target.rope_offset
        self._records: Dict[tuple, Record] = {}
        self._last: tuple = (None, None)  # (layout key, record) of the last run
        self._lock = threading.Lock()
        self._workspace: Optional[Array] = None
        cp = cupy_or_none()
        self._current_stream: Callable[[], Any] = cp.cuda.get_current_stream if cp is not None else _no_stream

    # -- what the plan is -----------------------------------------------------------------------
    batch = _FromProblem(lambda p: p.batch)
    num_heads = _FromProblem(lambda p: p.heads)
    dtype = _FromProblem(lambda p: p.dtype)
    out_dtype = _FromProblem(lambda p: p.out_dtype)
    mask = _FromProblem(lambda p: p.mask)
    scale = _FromProblem(lambda p: p.scale)
    q_max_seq_len = _FromProblem(lambda p: p.max_sq)
    num_queries = _FromProblem(lambda p: p.tq if p.tq >= 0 else None)
    paged = _FromProblem(lambda p: p.paged)
    fp8 = _FromProblem(lambda p: p.fp8)
    fp8_rope = _FromProblem(lambda p: p.fp8_rope)

    @property
    def scale_pairs(self) -> bool:
        """Whether its fp8 kernel reads a key tile's scales in pairs (:func:`mla_cupy.fp8.scale_pairs`:
        every sequence's first key row even, as the plan read the offsets)."""
        return self._p.scale_pairs

    @property
    def workspace(self) -> Optional[Array]:
        """The V^T workspace this fp8 plan owns (None before its first run without ``workspace=``)."""
        return self._workspace

    def __repr__(self) -> str:
        p = self._p
        return (f"PrefillPlan(batch={p.batch}, num_heads={p.heads}, dtype={p.dtype.name}, out_dtype={p.out_dtype.name}, "
                f"mask={p.mask!r}, q_max_seq_len={p.max_sq}, kernel={self.kernel!r}, paged={p.paged}, fp8={p.fp8}, "
                f"fp8_rope={p.fp8_rope})")

    # -- runs -------------------------------------------------------------------------------------
    def run(self, q: Array, k: Array, v: Array, k_rope: Union[Array, PagedKVCache], *,
            k_rope_scales: Optional[Array] = None, out: Optional[Array] = None, lse: Optional[Array] = None,
            stream: Stream = None) -> Union[Array, Tuple[Array, Array]]:
        """The prefill of one layer with this plan's layout.

        Parameters
        ----------
        q : ``[Tq, H, 192]`` device array of the plan's dtype
        k, v : ``[Tk, H, 128]``, same dtype
        k_rope : ``[Tk, 1, 64]`` array, or for a paged plan the cache blocks ``[num_blocks,
            page_size, 1, Dc]`` (or a :class:`PagedKVCache` over them with the plan's page table)
        k_rope_scales : float32 device array, optional
            For an fp8-rope plan: ``[Tk, 1, 1]``, or for a paged one ``[num_blocks, page_size, 1,
            Dc / 64]`` (a :class:`PagedKVCache` brings its ``scales``).
        out : ``[Tq, H, 128]`` device array of the plan's ``out_dtype``, optional
        lse : ``[Tq, H]`` float32 device array, optional
        stream : cupy / torch stream or raw ``cudaStream_t`` int, optional

        Returns
        -------
        out, and ``lse`` when the plan was built with ``return_lse=True``. ``out`` / ``lse`` are the
        arrays passed, or new ones of the kind of ``q`` (torch in, torch out).
        """
        if self._fp8:
            raise TypeError("run: this plan is for fp8 inputs; call plan.run_fp8(q_nope, q_rope, q_scale, k, k_scales, v, "
                            "k_rope, ...)")
        if type(k_rope) is PagedKVCache:
            if k_rope_scales is None:
                k_rope_scales = k_rope.scales
            self._check_cache_matches(k_rope)
            k_rope = k_rope.blocks
        return self._run(prefill_arrays(q, k, v, k_rope, out, lse, k_rope_scales), stream)

    def run_fp8(self, q_nope: Array, q_rope: Array, q_scale: Array, k: Array, k_scales: Array,
                v: Union[Array, TransposedV], k_rope: Union[Array, PagedKVCache], *, out: Optional[Array] = None,
                lse: Optional[Array] = None, stream: Stream = None,
                workspace: Optional[Array] = None) -> Union[Array, Tuple[Array, Array]]:
        """The prefill of one layer of fp8 per-token inputs with this (fp8) plan's layout; the
        arrays are those of :func:`mla_cupy.mla_prefill_fp8`. ``workspace`` (a contiguous uint8
        device array of at least ``prod(fp8.vt_shape(H, Tk, B))`` bytes) receives V^T; without it
        the plan's own workspace does, allocated by the first run (and again only by a run with
        more keys than any before). Returns ``out`` (and ``lse`` with ``return_lse``).

        ``v`` may be V^T made ahead (a :class:`~mla_cupy.fp8.TransposedV`, from
        ``quant.quantize_per_token(..., cache_row_offsets=...)``): the run then launches the
        attention kernel alone, and takes no workspace. Its offsets must be the plan's
        ``cache_row_offsets`` (the array given to :func:`plan`, or the device array the plan reads:
        the same object, or one of the same length at the same device address); failing that, a
        plan that read its offsets (``validate=True`` or no ``q_max_seq_len``) compares their
        values (a read of the TransposedV's offsets per run), any other refuses it
        (``ValueError`` naming ``v``). Its H and Tk are checked with the other arrays, on the first
        run of a layout."""
        if not self._fp8:
            raise TypeError("run_fp8: this plan is for 16-bit inputs; call plan.run(q, k, v, k_rope, ...)")
        q_nope, k, v = fp8_bytes(q_nope, "q_nope"), fp8_bytes(k, "k"), fp8_bytes(v, "v")
        q_rope, k_rope = fp8_bytes(q_rope, "q_rope"), fp8_bytes(k_rope, "k_rope")
        if type(k_rope) is PagedKVCache:
            self._check_cache_matches(k_rope)
            k_rope = k_rope.blocks
        return self._run(prefill_arrays(q_nope, k, v, k_rope, out, lse, None, q_rope, q_scale, k_scales, workspace),
                         stream)

    def run_backward(self, dout: Array, q: Array, k: Array, v: Array, k_rope: Array, out: Array, lse: Array, *,
                     dq: Optional[Array] = None, dk: Optional[Array] = None, dv: Optional[Array] = None,
                     dk_rope: Optional[Array] = None, dlse: Optional[Array] = None, deterministic: bool = False,
                     stream: Stream = None) -> Tuple[Array, Array, Array, Array]:
        """The backward of one layer with this (16-bit, plain-rope) plan's layout: the gradients of
        :meth:`run`'s result, as :func:`mla_cupy.mla_prefill_backward` computes them.

        Parameters
        ----------
        dout : ``[Tq, H, 128]`` device array of the plan's dtype
            The gradient of the loss with respect to the layer's ``out``.
        q, k, v, k_rope
            The layer's inputs, as :meth:`run` took them (``k_rope`` a plain ``[Tk, 1, 64]`` array).
        out, lse
            The forward's results (``out`` in the plan's dtype or float32, ``lse`` float32).
        dq, dk, dv, dk_rope : device arrays of the plan's dtype, optional
            Where the gradients go (``[Tq, H, 192]``, ``[Tk, H, 128]`` twice, ``[Tk, 1, 64]``);
            new ones of the kind of ``q`` where not given.
        dlse : ``[Tq, H]`` float32 device array, optional
            The gradient of the loss with respect to ``lse``, when the loss reads it.
        deterministic : bool
            dq's sums in a fixed order of the key blocks: the same bits on every run.
        stream : cupy / torch stream or raw ``cudaStream_t`` int, optional

        Returns
        -------
        dq, dk, dv, dk_rope

        Notes
        -----
        The first run of a layout checks the arrays against the plan and packs the launches; later
        runs rewrite the pointers and launch. The plan keeps the backward's float32 workspace per
        stream it ran on (about 780 bytes per query row and head, kernels/backward.cuh).
        """
        check_deterministic(deterministic)
        return self._run_backward(backward_arrays(dout, q, k, v, k_rope, out, lse, dq, dk, dv, dk_rope, dlse),
                                  bool(deterministic), stream)

    def _run_backward(self, arrays: BackwardArrays, deterministic: bool,
                      stream: Stream) -> Tuple[Array, Array, Array, Array]:
        """A backward run, as :meth:`_run` a forward one: the record of its arrays' layout as given
        (checked and packed by the first run of that layout, :meth:`_first_backward_run`), gradients
        made where none are given, the pointers rewritten and launched."""
        torch_in = is_torch(arrays.q)
        try:
            ptrs, layouts = pointers_and_layouts(arrays)
        except (TypeError, AttributeError):
            ptrs, layouts = pointers_and_layouts(self._checkable_backward(arrays))
        key = ("backward", deterministic, *layouts)
        rec = self._records.get(key)
        if rec is not None:
            return self._launch_backward(rec, arrays, ptrs, stream, torch_in)
        return self._first_backward_run(key, arrays, deterministic, stream, torch_in)

    def _launch_backward(self, rec: Record, arrays: BackwardArrays, ptrs: list, stream, torch_in: bool):
        """Launch ``rec`` over ``arrays`` (``ptrs`` their pointers), new gradients where none are given."""
        if any(getattr(arrays, name) is None for name in GRADIENTS):
            arrays = _with_gradients(arrays, torch_in)
            for slot in _GRADIENT_SLOTS:
                ptrs[slot] = device_pointer(arrays[slot])
        launch_record(rec, ptrs, self._raw_stream(stream, torch_in))
        return arrays.dq, arrays.dk, arrays.dv, arrays.dk_rope

    def _first_backward_run(self, key: tuple, arrays: BackwardArrays, deterministic: bool, stream, torch_in: bool):
        """A backward run of a layout the plan has not run, as :meth:`_first_run` a forward one."""
        with_gradients = arrays
        if any(getattr(arrays, name) is None for name in GRADIENTS):
            check_backward_run(self._p, self._t, self._bounds, self._checkable_backward(arrays))
            with_gradients = _with_gradients(arrays, torch_in)
        checkable_arrays = self._checkable_backward(with_gradients)
        run_p = check_backward_run(self._p, self._t, self._bounds, checkable_arrays)
        rec = self._remember(key, pack_backward(self._t, run_p, checkable_arrays, deterministic=deterministic))
        ptrs, _ = pointers_and_layouts(checkable_arrays)
        return self._launch_backward(rec, with_gradients, ptrs, stream, torch_in)

    def _raw_stream(self, stream, torch_in: bool) -> int:
        """The raw stream of a run: CuPy's current one for CuPy arrays and no ``stream``."""
        if stream is None and not torch_in:
            return self._current_stream().ptr
        return stream_ptr(stream, torch_in)

    @staticmethod
    def _checkable_backward(arrays: BackwardArrays) -> BackwardArrays:
        return BackwardArrays(*(None if x is None else checkable(x, name)
                                for name, x in zip(BackwardArrays._fields, arrays)))

    def _check_cache_matches(self, cache: PagedKVCache) -> None:
        if not self._p.paged:
            raise TypeError("k_rope: this plan is for a plain [Tk, 1, 64] rope, got a PagedKVCache")
        if cache.page_size != self.page_size or cache.rope_offset != self.rope_offset:
            raise ValueError(f"k_rope: page_size {cache.page_size} / rope_offset {cache.rope_offset} differ from the "
                             f"plan's {self.page_size} / {self.rope_offset}")
        table = self._t.page_table
        if cache.lookup_table is not table and (device_pointer(as_device(cache.lookup_table, "k_rope.lookup_table"))
                                                != device_pointer(table)):
            raise ValueError("k_rope.lookup_table: a paged plan reads the page table it was built with; pass the cache "
                             "blocks (or a PagedKVCache over that table)")

    def _run(self, arrays: PrefillArrays, stream):
        """A run: the record of its arrays' layout (checked and packed by the first run of that
        layout, :meth:`_first_run`), results made where none are given, the pointers rewritten and
        launched (:meth:`_launch`). The layout is the arrays' as given (``out`` / ``lse`` None
        included), so a layout run before was checked and its results are made without checks."""
        torch_in = is_torch(arrays.q)
        v = arrays.v
        tv = v if type(v) is TransposedV else None  # V^T made ahead: its data in place of v
        if tv is not None:
            given, device = self._cro
            check_transposed_v_offsets(tv, self._p.batch, given, self._bounds.cache_row_offsets is not None,
                                       self._bounds.cache_row_offsets, also=device)
            arrays = arrays._replace(v=tv.data)
        try:
            ptrs, layouts = pointers_and_layouts(arrays)  # read without converting the arrays
        except (TypeError, AttributeError):  # read through DLPack, or not an array: the CuPy views (or the error)
            ptrs, layouts = pointers_and_layouts(self._checkable(arrays, None))
        key = (*layouts, None if tv is None else tv.num_keys)
        last_key, rec = self._last  # the previous run's layout: most runs' own (no hash)
        if key != last_key:
            rec = self._records.get(key)
            if rec is not None:
                self._last = (key, rec)
        if rec is not None:
            return self._launch(rec, arrays, ptrs, tv, stream, torch_in)
        return self._first_run(key, arrays, tv, stream, torch_in)

    def _launch(self, rec: Record, arrays: PrefillArrays, ptrs: list, tv, stream, torch_in: bool):
        """Launch ``rec`` over ``arrays`` (``ptrs`` their pointers; ``tv`` the V^T made ahead whose
        data is v, or None): new ``out`` / ``lse`` where none are given, the plan's own fp8
        workspace where the run brings none."""
        out, lse = arrays.out, arrays.lse
        if out is None or (lse is None and self.return_lse):
            arrays = self._with_results(arrays, torch_in)
            out, lse = arrays.out, arrays.lse
            ptrs[_OUT] = device_pointer(out)
            ptrs[_LSE] = optional_ptr(lse)
        if self._fp8 and tv is None and arrays.workspace is None:
            ptrs[_WORKSPACE] = self._workspace.data.ptr if self._workspace is not None else 0
        launch_record(rec, ptrs, self._raw_stream(stream, torch_in))
        return (out, lse) if self.return_lse else out

    @staticmethod
    def _checkable(arrays: PrefillArrays, tv) -> PrefillArrays:
        """A run's arrays as the checks read them (:func:`~mla_cupy._arrays.checkable`); with ``tv``
        (v holding its data) v is the TransposedV over the checkable data."""
        checkable_arrays = PrefillArrays(*(None if x is None else checkable(x, name)
                                           for name, x in zip(PrefillArrays._fields, arrays)))
        if tv is not None:
            checkable_arrays = checkable_arrays._replace(v=tv.with_data(checkable_arrays.v))
        return checkable_arrays

    def _with_results(self, arrays: PrefillArrays, torch_in: bool) -> PrefillArrays:
        """``arrays`` with new ``out`` (and, for a plan that returns it, ``lse``) where none is given:
        of the kind of ``q`` (torch in, torch out)."""
        p, q = self._p, arrays.q
        torch_device = q.device if torch_in else None
        wrap = result_wrapper(q)
        out, lse = arrays.out, arrays.lse
        if out is None:
            out = wrap(empty_result((int(q.shape[0]), p.heads, DV), p.out_dtype, torch_device))
        if lse is None and self.return_lse:
            lse = wrap(empty_result((int(q.shape[0]), p.heads), FP32, torch_device, "lse"))
        return arrays._replace(out=out, lse=lse)

    # -- the first run of a layout: checks and packing --------------------------------------------
    def _first_run(self, key: tuple, arrays: PrefillArrays, tv, stream, torch_in: bool):
        """A run of a layout the plan has not run: its arrays checked against the plan
        (:func:`~mla_cupy._plan_checks.check_run`; without results first, so that a bad ``q`` is
        told before results are made from its rows), packed, remembered under ``key`` and launched."""
        with_results = arrays
        if arrays.out is None or (arrays.lse is None and self.return_lse):
            check_run(self._p, self._t, self._bounds, self._checkable(arrays, tv))
            with_results = self._with_results(arrays, torch_in)
        checkable_arrays = self._checkable(with_results, tv)
        run_p = check_run(self._p, self._t, self._bounds, checkable_arrays)  # device arrays from here on
        if tv is not None:
            checkable_arrays = checkable_arrays._replace(v=checkable_arrays.v.data)
        rec = self._remember(key, pack(self._t, run_p, checkable_arrays, stream_ptr(stream, torch_in),
                                       self._workspace_for))
        self._last = (key, rec)
        ptrs, _ = pointers_and_layouts(checkable_arrays)
        return self._launch(rec, with_results, ptrs, tv, stream, torch_in)

    def _remember(self, key: tuple, rec: Record) -> Record:
        with self._lock:
            if len(self._records) >= _RECORDS_MAX:
                self._records.clear()
            self._records[key] = rec
        return rec

    def _workspace_for(self, given, shape, raw_stream: int):
        """The V^T workspace of a run: the caller's (checked), or the plan's own, grown to ``shape``
        (allocated on the run's stream)."""
        if given is not None:
            return check_workspace(given, shape)
        if self._workspace is None or self._workspace.size < math.prod(shape):
            self._workspace = workspace_on(shape, raw_stream)
        return self._workspace


#: The slots of a forward run's results, made where a run gives none, and of its V^T workspace,
#: which a plan may fill with its own.
_OUT, _LSE, _WORKSPACE = (PrefillArrays._fields.index(name) for name in ("out", "lse", "workspace"))
#: The slots of a backward run's gradients, made where a run gives none.
_GRADIENT_SLOTS = tuple(BackwardArrays._fields.index(name) for name in GRADIENTS)


def _with_gradients(arrays: BackwardArrays, torch_in: bool) -> BackwardArrays:
    """``arrays`` with new gradients where none are given: in q's dtype, of the kind of ``q``."""
    q = arrays.q
    new = new_gradients(q, int(arrays.k.shape[0]), np.dtype(checkable(q, "q").dtype),
                        tuple(getattr(arrays, name) for name in GRADIENTS))
    wrap = result_wrapper(q)
    return arrays._replace(**{name: wrap(x) for name, x in zip(GRADIENTS, new) if x is not None})


def workspace_on(shape, raw_stream: int):
    """A new V^T workspace of ``prod(shape)`` bytes (at least one), from CuPy's pool on the raw
    stream ``raw_stream``."""
    return allocate_on(shape, raw_stream)


def plan(
    valid_length: Array, cache_row_offsets: Array, *, num_heads: int, dtype: Any, mask: Optional[Mask] = None,
    scale: Optional[float] = None, q_max_seq_len: Optional[int] = None, kernel: str = "auto",
    cache_offsets: Optional[Array] = None, q_start_pos: Optional[Array] = None, page_table: Optional[Array] = None,
    page_size: Optional[int] = None, rope_offset: int = 512, fp8: bool = False, fp8_rope: bool = False,
    out_dtype: Any = None, return_lse: bool = False, accumulate: bool = False, validate: bool = True,
) -> PrefillPlan:
    """Build the prefill plan of one batch layout, to run once per layer (:meth:`PrefillPlan.run`).

    Parameters
    ----------
    valid_length : ``[B + 1]`` int32/uint32 array
        Row offsets of each sequence's queries, as in :func:`mla_cupy.mla_prefill`. A device array
        is read in place (keep it alive and unchanged); a host array (NumPy, torch CPU) is copied
        to the device.
    cache_row_offsets : ``[B + 1]`` int32/uint32 array
        Row offsets of each sequence's keys in k / v (and a plain k_rope); host or device.
    num_heads : int
        H, the heads of q, k, v.
    dtype : bfloat16 or float16 (NumPy / ml_dtypes dtype, or a torch dtype)
        Dtype of q, k, v (of q_rope and k_rope for an fp8 plan: bfloat16).
    mask, scale : optional
        As in :func:`mla_cupy.mla_prefill` (default causal, ``1 / sqrt(192)``).
    q_max_seq_len : int, optional
        Upper bound on any sequence's query count (sizes the grid). Default: read from the offsets.
        With ``validate=False`` and ``q_max_seq_len`` given, building the plan reads nothing back
        from the device.
    kernel : {"auto", "sm80", "sm90"}
        As in :func:`mla_cupy.mla_prefill`; resolved here (``plan.kernel``).
    cache_offsets, q_start_pos : ``[B]`` arrays, optional
        Absolute positions of each sequence's first key / query, as in :func:`mla_cupy.mla_prefill`
        (host or device; an int32 ``q_start_pos`` is widened once here).
    page_table : ``[B, max_pages]`` int32/uint32 array, optional
        A paged rope's block ids (``PagedKVCache.lookup_table``): the plan is then paged and each
        run takes the cache blocks as ``k_rope``. Host or device.
    page_size : int
        Keys per page of a paged cache (a power of two from 16 to 512); with ``page_table`` only.
    rope_offset : int
        Column of the rope in a paged cache row (default 512).
    fp8 : bool
        Plan the fp8 per-token variant (:meth:`PrefillPlan.run_fp8`, Hopper only).
    fp8_rope : bool
        Plan for an fp8 (e4m3) rope with float32 scales (``k_rope_scales`` /
        ``PagedKVCache.scales``) and bfloat16 q, k, v (Hopper only). With ``fp8=True``: the
        all-e4m3 mode, e4m3 ``q_rope`` and plain ``k_rope`` under the per-token scales (no
        ``page_table``).
    out_dtype : dtype, optional
        ``dtype`` (default) or float32.
    return_lse : bool
        Runs return ``(out, lse)`` (lse allocated unless ``lse=`` is given).
    accumulate : bool
        Runs merge into ``out`` (float32) and ``lse`` in place, as in :func:`mla_cupy.mla_prefill`.
    validate : bool
        Check the offsets' values, and the page table's block ids, on the host.

    Returns
    -------
    PrefillPlan

    Notes
    -----
    Every check of the layout runs here, before the plan needs a GPU: a CPU machine hears about a
    bad layout (decreasing offsets, a negative scale, a page table too narrow...) exactly as a GPU
    one does. The arrays of a run are checked against the plan the first time a run sees their
    layout.
    """
    args = check_plan_args(valid_length, cache_row_offsets, num_heads=num_heads, dtype=dtype, mask=mask, scale=scale,
                           q_max_seq_len=q_max_seq_len, kernel=kernel, cache_offsets=cache_offsets,
                           q_start_pos=q_start_pos, page_table=page_table, page_size=page_size, rope_offset=rope_offset,
                           fp8=fp8, fp8_rope=fp8_rope, out_dtype=out_dtype, return_lse=return_lse,
                           accumulate=accumulate, validate=validate)
    layout = args.problem
    _require_gpu()
    dev = _select.device_id()
    vl, cro = _upload(args.valid_length, "valid_length"), _upload(args.cache_row_offsets, "cache_row_offsets")
    co, q_start = _upload(args.cache_offsets, "cache_offsets"), q_start_i64(_upload(args.q_start_pos, "q_start_pos"))
    lut = _upload(args.page_table, "page_table") if layout.paged else None
    if lut is not None and lut.shape[1] > 1 and int(lut.strides[1]) != dtype_of(lut).itemsize:
        raise ValueError(f"page_table: the last dimension must be contiguous, got strides {tuple(lut.strides)}")
    check_same_device([vl, cro, co, q_start, lut])
    chosen = kernel_for(layout, kernel, dev)
    cro_ptr = device_pointer(cro)
    offsets = offsets_of(vl, cro_ptr, cro_ptr + 4, co, q_start, keep=(cro, lut))
    target = Target(chosen, dev, offsets, bool(accumulate), lut, page_size or 0, rope_offset if layout.paged else 0)
    return PrefillPlan(layout, target, return_lse=return_lse, bounds=args.bounds,
                       cache_row_offsets=(cache_row_offsets, cro))


def kernel_for(p: Problem, kernel: str, dev: int) -> str:
    """The kernel a plan of ``p`` runs for the ``kernel`` argument on device ``dev``; the fp8
    variants need the Hopper one."""
    chosen = choose_kernel(kernel, p.paged, dev)
    if (p.fp8 or p.fp8_rope) and (kernel == "sm80" or chosen != "sm90"):
        what = "the fp8 per-token variant" if p.fp8 else "an fp8 rope"
        raise ValueError(f"kernel: {what} runs on the Hopper kernel only (compute capability 9.0, kernel='auto' or "
                         f"'sm90'), got kernel={kernel!r}")
    return chosen


def call_target(problem: Problem, offsets: Offsets, kernel: str, accumulate: bool, *, page_table=None,
                page_size: int = 0, rope_offset: int = 0) -> Target:
    """What a plan of one checked call fixes besides its problem (:func:`mla_cupy.mla_prefill` and
    what is built on it; the chunks of :func:`mla_cupy.mla_prefill_chunked`), as :func:`plan` fixes
    it for a layout: the kernel of the ``kernel`` argument on the current device, the offsets'
    pointers (``offsets.keep`` dropped: the call keeps its arrays alive until its launch) and a
    paged rope's table and geometry."""
    dev = _select.device_id()
    return Target(kernel_for(problem, kernel, dev), dev, replace(offsets, keep=()), bool(accumulate), page_table,
                  page_size, rope_offset)


def offsets_of(valid_length, kv_begin_ptr: int, kv_end_ptr: int, cache_offsets, q_start_pos, keep: tuple = ()) -> Offsets:
    """The offsets of a launch from device arrays (``q_start_pos`` int64) and raw key-range pointers."""
    return Offsets((valid_length, cache_offsets, q_start_pos) + tuple(keep), device_pointer(valid_length), kv_begin_ptr,
                    kv_end_ptr, optional_ptr(cache_offsets), optional_ptr(q_start_pos))

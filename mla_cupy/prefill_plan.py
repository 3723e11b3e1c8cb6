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
import struct
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ._arrays import (BF16, FP32, as_device, checkable, cupy_or_none, device_pointer, is_torch, optional_ptr,
                      result_wrapper, to_host)
from ._checks import OFFSET_DTYPES, check_aligned, check_array, check_layout, check_offsets_layout, check_shape, dtype_of
from ._geometry import BLOCK_M, SM90_BLOCK_N, prefill_kernel
from ._launch import PreparedLaunch
from ._prefill_args import SM80_ARGS, SM90_ARGS
from ._select import check_kernel_name, choose_kernel, heads_per_section, sm_count
from .dims import DV
from .fp8 import check_fp8_arrays, check_fp8_layout, vt_launch, vt_shape
from .masks import Mask
from .paged import PagedKVCache, check_page_geometry
from .tma import ZERO_MAP, prefill_maps, stride16
from .validation import (DEVICE_DTYPES, Problem, check_accumulate, check_grid, check_lse_and_accumulate,
                         check_lse_layout, check_offset_values, check_offsets, check_out, check_out_dtype,
                         check_paged_table, check_positions, check_qkv, check_rope, check_rope_layout,
                         check_same_device, check_scalars, require_devices, rope_arrays)
from .workspace import allocate_workspace, check_workspace, empty_result

__all__ = ["plan", "PrefillPlan"]

LOG2E = 1.4426950408889634
_U64 = struct.Struct("<Q")
_RECORDS_MAX = 256  # array layouts remembered per plan
_MAPS_MAX = 1024  # pointer sets whose tensor maps are remembered per layout

# Argument slots of a run, in this order: the pointers of a run are a tuple over them.
SLOTS = ("q", "k", "v", "k_rope", "out", "lse", "k_rope_scales", "q_rope", "q_scale", "k_scales", "workspace")
_Q, _K, _V, _ROPE, _OUT, _LSE, _RSC, _QR, _QS, _KS, _WS = range(len(SLOTS))


@dataclass(frozen=True)
class _Offsets:
    """Device pointers of the offset arrays a launch reads, and the arrays they belong to."""

    keep: tuple
    q_offsets: int
    kv_begin: int
    kv_end: int
    cache_offsets: int
    q_start: int


class _Record:
    """One array layout of a plan: the prepared launches and what a run rewrites in them."""

    __slots__ = ("launch", "ptr_fields", "map_slots", "make_maps", "maps", "vt", "vt_fields", "align")

    def __init__(self, launch: Optional[PreparedLaunch], ptr_fields, align, map_slots=None, make_maps=None, vt=None,
                 vt_fields=()):
        self.launch, self.ptr_fields, self.align = launch, ptr_fields, align
        self.map_slots, self.make_maps, self.maps = map_slots, make_maps, {}
        self.vt, self.vt_fields = vt, vt_fields


def _cupy_ndarray():
    cp = cupy_or_none()
    return cp.ndarray if cp is not None else None


def _describe(x, cp_nd) -> Optional[Tuple[int, tuple]]:
    """(data pointer, layout key) of a CuPy array or torch tensor without converting it; None for
    other kinds of arrays."""
    if x is None:
        return 0, None
    t = type(x)
    if t is cp_nd:
        d = x.data
        return d.ptr, (x.shape, x.strides, x.dtype, d.device_id)
    if t.__module__.startswith("torch"):
        return x.data_ptr(), (t, x.shape, x.stride(), x.dtype, x.device)
    return None


def _layout_key(x) -> Optional[tuple]:
    """The layout key of any array (the slow path of :func:`_describe`)."""
    if x is None:
        return None
    return type(x), tuple(int(n) for n in x.shape), tuple(int(n) for n in x.strides), np.dtype(x.dtype)


def _stream_ptr(stream, torch_in: bool) -> int:
    """The raw cudaStream_t of the ``stream=`` argument (default: CuPy's current stream, or
    torch's for torch inputs)."""
    if stream is None:
        if torch_in:
            import torch

            return int(torch.cuda.current_stream().cuda_stream)
        import cupy

        return cupy.cuda.get_current_stream().ptr
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    ptr = getattr(stream, "ptr", None)
    if isinstance(ptr, int):
        return ptr
    if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        return int(stream.cuda_stream)
    raise TypeError(f"stream: expected a cupy.cuda.Stream, a torch.cuda.Stream or a raw cudaStream_t int, got "
                    f"{type(stream).__name__}")


def _q_start_i64(q_start_pos):
    """The kernels read int64 positions: an int32 array is widened (a B-element copy, at plan time)."""
    if q_start_pos is None or dtype_of(q_start_pos) == np.int64:
        return q_start_pos
    import cupy

    return cupy.asarray(q_start_pos).astype(cupy.int64)


def _require_gpu() -> None:
    cp = cupy_or_none()
    count = 0
    if cp is not None:
        try:
            count = cp.cuda.runtime.getDeviceCount()
        except Exception:  # no driver, or no device
            count = 0
    if not count:
        raise RuntimeError("plan: needs a CUDA GPU and CuPy (pip install mla_cupy[cuda12] or [cuda13]); on a CPU use "
                           "mla_cupy.reference.mla_prefill")


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
    contents only for a layout with the same maximum query count and still valid for the plan.
    Runs of one plan may come from several threads; runs that can overlap on different streams
    must not share the plan's own V^T workspace (pass ``workspace=`` to each).
    """

    def __init__(self, layout: Problem, offsets: _Offsets, kernel: str, device_id: int, *, accumulate: bool,
                 return_lse: bool, page_table=None, page_size: int = 0, rope_offset: int = 0,
                 page_table_host: Optional[np.ndarray] = None, cache_offsets_host: Optional[np.ndarray] = None,
                 kv_sizes_host: Optional[np.ndarray] = None, kv_total: Optional[int] = None, validate: bool = True):
        self._p = layout
        self._offsets = offsets
        self.kernel = kernel
        self._device = device_id
        self.accumulate = bool(accumulate)
        self.return_lse = bool(return_lse)
        self._page_table = page_table
        self.page_size, self.rope_offset = page_size, rope_offset
        self._table_host, self._co_host, self._sk_host = page_table_host, cache_offsets_host, kv_sizes_host
        self._kv_total = kv_total
        self._validate = validate
        self._records: Dict[tuple, _Record] = {}
        self._lock = threading.Lock()
        self._workspace = None
        self._cp_nd = _cupy_ndarray()

    # -- what the plan is -----------------------------------------------------------------------
    batch = property(lambda self: self._p.batch)
    num_heads = property(lambda self: self._p.heads)
    dtype = property(lambda self: self._p.dtype)
    out_dtype = property(lambda self: self._p.out_dtype)
    mask = property(lambda self: self._p.mask)
    scale = property(lambda self: self._p.scale)
    q_max_seq_len = property(lambda self: self._p.max_sq)
    num_queries = property(lambda self: self._p.tq if self._p.tq >= 0 else None)
    paged = property(lambda self: self._p.paged)
    fp8 = property(lambda self: self._p.fp8)
    fp8_rope = property(lambda self: self._p.rope8)

    @property
    def workspace(self):
        """The V^T workspace this fp8 plan owns (None before its first run without ``workspace=``)."""
        return self._workspace

    def __repr__(self) -> str:
        p = self._p
        return (f"PrefillPlan(batch={p.batch}, num_heads={p.heads}, dtype={p.dtype.name}, out_dtype={p.out_dtype.name}, "
                f"mask={p.mask!r}, q_max_seq_len={p.max_sq}, kernel={self.kernel!r}, paged={p.paged}, fp8={p.fp8}, "
                f"fp8_rope={p.rope8})")

    # -- runs -------------------------------------------------------------------------------------
    def run(self, q, k, v, k_rope, *, k_rope_scales=None, out=None, lse=None, stream=None):
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
        if self._p.fp8:
            raise TypeError("run: this plan is for fp8 inputs; call plan.run_fp8(q_nope, q_rope, q_scale, k, k_scales, v, "
                            "k_rope, ...)")
        if type(k_rope) is PagedKVCache:
            if k_rope_scales is None:
                k_rope_scales = k_rope.scales
            self._check_cache_matches(k_rope)
            k_rope = k_rope.blocks
        return self._run((q, k, v, k_rope, out, lse, k_rope_scales, None, None, None, None), stream)

    def run_fp8(self, q_nope, q_rope, q_scale, k, k_scales, v, k_rope, *, out=None, lse=None, stream=None,
                workspace=None):
        """The prefill of one layer of fp8 per-token inputs with this (fp8) plan's layout; the
        arrays are those of :func:`mla_cupy.mla_prefill_fp8`. ``workspace`` (a contiguous uint8
        device array of at least ``prod(fp8.vt_shape(H, Tk, B))`` bytes) receives V^T; without it
        the plan's own workspace does, allocated by the first run (and again only by a run with
        more keys than any before). Returns ``out`` (and ``lse`` with ``return_lse``)."""
        if not self._p.fp8:
            raise TypeError("run_fp8: this plan is for 16-bit inputs; call plan.run(q, k, v, k_rope, ...)")
        from .fp8 import fp8_bytes

        q_nope, k, v = fp8_bytes(q_nope, "q_nope"), fp8_bytes(k, "k"), fp8_bytes(v, "v")
        if type(k_rope) is PagedKVCache:
            self._check_cache_matches(k_rope)
            k_rope = k_rope.blocks
        return self._run((q_nope, k, v, k_rope, out, lse, None, q_rope, q_scale, k_scales, workspace), stream)

    def _check_cache_matches(self, cache: PagedKVCache) -> None:
        if not self._p.paged:
            raise TypeError("k_rope: this plan is for a plain [Tk, 1, 64] rope, got a PagedKVCache")
        if cache.page_size != self.page_size or cache.rope_offset != self.rope_offset:
            raise ValueError(f"k_rope: page_size {cache.page_size} / rope_offset {cache.rope_offset} differ from the "
                             f"plan's {self.page_size} / {self.rope_offset}")
        if cache.lookup_table is not self._page_table and device_pointer(as_device(cache.lookup_table, "k_rope.lookup_table")) \
                != device_pointer(self._page_table):
            raise ValueError("k_rope.lookup_table: a paged plan reads the page table it was built with; pass the cache "
                             "blocks (or a PagedKVCache over that table)")

    def _run(self, a: tuple, stream):
        torch_in = is_torch(a[_Q])
        sp = _stream_ptr(stream, torch_in)
        out, lse = a[_OUT], a[_LSE]
        if out is None or (lse is None and self.return_lse):
            a, out, lse = self._allocate(a, torch_in)
        cp_nd = self._cp_nd
        ptrs, keys = [], []
        for x in a:
            d = _describe(x, cp_nd)
            if d is None:  # neither CuPy nor torch (e.g. a Numba device array)
                a = tuple(None if y is None else as_device(y, SLOTS[i]) for i, y in enumerate(a))
                ptrs, keys = [optional_ptr(y) for y in a], [_layout_key(y) for y in a]
                break
            ptrs.append(d[0])
            keys.append(d[1])
        key = tuple(keys)
        rec = self._records.get(key)
        if rec is None:
            rec = self._new_record(a, key, sp)
        if self._p.fp8 and a[_WS] is None:
            ptrs[_WS] = self._workspace.data.ptr if self._workspace is not None else 0
        self._launch(rec, ptrs, sp)
        return (out, lse) if self.return_lse else out

    def _allocate(self, a: tuple, torch_in: bool):
        p = self._p
        q = a[_Q]
        tq = int(q.shape[0])
        like = q if torch_in else None
        out, lse = a[_OUT], a[_LSE]
        wrap = result_wrapper(q)
        if out is None:
            out = wrap(empty_result((tq, p.heads, DV), p.out_dtype, like))
        if lse is None and self.return_lse:
            lse = wrap(empty_result((tq, p.heads), FP32, like, "lse"))
        a = a[:_OUT] + (out, lse) + a[_LSE + 1:]
        return a, out, lse

    def _launch(self, rec: _Record, ptrs: List[int], sp: int) -> None:
        acc = 0
        for i in rec.align:
            acc |= ptrs[i]
        if acc & 15:
            for i in rec.align:
                check_aligned(ptrs[i], SLOTS[i])
        if rec.launch is None:
            return
        with self._lock:
            launch = rec.launch
            mem = launch._mem
            for off, i, add in rec.ptr_fields:
                _U64.pack_into(mem, off, ptrs[i] + add)
            if rec.map_slots is not None:
                mk = tuple([ptrs[i] for i in rec.map_slots])
                maps = rec.maps.get(mk)
                if maps is None:
                    maps = self._new_maps(rec, mk)
                launch.set_bytes("tm_q", maps)
            if rec.vt is not None:
                vmem = rec.vt._mem
                for off, i, add in rec.vt_fields:
                    _U64.pack_into(vmem, off, ptrs[i] + add)
                rec.vt.launch(sp)
            launch.launch(sp)

    @staticmethod
    def _new_maps(rec: _Record, mk: tuple) -> bytes:
        maps, box_rows = rec.make_maps(mk)
        data = b"".join(m.tobytes() for m in maps)
        if len(rec.maps) >= _MAPS_MAX:
            rec.maps.clear()
        rec.maps[mk] = data
        rec.launch._buf[0]["rope_box_rows"] = box_rows
        return data

    # -- the first run of a layout: checks and packing --------------------------------------------
    def _new_record(self, a: tuple, key: tuple, sp: int) -> _Record:
        dev = [None if x is None else as_device(x, SLOTS[i]) for i, x in enumerate(a)]
        run_p = self._check_run(dev)
        return self._remember(key, self._record(run_p, dev, sp))

    def _remember(self, key: tuple, rec: _Record) -> _Record:
        with self._lock:
            if len(self._records) >= _RECORDS_MAX:
                self._records.clear()
            self._records[key] = rec
        return rec

    def _check_run(self, d: list) -> Problem:
        """The arrays of a run against the plan, in argument order, then on the device."""
        p = self._p
        if p.fp8:
            tq, heads, tk = check_fp8_arrays(d[_Q], d[_QR], d[_QS], d[_K], d[_KS], d[_V])
            dtype = BF16
            qname = "q_nope"
        else:
            tq, heads, tk, dtype = check_qkv(d[_Q], d[_K], d[_V], device=True)
            qname = "q"
        if heads != p.heads:
            raise ValueError(f"{qname}: expected H = {p.heads} heads (the plan's num_heads), got shape {list(d[_Q].shape)}")
        if dtype != p.dtype:
            raise TypeError(f"{qname}: expected dtype {p.dtype.name} (the plan's dtype), got {dtype.name}")
        if p.tq >= 0 and tq != p.tq:
            raise ValueError(f"{qname}: expected Tq = {p.tq} rows (valid_length[-1] of the plan), got shape "
                             f"{list(d[_Q].shape)}")
        if self._kv_total is not None and tk < self._kv_total:
            raise ValueError(f"k: expected at least {self._kv_total} rows (cache_row_offsets[-1] of the plan), got shape "
                             f"{list(d[_K].shape)}")
        rope = self._rope_view(d[_ROPE], d[_RSC])
        rope8 = check_rope(rope, d[_RSC], tk, dtype, device=True, fp8=p.fp8)
        if rope8 != p.rope8:
            raise TypeError(f"k_rope: the plan was built for {'an fp8' if p.rope8 else 'a 16-bit'} rope (fp8_rope="
                            f"{p.rope8}), got dtype {dtype_of(rope.blocks if p.paged else rope).name}")
        check_out(d[_OUT], p.out_dtype, tq, heads)
        run_p = replace(p, tq=tq, tk=tk)
        check_lse_and_accumulate(run_p, d[_OUT], d[_LSE], self.accumulate)
        if p.paged and self._table_host is not None and self._validate:
            check_paged_table(self._table_host, self.page_size, int(rope.blocks.shape[0]), self._co_host, self._sk_host)
        named = [(qname, d[_Q])]
        named += [("q_rope", d[_QR]), ("q_scale", d[_QS]), ("k", d[_K]), ("k_scales", d[_KS])] if p.fp8 else [("k", d[_K])]
        named += [("v", d[_V])] + [(n, x) for n, x in rope_arrays(rope, d[_RSC]) if n != "k_rope.lookup_table"]
        named += [("out", d[_OUT]), ("lse", d[_LSE]), ("workspace", d[_WS])]
        require_devices(named)
        if p.fp8:
            check_fp8_layout(d[_Q], d[_QR], d[_K], d[_KS], d[_V])
        else:
            for i in (_Q, _K, _V):
                check_layout(d[i], SLOTS[i])
        check_rope_layout(rope)
        if d[_OUT] is not None:
            check_layout(d[_OUT], "out")
        check_lse_layout(d[_LSE], heads)
        check_same_device([x for _, x in named] + [self._page_table])
        return run_p

    def _rope_view(self, k_rope, scales):
        """A paged plan's blocks as the PagedKVCache the checks read; a plain rope as it is."""
        if not self._p.paged:
            if isinstance(k_rope, PagedKVCache):
                raise TypeError("k_rope: this plan is for a plain [Tk, 1, 64] rope, got a PagedKVCache")
            return k_rope
        check_array(k_rope, "k_rope.blocks", 4)
        check_shape(k_rope, "k_rope.blocks", (None, self.page_size, 1, None),
                    f"[num_blocks, page_size, 1, Dc] with the plan's page_size = {self.page_size}")
        return PagedKVCache(k_rope, self._page_table, self.page_size, self.rope_offset, scales)

    def _record(self, p: Problem, d: list, sp: int) -> _Record:
        """Pack the kernel arguments of layout ``p`` with the arrays ``d`` of its first run."""
        if p.batch == 0 or p.tq == 0 or not p.max_sq:
            return _Record(None, (), ())
        dev = self._device
        ck = prefill_kernel(self.kernel, p.dtype, p.out_dtype, p.mask, p.paged, p.fp8, p.rope8, dev)
        nmb = -(-p.max_sq // BLOCK_M)
        out, lse = d[_OUT], d[_LSE]
        oitem = p.out_dtype.itemsize
        o = self._offsets
        values: Dict[str, Any] = dict(
            out=device_pointer(out), lse=optional_ptr(lse), q_offsets=o.q_offsets, kv_begin=o.kv_begin, kv_end=o.kv_end,
            cache_offsets=o.cache_offsets, q_start_pos=o.q_start, o_st=out.strides[0] // oitem,
            o_sh=out.strides[1] // oitem, lse_st=0 if lse is None else lse.strides[0] // 4, num_heads=p.heads,
            heads_per_section=heads_per_section(p, dev), batch=p.batch, num_m_blocks=nmb, scale_log2=p.scale * LOG2E,
            mask_arg=p.mask.arg, accumulate=int(self.accumulate))
        rope_add = self._rope_args(p, d, values)
        fields = [("out", _OUT, 0), ("lse", _LSE, 0), ("rope_base", _ROPE, rope_add)]
        align = [i for i in (_Q, _K, _V, _OUT) if math.prod(d[i].shape)]
        if not p.rope8 and math.prod(d[_ROPE].shape):
            align.append(_ROPE)
        if self.kernel == "sm80":
            item = p.dtype.itemsize
            q, k, v = d[_Q], d[_K], d[_V]
            values.update(q=device_pointer(q), k=device_pointer(k), v=device_pointer(v),
                          q_st=q.strides[0] // item, q_sh=q.strides[1] // item, k_st=k.strides[0] // item,
                          k_sh=k.strides[1] // item, v_st=v.strides[0] // item, v_sh=v.strides[1] // item)
            launch = PreparedLaunch(SM80_ARGS, ck.fn, (nmb * p.batch * p.heads, 1, 1), ck.threads, ck.smem, values)
            fields += [("q", _Q, 0), ("k", _K, 0), ("v", _V, 0)]
            return _Record(launch, self._offsets_of(SM80_ARGS, fields), tuple(align))
        return self._sm90_record(p, d, ck, values, fields, align, nmb, sp)

    def _rope_args(self, p: Problem, d: list, values: dict) -> int:
        """The rope_* parameters into ``values``; returns the byte offset of the rope from its array's pointer."""
        rope, rs = d[_ROPE], d[_RSC]
        item = dtype_of(rope).itemsize
        if p.paged:
            lut = self._page_table
            add = self.rope_offset * item
            values.update(rope_base=device_pointer(rope) + add, rope_row_stride=int(rope.strides[1]) // item,
                          rope_block_stride=int(rope.strides[0]) // item, lookup=device_pointer(lut),
                          lookup_stride=int(lut.strides[0]) // 4, log2_page_size=int(math.log2(self.page_size)),
                          num_blocks=int(rope.shape[0]), max_pages=int(lut.shape[1]))
            if rs is not None:  # the rope's scale of slot 0
                values.update(rope_scales=device_pointer(rs) + 4 * (self.rope_offset // 64),
                              rope_scale_row_stride=int(rs.strides[1]) // 4, rope_scale_block_stride=int(rs.strides[0]) // 4)
            return add
        values.update(rope_base=device_pointer(rope), rope_row_stride=int(rope.strides[0]) // item, rope_block_stride=0,
                      lookup=0, lookup_stride=0, log2_page_size=0, num_blocks=0, max_pages=0)
        if rs is not None:
            values.update(rope_scales=device_pointer(rs), rope_scale_row_stride=int(rs.strides[0]) // 4,
                          rope_scale_block_stride=0)
        return 0

    def _sm90_record(self, p: Problem, d: list, ck, values: dict, fields: list, align: list, nmb: int,
                     sp: int) -> _Record:
        q, k, v, rope, out = d[_Q], d[_K], d[_V], d[_ROPE], d[_OUT]
        values.setdefault("rope_scales", 0)
        values.setdefault("rope_scale_row_stride", 0)
        values.setdefault("rope_scale_block_stride", 0)
        if d[_RSC] is not None:
            fields.append(("rope_scales", _RSC, 4 * (self.rope_offset // 64) if p.paged else 0))
        q_st = (stride16(q, 1), stride16(q, 0))
        k_st = (stride16(k, 1), stride16(k, 0))
        v_st = (stride16(v, 1), stride16(v, 0))
        vt = None
        vt_fields: tuple = ()
        v_slot = _V
        fp8_st = None
        values.update(q_scale=0, q_scale_stride=0)
        if p.fp8:
            qr, qs = d[_QR], d[_QS]
            fp8_st = (stride16(qr, 1), stride16(qr, 0))
            values.update(q_scale=device_pointer(qs), q_scale_stride=int(qs.strides[0]) // 4)
            fields.append(("q_scale", _QS, 0))
            if math.prod(qr.shape):
                align.append(_QR)
            if p.tk:
                align.append(_KS)
            shape = vt_shape(p.heads, p.tk, p.batch)
            ws = self._workspace_for(d[_WS], shape, sp)
            cols = shape[2]
            v_st = (cols, DV * cols)
            v_slot = _WS
            if p.tk:
                vt = vt_launch(v, self._offsets.kv_begin, self._offsets.kv_end, p.batch, ws.reshape(-1)[:math.prod(shape)]
                               .reshape(shape), self._device)
                vt_fields = self._offsets_of(vt.pack, [("v", _V, 0), ("vt", _WS, 0)])
        heads, tq, tk, dtype = p.heads, p.tq, p.tk, p.dtype
        paged, rope8 = p.paged, p.rope8
        rope_geom = None
        if not rope8:
            if paged:
                item = dtype.itemsize
                rope_geom = (self.rope_offset * item, int(rope.strides[1]), int(rope.strides[0]), self.page_size,
                             int(rope.shape[0]))
            else:
                rope_geom = (stride16(rope, 0),)

        def make_maps(mk: tuple):
            qp, kp, vp, rp, op, qrp, ksp = mk
            if not tk:  # no keys: nothing is read through K, V or the rope; a map of a null buffer is refused
                kp = vp = rp = ksp = op
            if rope8:
                rmap: tuple = (0,)
            elif paged:
                rmap = (rp + rope_geom[0],) + rope_geom[1:]
            else:
                rmap = (rp, rope_geom[0])
            f8 = (qrp, fp8_st, ksp) if fp8_st is not None else None
            return prefill_maps(dtype, heads, tq, tk, (qp, q_st), (kp, k_st), (vp, v_st), rmap, f8, SM90_BLOCK_N)

        values.update({n: ZERO_MAP for n in ("tm_q", "tm_k", "tm_v", "tm_rope", "tm_q_rope", "tm_k_scales")},
                      rope_box_rows=0)
        grid = min(nmb * p.batch * p.heads, sm_count(self._device))  # persistent: at most one CTA per SM
        launch = PreparedLaunch(SM90_ARGS, ck.fn, (grid, 1, 1), ck.threads, ck.smem, values)
        return _Record(launch, self._offsets_of(SM90_ARGS, fields), tuple(align),
                       map_slots=(_Q, _K, v_slot, _ROPE, _OUT, _QR, _KS), make_maps=make_maps, vt=vt, vt_fields=vt_fields)

    @staticmethod
    def _offsets_of(pack, fields) -> tuple:
        return tuple((pack.offsets[name], slot, add) for name, slot, add in fields)

    def _workspace_for(self, given, shape, sp: int):
        """The V^T workspace of a run: the caller's (checked), or the plan's own, grown to ``shape``
        (allocated on the run's stream)."""
        if given is not None:
            return check_workspace(given, shape)
        need = math.prod(shape)
        if self._workspace is None or self._workspace.size < need:
            import cupy

            with cupy.cuda.ExternalStream(sp):
                self._workspace = allocate_workspace((max(need, 1),))
        return self._workspace


def plan(
    valid_length, cache_row_offsets, *, num_heads: int, dtype, mask: Optional[Mask] = None,
    scale: Optional[float] = None, q_max_seq_len: Optional[int] = None, kernel: str = "auto", cache_offsets=None,
    q_start_pos=None, page_table=None, page_size: Optional[int] = None, rope_offset: int = 512, fp8: bool = False,
    fp8_rope: bool = False, out_dtype=None, return_lse: bool = False, accumulate: bool = False, validate: bool = True,
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
        ``PagedKVCache.scales``) and bfloat16 q, k, v (Hopper only).
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
    if fp8 and fp8_rope:
        raise ValueError("fp8_rope: the fp8 per-token variant keeps a bfloat16 rope; pass fp8=True or fp8_rope=True")
    check_positions(d_co, d_qs, batch)
    paged = d_lut is not None
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
    tq, kv_total, lut_h, co_h, sk_h = -1, None, None, None, None
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
    check_grid(max_sq, batch, num_heads)

    _require_gpu()
    from ._select import device_id

    dev = device_id()
    vl, cro = _upload(d_vl, "valid_length"), _upload(d_cro, "cache_row_offsets")
    co, qs = _upload(d_co, "cache_offsets"), _q_start_i64(_upload(d_qs, "q_start_pos"))
    lut = _upload(d_lut, "page_table") if paged else None
    if paged and lut.shape[1] > 1 and int(lut.strides[1]) != dtype_of(lut).itemsize:
        raise ValueError(f"page_table: the last dimension must be contiguous, got strides {tuple(lut.strides)}")
    check_same_device([vl, cro, co, qs, lut])
    chosen = choose_kernel(kernel, paged, dev)
    if (fp8 or fp8_rope) and chosen != "sm90":
        raise ValueError(f"kernel: the fp8 variants run on the Hopper kernel only (compute capability 9.0, kernel='auto' "
                         f"or 'sm90'), got kernel={kernel!r} on a device where it is {chosen!r}")
    layout = Problem(batch, int(num_heads), tq, -1, dt, out_dtype, mask, scale, max_sq, paged, bool(fp8), bool(fp8_rope))
    cro_ptr = device_pointer(cro)
    offsets = _Offsets((vl, cro, co, qs, lut), device_pointer(vl), cro_ptr, cro_ptr + 4, optional_ptr(co), optional_ptr(qs))
    return PrefillPlan(layout, offsets, chosen, dev, accumulate=accumulate, return_lse=return_lse, page_table=lut,
                       page_size=page_size or 0, rope_offset=rope_offset if paged else 0, page_table_host=lut_h,
                       cache_offsets_host=co_h, kv_sizes_host=sk_h, kv_total=kv_total, validate=validate)


def _dtype_arg(dtype) -> np.dtype:
    """A NumPy dtype from a NumPy / ml_dtypes dtype, its name, or a torch dtype."""
    if type(dtype).__module__.startswith("torch"):
        name = str(dtype).replace("torch.", "")
        dtype = BF16 if name == "bfloat16" else name
    try:
        return np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"dtype: expected a dtype (bfloat16 or float16), got {dtype!r}") from exc


def plan_for_call(p: Problem, offsets: _Offsets, kernel: str, *, accumulate: bool, return_lse: bool,
                  page_table=None, page_size: int = 0, rope_offset: int = 0) -> PrefillPlan:
    """The plan of one checked call (:func:`mla_cupy.mla_prefill`, the chunks of
    :func:`mla_cupy.mla_prefill_chunked`): its layout is ``p``, already checked with its arrays."""
    from ._select import device_id

    dev = device_id()
    chosen = choose_kernel(kernel, p.paged, dev)
    if (p.fp8 or p.rope8) and (kernel == "sm80" or chosen != "sm90"):
        what = "the fp8 per-token variant" if p.fp8 else "an fp8 rope"
        raise ValueError(f"kernel: {what} runs on the Hopper kernel only (compute capability 9.0, kernel='auto' or "
                         f"'sm90'), got kernel={kernel!r}")
    return PrefillPlan(p, offsets, chosen, dev, accumulate=accumulate, return_lse=return_lse, page_table=page_table,
                       page_size=page_size, rope_offset=rope_offset, validate=False)


def run_checked(pl: PrefillPlan, p: Problem, arrays: tuple, stream_ptr: int) -> None:
    """Launch ``pl`` on arrays already checked against ``p`` (CuPy views, in :data:`SLOTS` order)."""
    d = list(arrays)
    rec = pl._record(p, d, stream_ptr)
    ptrs = [optional_ptr(x) for x in d]
    if p.fp8 and d[_WS] is None and pl.workspace is not None:
        ptrs[_WS] = device_pointer(pl.workspace)
    pl._launch(rec, ptrs, stream_ptr)


def offsets_of(valid_length, kv_begin_ptr: int, kv_end_ptr: int, cache_offsets, q_start_pos, keep: tuple = ()) -> _Offsets:
    """The offsets of a launch from device arrays (``q_start_pos`` int64) and raw key-range pointers."""
    return _Offsets((valid_length, cache_offsets, q_start_pos) + tuple(keep), device_pointer(valid_length), kv_begin_ptr,
                    kv_end_ptr, optional_ptr(cache_offsets), optional_ptr(q_start_pos))

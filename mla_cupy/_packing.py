"""Argument packing of the prefill launches: for one array layout of a plan, the prepared
launches with every kernel argument packed (:class:`Record`), and the run-time step that rewrites
the data pointers (and the Hopper kernel's tensor maps) before launching (:func:`launch_record`)."""
from __future__ import annotations

import math
import struct
from typing import Any, Callable, Dict, List, Optional

from ._arrays import device_pointer, optional_ptr
from ._checks import check_aligned, dtype_of
from ._geometry import prefill_kernel
from ._launch import TENSOR_MAP_DTYPE, ArgPack, PreparedLaunch
from ._run_args import KS, LSE, OUT, QR, QS, ROPE, RSC, SLOTS, WS, K, Q, Target, V
from ._select import heads_per_section, sm_count, tail_blocks
from .dims import DR, DV
from .fp8 import vt_launch, vt_shape
from .tma import ZERO_MAP, prefill_maps, stride16
from .validation import Problem
from . import workspace
from .workspace import tile_counter

__all__ = ["Record", "pack", "launch_record"]

LOG2E = 1.4426950408889634
_GRID_Y_MAX = 65535  # the largest gridDim.y (the gather's kernel strides over more sequences)
_U64 = struct.Struct("<Q")
_MAPS_MAX = 1024  # pointer sets whose tensor maps are remembered per layout
_ROWS_STREAMS_MAX = 64  # streams whose gathered rope rows a record keeps


class Record:
    """One array layout of a plan: the prepared launches, and what a run rewrites in them (pointer
    fields as (byte offset, slot, addend); the slots whose pointers key the tensor maps, with the
    gathered rope rows' pointer; the slots that must be 16-byte aligned; the byte offset of the
    ``q_start_pos`` pointer, for a launch that passes its own)."""

    __slots__ = ("launch", "ptr_fields", "map_slots", "make_maps", "maps", "maps_max", "vt", "vt_fields", "align",
                 "counter", "map_field", "q_start_field", "last_maps", "last_stream", "gather", "gather_fields",
                 "rows_bytes", "rows", "keep_rows")

    def __init__(self, launch: Optional[PreparedLaunch], ptr_fields, align, map_slots=None, make_maps=None, vt=None,
                 vt_fields=(), counter=None, map_field=None, q_start_field=None, gather=None, gather_fields=(),
                 rows_bytes: int = 0):
        self.launch, self.ptr_fields, self.align = launch, ptr_fields, align
        self.map_slots, self.make_maps, self.maps, self.maps_max = map_slots, make_maps, {}, _MAPS_MAX
        self.vt, self.vt_fields = vt, vt_fields
        # Hopper, paged 16-bit rope: the gather into key rows of rows_bytes, its pointer fields
        # besides the rows' ("dst"), and (keep_rows: a plan's record) the rows of each stream it
        # launched on; without keep_rows (the plan cache's records) each launch allocates its own
        self.gather, self.gather_fields, self.rows_bytes = gather, gather_fields, rows_bytes
        self.rows: Dict[int, Any] = {}
        self.keep_rows = True
        self.counter = counter  # Hopper: (byte offset of tile_counter, device), set per stream at launch
        self.map_field = map_field  # Hopper: the first of the consecutive tensor-map fields
        self.q_start_field = q_start_field
        self.last_maps = self.last_stream = None  # what the buffer holds now (map pointers; stream and
        # schedule of the counter): a run that changes neither skips rewriting them


def pack(t: Target, p: Problem, d: list, sp: int, workspace_for: Callable) -> Record:
    """Pack the kernel arguments of layout ``p`` with the arrays ``d`` (device arrays in
    :data:`~mla_cupy._run_args.SLOTS` order) of its first run on stream ``sp``.
    ``workspace_for(given, shape, sp)`` gives the fp8 variant's V^T workspace."""
    if p.batch == 0 or p.tq == 0 or not p.max_sq:
        return Record(None, (), ())
    dev = t.device_id
    ck = prefill_kernel(t.kernel, p.dtype, p.out_dtype, p.mask, p.paged, p.variant, dev, p.scale_pairs)
    nmb = -(-p.max_sq // ck.geometry["block_m"])
    out, lse = d[OUT], d[LSE]
    oitem = p.out_dtype.itemsize
    o = t.offsets
    values: Dict[str, Any] = dict(
        out=device_pointer(out), lse=optional_ptr(lse), q_offsets=o.q_offsets, kv_begin=o.kv_begin, kv_end=o.kv_end,
        cache_offsets=o.cache_offsets, q_start_pos=o.q_start, o_st=out.strides[0] // oitem,
        o_sh=out.strides[1] // oitem, lse_st=0 if lse is None else lse.strides[0] // 4, num_heads=p.heads,
        heads_per_section=heads_per_section(p, dev), batch=p.batch, num_m_blocks=nmb, scale_log2=p.scale * LOG2E,
        mask_arg=p.mask.arg, accumulate=int(t.accumulate))
    rope_add = _rope_args(t, p, d, values)
    fields = [("out", OUT, 0), ("lse", LSE, 0), ("rope_base", ROPE, rope_add)]
    align = [i for i in (Q, K, V, OUT) if math.prod(d[i].shape)]
    if not p.rope_scaled_e4m3 and math.prod(d[ROPE].shape):  # read by TMA
        align.append(ROPE)
    if t.kernel == "sm80":
        item = p.dtype.itemsize
        q, k, v = d[Q], d[K], d[V]
        values.update(q=device_pointer(q), k=device_pointer(k), v=device_pointer(v),
                      q_st=q.strides[0] // item, q_sh=q.strides[1] // item, k_st=k.strides[0] // item,
                      k_sh=k.strides[1] // item, v_st=v.strides[0] // item, v_sh=v.strides[1] // item)
        launch = PreparedLaunch(ck.params, ck.fn, (nmb * p.batch * p.heads, 1, 1), ck.threads, ck.smem, values)
        fields += [("q", Q, 0), ("k", K, 0), ("v", V, 0)]
        return Record(launch, _offsets_of(ck.params, fields), tuple(align),
                      q_start_field=ck.params.offsets["q_start_pos"])
    return _sm90_record(t, p, d, ck, values, fields, align, nmb, sp, workspace_for)


def _rope_args(t: Target, p: Problem, d: list, values: dict) -> int:
    """The rope_* parameters into ``values``; returns the byte offset of the rope from its array's pointer."""
    rope, rs = d[ROPE], d[RSC]
    item = dtype_of(rope).itemsize
    if p.paged:
        lut = t.page_table
        add = t.rope_offset * item
        values.update(rope_base=device_pointer(rope) + add, rope_row_stride=int(rope.strides[1]) // item,
                      rope_block_stride=int(rope.strides[0]) // item, lookup=device_pointer(lut),
                      lookup_stride=int(lut.strides[0]) // 4, log2_page_size=int(math.log2(t.page_size)),
                      num_blocks=int(rope.shape[0]), max_pages=int(lut.shape[1]))
        if rs is not None:  # the rope's scale of slot 0
            values.update(rope_scales=device_pointer(rs) + 4 * (t.rope_offset // 64),
                          rope_scale_row_stride=int(rs.strides[1]) // 4, rope_scale_block_stride=int(rs.strides[0]) // 4)
        return add
    values.update(rope_base=device_pointer(rope), rope_row_stride=int(rope.strides[0]) // item, rope_block_stride=0,
                  lookup=0, lookup_stride=0, log2_page_size=0, num_blocks=0, max_pages=0)
    if rs is not None:
        values.update(rope_scales=device_pointer(rs), rope_scale_row_stride=int(rs.strides[0]) // 4,
                      rope_scale_block_stride=0)
    return 0


def _sm90_record(t: Target, p: Problem, d: list, ck, values: dict, fields: list, align: list, nmb: int, sp: int,
                 workspace_for: Callable) -> Record:
    q, k, v, rope = d[Q], d[K], d[V], d[ROPE]
    geom = ck.geometry
    values.setdefault("rope_scales", 0)
    values.setdefault("rope_scale_row_stride", 0)
    values.setdefault("rope_scale_block_stride", 0)
    if d[RSC] is not None:
        fields.append(("rope_scales", RSC, 4 * (t.rope_offset // 64) if p.paged else 0))
    q_st = (stride16(q, 1), stride16(q, 0))
    k_st = (stride16(k, 1), stride16(k, 0))
    v_st = (stride16(v, 1), stride16(v, 0))
    vt = None
    vt_fields: tuple = ()
    v_slot = V
    fp8_st = None
    values.update(q_scale=0, q_scale_stride=0)
    if p.fp8:
        qr, qs = d[QR], d[QS]
        fp8_st = (stride16(qr, 1), stride16(qr, 0))
        values.update(q_scale=device_pointer(qs), q_scale_stride=int(qs.strides[0]) // 4)
        fields.append(("q_scale", QS, 0))
        if math.prod(qr.shape):
            align.append(QR)
        shape = vt_shape(p.heads, p.tk, p.batch)
        cols = shape[2]
        v_st = (cols, DV * cols)  # the kernel reads V^T: the caller's (slot V), or the pre-pass's (slot WS)
        if p.tk:
            align.append(KS)
        if not p.v_transposed:
            if p.tk:
                align.append(WS)
            ws = workspace_for(d[WS], shape, sp)
            v_slot = WS
            if p.tk:
                vt = vt_launch(v, t.offsets.kv_begin, t.offsets.kv_end, p.batch, ws.reshape(-1)[:math.prod(shape)]
                               .reshape(shape), t.device_id)
                vt_fields = _offsets_of(vt.pack, [("v", V, 0), ("vt", WS, 0)])
    heads, tq, tk, dtype = p.heads, p.tq, p.tk, p.dtype
    out = d[OUT]
    # out's map where the kernel's staged epilogue stores by TMA: 16-bit rows written whole, not merged
    # into (its layout, last dimension contiguous and the rest in multiples of 16 bytes, is a run's
    # check_layout)
    by_tma = geom["out_tma"] and p.out_dtype.itemsize == 2 and not t.accumulate
    out_st = (stride16(out, 1), stride16(out, 0)) if by_tma else None
    values["out_by_tma"] = int(out_st is not None)
    paged, rope_warp = p.paged, p.rope_scaled_e4m3  # the rope warp reads the scaled e4m3 rope (no map)
    if p.all_e4m3:  # q_rope and the (plain) rope are e4m3 bytes, read by TMA
        dtype = dtype_of(rope)
    # a paged 16-bit rope: gathered into key rows of 128 bytes (one per row of k) before each launch,
    # read by TMA as a plain rope
    gather_rows = paged and not rope_warp and tk > 0
    rope_row_bytes = None if rope_warp else (DR * dtype.itemsize if paged else stride16(rope, 0))

    pack = ck.params
    maps = map_fields(pack)

    def make_maps(mk: tuple) -> bytes:
        qp, kp, vp, rp, op, qrp, ksp, rows = mk
        if gather_rows:
            rp = rows
        if not tk:  # no keys: nothing is read through K, V or the rope; a map of a null buffer is refused
            kp = vp = rp = ksp = op
        rmap = (0,) if rope_warp else (rp, rope_row_bytes)
        f8 = (qrp, fp8_st, ksp) if fp8_st is not None else None
        om = (op, p.out_dtype, out_st) if out_st is not None else None
        by_name = prefill_maps(dtype, heads, tq, tk, (qp, q_st), (kp, k_st), (vp, v_st), rmap, f8, geom["block_n"],
                               geom["scale_box"], geom["q_rows"], om)
        return b"".join(by_name[n].tobytes() for n in maps)  # the struct's consecutive map fields

    values.update({n: ZERO_MAP for n in maps}, tile_counter=0)
    grid = min(nmb * p.batch * p.heads, sm_count(t.device_id))  # persistent: at most one CTA per SM
    values["tail_blocks"] = tail_blocks(p, values["heads_per_section"], nmb, grid)
    launch = PreparedLaunch(pack, ck.fn, (grid, 1, 1), ck.threads, ck.smem, values)
    gather = gather_fields = None
    if gather_rows:
        gather = _gather_launch(t, p, values, tk)
        gather_fields = _offsets_of(gather.pack, [("rope_base", ROPE, t.rope_offset * dtype.itemsize)])
    return Record(launch, _offsets_of(pack, fields), tuple(align),
                   map_slots=(Q, K, v_slot, ROPE, OUT, QR, KS), make_maps=make_maps, vt=vt, vt_fields=vt_fields,
                   counter=(pack.offsets["tile_counter"], t.device_id), map_field=maps[0],
                   q_start_field=pack.offsets["q_start_pos"], gather=gather, gather_fields=gather_fields or (),
                   rows_bytes=tk * DR * dtype.itemsize if gather_rows else 0)


def _gather_launch(t: Target, p: Problem, values: dict, tk: int) -> PreparedLaunch:
    """The gather of a paged 16-bit rope into ``tk`` key rows (kernels/rope_gather.cu), with the
    cache's table and geometry of the prefill launch's ``values``; its rope and rows pointers are
    written per launch."""
    from ._geometry import rope_gather_kernel

    ck = rope_gather_kernel(t.device_id)
    names = ("rope_base", "rope_row_stride", "rope_block_stride", "lookup", "lookup_stride", "log2_page_size",
             "num_blocks", "max_pages", "kv_begin", "kv_end", "cache_offsets")
    gv = {n: values[n] for n in names}
    gv.update(batch=p.batch, dst=0, tk=tk)
    rows = ck.geometry["rows_per_cta"]
    # CTAs per sequence: together about one row each (a sequence's rows are strided over them)
    per_seq = min(max(1, -(-tk // (rows * max(p.batch, 1)))), _GRID_Y_MAX)
    return PreparedLaunch(ck.params, ck.fn, (per_seq, min(max(p.batch, 1), _GRID_Y_MAX), 1), ck.threads, 0, gv)


def map_fields(pack: ArgPack) -> tuple:
    """The tensor-map fields of a parameter struct, in its order: consecutive, so that a run
    rewrites them as one block."""
    maps = tuple(n for n in pack.names if pack.dtype.fields[n][0] == TENSOR_MAP_DTYPE)
    offs = [pack.offsets[n] for n in maps]
    if not maps or offs != [offs[0] + TENSOR_MAP_DTYPE.itemsize * i for i in range(len(maps))]:
        raise RuntimeError(f"the Hopper kernel's tensor maps are {maps} at offsets {offs}: expected consecutive ones")
    return maps


def _offsets_of(pack, fields) -> tuple:
    return tuple((pack.offsets[name], slot, add) for name, slot, add in fields)


def launch_record(rec: Record, ptrs: List[int], sp: int, q_start: Optional[int] = None,
                  new_rows: Optional[Callable] = None) -> None:
    """Check the pointers' alignment, rewrite them (and the tensor maps they key) into the record's
    launches, and launch on stream ``sp``; ``q_start``: the ``q_start_pos`` pointer of this launch
    (a widened copy made per call) instead of the packed one. A paged 16-bit rope's key rows come
    from ``new_rows(shape, sp)`` (default CuPy's pool on ``sp``): a plan's record keeps those of
    each stream from its first launch there (launches on one stream reuse them in order, launches
    on different streams never share them, a graph captured on ``sp`` reads rows that stay
    allocated while the plan lives); any other record allocates them per launch and lets them go
    once the kernels are enqueued (the pools reuse them in stream order). One thread at a time per
    record."""
    acc = 0
    for i in rec.align:
        acc |= ptrs[i]
    if acc & 15:
        for i in rec.align:
            check_aligned(ptrs[i], SLOTS[i])
    if rec.launch is None:
        return
    launch = rec.launch
    mem = launch._mem
    for off, i, add in rec.ptr_fields:
        _U64.pack_into(mem, off, ptrs[i] + add)
    if q_start is not None:
        _U64.pack_into(mem, rec.q_start_field, q_start)
    rows = None
    rows_ptr = 0
    if rec.gather is not None:
        rows = rec.rows.get(sp)
        if rows is None:
            rows = (new_rows or rows_on)((rec.rows_bytes,), sp)
            if rec.keep_rows:
                if len(rec.rows) >= _ROWS_STREAMS_MAX:
                    rec.rows.clear()
                rec.rows[sp] = rows
        rows_ptr = device_pointer(rows)
        gmem = rec.gather._mem
        for off, i, add in rec.gather_fields:
            _U64.pack_into(gmem, off, ptrs[i] + add)
        _U64.pack_into(gmem, rec.gather.pack.offsets["dst"], rows_ptr)
    if rec.map_slots is not None:
        mk = tuple([ptrs[i] for i in rec.map_slots]) + (rows_ptr,)
        if mk != rec.last_maps:
            maps = rec.maps.get(mk)
            if maps is None:
                maps = _new_maps(rec, mk)
            launch.set_bytes(rec.map_field, maps)
            rec.last_maps = mk
    if rec.counter is not None:
        ck = (sp, workspace.DYNAMIC_SCHEDULE)
        if ck != rec.last_stream:
            _U64.pack_into(mem, rec.counter[0], tile_counter(rec.counter[1], sp))
            rec.last_stream = ck
    if rec.vt is not None:
        vmem = rec.vt._mem
        for off, i, add in rec.vt_fields:
            _U64.pack_into(vmem, off, ptrs[i] + add)
        rec.vt.launch(sp)
    if rec.gather is not None:
        rec.gather.launch(sp)
    launch.launch(sp)
    del rows  # a per-launch allocation goes back to its pool: reused in stream order, after these kernels


def rows_on(shape, sp: int):
    """A paged rope's key rows: ``prod(shape)`` bytes from CuPy's pool on stream ``sp``."""
    return workspace.allocate_on(shape, sp, "the paged rope's key rows", "split the batch")


def _new_maps(rec: Record, mk: tuple) -> bytes:
    data = rec.make_maps(mk)
    if len(rec.maps) >= rec.maps_max:
        rec.maps.clear()
    rec.maps[mk] = data
    return data

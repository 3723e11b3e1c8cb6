"""Argument packing of the prefill launches: for one array layout of a plan, the prepared
launches with every kernel argument packed (:class:`Record`), and the run-time step that rewrites
the data pointers (and the Hopper kernel's tensor maps) before launching (:func:`launch_record`).

A record knows a run's arrays by slot, their positions in the run's tuple of arrays (a direction's
``NamedTuple``, the forward's :class:`~mla_cupy._run_args.PrefillArrays`), and keeps the names of
those positions for its messages; a launch hands it the pointers of a run's arrays as a list in that
order. Besides its main launch a record has the launches before and after it (:class:`Step`: the
forward's fp8 V^T pre-pass and paged-rope gather; a direction with more passes adds its own) and
optionally a scratch buffer per stream (the forward's gathered key rows)."""
from __future__ import annotations

import math
import struct
import threading
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from ._arrays import device_pointer, optional_ptr
from ._checks import check_aligned, dtype_of
from ._geometry import prefill_kernel
from ._launch import TENSOR_MAP_DTYPE, ArgPack, PreparedLaunch
from ._run_args import PrefillArrays, Target
from ._select import heads_per_section, sm_count, tail_blocks
from .dims import DR, DV
from .fp8 import vt_launch, vt_shape
from .tma import ZERO_MAP, prefill_maps
from .validation import Problem
from . import workspace
from .workspace import check_workspace, tile_counter

__all__ = ["Record", "Step", "pack", "aligned_slots", "launch_record", "slots_of"]

LOG2E = 1.4426950408889634
_GRID_Y_MAX = 65535  # the largest gridDim.y (the gather's kernel strides over more sequences)
_U64 = struct.Struct("<Q")
_MAPS_MAX = 1024  # pointer sets whose tensor maps a plan's record remembers
_ONE_SHOT_MAPS_MAX = 64  # ... and a one-shot call's, of which the plan cache holds many
_SCRATCH_STREAMS_MAX = 64  # streams whose scratch (gathered rope rows) a record keeps


_SLOTS: Dict[type, Dict[str, int]] = {}


def slots_of(arrays_type: type) -> Dict[str, int]:
    """The slot (position) of each array of a direction's tuple of arrays, by name."""
    slots = _SLOTS.get(arrays_type)
    if slots is None:
        slots = _SLOTS[arrays_type] = {name: i for i, name in enumerate(arrays_type._fields)}
    return slots


class Step(NamedTuple):
    """A launch of a record besides its main one: its pointer fields (byte offset, slot, addend),
    rewritten per launch like the main launch's, and where it takes the record's scratch pointer
    (byte offset, addend: a part of the scratch; none: it takes none)."""

    launch: PreparedLaunch
    fields: tuple = ()
    scratch_fields: tuple = ()


class Record:
    """One array layout of a plan: the prepared launches, and what a run rewrites in them (pointer
    fields as (byte offset, slot, addend); the slots whose pointers key the tensor maps, with the
    scratch's pointer; the slots that must be 16-byte aligned and the names of every slot, for the
    message; the byte offset of the ``q_start_pos`` pointer, for a launch that passes its own), the
    launches before and after the main one (:class:`Step`), and the lock its launches take: a record
    is rewritten and launched by one thread at a time, so that threads and streams share it safely."""

    __slots__ = ("launch", "ptr_fields", "map_slots", "make_maps", "maps", "maps_max", "before", "after", "align",
                 "names", "counter", "map_field", "q_start_field", "last_maps", "last_stream", "scratch_bytes",
                 "scratch_fields", "scratch", "keep_scratch", "lock")

    def __init__(self, launch: Optional[PreparedLaunch], ptr_fields, align, names: Tuple[str, ...],
                 map_slots=None, make_maps=None, before: Tuple[Step, ...] = (), after: Tuple[Step, ...] = (),
                 counter=None, map_field=None, q_start_field=None, scratch_bytes: int = 0, scratch_fields: tuple = ()):
        self.launch, self.ptr_fields, self.align, self.names = launch, ptr_fields, align, names
        self.scratch_fields = scratch_fields  # (byte offset, addend) of the main launch's scratch pointers
        self.lock = threading.Lock()
        self.map_slots, self.make_maps, self.maps, self.maps_max = map_slots, make_maps, {}, _MAPS_MAX
        self.before, self.after = before, after
        # scratch_bytes (0: none) per launch, for the launches that take it and for the tensor maps
        # (Hopper, paged 16-bit rope: the gathered key rows; the backward: its float32 workspace);
        # with keep_scratch (a plan's record) the
        # scratch of each stream it launched on, without it (the plan cache's records) one per launch
        self.scratch_bytes = scratch_bytes
        self.scratch: Dict[int, Any] = {}
        self.keep_scratch = True
        self.counter = counter  # Hopper: (byte offset of tile_counter, device), set per stream at launch
        self.map_field = map_field  # Hopper: the first of the consecutive tensor-map fields
        self.q_start_field = q_start_field
        self.last_maps = self.last_stream = None  # what the buffer holds now (map pointers; stream and
        # schedule of the counter): a run that changes neither skips rewriting them

    def reads(self, slot: int) -> bool:
        """Whether a launch of the record reads the pointer of ``slot``."""
        fields = [self.ptr_fields] + [step.fields for step in self.before + self.after]
        return any(i == slot for f in fields for _, i, _ in f) or slot in (self.map_slots or ())


def aligned_slots(problem: Problem, arrays: PrefillArrays) -> Tuple[int, ...]:
    """The slots of the arrays that must start 16-byte aligned, as the checks of a call and of a
    plan's run require (validation: check_layout, check_fp8_layout, check_workspace): q, k, v, the
    rope (a paged one's blocks), out and the fp8 q_rope when they hold anything, the fp8 key scales
    with keys, and an fp8 pre-pass's workspace. A launch whose pointer there is misaligned is
    refused (:func:`launch_record`), a one-shot call's then checked again."""
    names = ["q", "k", "v", "k_rope", "out"]
    if problem.fp8:
        names += ["q_rope"] + (["k_scales"] if problem.tk else [])
    slot = slots_of(type(arrays))
    aligned = tuple(slot[n] for n in names if getattr(arrays, n) is not None and math.prod(getattr(arrays, n).shape))
    return aligned + ((slot["workspace"],) if problem.fp8 and not problem.v_transposed else ())


def pack(target: Target, problem: Problem, arrays: PrefillArrays, raw_stream: int,
         workspace_for: Optional[Callable] = None, *, one_shot: bool = False) -> Record:
    """The launch record of the checked ``problem`` on ``target`` for the layout of ``arrays``
    (device arrays, the results given; a one-shot call's arrays may go on past the run's fields),
    packed for its first launch on the raw stream ``raw_stream``: every plan's run and every
    one-shot call packs here. ``workspace_for(given, shape, raw_stream)`` gives the fp8 variant's
    V^T workspace (default: the one given, checked). A one-shot call's record (``one_shot``; the
    plan cache holds many) holds no device memory between launches (its scratch, a paged rope's key
    rows, is allocated per launch) and remembers fewer tensor maps."""
    align = aligned_slots(problem, arrays)
    rec = _packed(target, problem, arrays, align, raw_stream, workspace_for or _given_workspace)
    rec.maps_max = _ONE_SHOT_MAPS_MAX if one_shot else _MAPS_MAX
    rec.keep_scratch = not one_shot
    return rec


def _given_workspace(given, shape, raw_stream: int):
    """The V^T workspace given with a call (or allocated for it by the caller), checked."""
    return check_workspace(given, shape)


def _packed(target: Target, p: Problem, arrays: PrefillArrays, align: tuple, raw_stream: int,
            workspace_for: Callable) -> Record:
    names = type(arrays)._fields
    if p.batch == 0 or p.tq == 0 or not p.max_sq:
        return Record(None, (), align, names)
    dev = target.device_id
    ck = prefill_kernel(target.kernel, p.dtype, p.out_dtype, p.mask, p.paged, p.variant, dev, p.scale_pairs)
    nmb = -(-p.max_sq // ck.geometry["block_m"])
    out, lse = arrays.out, arrays.lse
    oitem = p.out_dtype.itemsize
    o = target.offsets
    values: Dict[str, Any] = dict(
        out=device_pointer(out), lse=optional_ptr(lse), q_offsets=o.q_offsets, kv_begin=o.kv_begin, kv_end=o.kv_end,
        cache_offsets=o.cache_offsets, q_start_pos=o.q_start, o_st=out.strides[0] // oitem,
        o_sh=out.strides[1] // oitem, lse_st=0 if lse is None else lse.strides[0] // 4, num_heads=p.heads,
        heads_per_section=heads_per_section(p, dev), batch=p.batch, num_m_blocks=nmb, scale_log2=p.scale * LOG2E,
        mask_arg=p.mask.arg, accumulate=int(target.accumulate))
    rope_add = _rope_args(target, p, arrays, values)
    fields = [("out", "out", 0), ("lse", "lse", 0), ("rope_base", "k_rope", rope_add)]
    if target.kernel == "sm80":
        item = p.dtype.itemsize
        q, k, v = arrays.q, arrays.k, arrays.v
        values.update(q=device_pointer(q), k=device_pointer(k), v=device_pointer(v),
                      q_st=q.strides[0] // item, q_sh=q.strides[1] // item, k_st=k.strides[0] // item,
                      k_sh=k.strides[1] // item, v_st=v.strides[0] // item, v_sh=v.strides[1] // item)
        launch = PreparedLaunch(ck.params, ck.fn, (nmb * p.batch * p.heads, 1, 1), ck.threads, ck.smem, values)
        fields += [("q", "q", 0), ("k", "k", 0), ("v", "v", 0)]
        return Record(launch, _offsets_of(ck.params, fields, slots_of(type(arrays))), align, names,
                      q_start_field=ck.params.offsets["q_start_pos"])
    return _sm90_record(target, p, arrays, ck, values, fields, align, nmb, raw_stream, workspace_for)


def _rope_args(target: Target, p: Problem, arrays: PrefillArrays, values: dict) -> int:
    """The rope_* parameters into ``values``; returns the byte offset of the rope from its array's pointer."""
    rope, rs = arrays.k_rope, arrays.k_rope_scales
    item = dtype_of(rope).itemsize
    if p.paged:
        lut = target.page_table
        add = target.rope_offset * item
        values.update(rope_base=device_pointer(rope) + add, rope_row_stride=int(rope.strides[1]) // item,
                      rope_block_stride=int(rope.strides[0]) // item, lookup=device_pointer(lut),
                      lookup_stride=int(lut.strides[0]) // 4, log2_page_size=int(math.log2(target.page_size)),
                      num_blocks=int(rope.shape[0]), max_pages=int(lut.shape[1]))
        if rs is not None:  # the rope's scale of slot 0
            values.update(rope_scales=device_pointer(rs) + 4 * (target.rope_offset // 64),
                          rope_scale_row_stride=int(rs.strides[1]) // 4,
                          rope_scale_block_stride=int(rs.strides[0]) // 4)
        return add
    values.update(rope_base=device_pointer(rope), rope_row_stride=int(rope.strides[0]) // item, rope_block_stride=0,
                  lookup=0, lookup_stride=0, log2_page_size=0, num_blocks=0, max_pages=0)
    if rs is not None:
        values.update(rope_scales=device_pointer(rs), rope_scale_row_stride=int(rs.strides[0]) // 4,
                      rope_scale_block_stride=0)
    return 0


def _sm90_record(target: Target, p: Problem, arrays: PrefillArrays, ck, values: dict, fields: list, align: tuple,
                 nmb: int, raw_stream: int, workspace_for: Callable) -> Record:
    q, k, v, rope = arrays.q, arrays.k, arrays.v, arrays.k_rope
    slot = slots_of(type(arrays))
    geom = ck.geometry
    values.setdefault("rope_scales", 0)
    values.setdefault("rope_scale_row_stride", 0)
    values.setdefault("rope_scale_block_stride", 0)
    if arrays.k_rope_scales is not None:
        fields.append(("rope_scales", "k_rope_scales", 4 * (target.rope_offset // 64) if p.paged else 0))
    q_st = (stride16(q, 1), stride16(q, 0))
    k_st = (stride16(k, 1), stride16(k, 0))
    v_st = (stride16(v, 1), stride16(v, 0))
    before: List[Step] = []
    v_slot = "v"
    fp8_st = None
    values.update(q_scale=0, q_scale_stride=0)
    if p.fp8:
        q_rope, q_scale = arrays.q_rope, arrays.q_scale
        fp8_st = (stride16(q_rope, 1), stride16(q_rope, 0))
        values.update(q_scale=device_pointer(q_scale), q_scale_stride=int(q_scale.strides[0]) // 4)
        fields.append(("q_scale", "q_scale", 0))
        shape = vt_shape(p.heads, p.tk, p.batch)
        cols = shape[2]
        v_st = (cols, DV * cols)  # the kernel reads V^T: the caller's (in v), or the pre-pass's (the workspace)
        if not p.v_transposed:
            ws = workspace_for(arrays.workspace, shape, raw_stream)
            v_slot = "workspace"
            if p.tk:
                vt = vt_launch(v, target.offsets.kv_begin, target.offsets.kv_end, p.batch,
                               ws.reshape(-1)[:math.prod(shape)].reshape(shape), target.device_id)
                before.append(Step(vt, _offsets_of(vt.pack, [("v", "v", 0), ("vt", "workspace", 0)], slot)))
    heads, tq, tk, dtype = p.heads, p.tq, p.tk, p.dtype
    out = arrays.out
    # out's map where the kernel's staged epilogue stores by TMA: 16-bit rows written whole, not merged
    # into (its layout, last dimension contiguous and the rest in multiples of 16 bytes, is a run's
    # check_layout)
    by_tma = geom["out_tma"] and p.out_dtype.itemsize == 2 and not target.accumulate
    out_st = (stride16(out, 1), stride16(out, 0)) if by_tma else None
    values["out_by_tma"] = int(out_st is not None)
    paged, rope_warp = p.paged, p.rope_scaled_e4m3  # the rope warp reads the scaled e4m3 rope (no map)
    if p.all_e4m3:  # q_rope and the (plain) rope are e4m3 bytes, read by TMA
        dtype = dtype_of(rope)
    # a paged 16-bit rope: gathered into key rows of 128 bytes (one per row of k) before each launch,
    # read by TMA as a plain rope
    gather_rows = paged and not rope_warp and tk > 0
    rope_row_bytes = None if rope_warp else (DR * dtype.itemsize if paged else stride16(rope, 0))

    params = ck.params
    maps = map_fields(params)

    def make_maps(map_key: tuple) -> bytes:
        qp, kp, vp, rp, op, qrp, ksp, rows = map_key
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
    grid = min(nmb * p.batch * p.heads, sm_count(target.device_id))  # persistent: at most one CTA per SM
    values["tail_blocks"] = tail_blocks(p, values["heads_per_section"], nmb, grid)
    launch = PreparedLaunch(params, ck.fn, (grid, 1, 1), ck.threads, ck.smem, values)
    if gather_rows:  # after the V^T pre-pass, as before every launch
        gather = _gather_launch(target, p, values, tk)
        before.append(Step(gather, _offsets_of(gather.pack, [("rope_base", "k_rope", target.rope_offset * dtype.itemsize)],
                                               slot), ((gather.pack.offsets["dst"], 0),)))
    map_slots = tuple(slot[n] for n in ("q", "k", v_slot, "k_rope", "out", "q_rope", "k_scales"))
    return Record(launch, _offsets_of(params, fields, slot), align, type(arrays)._fields,
                  map_slots=map_slots, make_maps=make_maps, before=tuple(before),
                  counter=(params.offsets["tile_counter"], target.device_id), map_field=maps[0],
                  q_start_field=params.offsets["q_start_pos"],
                  scratch_bytes=tk * DR * dtype.itemsize if gather_rows else 0)


def _gather_launch(target: Target, p: Problem, values: dict, tk: int) -> PreparedLaunch:
    """The gather of a paged 16-bit rope into ``tk`` key rows (kernels/rope_gather.cu), with the
    cache's table and geometry of the prefill launch's ``values``; its rope and rows pointers are
    written per launch."""
    from ._geometry import rope_gather_kernel

    ck = rope_gather_kernel(target.device_id)
    names = ("rope_base", "rope_row_stride", "rope_block_stride", "lookup", "lookup_stride", "log2_page_size",
             "num_blocks", "max_pages", "kv_begin", "kv_end", "cache_offsets")
    gv = {n: values[n] for n in names}
    gv.update(batch=p.batch, dst=0, tk=tk)
    rows = ck.geometry["rows_per_cta"]
    # CTAs per sequence: together about one row each (a sequence's rows are strided over them)
    per_seq = min(max(1, -(-tk // (rows * max(p.batch, 1)))), _GRID_Y_MAX)
    return PreparedLaunch(ck.params, ck.fn, (per_seq, min(max(p.batch, 1), _GRID_Y_MAX), 1), ck.threads, 0, gv)


def stride16(x, dim: int) -> int:
    """Byte stride of ``dim`` of ``x`` for a tensor map (a size-1 dimension's stride is arbitrary:
    16)."""
    st = int(x.strides[dim])
    return st if x.shape[dim] > 1 and st % 16 == 0 else 16


def map_fields(pack: ArgPack) -> tuple:
    """The tensor-map fields of a parameter struct, in its order: consecutive, so that a run
    rewrites them as one block."""
    maps = tuple(n for n in pack.names if pack.dtype.fields[n][0] == TENSOR_MAP_DTYPE)
    offs = [pack.offsets[n] for n in maps]
    if not maps or offs != [offs[0] + TENSOR_MAP_DTYPE.itemsize * i for i in range(len(maps))]:
        raise RuntimeError(f"the Hopper kernel's tensor maps are {maps} at offsets {offs}: expected consecutive ones")
    return maps


def _offsets_of(pack, fields, slot: Dict[str, int]) -> tuple:
    """(byte offset, slot, addend) of each (parameter, array, addend): the parameter's place in the
    packed buffer, the array's slot in a run's pointers (``slot``: by name)."""
    return tuple((pack.offsets[param], slot[array], add) for param, array, add in fields)


def launch_record(rec: Record, ptrs: List[int], raw_stream: int, q_start: Optional[int] = None,
                  new_scratch: Optional[Callable] = None) -> None:
    """Check the pointers' alignment, rewrite them (and the tensor maps they key) into the record's
    launches, and launch its steps before, its main launch and its steps after on the raw stream
    ``raw_stream``; ``q_start``: the ``q_start_pos`` pointer of this launch (a widened copy made per
    call) instead of the packed one. A record's scratch (a paged 16-bit rope's key rows) comes from
    ``new_scratch(shape, raw_stream)`` (default CuPy's pool on that stream): a plan's record keeps
    that of each stream from its first launch there (launches on one stream reuse it in order,
    launches on different streams never share it, a graph captured there reads scratch that stays
    allocated while the plan lives); any other record allocates it per launch and lets it go once
    the kernels are enqueued (the pools reuse it in stream order). Holds the record's lock."""
    with rec.lock:
        _launch_record(rec, ptrs, raw_stream, q_start, new_scratch)


def _launch_record(rec: Record, ptrs: List[int], raw_stream: int, q_start: Optional[int],
                   new_scratch: Optional[Callable]) -> None:
    acc = 0
    for i in rec.align:
        acc |= ptrs[i]
    if acc & 15:
        for i in rec.align:
            check_aligned(ptrs[i], rec.names[i])
    if rec.launch is None:
        return
    launch = rec.launch
    mem = launch._mem
    for off, i, add in rec.ptr_fields:
        _U64.pack_into(mem, off, ptrs[i] + add)
    if q_start is not None and rec.q_start_field is not None:  # a record without a kernel that reads it
        _U64.pack_into(mem, rec.q_start_field, q_start)
    scratch = None
    scratch_ptr = 0
    if rec.scratch_bytes:
        scratch = rec.scratch.get(raw_stream)
        if scratch is None:
            scratch = (new_scratch or scratch_on)((rec.scratch_bytes,), raw_stream)
            if rec.keep_scratch:
                if len(rec.scratch) >= _SCRATCH_STREAMS_MAX:
                    rec.scratch.clear()
                rec.scratch[raw_stream] = scratch
        scratch_ptr = device_pointer(scratch)
    if rec.map_slots is not None:
        map_key = tuple([ptrs[i] for i in rec.map_slots]) + (scratch_ptr,)
        if map_key != rec.last_maps:
            maps = rec.maps.get(map_key)
            if maps is None:
                maps = _new_maps(rec, map_key)
            launch.set_bytes(rec.map_field, maps)
            rec.last_maps = map_key
    for off, add in rec.scratch_fields:
        _U64.pack_into(mem, off, scratch_ptr + add)
    if rec.counter is not None:
        schedule = (raw_stream, workspace.DYNAMIC_SCHEDULE)
        if schedule != rec.last_stream:
            _U64.pack_into(mem, rec.counter[0], tile_counter(rec.counter[1], raw_stream))
            rec.last_stream = schedule
    for step in rec.before:
        _launch_step(step, ptrs, scratch_ptr, raw_stream)
    launch.launch(raw_stream)
    for step in rec.after:
        _launch_step(step, ptrs, scratch_ptr, raw_stream)
    del scratch  # a per-launch allocation goes back to its pool: reused in stream order, after these kernels


def _launch_step(step: Step, ptrs: List[int], scratch_ptr: int, raw_stream: int) -> None:
    smem = step.launch._mem
    for off, i, add in step.fields:
        _U64.pack_into(smem, off, ptrs[i] + add)
    for off, add in step.scratch_fields:
        _U64.pack_into(smem, off, scratch_ptr + add)
    step.launch.launch(raw_stream)


def scratch_on(shape, raw_stream: int):
    """A record's scratch (a paged rope's key rows, the backward's workspace): ``prod(shape)`` bytes
    from CuPy's pool on the raw stream ``raw_stream``."""
    return workspace.allocate_on(shape, raw_stream, "a launch's scratch (paged rope rows, backward workspace)",
                                 "split the batch")


def _new_maps(rec: Record, map_key: tuple) -> bytes:
    data = rec.make_maps(map_key)
    if len(rec.maps) >= rec.maps_max:
        rec.maps.clear()
    rec.maps[map_key] = data
    return data

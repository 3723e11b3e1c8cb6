"""Argument packing of the backward's launches: for one array layout of a plan (or one one-shot
call), a :class:`~mla_cupy._packing.Record` of the pipeline, whose main launch is the backward's
main kernel (Hopper or portable), with the pre-pass before it and the dq and rope passes after it
(kernels/mla_backward_*.cu), and whose scratch is the backward's float32 workspace
(kernels/backward.cuh says what it holds): every pass reads its parts at fixed offsets from the
scratch's pointer, which :func:`~mla_cupy._packing.launch_record` writes per launch, as it writes
the arrays' pointers (by slot of :class:`~mla_cupy._run_args.BackwardArrays`) and the Hopper
kernel's tensor maps."""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ._geometry import backward_kernel, backward_passes
from ._arrays import is_torch
from ._launch import PreparedLaunch
from ._packing import LOG2E, Record, Step, map_fields, slots_of, stride16
from ._run_args import BackwardArrays, Target
from ._select import l2_bytes, sm_count
from .dims import DQK, DR, DV, kernel_int
from .tma import ZERO_MAP, encode_tiled
from .validation import Problem
from .workspace import empty_result

__all__ = ["pack_backward", "heads_per_group", "tail_groups", "rope_added", "rope_slots", "workspace_parts",
           "aligned_slots", "GRADIENTS", "new_gradients"]

#: Query rows of a dq chunk, the workspace's unit (kernels/backward.cuh: kChunkRows; a main kernel's
#: query blocks, its geometry's block_m, must be one chunk: checked where a launch is packed).
_CHUNK_ROWS = kernel_int("backward.cuh", "kChunkRows")
#: float4s of the words the main kernel adds into that a pre-pass thread zeroes at most (the grid
#: widened past the query blocks where they are many: a long prefix of keys, few queries).
_ZEROED_PER_THREAD = 8


def heads_per_group(heads: int, work_per_group: int, sms: int, kernel: str) -> int:
    """Heads a work tile takes one after another (its rope gradient summed over them in registers;
    on the portable kernel a rope slot per group: ``heads / g`` rows of float32 per key in the
    workspace).

    The Hopper kernel's persistent tiles take one head: a tile one head long keeps about half as
    many heads' q and dout rows in flight in the L2 and ends the launch on shorter tiles. On H100
    one head took 0.84-0.86 (1 x 2048), 0.94-0.95 (1 x 4096), 0.90-0.92 (ragged), 0.90-0.95
    (H = 16) of the time of four heads (two at H = 16), and 0.99-1.01 at 1 x 8192. The portable
    kernel (a CTA per tile) takes 4 when that still leaves 4 tiles per SM (``work_per_group`` key
    tiles per group, ``sms`` SMs), else 2."""
    if kernel == "sm90":
        return 1
    g = 4
    if work_per_group * -(-heads // g) < 4 * sms:
        g = 2
    return min(g, heads)


def tail_groups(groups: int, work_per_group: int, ctas: int, heads_per_group: int, tq: int,
                l2: int) -> int:
    """Head groups at the end of a persistent launch whose key blocks are handed out slowest
    (kernels/backward.cuh: decode_key_tile): the fewest last groups that hold two work tiles per
    CTA, so that the launch ends on the short tiles of all of them, not on the long first blocks
    of the last one; 0 where those groups' q and dout rows (``(192 + 128) * 2`` bytes per row and
    head) exceed the L2, which their concurrent tiles then read from DRAM. On H100, H = 16 at
    1 x 4096 and 1 x 8192 took 0.87 and 0.94 of the time, a ragged batch of 4 sequences 0.98;
    where the rows did not fit (H = 128 at 1 x 2048 to 1 x 8192) the order took 1.06-1.09."""
    if not groups or not work_per_group:
        return 0
    tail = min(groups, -(-2 * ctas // work_per_group))
    return tail if tail * heads_per_group * tq * (DQK + DV) * 2 <= l2 else 0


def num_chunks(p: Problem) -> int:
    """dq chunks of the workspace: every sequence's query blocks, none shared (kernels/backward.cuh:
    chunk_of, below Tq / 64 + B + 1)."""
    return p.tq // _CHUNK_ROWS + p.batch + 1


def rope_added(kernel: str) -> bool:
    """Whether the main kernel adds its work tiles' rope rows into one slot of ``rope_part`` by bulk
    reductions (Hopper; in deterministic mode in head-group order), which the pre-pass then zeroes,
    rather than storing them into their head group's own slot (the portable kernel)."""
    return kernel == "sm90"


def rope_slots(groups: int, kernel: str) -> int:
    """Slots of the workspace's ``rope_part`` (kernels/backward.cuh): one where the kernel adds into it
    (:func:`rope_added`), else one per head group."""
    return 1 if rope_added(kernel) else groups


def key_blocks_bound(p: Problem, block_n: int) -> int:
    """A bound on the key blocks' indices over every sequence (kernels/backward.cuh: key_block_of)."""
    return p.tk // block_n + p.batch + 1


def workspace_parts(p: Problem, slots: int, deterministic: bool,
                    key_blocks: int = 0) -> Tuple[int, Dict[str, Tuple[int, int]]]:
    """Bytes of the workspace and each part's (byte offset, floats) in it (kernels/backward.cuh):
    ``slots`` of ``rope_part``, and in deterministic mode a semaphore per dq chunk and head and, where
    the kernel adds the rope rows into one slot, per key block (``key_blocks`` of them; 0: none)."""
    chunks = num_chunks(p)
    stat = p.heads * chunks * _CHUNK_ROWS

    def words(n: int) -> int:  # int32 counters, in whole float4s
        return -(-n // 4) * 4 if deterministic else 0
    parts = [("lse_log2", stat), ("dpsum", stat), ("dq_accum", stat * DQK), ("rope_part", slots * p.tk * DR),
             ("rope_sem", words(key_blocks)), ("dq_sem", words(p.heads * chunks))]
    out, off = {}, 0
    for name, n in parts:
        out[name] = (4 * off, n)
        off += n
    return 4 * off, out


def aligned_slots(arrays: BackwardArrays) -> Tuple[int, ...]:
    """The slots of the arrays whose start the checks require 16-byte aligned (check_layout: every
    array of the backward but the two lse arrays) where they hold anything."""
    slot = slots_of(BackwardArrays)
    return tuple(slot[n] for n in ("dout", "q", "k", "v", "k_rope", "out", "dq", "dk", "dv", "dk_rope")
                 if getattr(arrays, n) is not None and math.prod(getattr(arrays, n).shape))


#: The gradients a backward writes, in the order it returns them.
GRADIENTS = ("dq", "dk", "dv", "dk_rope")


def new_gradients(q, tk: int, dtype, given: tuple) -> list:
    """The gradients not ``given`` (None where given, in :data:`GRADIENTS` order): new device
    arrays (views of torch's memory for a torch ``q``) of ``q``'s Tq and H and ``tk`` keys, in
    ``dtype``."""
    torch_device = q.device if is_torch(q) else None
    tq, heads = int(q.shape[0]), int(q.shape[1])
    shapes = ((tq, heads, DQK), (tk, heads, DV), (tk, heads, DV), (tk, 1, DR))
    return [None if g is not None else empty_result(shape, dtype, torch_device, name)
            for g, shape, name in zip(given, shapes, GRADIENTS)]


def _strides(x) -> Tuple[int, int]:
    """(row, head) element strides of a [T, H, D] array (a [T, 1, D] one's head stride unused)."""
    item = np.dtype(x.dtype).itemsize
    return int(x.strides[0]) // item, int(x.strides[1]) // item


def pack_backward(target: Target, p: Problem, arrays: BackwardArrays, *, deterministic: bool,
                  one_shot: bool = False) -> Record:
    """The launch record of the checked backward ``p`` on ``target`` for the layout of ``arrays``
    (device arrays, the results given; ``arrays.dlse`` None or an array, which the record reads per
    launch). ``p.max_sk`` sizes the grid of key blocks (None: Tk bounds it, every sequence's key
    blocks past its own decoding to nothing). A one-shot call's record (``one_shot``) takes a new
    workspace per launch; a plan's keeps one per stream."""
    slot = slots_of(BackwardArrays)
    names = BackwardArrays._fields
    align = aligned_slots(arrays)
    dev = target.device_id
    main = backward_kernel(target.kernel, p.dtype, p.mask, dev)
    pre, dq, rope = backward_passes(p.dtype, np.dtype(arrays.out.dtype), target.kernel, dev)
    if main.geometry["block_m"] != _CHUNK_ROWS:
        raise RuntimeError(f"backward kernel: query blocks of {main.geometry['block_m']} rows, expected {_CHUNK_ROWS}")
    block_n = main.geometry["block_n"]
    max_sk = p.tk if p.max_sk is None else p.max_sk
    n_blocks = -(-max_sk // block_n) if max_sk else 0
    m_blocks = -(-p.max_sq // _CHUNK_ROWS) if p.max_sq else 0
    queries = bool(m_blocks and p.batch)
    sms = sm_count(dev)
    g = heads_per_group(p.heads, n_blocks * p.batch, sms, target.kernel)
    groups = -(-p.heads // g)
    slots = rope_slots(groups, target.kernel)
    one_slot = rope_added(target.kernel)  # the main kernel adds into it: the pre-pass zeroes it
    ws_bytes, parts = workspace_parts(p, slots, deterministic, key_blocks_bound(p, block_n) if one_slot else 0)
    zeroed_f4 = (parts["rope_part"][1] + parts["rope_sem"][1]) // 4 if one_slot else 0
    chunks = num_chunks(p)
    o = target.offsets
    out, lse, dlse = arrays.out, arrays.lse, arrays.dlse

    def fields_of(launch: PreparedLaunch, pointer_names: List[Tuple[str, str]]) -> tuple:
        return tuple((launch.pack.offsets[param], slot[array], 0) for param, array in pointer_names)

    def scratch_of(launch: PreparedLaunch, part_names: List[str]) -> tuple:
        return tuple((launch.pack.offsets[n], parts[n][0]) for n in part_names if parts[n][1])

    # the pre-pass: lse_log2, D (less dlse), the accumulator (and semaphores) zeroed, and what the main
    # kernel adds into (its grid widened so that a thread zeroes at most _ZEROED_PER_THREAD float4s)
    out_st = _strides(out)
    dout_st = _strides(arrays.dout)
    head_blocks = -(-p.heads // pre.geometry["heads_per_cta"])
    zeroing_ctas = -(-zeroed_f4 // (pre.threads * _ZEROED_PER_THREAD * max(1, p.batch) * head_blocks))
    pre_launch = PreparedLaunch(pre.params, pre.fn, (max(1, m_blocks, zeroing_ctas), max(1, p.batch), head_blocks),
                                pre.threads, 0,
                                dict(dout=0, do_st=dout_st[0], do_sh=dout_st[1], out=0, o_st=out_st[0], o_sh=out_st[1],
                                     lse=0, lse_st=int(lse.strides[0]) // 4, dlse=0,
                                     dlse_st=0 if dlse is None else int(dlse.strides[0]) // 4, lse_log2=0, dpsum=0,
                                     dq_accum=0, dq_sem=0, rope_part=0, zeroed_f4=zeroed_f4, q_offsets=o.q_offsets,
                                     num_heads=p.heads, batch=p.batch, num_chunks=chunks))
    pre_ptrs = [("dout", "dout"), ("out", "out"), ("lse", "lse")] + ([("dlse", "dlse")] if dlse is not None else [])
    pre_step = Step(pre_launch, fields_of(pre_launch, pre_ptrs),
                    scratch_of(pre_launch, ["lse_log2", "dpsum", "dq_accum", "dq_sem"]
                               + (["rope_part"] if zeroed_f4 else [])))
    # the dq pass: dq = scale * dq_accum, in q's dtype
    dq_st = _strides(arrays.dq)
    dq_launch = PreparedLaunch(dq.params, dq.fn, (max(1, m_blocks), max(1, p.batch), p.heads), dq.threads, dq.smem,
                               dict(dq_accum=0, dq=0, dq_st=dq_st[0], dq_sh=dq_st[1], scale=p.scale,
                                    q_offsets=o.q_offsets, num_heads=p.heads, batch=p.batch, num_chunks=chunks))
    dq_step = Step(dq_launch, fields_of(dq_launch, [("dq", "dq")]), scratch_of(dq_launch, ["dq_accum"]))
    # the rope pass: dk_rope summed over the slots; the rows of no sequence (all rows without a query) zeroed
    dk_st, dv_st = _strides(arrays.dk), _strides(arrays.dv)
    rope_launch = PreparedLaunch(rope.params, rope.fn, (max(1, -(-p.tk // rope.geometry["rows_per_cta"])), 1, 1),
                                 rope.threads, 0,
                                 dict(rope_part=0, slots=slots, tk=p.tk, dk_rope=0,
                                      dkr_st=_strides(arrays.dk_rope)[0], dk=0, dk_st=dk_st[0], dk_sh=dk_st[1], dv=0,
                                      dv_st=dv_st[0], dv_sh=dv_st[1], num_heads=p.heads, kv_end=o.kv_end,
                                      batch=p.batch if queries else 0))
    rope_step = Step(rope_launch, fields_of(rope_launch, [("dk_rope", "dk_rope"), ("dk", "dk"), ("dv", "dv")]),
                     scratch_of(rope_launch, ["rope_part"]) if queries else ())
    if not queries:  # no query: nothing but zero gradients of k, v and the rope
        if not p.tk:
            return Record(None, (), align, names)
        return Record(rope_launch, rope_step.fields, align, names)
    after = (dq_step,) + ((rope_step,) if p.tk else ())
    if not n_blocks:  # no key: dq is 0 (the accumulator zeroed), nothing else runs
        return Record(dq_launch, dq_step.fields, align, names, before=(pre_step,), after=after[1:],
                      scratch_bytes=ws_bytes, scratch_fields=dq_step.scratch_fields)

    # the main kernel
    q_st, k_st, v_st = _strides(arrays.q), _strides(arrays.k), _strides(arrays.v)
    values = dict(q=0, k=0, v=0, k_rope=0, dout=0, q_st=q_st[0], q_sh=q_st[1], k_st=k_st[0], k_sh=k_st[1],
                  v_st=v_st[0], v_sh=v_st[1], rope_st=_strides(arrays.k_rope)[0], do_st=dout_st[0], do_sh=dout_st[1],
                  dk=0, dv=0, dk_st=dk_st[0], dk_sh=dk_st[1], dv_st=dv_st[0], dv_sh=dv_st[1], dq_accum=0,
                  lse_log2=0, dpsum=0, rope_part=0, dq_sem=0, rope_sem=0, tk=p.tk, q_offsets=o.q_offsets,
                  kv_begin=o.kv_begin,
                  kv_end=o.kv_end, cache_offsets=o.cache_offsets, q_start_pos=o.q_start, num_heads=p.heads,
                  heads_per_group=g, batch=p.batch, num_n_blocks=n_blocks, num_chunks=chunks, tail_groups=0,
                  scale_log2=p.scale * LOG2E, scale=p.scale, mask_arg=p.mask.arg, deterministic=int(deterministic),
                  tile_counter=0)
    work = n_blocks * p.batch * groups
    make_maps: Optional[Callable[[tuple], bytes]] = None
    map_slots = map_field = None
    if target.kernel == "sm90":
        maps = map_fields(main.params)
        values.update({n: ZERO_MAP for n in maps})
        grid = max(1, min(work, sms))  # persistent
        values["tail_groups"] = tail_groups(groups, n_blocks * p.batch, grid, g, p.tq, l2_bytes(dev))
        map_slots = tuple(slot[n] for n in ("q", "k", "v", "k_rope", "dout"))
        map_field = maps[0]
        dtype, heads, tq, tk = p.dtype, p.heads, p.tq, p.tk
        st = {n: (stride16(getattr(arrays, n), 1), stride16(getattr(arrays, n), 0)) for n in ("q", "k", "v", "dout")}
        rope_row = stride16(arrays.k_rope, 0)

        def sm90_maps(map_key: tuple) -> bytes:
            qp, kp, vp, rp, dp, _scratch = map_key
            by_name = dict(tm_q=encode_tiled(qp, dtype, (DQK, heads, tq), st["q"], (64, 1, _CHUNK_ROWS)),
                           tm_k=encode_tiled(kp, dtype, (DV, heads, tk), st["k"], (32, 1, block_n), swizzle=64),
                           tm_v=encode_tiled(vp, dtype, (DV, heads, tk), st["v"], (64, 1, block_n)),
                           tm_rope=encode_tiled(rp, dtype, (DR, tk), (rope_row,), (32, block_n), swizzle=64),
                           tm_do=encode_tiled(dp, dtype, (DV, heads, tq), st["dout"], (64, 1, _CHUNK_ROWS)))
            return b"".join(by_name[n].tobytes() for n in maps)  # the struct's consecutive map fields
        make_maps = sm90_maps
    else:
        grid = max(1, work)  # one CTA per work tile (its ticket from the counter)
    launch = PreparedLaunch(main.params, main.fn, (grid, 1, 1), main.threads, main.smem, values)
    ptr_fields = fields_of(launch, [(n, n) for n in ("q", "k", "v", "k_rope", "dout", "dk", "dv")])
    rec = Record(launch, ptr_fields, align, names, map_slots=map_slots, make_maps=make_maps, before=(pre_step,),
                 after=after, counter=(main.params.offsets["tile_counter"], dev), map_field=map_field,
                 q_start_field=main.params.offsets["q_start_pos"], scratch_bytes=ws_bytes,
                 scratch_fields=scratch_of(launch, ["dq_accum", "lse_log2", "dpsum", "rope_part", "dq_sem",
                                                    "rope_sem"]))
    rec.keep_scratch = not one_shot
    return rec


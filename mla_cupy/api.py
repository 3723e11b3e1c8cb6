"""``mla_prefill``: the public entry point, its launch, and the small device helpers around it."""
from __future__ import annotations

import functools
import math
import os
from typing import Any, Optional, Tuple, Union

import numpy as np

from . import _registry as reg
from ._arrays import FP8_E4M3, FP32, as_device, device_pointer, is_torch, optional_ptr, result_wrapper, stream_of
from ._launch import F32, I32, I64, PTR, U32, ArgPack
from .jit import get_function
from .masks import Mask
from .paged import PagedKVCache
from .quant import _transpose_v_device, vt_columns
from .tma import TENSOR_MAP_DTYPE, encode_tiled
from .validation import DQK, DR, DV, Problem, check_inputs, check_lse_and_accumulate

__all__ = ["mla_prefill"]

BLOCK_M = 128  # query rows per CTA of the portable kernel (kernels/mla_prefill_sm80.cu: kBlockM)
THREADS = 256  # its threads per CTA (kThreads)
SMEM_BYTES = 128 * 384 + 2 * (64 * 384 + 64 * 256) + 2 * 64  # its kSmemBytes
LOG2E = 1.4426950408889634


def _empty(shape, dtype, like_torch: Optional[Any], name: str = "out"):
    """Allocate through torch's allocator for torch callers, CuPy's pool otherwise. Running out of
    device memory is a ``MemoryError`` naming the result; the process stays usable."""
    import cupy

    try:
        if like_torch is not None:
            import torch

            tdt = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}.get(np.dtype(dtype), torch.bfloat16)
            return cupy.from_dlpack(torch.empty(shape, dtype=tdt, device=like_torch.device))
        return cupy.empty(shape, dtype=dtype)
    except (cupy.cuda.memory.OutOfMemoryError, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and "out of memory" not in str(exc).lower():
            raise
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        raise MemoryError(f"{name}: cannot allocate {list(shape)} {np.dtype(dtype).name} ({nbytes / 2**30:.1f} GiB) "
                          f"on the device; pass out= or split the batch") from exc


def _rope_args(k_rope) -> Tuple[int, int, int, int, int, int, int, int]:
    """(base, row_stride, block_stride, lookup, lookup_stride, log2_page, num_blocks, max_pages), in
    elements of the rope's own dtype (bytes for an fp8 rope)."""
    if isinstance(k_rope, PagedKVCache):
        bl, lut = k_rope.blocks, k_rope.lookup_table
        item = np.dtype(bl.dtype).itemsize
        return (device_pointer(bl) + k_rope.rope_offset * item, int(bl.strides[1]) // item, int(bl.strides[0]) // item,
                device_pointer(lut), int(lut.strides[0]) // 4, int(math.log2(k_rope.page_size)),
                int(bl.shape[0]), int(lut.shape[1]))
    item = np.dtype(k_rope.dtype).itemsize
    return (device_pointer(k_rope), int(k_rope.strides[0]) // item, 0, 0, 0, 0, 0, 0)


def _rope_scale_args(k_rope, k_rope_scales) -> Tuple[int, int, int]:
    """(pointer to the rope's scale of key / slot 0, row stride, block stride) in floats; zeros
    unless the rope is fp8."""
    if isinstance(k_rope, PagedKVCache):
        sc = k_rope.scales
        if sc is None:
            return 0, 0, 0
        return device_pointer(sc) + 4 * (k_rope.rope_offset // 64), int(sc.strides[1]) // 4, int(sc.strides[0]) // 4
    if k_rope_scales is None:
        return 0, 0, 0
    return device_pointer(k_rope_scales), int(k_rope_scales.strides[0]) // 4, 0


KERNELS = ("auto", "sm80", "sm90")
SM90_THREADS = 384  # kernels/mla_prefill_sm90.cu: kThreads
SM90_BLOCK_N = 128  # keys per tile (kBlockN)


def sm90_smem_for(p: Problem) -> int:
    """Dynamic shared memory of the Hopper instantiation ``p`` runs; the one place both the
    attribute and the launch take it from."""
    return sm90_smem_bytes(p.fp8)


def sm90_smem_bytes(fp8: bool = False) -> int:
    """kernels/mla_prefill_sm90.cu: kSmemBytes<kFp8> (the same with or without the rope warp)."""
    col = 128 * 128  # one 128-byte-wide column block of a 128-row tile
    nope = 1 if fp8 else 2  # column blocks of 128 nope values: e4m3 or 16-bit
    q, k, v = (nope + 1) * col, (nope + 1) * col + (1024 if fp8 else 0), nope * col
    stages = 3 if fp8 else 2  # kStages<kFp8>
    return q + stages * (k + v) + 256 + 3 * (128 + 16) + 1024


@functools.lru_cache(maxsize=None)
def _capability(device_id: int) -> str:
    import cupy

    return cupy.cuda.Device(device_id).compute_capability


@functools.lru_cache(maxsize=None)
def _sm_count_and_l2(device_id: int) -> Tuple[int, int]:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    return int(props["multiProcessorCount"]), int(props.get("l2CacheSize", 50 << 20))


def _device_id() -> int:
    import cupy

    return cupy.cuda.runtime.getDevice()


def heads_per_section(p: Problem, device_id: int) -> int:
    """Heads whose keys and values together fill about a quarter of the L2 (see
    kernels/tile_scheduler.cuh): the tiles of one section run together, so each head's K/V is read
    from DRAM about once. A quarter, not a half: Hopper's L2 is two partitions that each cache what
    their SMs read, so data every SM reads takes room in both."""
    kv_bytes_per_head = max(1, p.tk) * 2 * DV * (1 if p.fp8 else p.dtype.itemsize)
    g = max(1, min(p.heads, (_sm_count_and_l2(device_id)[1] // 4) // kv_bytes_per_head))
    return -(-p.heads // -(-p.heads // g))  # the same number of heads in every section, or one fewer


def choose_kernel(kernel: str, paged: bool, device_id: Optional[int] = None) -> str:
    """``'sm90'`` (the Hopper TMA + wgmma kernel) on compute capability 9.0, else ``'sm80'`` (the
    portable mma.sync kernel). ``kernel`` forces one; the environment variable
    ``MLA_CUPY_DISABLE_SM90=1`` makes ``"auto"`` pick the portable kernel. ``paged`` does not change
    the choice (both kernels read a 16-bit PagedKVCache); the fp8 variants need ``'sm90'`` and the
    caller refuses anything else (``_prefill``)."""
    import cupy

    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    if device_id is None:
        device_id = cupy.cuda.runtime.getDevice()
    hopper = _capability(device_id) == "90"
    if kernel == "sm90":
        if not hopper:
            raise ValueError(f"kernel: 'sm90' needs a compute capability 9.0 GPU, this one is {_capability(device_id)}")
        return "sm90"
    if kernel == "sm80":
        return "sm80"
    return "sm90" if hopper and not os.environ.get("MLA_CUPY_DISABLE_SM90") else "sm80"


def _stride16(x, dim: int) -> int:
    """Byte stride of ``dim`` for a tensor map (a size-1 dimension's stride is arbitrary: use 16)."""
    st = int(x.strides[dim])
    return st if x.shape[dim] > 1 and st % 16 == 0 else 16


# The kernels' parameter lists, in order (kernels/mla_prefill_sm{80,90}.cu).
_ROPE_AND_GRID = [("rope_base", PTR), ("rope_row_stride", I64), ("rope_block_stride", I64), ("lookup", PTR),
                  ("lookup_stride", I64), ("log2_page_size", I32), ("num_blocks", U32), ("max_pages", U32),
                  ("num_heads", I32), ("heads_per_section", I32), ("batch", I32), ("num_m_blocks", I32),
                  ("scale_log2", F32), ("mask_arg", I64), ("accumulate", I32)]
_OFFSETS = [("q_offsets", PTR), ("kv_begin", PTR), ("kv_end", PTR), ("cache_offsets", PTR), ("q_start_pos", PTR)]
SM80_ARGS = ArgPack([("q", PTR), ("k", PTR), ("v", PTR), ("out", PTR), ("lse", PTR)] + _OFFSETS
                    + [(n, I64) for n in ("q_st", "q_sh", "k_st", "k_sh", "v_st", "v_sh", "o_st", "o_sh", "lse_st")]
                    + _ROPE_AND_GRID)
SM90_ARGS = ArgPack([("tm_q", TENSOR_MAP_DTYPE), ("tm_k", TENSOR_MAP_DTYPE), ("tm_v", TENSOR_MAP_DTYPE),
                     ("tm_rope", TENSOR_MAP_DTYPE), ("tm_q_rope", TENSOR_MAP_DTYPE), ("tm_k_scales", TENSOR_MAP_DTYPE),
                     ("out", PTR), ("lse", PTR)] + _OFFSETS
                    + [("o_st", I64), ("o_sh", I64), ("lse_st", I64)] + _ROPE_AND_GRID
                    + [("rope_box_rows", I32), ("q_scale", PTR), ("q_scale_stride", I64), ("rope_scales", PTR),
                       ("rope_scale_row_stride", I64), ("rope_scale_block_stride", I64), ("tile_counter", PTR)])

_FUNCTIONS: dict = {}  # (device, kernel, dtype, out_dtype, mask, paged) -> (RawKernel, CUfunction), smem limit set


def _prefill_function(kernel: str, p: Problem, device_id: int):
    """(RawKernel, CUfunction) of the instantiation ``p`` needs on this device (compiled on first use)."""
    variant = "fp8" if p.fp8 else "fp8_rope" if p.rope8 else "bf16"
    key = (device_id, kernel, p.dtype, p.out_dtype, p.mask.cpp_name, p.paged, variant)
    ptr = _FUNCTIONS.get(key)
    if ptr is None:
        if kernel == "sm90":
            fn, smem = (get_function(*reg.prefill_sm90(p.dtype, p.mask, variant),
                                     reg.prefill_sm90_name(p.dtype, p.out_dtype, p.mask, p.paged, variant)),
                        sm90_smem_for(p))
        else:
            fn, smem = get_function(*reg.prefill_sm80(p.dtype, p.mask),
                                    reg.prefill_sm80_name(p.dtype, p.out_dtype, p.mask, p.paged)), SMEM_BYTES
        if fn.max_dynamic_shared_size_bytes < smem:  # a driver call, once per kernel and device
            fn.max_dynamic_shared_size_bytes = smem
        ptr = _FUNCTIONS.setdefault(key, (fn, int(fn.kernel.ptr)))
    return ptr


@functools.lru_cache(maxsize=256)
def _tensor_maps(dtype: np.dtype, heads: int, tq: int, tk: int, q_ptr: int, q_st: Tuple[int, int], k_ptr: int,
                 k_st: Tuple[int, int], v_ptr: int, v_st: Tuple[int, int], rope: tuple, fp8: Optional[tuple]):
    """The Hopper kernel's TMA descriptors (Q, K, V, rope, q_rope, k_scales), cached by buffer and
    layout, and the rope box height. ``rope`` is ``(ptr, row_stride_bytes)`` for a plain k_rope, or
    ``(ptr, row_stride_bytes, block_stride_bytes, page_size, num_blocks)`` for a paged cache. ``fp8``
    (per-token variant) is ``(q_rope_ptr, q_rope_strides, k_scales_ptr)``: q / k are then e4m3
    bytes of the 128 nope values (one 128-byte box per row) and v the e4m3 V^T of
    :func:`mla_cupy.quant.transpose_v`."""
    zero = np.zeros(1, TENSOR_MAP_DTYPE)[0]
    if fp8 is None:
        tm_q = encode_tiled(q_ptr, dtype, (DQK, heads, tq), q_st, (64, 1, 128))
        tm_k = encode_tiled(k_ptr, dtype, (DV, heads, tk), k_st, (64, 1, 128))
        tm_v = encode_tiled(v_ptr, dtype, (DV, heads, tk), v_st, (64, 1, 128))
        tm_qr = tm_ks = zero
    else:
        u8 = np.dtype(np.uint8)
        tm_q = encode_tiled(q_ptr, u8, (DV, heads, tq), q_st, (128, 1, 128))
        tm_k = encode_tiled(k_ptr, u8, (DV, heads, tk), k_st, (128, 1, 128))
        # V^T[H][128][cols] (quant.transpose_v; v_st = (cols, 128 * cols)): 128 key columns x 128 values
        tm_v = encode_tiled(v_ptr, u8, (v_st[0], DV, heads), v_st, (128, DV, 1))
        tm_qr = encode_tiled(fp8[0], dtype, (DR, heads, tq), fp8[1], (64, 1, 128))
        # key scales from the 16-byte boundary at or before a tile's first key (kernels: kScaleBox)
        tm_ks = encode_tiled(fp8[2], FP32, (tk,), (), (SM90_BLOCK_N + 4,), swizzle=False)
    if len(rope) == 2:
        tm_r, box_rows = encode_tiled(rope[0], dtype, (DR, tk), (rope[1],), (64, 128)), 0
    elif not rope[0]:  # an fp8 rope: the rope warp reads it
        tm_r, box_rows = zero, 0
    else:
        tm_r, box_rows = _paged_rope_map(dtype, *rope)
    return tm_q, tm_k, tm_v, tm_r, tm_qr, tm_ks, box_rows


def _paged_rope_map(dtype: np.dtype, ptr: int, row_st: int, block_st: int, page_size: int, num_blocks: int):
    """The paged cache's rope columns as a [num_blocks][page_size][64] tensor map with boxes of
    min(page_size, 128) slots (one page run of a key tile), or a zero map and box height 0 (the
    kernel then gathers every tile) when TMA cannot address the cache: strides or the base not
    16-byte aligned, or no blocks."""
    box_rows = min(page_size, SM90_BLOCK_N)
    ok = num_blocks > 0 and ptr % 16 == 0 and row_st > 0 and row_st % 16 == 0 and block_st > 0 and block_st % 16 == 0
    if ok:
        try:
            return encode_tiled(ptr, dtype, (DR, page_size, num_blocks), (row_st, block_st), (64, box_rows, 1)), box_rows
        except RuntimeError:  # a layout the driver refuses (e.g. strides past 2^40): gather instead
            pass
    return np.zeros(1, TENSOR_MAP_DTYPE)[0], 0


def launch_prefill(p: Problem, q, k, v, k_rope, out, lse, q_offsets_ptr: int, kv_begin_ptr: int, kv_end_ptr: int,
                   cache_offsets_ptr: int, q_start_ptr: int, stream, kernel: str = "auto",
                   accumulate: bool = False, fp8: Optional[tuple] = None,
                   k_rope_scales=None) -> Optional[tuple]:
    """Launch a prefill kernel over a checked problem (no checks here; pointers are raw). With
    ``accumulate``, ``out`` / ``lse`` hold a partial result over other keys that is merged in place.
    Returns the launch as a record ``(ArgPack, kernel, CUfunction, grid, block, smem, values)``
    that :func:`_relaunch` repeats on a stream (None when there was nothing to launch).
    ``fp8`` (per-token variant, Hopper only): ``(q_rope, q_scale, k_scales)``, with q / k / v the
    e4m3 (uint8) nope parts."""
    if p.batch == 0 or p.tq == 0 or not p.max_sq:
        return None
    import cupy

    device_id = cupy.cuda.runtime.getDevice()
    nmb = -(-p.max_sq // BLOCK_M)
    oitem = p.out_dtype.itemsize
    rope_args = _rope_args(k_rope)  # the kernels' rope_base .. max_pages parameters
    tail = (*rope_args, p.heads, heads_per_section(p, device_id), p.batch, nmb, p.scale * LOG2E, p.mask.arg, int(accumulate))
    out_lse = (device_pointer(out), optional_ptr(lse), q_offsets_ptr, kv_begin_ptr, kv_end_ptr, cache_offsets_ptr,
               q_start_ptr)
    o_strides = (out.strides[0] // oitem, out.strides[1] // oitem, 0 if lse is None else lse.strides[0] // 4)
    if choose_kernel(kernel, p.paged, device_id) == "sm90":
        # With no keys at all (Tk = 0) nothing is read through K, V or the rope; their maps then
        # point at `out` because the driver refuses to encode a map of a null (empty) buffer.
        stand_in = device_pointer(out)
        kp, vp = (device_pointer(k), device_pointer(v)) if p.tk else (stand_in, stand_in)
        if p.rope8:  # dequantized by the rope warp: no map
            rope_map = (0, 0, 0, 0, 0)
        elif p.paged:
            bl = k_rope.blocks
            rope_map = (device_pointer(bl) + k_rope.rope_offset * p.dtype.itemsize, int(bl.strides[1]),
                        int(bl.strides[0]), k_rope.page_size, int(bl.shape[0]))
        else:
            rope_map = (device_pointer(k_rope) if p.tk else stand_in, _stride16(k_rope, 0))
        v_st = (_stride16(v, 1), _stride16(v, 0))
        fp8_maps, q_scale, vt = None, (0, 0), None
        if fp8 is not None:
            q_rope, qs, ks = fp8
            fp8_maps = (device_pointer(q_rope), (_stride16(q_rope, 1), _stride16(q_rope, 0)),
                        device_pointer(ks) if p.tk else stand_in)
            q_scale = (device_pointer(qs), int(qs.strides[0]) // 4)
            # the e4m3 P V reads V^T: written here, on the kernel's stream, once per call (freed
            # back to CuPy's stream-ordered pool when the call returns)
            cols = vt_columns(p.tk, p.batch)
            if p.tk:
                vt = _transpose_v_device(v, kv_begin_ptr, kv_end_ptr, p.batch, stream)
                vp = device_pointer(vt)
            v_st = (cols, DV * cols)
        *maps, box_rows = _tensor_maps(p.dtype, p.heads, p.tq, p.tk, device_pointer(q), (_stride16(q, 1), _stride16(q, 0)),
                                       kp, (_stride16(k, 1), _stride16(k, 0)), vp, v_st, rope_map, fp8_maps)
        # Persistent: at most one CTA per SM (over 200 KiB of shared memory each), striding over the tiles.
        grid = min(nmb * p.batch * p.heads, _sm_count_and_l2(device_id)[0])
        rec = (SM90_ARGS, *_prefill_function("sm90", p, device_id), grid, SM90_THREADS,
               sm90_smem_for(p),
               (*maps, *out_lse, *o_strides, *tail, box_rows, *q_scale, *_rope_scale_args(k_rope, k_rope_scales), 0))
        _relaunch(rec, stream)
        return rec
    item = p.dtype.itemsize
    in_strides = (q.strides[0] // item, q.strides[1] // item, k.strides[0] // item, k.strides[1] // item,
                  v.strides[0] // item, v.strides[1] // item)
    rec = (SM80_ARGS, *_prefill_function("sm80", p, device_id), nmb * p.batch * p.heads, THREADS, SMEM_BYTES,
           (device_pointer(q), device_pointer(k), device_pointer(v)) + out_lse + in_strides + o_strides + tail)
    _relaunch(rec, stream)
    return rec


DYNAMIC_SCHEDULE = True  # the Hopper kernel's tile hand-out: dynamic (a counter per stream) or round robin
_COUNTERS: dict = {}  # (device, stream) -> the hand-out counter (2 zeroed words; kernels/sm90_scheduler.cuh)


def _tile_counter(stream) -> int:
    """The Hopper kernel's work-tile counter for launches on ``stream`` (zero between launches: the
    kernel resets it; launches on one stream never overlap, so each stream has its own)."""
    if not DYNAMIC_SCHEDULE:
        return 0
    import cupy

    key = (cupy.cuda.runtime.getDevice(), stream.ptr)
    buf = _COUNTERS.get(key)
    if buf is None:
        buf = _COUNTERS[key] = cupy.zeros(2, cupy.uint32)
    return buf.data.ptr


def _relaunch(rec: tuple, stream) -> None:
    pack, fn, ptr, grid, block, smem, values = rec
    if pack is SM90_ARGS:
        values = values[:-1] + (_tile_counter(stream),)
    pack.launch(fn, ptr, grid, block, smem, stream, values)


_PLANS: dict = {}  # launch records of fully specified calls (see _plan_key)
_PLANS_MAX = 1024


def _plan_key(arrays, k_rope, extra) -> Optional[tuple]:
    """Everything a launch record depends on, for calls whose arrays are all CuPy arrays: pointers,
    shapes, strides, dtypes and devices of every array, and the keywords. None otherwise."""
    import cupy as cp

    parts = []
    if isinstance(k_rope, PagedKVCache):
        if k_rope.scales is not None:
            return None
        arrays = arrays + (k_rope.blocks, k_rope.lookup_table)
        parts.append((k_rope.page_size, k_rope.rope_offset))
    else:
        arrays = arrays + (k_rope,)
    for x in arrays:
        if x is None:
            parts.append(None)
        elif type(x) is cp.ndarray:
            parts.append((x.data.ptr, x.shape, x.strides, x.dtype, x.data.device_id))
        else:
            return None
    return tuple(parts) + extra


def _q_start_i64(q_start_pos):
    """The kernel reads int64 positions; an int32 array is widened (a B-element copy)."""
    if q_start_pos is None or np.dtype(q_start_pos.dtype) == np.int64:
        return q_start_pos
    import cupy

    return cupy.asarray(q_start_pos).astype(cupy.int64)


def device_inputs(q, k, v, k_rope, valid_length, cache_row_offsets, cache_offsets, q_start_pos, out):
    """Every array argument as something the kernels read in place (see ``_arrays.as_device``)."""
    def opt(x, name):
        return None if x is None else as_device(x, name)

    if isinstance(k_rope, PagedKVCache):
        k_rope = PagedKVCache(as_device(k_rope.blocks, "k_rope.blocks"), as_device(k_rope.lookup_table, "k_rope.lookup_table"),
                              k_rope.page_size, k_rope.rope_offset, opt(k_rope.scales, "k_rope.scales"))
    else:
        k_rope = as_device(k_rope, "k_rope")
    return (as_device(q, "q"), as_device(k, "k"), as_device(v, "v"), k_rope, as_device(valid_length, "valid_length"),
            as_device(cache_row_offsets, "cache_row_offsets"), opt(cache_offsets, "cache_offsets"),
            opt(q_start_pos, "q_start_pos"), opt(out, "out"))


_PROBLEMS: dict = {}  # fast path: validate=False problems by the metadata check_inputs looks at
_PROBLEMS_MAX = 4096


def _meta(x, cp) -> Optional[tuple]:
    """What check_inputs reads of a CuPy array without touching its data; None for other kinds."""
    if x is None:
        return ()
    if type(x) is not cp.ndarray:
        return None
    return x.shape, x.strides, x.dtype, x.data.ptr % 16, x.data.device_id


def _problem_key(arrays, k_rope, extra) -> Optional[tuple]:
    import cupy as cp

    metas = [_meta(a, cp) for a in arrays]
    if isinstance(k_rope, PagedKVCache):
        if k_rope.scales is not None:
            return None
        metas += [_meta(k_rope.blocks, cp), _meta(k_rope.lookup_table, cp), ("paged", k_rope.page_size, k_rope.rope_offset)]
    else:
        metas.append(_meta(k_rope, cp))
    if any(m is None for m in metas):
        return None
    return tuple(metas) + extra


def _check_cached(q, k, v, k_rope, valid_length, cache_row_offsets, *, scale, mask, q_max_seq_len, cache_offsets,
                  q_start_pos, out, out_dtype, lse, accumulate, k_rope_scales=None) -> Problem:
    """check_inputs for ``validate=False`` with ``q_max_seq_len`` given: nothing it checks depends on
    array contents then, so a call with the same shapes, strides, dtypes, alignments, devices and
    keywords as an earlier one reuses that call's Problem (a dict lookup instead of ~30 us of checks)."""
    key = _problem_key((q, k, v, valid_length, cache_row_offsets, cache_offsets, q_start_pos, out, lse, k_rope_scales),
                       k_rope,
                       (scale, type(scale), mask, q_max_seq_len, type(q_max_seq_len), out_dtype, accumulate,
                        type(accumulate)))
    try:
        p = _PROBLEMS.get(key) if key is not None else None
    except TypeError:  # an unhashable keyword: check_inputs will say what is wrong with it
        key = p = None
    if p is None:
        p = check_inputs(q, k, v, k_rope, valid_length, cache_row_offsets, scale=scale, mask=mask,
                         q_max_seq_len=q_max_seq_len, cache_offsets=cache_offsets, q_start_pos=q_start_pos, out=out,
                         out_dtype=out_dtype, validate=False, device=True, read_offsets=False,
                         k_rope_scales=k_rope_scales)
        check_lse_and_accumulate(p, out, lse, accumulate)
        if key is not None:
            if len(_PROBLEMS) >= _PROBLEMS_MAX:
                _PROBLEMS.clear()
            _PROBLEMS[key] = p
    return p


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
        capturable). A bound below the true maximum leaves rows unwritten (checked when ``validate``).
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
        Check offset values and paged block ids on the host (one small device-to-host copy).
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
    """
    # Fully specified repeat calls (validate=False, q_max_seq_len, out and, if wanted, lse given,
    # CuPy arrays only) reuse the launch record of an identical earlier call: no checks and no
    # argument packing, just the launch (issue 7: host time per call).
    plan_key = None
    if not validate and q_max_seq_len is not None and out is not None and (lse is not None or not return_lse):
        plan_key = _plan_key((q, k, v, valid_length, cache_row_offsets, cache_offsets, q_start_pos, out, lse,
                              k_rope_scales), k_rope,
                             (scale, type(scale), mask, q_max_seq_len, type(q_max_seq_len), out_dtype, accumulate,
                              type(accumulate), return_lse, kernel, os.environ.get("MLA_CUPY_DISABLE_SM90"),
                              _device_id()))
        if plan_key is not None:
            try:
                rec = _PLANS.get(plan_key)
            except TypeError:  # an unhashable keyword: the checks below will name it
                rec, plan_key = None, None
            if rec is not None:
                s = stream_of(stream, False)
                if rec[1] is not None:
                    _relaunch(rec[1], s)
                return (out, lse) if return_lse else out
    return _prefill(q, k, v, k_rope, valid_length, cache_row_offsets, scale=scale, mask=mask,
                    q_max_seq_len=q_max_seq_len, cache_offsets=cache_offsets, q_start_pos=q_start_pos, out=out,
                    out_dtype=out_dtype, return_lse=return_lse, lse=lse, accumulate=accumulate, stream=stream,
                    validate=validate, kernel=kernel, plan_key=plan_key, k_rope_scales=k_rope_scales)


def _fp8_bytes(x, name: str):
    """e4m3 data as the uint8 bytes the kernels read: torch float8_e4m3fn tensors are viewed as
    uint8 (no copy); CuPy has no fp8 dtype, so CuPy data comes as uint8 already."""
    if is_torch(x) and str(x.dtype) == "torch.float8_e4m3fn":
        import torch

        return x.view(torch.uint8)
    if FP8_E4M3 is not None and getattr(x, "dtype", None) == FP8_E4M3 and isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a device array, got a NumPy float8_e4m3fn array; upload its bytes with "
                        f"cupy.asarray({name}.view(numpy.uint8))")
    return x


def mla_prefill_fp8(
    q_nope, q_rope, q_scale, k, k_scales, v, k_rope: Union[Any, PagedKVCache], valid_length, cache_row_offsets, *,
    scale: Optional[float] = None, mask: Optional[Mask] = None, q_max_seq_len: Optional[int] = None,
    cache_offsets=None, q_start_pos=None, out=None, out_dtype=None, return_lse: bool = False,
    lse=None, accumulate: bool = False, stream=None, validate: bool = True, kernel: str = "auto",
):
    """MLA prefill with fp8 per-token inputs (MAX's ``q_nope, q_rope, q_scale, k, k_scales``
    overload), on the Hopper kernel: Q K^T of the nope part and P V on the e4m3 tensor cores.

    Parameters
    ----------
    q_nope : ``[Tq, H, 128]`` float8_e4m3fn as uint8 (a torch float8_e4m3fn tensor is viewed as uint8)
    q_rope : ``[Tq, H, 64]`` bfloat16
    q_scale : ``[Tq, 1]`` float32, non-negative (checked with ``validate=True``)
        The true query is ``q_scale[i] * concat(q_nope[i], q_rope[i])``. The kernel folds
        ``q_scale[i]`` into row i's softmax scale, which needs it non-negative (the quantizers give
        ``amax / 448``, or 1 for an all-zero row).
    k, v : ``[Tk, H, 128]`` float8_e4m3fn as uint8
        The nope keys and the values (V is used as stored, no scale).
    k_scales : ``[Tk, 1]`` float32, contiguous
        The true key is ``k_scales[j] * concat(k[j], rope_j)``.
    k_rope : ``[Tk, 1, 64]`` bfloat16 array or bfloat16 :class:`PagedKVCache`
        The shared rope, stored divided by ``k_scales`` as MAX's per-token cache holds it.
    valid_length, cache_row_offsets, and the keywords
        As in :func:`mla_prefill` (``scale`` defaults to ``1 / sqrt(192)``; ``kernel`` must be
        ``"auto"`` or ``"sm90"``).

    Returns
    -------
    out : ``[Tq, H, 128]`` bfloat16 (or ``out_dtype`` float32), and ``lse`` with ``return_lse=True``.

    Notes
    -----
    P is rounded to e4m3 for P V (as in FlashAttention-3's fp8 path); the row sums use the float32
    P. :func:`mla_cupy.quant.quantize_per_token` produces these inputs from bf16 ones (on the host
    for NumPy data, on the device for CuPy data).

    Each call writes V transposed (:func:`mla_cupy.quant.transpose_v`, the layout the e4m3 tensor
    cores read) into a workspace of about V's size, taken from CuPy's memory pool on the call's
    stream and returned to it when the call returns; the transpose is part of the call's time.
    Key tiles start on multiples of 16 keys of a sequence, so a NaN in the v of a key also reaches
    query blocks whose visible keys start up to 15 keys after it (never another sequence).
    """
    return _prefill(_fp8_bytes(q_nope, "q_nope"), _fp8_bytes(k, "k"), _fp8_bytes(v, "v"), k_rope, valid_length,
                    cache_row_offsets, scale=scale, mask=mask, q_max_seq_len=q_max_seq_len, cache_offsets=cache_offsets,
                    q_start_pos=q_start_pos, out=out, out_dtype=out_dtype, return_lse=return_lse, lse=lse,
                    accumulate=accumulate, stream=stream, validate=validate, kernel=kernel, fp8=(q_rope, q_scale, k_scales))


def _prefill(q, k, v, k_rope, valid_length, cache_row_offsets, *, scale, mask, q_max_seq_len, cache_offsets,
             q_start_pos, out, out_dtype, return_lse, lse, accumulate, stream, validate, kernel,
             plan_key=None, fp8=None, k_rope_scales=None):
    """The body of :func:`mla_prefill` and :func:`mla_prefill_fp8` (``fp8 = (q_rope, q_scale,
    k_scales)``, with q / k / v the e4m3 nope parts): device views, checks, outputs, the launch."""
    torch_q = q if is_torch(q) else None
    wrap = result_wrapper(q)
    q, k, v, k_rope, valid_length, cache_row_offsets, cache_offsets, q_start_pos, out = device_inputs(
        q, k, v, k_rope, valid_length, cache_row_offsets, cache_offsets, q_start_pos, out)
    if k_rope_scales is not None:
        k_rope_scales = as_device(k_rope_scales, "k_rope_scales")
    if fp8 is not None:
        fp8 = tuple(as_device(x, n) for x, n in zip(fp8, ("q_rope", "q_scale", "k_scales")))
    if lse is not None:
        lse = as_device(lse, "lse")
    if validate or q_max_seq_len is None or fp8 is not None:
        p = check_inputs(q, k, v, k_rope, valid_length, cache_row_offsets, scale=scale, mask=mask,
                         q_max_seq_len=q_max_seq_len, cache_offsets=cache_offsets, q_start_pos=q_start_pos, out=out,
                         out_dtype=out_dtype, validate=validate, device=True, read_offsets=q_max_seq_len is None, fp8=fp8,
                         k_rope_scales=k_rope_scales)
        check_lse_and_accumulate(p, out, lse, accumulate)
    else:
        p = _check_cached(q, k, v, k_rope, valid_length, cache_row_offsets, scale=scale, mask=mask,
                          q_max_seq_len=q_max_seq_len, cache_offsets=cache_offsets, q_start_pos=q_start_pos, out=out,
                          out_dtype=out_dtype, lse=lse, accumulate=accumulate, k_rope_scales=k_rope_scales)
    if (p.fp8 or p.rope8) and (kernel == "sm80" or choose_kernel(kernel, p.paged) != "sm90"):
        what = "the fp8 per-token variant" if p.fp8 else "an fp8 rope"
        raise ValueError(f"kernel: {what} runs on the Hopper kernel only (compute capability 9.0, kernel='auto' or "
                         f"'sm90'), got kernel={kernel!r}")
    s = stream_of(stream, torch_q is not None)
    if out is None:
        out = _empty((p.tq, p.heads, DV), p.out_dtype, torch_q)
    if lse is None and return_lse:
        lse = _empty((p.tq, p.heads), FP32, torch_q, "lse")
    qs_given = q_start_pos
    if q_start_pos is not None:
        with s:
            q_start_pos = _q_start_i64(q_start_pos)
    cro_ptr = device_pointer(cache_row_offsets)
    rec = launch_prefill(p, q, k, v, k_rope, out, lse, device_pointer(valid_length), cro_ptr, cro_ptr + 4,
                         optional_ptr(cache_offsets), optional_ptr(q_start_pos), s, kernel, accumulate, fp8,
                         k_rope_scales)
    if plan_key is not None and q_start_pos is qs_given:  # (a widened int32 q_start_pos is a temporary)
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[plan_key] = (p, rec)
    return (wrap(out), wrap(lse)) if return_lse else wrap(out)

"""``mla_prefill``: the public entry point, its launch, and the small device helpers around it."""
from __future__ import annotations

import functools
import math
import os
from typing import Any, Optional, Tuple, Union

import numpy as np

from . import _registry as reg
from ._arrays import FP32, as_device, device_pointer, is_torch, optional_ptr, result_wrapper, stream_of
from .jit import get_function
from .masks import CausalMask, Mask
from .paged import PagedKVCache
from .validation import DQK, DR, DV, Problem, check_inputs

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


def _rope_args(k_rope, dtype) -> Tuple[int, int, int, int, int, int, int, int]:
    """(base, row_stride, block_stride, lookup, lookup_stride, log2_page, num_blocks, max_pages)."""
    item = np.dtype(dtype).itemsize
    if isinstance(k_rope, PagedKVCache):
        bl, lut = k_rope.blocks, k_rope.lookup_table
        return (device_pointer(bl) + k_rope.rope_offset * item, int(bl.strides[1]) // item, int(bl.strides[0]) // item,
                device_pointer(lut), int(lut.strides[0]) // 4, int(math.log2(k_rope.page_size)),
                int(bl.shape[0]), int(lut.shape[1]))
    return (device_pointer(k_rope), int(k_rope.strides[0]) // item, 0, 0, 0, 0, 0, 0)


KERNELS = ("auto", "sm80", "sm90")
SM90_THREADS = 384  # kernels/mla_prefill_sm90.cu: kThreads
SM90_SMEM_BYTES = 128 * 384 + 2 * (128 * 384 + 128 * 256) + 128 + 2 * (128 + 16) + 1024  # its kSmemBytes


@functools.lru_cache(maxsize=None)
def _capability(device_id: int) -> str:
    import cupy

    return cupy.cuda.Device(device_id).compute_capability


@functools.lru_cache(maxsize=None)
def _sm_count_and_l2(device_id: int) -> Tuple[int, int]:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    return int(props["multiProcessorCount"]), int(props.get("l2CacheSize", 50 << 20))


def heads_per_section(p: Problem, device_id: int) -> int:
    """Heads whose keys and values together fill about half the L2 (see kernels/tile_scheduler.cuh):
    the tiles of one section run together, so each head's K/V is read from DRAM about once."""
    kv_bytes_per_head = max(1, p.tk) * 2 * DV * p.dtype.itemsize
    g = max(1, min(p.heads, (_sm_count_and_l2(device_id)[1] // 2) // kv_bytes_per_head))
    return -(-p.heads // -(-p.heads // g))  # the same number of heads in every section, or one fewer


def choose_kernel(kernel: str, paged: bool, device_id: Optional[int] = None) -> str:
    """``'sm90'`` (the Hopper TMA + wgmma kernel) on compute capability 9.0, else ``'sm80'`` (the
    portable mma.sync kernel). ``kernel`` forces one; the environment variable
    ``MLA_CUPY_DISABLE_SM90=1`` makes ``"auto"`` pick the portable kernel. ``paged`` does not change
    the choice today (both kernels read a PagedKVCache); it stays so a rope source that only one
    kernel supports (the fp8 cache) can steer it."""
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


_SMEM_SET: set = set()  # (id of kernel object, bytes) already configured; jit keeps those objects alive


def _with_smem(fn, nbytes: int):
    """Raise a kernel's dynamic shared-memory limit once (a driver call), not on every launch."""
    key = (id(fn), nbytes)
    if key not in _SMEM_SET:
        if fn.max_dynamic_shared_size_bytes < nbytes:
            fn.max_dynamic_shared_size_bytes = nbytes
        _SMEM_SET.add(key)
    return fn


def _stride16(x, dim: int) -> int:
    """Byte stride of ``dim`` for a tensor map (a size-1 dimension's stride is arbitrary: use 16)."""
    st = int(x.strides[dim])
    return st if x.shape[dim] > 1 and st % 16 == 0 else 16


_FUNCTIONS: dict = {}  # (kernel, dtype, out_dtype, mask template, paged) -> kernel object, smem limit set


def _prefill_function(kernel: str, p: Problem):
    key = (kernel, p.dtype, p.out_dtype, p.mask.cpp_name, p.paged)
    fn = _FUNCTIONS.get(key)
    if fn is None:
        if kernel == "sm90":
            fn = _with_smem(get_function(*reg.prefill_sm90(p.dtype, p.mask),
                                         reg.prefill_sm90_name(p.dtype, p.out_dtype, p.mask, p.paged)), SM90_SMEM_BYTES)
        else:
            fn = _with_smem(get_function(*reg.prefill_sm80(p.dtype, p.mask),
                                         reg.prefill_sm80_name(p.dtype, p.out_dtype, p.mask, p.paged)), SMEM_BYTES)
        fn = _FUNCTIONS.setdefault(key, fn)
    return fn


@functools.lru_cache(maxsize=256)
def _tensor_maps(dtype: np.dtype, heads: int, tq: int, tk: int, q_ptr: int, q_st: Tuple[int, int], k_ptr: int,
                 k_st: Tuple[int, int], v_ptr: int, v_st: Tuple[int, int], rope_ptr: Optional[int], rope_st: int):
    """The Hopper kernel's TMA descriptors for Q, K, V (and a plain k_rope), cached by buffer and layout."""
    from .tma import TENSOR_MAP_DTYPE, encode_tiled

    tm_q = encode_tiled(q_ptr, dtype, (DQK, heads, tq), q_st, (64, 1, 128))
    tm_k = encode_tiled(k_ptr, dtype, (DV, heads, tk), k_st, (64, 1, 128))
    tm_v = encode_tiled(v_ptr, dtype, (DV, heads, tk), v_st, (64, 1, 128))
    if rope_ptr is None:  # paged: the producer warp gathers rope rows itself; the map is unused
        tm_r = np.zeros(1, TENSOR_MAP_DTYPE)[0]
    else:
        tm_r = encode_tiled(rope_ptr, dtype, (DR, tk), (rope_st,), (64, 128))
    return tm_q, tm_k, tm_v, tm_r


def _launch_sm90(p: Problem, q, k, v, k_rope, out, lse, q_offsets_ptr, kv_begin_ptr, kv_end_ptr, cache_offsets_ptr,
                 q_start_ptr, stream, nmb: int, device_id: int) -> None:
    tm_q, tm_k, tm_v, tm_r = _tensor_maps(
        p.dtype, p.heads, p.tq, p.tk, device_pointer(q), (_stride16(q, 1), _stride16(q, 0)),
        device_pointer(k), (_stride16(k, 1), _stride16(k, 0)), device_pointer(v), (_stride16(v, 1), _stride16(v, 0)),
        None if p.paged else device_pointer(k_rope), 0 if p.paged else _stride16(k_rope, 0))
    rope = _rope_args(k_rope, p.dtype)
    fn = _prefill_function("sm90", p)
    oitem = p.out_dtype.itemsize
    i64 = np.int64
    args = (tm_q, tm_k, tm_v, tm_r, device_pointer(out), optional_ptr(lse), q_offsets_ptr, kv_begin_ptr, kv_end_ptr,
            cache_offsets_ptr, q_start_ptr, i64(out.strides[0] // oitem), i64(out.strides[1] // oitem), i64(p.heads),
            rope[0], i64(rope[1]), i64(rope[2]), rope[3], i64(rope[4]), np.int32(rope[5]), np.uint32(rope[6]),
            np.uint32(rope[7]), np.int32(p.heads), np.int32(heads_per_section(p, device_id)), np.int32(p.batch),
            np.int32(nmb), np.float32(p.scale * LOG2E), i64(p.mask.arg))
    # Persistent: at most one CTA per SM (214 KiB of shared memory each), striding over the tiles.
    grid = min(nmb * p.batch * p.heads, _sm_count_and_l2(device_id)[0])
    with stream:
        fn((grid,), (SM90_THREADS,), args, shared_mem=SM90_SMEM_BYTES)


def launch_prefill(p: Problem, q, k, v, k_rope, out, lse, q_offsets_ptr: int, kv_begin_ptr: int, kv_end_ptr: int,
                   cache_offsets_ptr: int, q_start_ptr: int, stream, kernel: str = "auto") -> None:
    """Launch a prefill kernel over a checked problem (no checks here; pointers are raw)."""
    if p.batch == 0 or p.tq == 0 or not p.max_sq:
        return
    import cupy

    device_id = cupy.cuda.runtime.getDevice()
    if choose_kernel(kernel, p.paged, device_id) == "sm90":
        _launch_sm90(p, q, k, v, k_rope, out, lse, q_offsets_ptr, kv_begin_ptr, kv_end_ptr, cache_offsets_ptr,
                     q_start_ptr, stream, -(-p.max_sq // BLOCK_M), device_id)
        return
    fn = _prefill_function("sm80", p)
    item, oitem = p.dtype.itemsize, p.out_dtype.itemsize
    nmb = -(-p.max_sq // BLOCK_M)
    rope = _rope_args(k_rope, p.dtype)
    i64 = np.int64
    args = (
        device_pointer(q), device_pointer(k), device_pointer(v), device_pointer(out), optional_ptr(lse),
        q_offsets_ptr, kv_begin_ptr, kv_end_ptr, cache_offsets_ptr, q_start_ptr,
        i64(q.strides[0] // item), i64(q.strides[1] // item), i64(k.strides[0] // item), i64(k.strides[1] // item),
        i64(v.strides[0] // item), i64(v.strides[1] // item), i64(out.strides[0] // oitem), i64(out.strides[1] // oitem),
        i64(p.heads),
        rope[0], i64(rope[1]), i64(rope[2]), rope[3], i64(rope[4]), np.int32(rope[5]), np.uint32(rope[6]), np.uint32(rope[7]),
        np.int32(p.heads), np.int32(heads_per_section(p, device_id)), np.int32(p.batch), np.int32(nmb),
        np.float32(p.scale * LOG2E), i64(p.mask.arg),
    )
    with stream:
        fn((nmb * p.batch * p.heads,), (THREADS,), args, shared_mem=SMEM_BYTES)


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
                              k_rope.page_size, k_rope.rope_offset)
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
                  q_start_pos, out, out_dtype) -> Problem:
    """check_inputs for ``validate=False`` with ``q_max_seq_len`` given: nothing it checks depends on
    array contents then, so a call with the same shapes, strides, dtypes, alignments, devices and
    keywords as an earlier one reuses that call's Problem (a dict lookup instead of ~30 us of checks)."""
    key = _problem_key((q, k, v, valid_length, cache_row_offsets, cache_offsets, q_start_pos, out), k_rope,
                       (scale, type(scale), mask, q_max_seq_len, type(q_max_seq_len), out_dtype))
    try:
        p = _PROBLEMS.get(key) if key is not None else None
    except TypeError:  # an unhashable keyword: check_inputs will say what is wrong with it
        key = p = None
    if p is None:
        p = check_inputs(q, k, v, k_rope, valid_length, cache_row_offsets, scale=scale, mask=mask,
                         q_max_seq_len=q_max_seq_len, cache_offsets=cache_offsets, q_start_pos=q_start_pos, out=out,
                         out_dtype=out_dtype, validate=False, device=True, read_offsets=False)
        if key is not None:
            if len(_PROBLEMS) >= _PROBLEMS_MAX:
                _PROBLEMS.clear()
            _PROBLEMS[key] = p
    return p


def mla_prefill(
    q, k, v, k_rope: Union[Any, PagedKVCache], valid_length, cache_row_offsets, *,
    scale: Optional[float] = None, mask: Optional[Mask] = None, q_max_seq_len: Optional[int] = None,
    cache_offsets=None, q_start_pos=None, out=None, out_dtype=None, return_lse: bool = False,
    stream=None, validate: bool = True, kernel: str = "auto",
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
    stream : cupy / torch stream or raw ``cudaStream_t`` int, optional
        Default: CuPy's current stream, or torch's current stream for torch inputs.
    validate : bool
        Check offset values and paged block ids on the host (one small device-to-host copy).
    kernel : {"auto", "sm80", "sm90"}
        ``"auto"`` runs the Hopper TMA + wgmma kernel on compute capability 9.0 (plain or paged
        k_rope) and the portable mma.sync kernel elsewhere; the others force one.

    Returns
    -------
    out : ``[Tq, H, 128]``, same kind of array as ``q`` (CuPy in, CuPy out; torch in, torch out)
    lse : ``[Tq, H]`` float32, only with ``return_lse=True``

    Notes
    -----
    A query row that sees no key gets output 0 and lse ``-inf`` (MAX would return the mean of V).
    Inputs are read in place; nothing is copied except an int32 ``q_start_pos`` (widened).
    """
    torch_q = q if is_torch(q) else None
    wrap = result_wrapper(q)
    q, k, v, k_rope, valid_length, cache_row_offsets, cache_offsets, q_start_pos, out = device_inputs(
        q, k, v, k_rope, valid_length, cache_row_offsets, cache_offsets, q_start_pos, out)
    if validate or q_max_seq_len is None:
        p = check_inputs(q, k, v, k_rope, valid_length, cache_row_offsets, scale=scale, mask=mask,
                         q_max_seq_len=q_max_seq_len, cache_offsets=cache_offsets, q_start_pos=q_start_pos, out=out,
                         out_dtype=out_dtype, validate=validate, device=True, read_offsets=q_max_seq_len is None)
    else:
        p = _check_cached(q, k, v, k_rope, valid_length, cache_row_offsets, scale=scale, mask=mask,
                          q_max_seq_len=q_max_seq_len, cache_offsets=cache_offsets, q_start_pos=q_start_pos, out=out,
                          out_dtype=out_dtype)
    s = stream_of(stream, torch_q is not None)
    with s:
        if out is None:
            out = _empty((p.tq, p.heads, DV), p.out_dtype, torch_q)
        lse = _empty((p.tq, p.heads), FP32, torch_q, "lse") if return_lse else None
        q_start_pos = _q_start_i64(q_start_pos)
    cro_ptr = device_pointer(cache_row_offsets)
    launch_prefill(p, q, k, v, k_rope, out, lse, device_pointer(valid_length), cro_ptr, cro_ptr + 4,
                   optional_ptr(cache_offsets), optional_ptr(q_start_pos), s, kernel)
    return (wrap(out), wrap(lse)) if return_lse else wrap(out)

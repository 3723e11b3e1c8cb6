"""Host-side TMA tensor maps (``cuTensorMapEncodeTiled`` through ctypes on ``libcuda``), and the
maps of the Hopper prefill kernel.

CuPy does not wrap the call; ctypes reaches it in the driver every CUDA machine has. A map is
passed to the kernel by value (a 128-byte ``__grid_constant__`` parameter) as a NumPy structured
scalar, copied into the launch's packed parameter buffer.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Dict, Optional, Sequence, Tuple, Union

import numpy as np

from ._arrays import BF16, FP16
from ._launch import TENSOR_MAP_DTYPE
from .dims import DQK, DR, DV

__all__ = ["encode_tiled", "TENSOR_MAP_DTYPE", "ZERO_MAP", "prefill_maps"]

# CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 / _FLOAT16 / _UINT8 (e4m3 bytes) / _FLOAT32 (fp8 scales)
_DTYPE_CODE = {BF16: 9, FP16: 6, np.dtype(np.uint8): 0, np.dtype(np.float32): 7}
_SWIZZLE_NONE = 0
_SWIZZLE_64B = 2
_SWIZZLE_128B = 3
#: the ``swizzle`` argument of encode_tiled: False (none), True or 128 (128-byte), 64 (64-byte: rows of 64 bytes)
_SWIZZLE = {False: _SWIZZLE_NONE, True: _SWIZZLE_128B, 128: _SWIZZLE_128B, 64: _SWIZZLE_64B}
_L2_PROMOTION_256B = 3

@functools.lru_cache(maxsize=1)
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                   ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32),
                   ctypes.POINTER(ctypes.c_uint32), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


def encode_tiled(ptr: int, dtype, dims: Sequence[int], strides_bytes: Sequence[int], box: Sequence[int],
                 swizzle: Union[bool, int] = True) -> np.void:
    """A tiled tensor map, with the 128-byte swizzle unless ``swizzle=False`` (none) or ``64`` (the
    64-byte swizzle, for boxes 64 bytes wide); ``dims``/``box``
    innermost first, ``strides_bytes`` for dims 1.. (multiples of 16). Out-of-bounds elements read
    as zero. Maps are cached by their arguments (repeated calls on the same buffers encode nothing)."""
    return _encode_cached(int(ptr), np.dtype(dtype), tuple(int(d) for d in dims), tuple(int(s) for s in strides_bytes),
                          tuple(int(b) for b in box), _SWIZZLE[swizzle])


@functools.lru_cache(maxsize=256)
def _encode_cached(ptr: int, dtype: np.dtype, dims, strides_bytes, box, swizzle: int) -> np.void:
    rank = len(dims)
    buf = np.zeros(1, TENSOR_MAP_DTYPE)
    c_dims = (ctypes.c_uint64 * rank)(*[max(1, int(d)) for d in dims])
    c_strides = (ctypes.c_uint64 * max(1, rank - 1))(*[int(s) for s in strides_bytes])
    c_box = (ctypes.c_uint32 * rank)(*[int(b) for b in box])
    c_elem = (ctypes.c_uint32 * rank)(*([1] * rank))
    rc = _driver()(buf.ctypes.data, _DTYPE_CODE[np.dtype(dtype)], rank, ctypes.c_void_p(int(ptr)), c_dims, c_strides,
                   c_box, c_elem, 0, swizzle, _L2_PROMOTION_256B, 0)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {rc} (dims {list(dims)}, strides "
                           f"{list(strides_bytes)}, box {list(box)})")
    return buf[0]


# ---------------------------------------------------------------------------------------------
# The Hopper prefill kernel's maps (kernels/sm90/params.cuh: tm_q .. tm_out)

ZERO_MAP = np.zeros(1, TENSOR_MAP_DTYPE)[0]  #: an unused map parameter


def prefill_maps(dtype: np.dtype, heads: int, tq: int, tk: int, q: Tuple[int, Tuple[int, int]],
                 k: Tuple[int, Tuple[int, int]], v: Tuple[int, Tuple[int, int]], rope: tuple,
                 fp8: Optional[tuple], block_rows: int, scale_box: int, q_rows: int,
                 out: Optional[tuple] = None) -> Dict[str, np.void]:
    """The TMA descriptors of the Hopper kernel by parameter name (kernels/sm90/params.cuh: tm_q,
    tm_k, tm_v, tm_rope, tm_q_rope, tm_k_scales, tm_out; an unused one zero). ``q``,
    ``k``, ``v`` are ``(pointer, (head stride, row stride))`` in bytes; ``block_rows`` is the
    kernel's key tile height (rows of a K / V box), ``q_rows`` the rows of a Q box (each consumer's
    own rows: they load and release apart), ``scale_box`` the floats of the fp8 key-scale box (all
    three from the kernel's exported geometry).

    ``rope`` is ``(ptr, row_stride)`` for a plain k_rope or a paged one's gathered key rows
    (kernels/rope_gather.cu), or ``(0,)`` for an fp8 rope (read by the rope warp, no map). ``fp8``
    (per-token variant) is ``(q_rope_ptr, q_rope_strides, k_scales_ptr)``: q / k are then e4m3
    bytes of the 128 nope values (one 128-byte box per row) and v the e4m3 V^T of
    :func:`mla_cupy.fp8.transpose_v`, with strides ``(cols, 128 * cols)``. ``dtype`` is that of
    q_rope and the rope: uint8 in the all-e4m3 mode, whose rope rows are 64 bytes (boxes of 64 bytes
    with the 64-byte swizzle, kernels/sm90/ptx.cuh), else 16-bit (128-byte rows and swizzle).

    ``out`` is ``(pointer, dtype, (head stride, row stride))`` of a 16-bit output the kernel's
    staged epilogue may store by TMA (boxes of a consumer's ``q_rows`` rows and half a row, the
    staging's 128-byte swizzle), or None (a zero map: the threads store)."""
    rope_swizzle = 64 if np.dtype(dtype).itemsize == 1 else True
    if fp8 is None:
        tm_q = encode_tiled(q[0], dtype, (DQK, heads, tq), q[1], (64, 1, q_rows))
        tm_k = encode_tiled(k[0], dtype, (DV, heads, tk), k[1], (64, 1, block_rows))
        tm_v = encode_tiled(v[0], dtype, (DV, heads, tk), v[1], (64, 1, block_rows))
        tm_qr = tm_ks = ZERO_MAP
    else:
        u8 = np.dtype(np.uint8)
        tm_q = encode_tiled(q[0], u8, (DV, heads, tq), q[1], (128, 1, q_rows))
        tm_k = encode_tiled(k[0], u8, (DV, heads, tk), k[1], (128, 1, block_rows))
        # V^T[H][128][cols]: block_rows key columns x 128 values
        tm_v = encode_tiled(v[0], u8, (v[1][0], DV, heads), v[1], (block_rows, DV, 1))
        tm_qr = encode_tiled(fp8[0], dtype, (DR, heads, tq), fp8[1], (64, 1, q_rows), swizzle=rope_swizzle)
        # key scales from the 16-byte boundary at or before a tile's first key
        tm_ks = encode_tiled(fp8[2], np.float32, (tk,), (), (scale_box,), swizzle=False)
    if len(rope) == 2:
        tm_r = encode_tiled(rope[0], dtype, (DR, tk), (rope[1],), (64, block_rows), swizzle=rope_swizzle)
    else:
        tm_r = ZERO_MAP
    tm_o = ZERO_MAP if out is None else encode_tiled(out[0], out[1], (DV, heads, tq), out[2], (DV // 2, 1, q_rows))
    return dict(tm_q=tm_q, tm_k=tm_k, tm_v=tm_v, tm_rope=tm_r, tm_q_rope=tm_qr, tm_k_scales=tm_ks, tm_out=tm_o)

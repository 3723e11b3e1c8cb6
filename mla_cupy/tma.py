"""Host-side TMA tensor maps (``cuTensorMapEncodeTiled`` through ctypes on ``libcuda``).

CuPy does not wrap the call; ctypes reaches it in the driver every CUDA machine has. A map is
passed to the kernel by value (a 128-byte ``__grid_constant__`` parameter) as a NumPy structured
scalar, which CuPy's ``RawKernel`` copies into the launch's parameter buffer.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Sequence

import numpy as np

from ._arrays import BF16, FP16

__all__ = ["encode_tiled", "TENSOR_MAP_DTYPE"]

# CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 / _FLOAT16 / _UINT8 (e4m3 bytes) / _FLOAT32 (fp8 scales)
_DTYPE_CODE = {BF16: 9, FP16: 6, np.dtype(np.uint8): 0, np.dtype(np.float32): 7}
_SWIZZLE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3

#: 128 opaque bytes, what CuPy passes by value for a ``TensorMap`` parameter.
TENSOR_MAP_DTYPE = np.dtype([("opaque", np.uint64, (16,))])


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
                 swizzle: bool = True) -> np.void:
    """A tiled tensor map, with the 128-byte swizzle unless ``swizzle=False``; ``dims``/``box``
    innermost first, ``strides_bytes`` for dims 1.. (multiples of 16). Out-of-bounds elements read
    as zero. Maps are cached by their arguments (repeated calls on the same buffers encode nothing)."""
    return _encode_cached(int(ptr), np.dtype(dtype), tuple(int(d) for d in dims), tuple(int(s) for s in strides_bytes),
                          tuple(int(b) for b in box), bool(swizzle))


@functools.lru_cache(maxsize=256)
def _encode_cached(ptr: int, dtype: np.dtype, dims, strides_bytes, box, swizzle: bool) -> np.void:
    rank = len(dims)
    buf = np.zeros(1, TENSOR_MAP_DTYPE)
    c_dims = (ctypes.c_uint64 * rank)(*[max(1, int(d)) for d in dims])
    c_strides = (ctypes.c_uint64 * max(1, rank - 1))(*[int(s) for s in strides_bytes])
    c_box = (ctypes.c_uint32 * rank)(*[int(b) for b in box])
    c_elem = (ctypes.c_uint32 * rank)(*([1] * rank))
    rc = _driver()(buf.ctypes.data, _DTYPE_CODE[np.dtype(dtype)], rank, ctypes.c_void_p(int(ptr)), c_dims, c_strides,
                   c_box, c_elem, 0, _SWIZZLE_128B if swizzle else _SWIZZLE_NONE, _L2_PROMOTION_256B, 0)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {rc} (dims {list(dims)}, strides "
                           f"{list(strides_bytes)}, box {list(box)})")
    return buf[0]

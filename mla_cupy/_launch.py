"""Kernel launches straight through the driver (``cuLaunchKernel``) from a packed argument buffer.

CuPy's ``RawKernel.__call__`` converts every argument on every call (tens of microseconds for the
prefill kernels' ~29 parameters, four of them 128-byte tensor maps). Here a kernel's parameter
list is declared once as NumPy dtypes; a call writes the values into a per-thread structured
buffer (one NumPy assignment) and passes the driver an array of pointers into it. The driver
copies the values at launch, so the buffer is free again when the call returns; CUDA-graph
capture records them the same way.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Sequence, Tuple

import numpy as np

__all__ = ["ArgPack", "PTR", "I32", "U32", "I64", "F32"]

PTR = np.dtype(np.uint64)  # any device pointer
I32, U32, I64, F32 = np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.int64), np.dtype(np.float32)


class ArgPack:
    """The parameter list of one kernel signature: ``ArgPack([("q", PTR), ("heads", I32), ...])``."""

    def __init__(self, params: Sequence[Tuple[str, np.dtype]]):
        names, formats, offsets = [], [], []
        off = 0
        for name, dt in params:
            dt = np.dtype(dt)
            align = 64 if dt.itemsize >= 64 else dt.itemsize  # natural alignment; tensor maps 64
            off = -(-off // align) * align
            names.append(name)
            formats.append(dt)
            offsets.append(off)
            off += dt.itemsize
        self.dtype = np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": -(-off // 64) * 64})
        self.names = tuple(names)
        self._types = tuple(np.dtype(f).type if np.dtype(f).names is None else None for f in formats)
        self._offsets = tuple(offsets)
        self._local = threading.local()

    def _buffer(self):
        b = getattr(self._local, "b", None)
        if b is None:
            buf = np.zeros(1, self.dtype)
            ptrs = np.array([buf.ctypes.data + o for o in self._offsets], np.uint64)
            b = self._local.b = (buf, ptrs, int(ptrs.ctypes.data))
        return b

    def launch(self, kernel: Any, func_ptr: int, grid: int, block: int, smem: int, stream, values: tuple) -> None:
        """Launch ``func_ptr`` (the CUfunction of the ``cupy.RawKernel`` ``kernel``) on a 1-D grid
        with ``values`` in parameter order, on ``stream``. ``MLA_CUPY_LAUNCH=cupy`` in the
        environment routes launches through ``RawKernel.__call__`` instead (a debugging aid)."""
        if os.environ.get("MLA_CUPY_LAUNCH") == "cupy":
            args = tuple(v if t is None else t(v) for v, t in zip(values, self._types))
            with stream:
                kernel((grid,), (block,), args, shared_mem=smem)
            return
        from cupy.cuda import driver

        buf, _ptrs, pptr = self._buffer()
        buf[0] = values
        driver.launchKernel(func_ptr, grid, 1, 1, block, 1, 1, smem, stream.ptr, pptr, 0)

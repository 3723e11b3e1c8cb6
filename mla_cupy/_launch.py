"""Kernel launches straight through the driver (``cuLaunchKernel``) from a packed argument buffer.

CuPy's ``RawKernel.__call__`` converts every argument on every call (tens of microseconds for the
prefill kernels' ~37 parameters, six of them 128-byte tensor maps). Here a kernel's parameter
list is declared once as NumPy dtypes (:class:`ArgPack`); a :class:`PreparedLaunch` holds one
packed buffer of it with every value filled in, and a call rewrites only the values that change
(pointers, tensor maps) before handing the driver an array of pointers into the buffer. The driver
copies the values at launch, so the buffer may be rewritten as soon as the launch returns; CUDA
graph capture records the values the same way.
"""
from __future__ import annotations

import os
import struct
from typing import Any, Dict, Sequence, Tuple

import numpy as np

__all__ = ["ArgPack", "PreparedLaunch", "PTR", "I32", "U32", "I64", "F32"]

PTR = np.dtype(np.uint64)  # any device pointer
I32, U32, I64, F32 = np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.int64), np.dtype(np.float32)

_U64 = struct.Struct("<Q")


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
        self.offsets: Dict[str, int] = dict(zip(names, offsets))
        self._types = tuple(np.dtype(f).type if np.dtype(f).names is None else None for f in formats)

    def new_buffer(self) -> Tuple[np.ndarray, np.ndarray]:
        """A zeroed structured buffer of one argument set and the array of pointers to its fields."""
        buf = np.zeros(1, self.dtype)
        ptrs = np.array([buf.ctypes.data + self.offsets[n] for n in self.names], np.uint64)
        return buf, ptrs

    def launch_through_cupy(self, kernel: Any, grid: tuple, block: int, smem: int, stream, values: tuple) -> None:
        """The same launch through ``RawKernel.__call__`` (``MLA_CUPY_LAUNCH=cupy``, a debugging aid)."""
        args = tuple(v if t is None else t(v) for v, t in zip(values, self._types))
        with stream:
            kernel(grid, (block,), args, shared_mem=smem)


def _through_cupy() -> bool:
    return os.environ.get("MLA_CUPY_LAUNCH") == "cupy"


class PreparedLaunch:
    """One kernel with its geometry and a packed argument buffer of its own.

    Parameters
    ----------
    pack : ArgPack
        The kernel's parameter list.
    kernel : cupy.RawKernel
        The compiled kernel (kept alive with the launch; its CUfunction is what is launched).
    grid : tuple of int
        Grid size (x, y, z).
    block, smem : int
        Threads per block and dynamic shared memory in bytes.
    values : dict
        Initial value of every parameter, by name.

    Notes
    -----
    :meth:`set_pointer` and :meth:`set_bytes` rewrite one field in place (a few hundred
    nanoseconds); :meth:`launch` enqueues the kernel with the buffer as it stands. One prepared
    launch is meant for one thread at a time (the plans that own them hold a lock around a run).
    """

    __slots__ = ("pack", "kernel", "func_ptr", "grid", "block", "smem", "_buf", "_ptrs", "_pptr", "_mem", "_off")

    def __init__(self, pack: ArgPack, kernel: Any, grid: Tuple[int, int, int], block: int, smem: int,
                 values: Dict[str, Any]):
        missing = set(pack.names) - set(values)
        if missing:
            raise ValueError(f"PreparedLaunch: no value for parameters {sorted(missing)}")
        self.pack, self.kernel = pack, kernel
        self.func_ptr = int(kernel.kernel.ptr) if hasattr(kernel, "kernel") else 0
        self.grid, self.block, self.smem = tuple(int(g) for g in grid), int(block), int(smem)
        self._buf, self._ptrs = pack.new_buffer()
        self._buf[0] = tuple(values[n] for n in pack.names)
        self._pptr = int(self._ptrs.ctypes.data)
        self._mem = memoryview(self._buf.view(np.uint8))
        self._off = pack.offsets

    def set_pointer(self, name: str, value: int) -> None:
        _U64.pack_into(self._mem, self._off[name], value)

    def set_bytes(self, name: str, data: bytes) -> None:
        """Overwrite the bytes of field ``name`` (and of the following fields, if ``data`` is longer)."""
        o = self._off[name]
        self._mem[o:o + len(data)] = data

    def values(self) -> tuple:
        """The current argument values in parameter order (tests and the CuPy launch path)."""
        return tuple(self._buf[0])

    def launch(self, stream_ptr: int) -> None:
        """Enqueue the kernel on the raw stream ``stream_ptr``."""
        if _through_cupy():
            import cupy

            self.pack.launch_through_cupy(self.kernel, self.grid, self.block, self.smem,
                                          cupy.cuda.ExternalStream(stream_ptr), self.values())
            return
        from cupy.cuda import driver

        g = self.grid
        driver.launchKernel(self.func_ptr, g[0], g[1], g[2], self.block, 1, 1, self.smem, stream_ptr, self._pptr, 0)

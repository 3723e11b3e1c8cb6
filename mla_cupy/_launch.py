"""Kernel launches straight through the driver (``cuLaunchKernel``) from a packed argument buffer.

CuPy's ``RawKernel.__call__`` converts every argument on every call (tens of microseconds for
kernels with many parameters or 128-byte tensor maps). Here a kernel's parameters are described
once as a NumPy structured dtype (:class:`ArgPack`): the prefill kernels take one parameter
struct whose layout their compiled module exports (``kernels/params_abi.cuh``:
:meth:`ArgPack.from_export`), smaller kernels a list declared in Python. A :class:`PreparedLaunch`
holds one packed buffer with every value filled in, and a call rewrites only the values that
change (pointers, tensor maps) before handing the driver an array of pointers into the buffer. The
driver copies the values at launch, so the buffer may be rewritten as soon as the launch returns;
CUDA graph capture records the values the same way.
"""
from __future__ import annotations

import os
import struct
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

__all__ = ["ArgPack", "PreparedLaunch", "PTR", "I32", "U32", "I64", "F32", "TENSOR_MAP_DTYPE", "environ_get"]

PTR = np.dtype(np.uint64)  # any device pointer
I32, U32, I64, F32 = np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.int64), np.dtype(np.float32)
#: A TMA tensor map: 128 opaque bytes, passed by value (kernels/sm90/ptx.cuh: TensorMap).
TENSOR_MAP_DTYPE = np.dtype([("opaque", np.uint64, (16,))])
#: kernels/params_abi.cuh: ParamKindCode -> the field's dtype
_PARAM_KINDS = {0: PTR, 1: I32, 2: U32, 3: I64, 4: F32, 5: TENSOR_MAP_DTYPE}

_U64 = struct.Struct("<Q")


def _param_dtype(ctype: str) -> np.dtype:
    """The field dtype of a parameter's C type (kernels/params_abi.cuh: ParamKind)."""
    if "*" in ctype:
        return PTR
    dt = {"int": I32, "u32": U32, "i64": I64, "float": F32, "TensorMap": TENSOR_MAP_DTYPE}.get(ctype)
    if dt is None:
        raise ValueError(f"a parameter of C type {ctype!r}: not a kind of kernels/params_abi.cuh")
    return dt


class ArgPack:
    """A kernel's parameters: ``ArgPack([("q", PTR), ("heads", I32), ...])`` for a parameter list
    (natural alignment, tensor maps on 64 bytes), or :meth:`from_export` for one parameter struct."""

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
        self._init(names, formats, offsets, -(-off // 64) * 64, struct=False)

    @classmethod
    def from_fields(cls, fields: Sequence[Tuple[str, str]]) -> "ArgPack":
        """The parameter struct that ``MLA_DEFINE_PARAMS`` (kernels/params_abi.cuh) makes of
        ``(C type, name)`` fields (:func:`mla_cupy.dims.param_fields` reads them from a kernel's
        text), laid out as C lays out a struct: each field on a multiple of its size (a tensor map
        on 64 bytes), the size a multiple of the largest. For code without a compiled module (the
        tests' fake GPU); a module's own export (:meth:`from_export`) is the same (a CPU test
        compares them)."""
        pack = cls([(name, _param_dtype(ctype)) for ctype, name in fields])  # the offsets
        formats = [pack.dtype.fields[n][0] for n in pack.names]
        offsets = [pack.offsets[n] for n in pack.names]
        end = max((o + f.itemsize for o, f in zip(offsets, formats)), default=0)
        align = max((min(f.itemsize, 64) for f in formats), default=1)
        pack._init(list(pack.names), formats, offsets, -(-end // align) * align, struct=True)
        return pack

    def _init(self, names, formats, offsets, itemsize: int, struct: bool) -> None:
        self.dtype = np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": itemsize})
        self.names = tuple(names)
        self.offsets: Dict[str, int] = dict(zip(names, offsets))
        self.struct = struct  # one kernel parameter: the whole buffer
        self._types = tuple(np.dtype(f).type if np.dtype(f).names is None else None for f in formats)

    @classmethod
    def from_export(cls, layout: np.ndarray, names: bytes, what: str = "kernel") -> "ArgPack":
        """The parameter struct a compiled module describes (kernels/params_abi.cuh): ``layout`` is
        its ``kParamLayout`` (int32: size, field count, bytes of the names, then offset, size and
        kind per field), ``names`` its ``kParamNames`` (``"a,b,...,"``)."""
        layout = np.asarray(layout, np.int64)
        size, count, nchars = (int(x) for x in layout[:3])
        fields = layout[3:3 + 3 * count].reshape(count, 3)
        field_names = bytes(names[:nchars]).rstrip(b"\0").decode("ascii").split(",")[:-1]
        if len(field_names) != count or len(fields) != count:
            raise RuntimeError(f"{what}: malformed parameter export ({count} fields, names {field_names})")
        formats = []
        for name, (off, nbytes, kind) in zip(field_names, fields.tolist()):
            dt = _PARAM_KINDS.get(kind)
            if dt is None or dt.itemsize != nbytes or off + nbytes > size:
                raise RuntimeError(f"{what}: parameter {name!r} has kind {kind}, {nbytes} bytes at {off} of {size}")
            formats.append(dt)
        pack = cls.__new__(cls)
        pack._init(field_names, formats, [int(f[0]) for f in fields], size, struct=True)
        return pack

    def new_buffer(self) -> Tuple[np.ndarray, np.ndarray]:
        """A zeroed structured buffer of one argument set and the array of pointers to its fields
        (to the buffer itself for a parameter struct)."""
        buf = np.zeros(1, self.dtype)
        if self.struct:
            return buf, np.array([buf.ctypes.data], np.uint64)
        ptrs = np.array([buf.ctypes.data + self.offsets[n] for n in self.names], np.uint64)
        return buf, ptrs

    def launch_through_cupy(self, kernel: Any, grid: tuple, block: int, smem: int, stream, values: tuple) -> None:
        """The same launch through ``RawKernel.__call__`` (``MLA_CUPY_LAUNCH=cupy``, a debugging aid)."""
        if self.struct:
            buf = np.zeros(1, self.dtype)
            buf[0] = values
            args: tuple = (buf[0],)
        else:
            args = tuple(v if t is None else t(v) for v, t in zip(values, self._types))
        with stream:
            kernel(grid, (block,), args, shared_mem=smem)


def _through_cupy() -> bool:
    return environ_get("MLA_CUPY_LAUNCH") == "cupy"


_ENCODED: Dict[str, bytes] = {}  # names as os.environ's mapping holds them


def environ_get(name: str) -> Optional[str]:
    """``os.environ.get(name)``, for the switches read at every launch: on POSIX one lookup in the
    mapping that ``os.environ`` keeps, without encoding the name again each time."""
    env = os.environ
    data = getattr(env, "_data", None) if os.name == "posix" else None
    if type(data) is not dict:
        return env.get(name)
    key = _ENCODED.get(name)
    if key is None:
        key = _ENCODED[name] = os.fsencode(name)
    value = data.get(key)
    return None if value is None else os.fsdecode(value)


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
            from ._arrays import cupy_stream

            self.pack.launch_through_cupy(self.kernel, self.grid, self.block, self.smem,
                                          cupy_stream(stream_ptr), self.values())
            return
        g = self.grid
        driver = _DRIVER[0] if _DRIVER else _driver()
        driver.launchKernel(self.func_ptr, g[0], g[1], g[2], self.block, 1, 1, self.smem, stream_ptr, self._pptr, 0)


_DRIVER: list = []  # memo: [cupy.cuda.driver]


def _driver():
    from cupy.cuda import driver

    _DRIVER.append(driver)
    return driver

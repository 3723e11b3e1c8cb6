"""Checks of one array argument: rank, dtype, shape, offsets, and the device layout rules.

Every message names the argument, says what was expected and what came. The metadata checks
(:func:`check_array`, :func:`check_shape`, :func:`check_offsets_array`) and the value checks work
on NumPy arrays as well as device arrays, so a caller with host data hears about a wrong shape
before being told to move the data; :func:`check_layout` is for device arrays only.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from ._arrays import device_pointer

__all__ = ["OFFSET_DTYPES", "QSTART_DTYPES", "U8", "dtype_of", "check_array", "check_layout", "check_shape",
           "check_aligned", "check_offsets_array", "check_offsets_layout", "check_offsets_values", "step_range"]

OFFSET_DTYPES = (np.dtype(np.int32), np.dtype(np.uint32))
QSTART_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
U8 = np.dtype(np.uint8)  #: float8_e4m3fn data travels as its bytes


def dtype_of(x: Any) -> np.dtype:
    return np.dtype(x.dtype)


def _name(d: Any) -> str:
    return np.dtype(d).name


def check_array(x: Any, name: str, ndim: int, dtypes: Optional[Sequence[np.dtype]] = None) -> None:
    """Rank and dtype of one array argument (any kind of array)."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
    if len(x.shape) != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {tuple(x.shape)} ({len(x.shape)}-D)")
    if dtypes is not None and dtype_of(x) not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(_name(d) for d in dtypes)}, got {_name(dtype_of(x))}")


def check_layout(x: Any, name: str) -> None:
    """Device layout for vector and TMA loads: last dimension contiguous, other strides and the
    base address multiples of 16 bytes."""
    if math.prod(x.shape) == 0:
        return
    item = dtype_of(x).itemsize
    strides = tuple(int(s) for s in x.strides)
    if x.shape[-1] > 1 and strides[-1] != item:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride {item} bytes), got strides {strides} bytes")
    if len(x.shape) > 1 and any(s % 16 for s, n in zip(strides[:-1], x.shape[:-1]) if n > 1):
        raise ValueError(f"{name}: every stride but the last must be a multiple of 16 bytes, got strides {strides} bytes")
    check_aligned(device_pointer(x), name)


def check_aligned(ptr: int, name: str) -> None:
    """The data of ``name`` starts at a 16-byte aligned address."""
    if ptr % 16:
        raise ValueError(f"{name}: the data must start at a 16-byte aligned address, got {ptr:#x}")


def check_shape(x: Any, name: str, expected: Tuple[Optional[int], ...], what: str) -> None:
    got = tuple(int(n) for n in x.shape)
    if len(got) != len(expected) or any(e is not None and e != g for e, g in zip(expected, got)):
        shown = ", ".join("*" if e is None else str(e) for e in expected)
        raise ValueError(f"{name}: expected shape [{shown}] ({what}), got {list(got)}")


def check_offsets_array(x: Any, name: str, length: int, dtypes: Sequence[np.dtype]) -> None:
    """A 1-D array of ``length`` integers of one of ``dtypes``."""
    check_array(x, name, 1, dtypes)
    if x.shape[0] != length:
        raise ValueError(f"{name}: expected {length} entries, got {x.shape[0]}")


def check_offsets_layout(x: Any, name: str) -> None:
    """The kernels read offsets as a contiguous 1-D device array."""
    if x.shape[0] > 1 and int(x.strides[0]) != dtype_of(x).itemsize:
        raise ValueError(f"{name}: expected a contiguous 1-D array, got stride {int(x.strides[0])} bytes")


def step_range(h: np.ndarray) -> Tuple[int, int]:
    """``(smallest, largest)`` step ``h[i + 1] - h[i]`` of integer offsets (``(0, 0)`` for fewer than
    two); on Python ints for short arrays, where NumPy's per-call cost dominates."""
    n = len(h)
    if n < 2:
        return 0, 0
    if n <= 64:
        v = h.tolist()
        d = [b - a for a, b in zip(v, v[1:])]
        return min(d), max(d)
    d = h[1:] - h[:-1]
    return int(d.min()), int(d.max())


def check_offsets_values(h: np.ndarray, name: str, last: Optional[int], exact_last: bool, what: str) -> int:
    """Offsets start at 0, never decrease, and end at (or before) ``last`` (unchecked when None).
    Returns the largest step (the longest sequence; 0 for a single offset)."""
    if h[0] != 0:
        raise ValueError(f"{name}: expected offsets starting at 0, got {name}[0] = {h[0]}")
    smallest, largest = step_range(h)
    if smallest < 0:
        d = h[1:] - h[:-1]
        i = int(np.argmax(d < 0))
        raise ValueError(f"{name}: offsets must be non-decreasing, got {name}[{i}] = {h[i]} > {name}[{i + 1}] = {h[i + 1]}")
    if last is None:
        return largest
    end = int(h[-1])
    if exact_last and end != last:
        raise ValueError(f"{name}: the last offset must equal {what} = {last}, got {h[-1]}")
    if not exact_last and end > last:
        raise ValueError(f"{name}: the last offset must be <= {what} = {last}, got {h[-1]}")
    return largest

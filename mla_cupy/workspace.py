"""Device memory the calls allocate: results (``out``, ``lse``), the fp8 variant's V^T workspace and
the key rows a paged 16-bit rope is gathered into for the Hopper kernel."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from ._arrays import as_device, device_pointer
from ._checks import U8, check_aligned, check_array

__all__ = ["empty_result", "check_workspace", "allocate_workspace", "allocate_on", "tile_counter"]


def _out_of_memory(shape, dtype, name: str, exc: BaseException, hint: str) -> MemoryError:
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return MemoryError(f"{name}: cannot allocate {list(shape)} {np.dtype(dtype).name} ({nbytes / 2**30:.1f} GiB) "
                       f"on the device; {hint}")


def _is_oom(exc: BaseException) -> bool:
    import cupy

    return isinstance(exc, cupy.cuda.memory.OutOfMemoryError) or "out of memory" in str(exc).lower()


def empty_result(shape, dtype, torch_device: Optional[Any], name: str = "out"):
    """Allocate a result through torch's allocator on ``torch_device`` for torch callers (the device
    of their tensors), CuPy's pool otherwise (``None``; on the current stream). Running out of
    device memory is a ``MemoryError`` naming the result; the process stays usable."""
    import cupy

    try:
        if torch_device is not None:
            import torch

            tdt = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}.get(np.dtype(dtype), torch.bfloat16)
            return cupy.from_dlpack(torch.empty(shape, dtype=tdt, device=torch_device))
        return cupy.empty(shape, dtype=dtype)
    except (cupy.cuda.memory.OutOfMemoryError, RuntimeError) as exc:
        if not _is_oom(exc):
            raise
        raise _out_of_memory(shape, dtype, name, exc, "pass out= or split the batch") from exc


def allocate_workspace(shape: Tuple[int, ...], name: str = "workspace", hint: str = "pass workspace= or split the batch"):
    """A new uint8 V^T workspace (or other scratch, ``name``) of ``shape`` from CuPy's pool
    (current stream)."""
    import cupy

    try:
        return cupy.empty(shape, cupy.uint8)
    except cupy.cuda.memory.OutOfMemoryError as exc:
        raise _out_of_memory(shape, np.uint8, name, exc, hint) from exc


def allocate_on(shape: Tuple[int, ...], stream_ptr: int, name: str = "workspace",
                hint: str = "pass workspace= or split the batch"):
    """:func:`allocate_workspace` of ``prod(shape)`` bytes (at least one) on the raw stream
    ``stream_ptr`` (CuPy's pool reuses it in that stream's order)."""
    from ._arrays import cupy_stream

    with cupy_stream(stream_ptr):
        return allocate_workspace((max(int(np.prod(shape)), 1),), name, hint)


def check_workspace(workspace: Any, shape: Tuple[int, ...]):
    """A caller's V^T workspace: a C-contiguous uint8 device array of at least ``prod(shape)``
    bytes, 16-byte aligned. Returns it as a device array."""
    ws = as_device(workspace, "workspace")
    check_array(ws, "workspace", len(ws.shape), (U8,))
    need = int(np.prod(shape))
    if int(np.prod(ws.shape)) < need:
        raise ValueError(f"workspace: expected at least {need} bytes (V^T of shape {list(shape)}), got {list(ws.shape)}")
    contiguous = getattr(getattr(ws, "flags", None), "c_contiguous", None)
    if contiguous is False:
        raise ValueError("workspace: expected a C-contiguous array")
    check_aligned(device_pointer(ws), "workspace")
    return ws


#: The Hopper kernel hands out work tiles dynamically, from a counter (kernels/sm90/scheduler.cuh);
#: False makes it stride over them in round robin (a measurement switch for benchmarks/ab.py).
DYNAMIC_SCHEDULE = True
_COUNTER_BLOCK = 256  # counters allocated together
_counters: dict = {}  # device -> (list of buffers, {stream pointer: address})


def tile_counter(device_id: int, stream_ptr: int) -> int:
    """Device address of the Hopper kernel's work-tile counter for launches on ``stream_ptr`` (two
    uint32 words, zero between launches: the kernel resets them as it ends). Launches on one
    stream never overlap, so each stream has its own counter, shared by every plan; counters are
    allocated 256 at a time, zeroed, on a device's first launch, and kept. 0 (round robin) when
    :data:`DYNAMIC_SCHEDULE` is False."""
    if not DYNAMIC_SCHEDULE:
        return 0
    entry = _counters.get(device_id)
    if entry is None:
        entry = _counters[device_id] = ([], {})
    buffers, addresses = entry
    addr = addresses.get(stream_ptr)
    if addr is None:
        n = len(addresses)
        if n % _COUNTER_BLOCK == 0:
            import cupy

            with cupy.cuda.Device(device_id):
                buffers.append(cupy.zeros((_COUNTER_BLOCK, 2), cupy.uint32))
                cupy.cuda.runtime.deviceSynchronize()  # zeroed before any stream's kernel reads it
        addr = addresses[stream_ptr] = buffers[-1].data.ptr + 8 * (n % _COUNTER_BLOCK)
    return addr

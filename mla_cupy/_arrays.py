"""Array interop: CuPy arrays, anything with DLPack (torch CUDA tensors) or
``__cuda_array_interface__`` (Numba, JAX...), without copies. NumPy arrays are refused where a
device array is needed, with a message that says how to move them."""
from __future__ import annotations

import ctypes
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

try:  # ml_dtypes gives NumPy (and CuPy >= 14) bfloat16 / float8 dtypes.
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
    FP8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
except ImportError:  # pragma: no cover - ml_dtypes is a base dependency
    BF16 = None
    FP8_E4M3 = None

FP16 = np.dtype(np.float16)
FP32 = np.dtype(np.float32)

#: An array as the API takes it (for type hints): a CuPy array, a torch tensor, an object with
#: ``__cuda_array_interface__`` or DLPack, or a NumPy array where host data is accepted.
Array = Any
#: A ``stream=`` argument: a CuPy stream, a torch stream, a raw ``cudaStream_t`` int, or None.
Stream = Any

__all__ = ["BF16", "FP16", "FP32", "FP8_E4M3", "INSTALL_GPU", "cupy_or_none", "gpu_missing", "require_gpu", "as_device",
           "checkable", "is_device", "require_device", "is_torch", "result_wrapper", "to_host", "read_back",
           "stream_ptr", "stream_of", "pointers_and_layouts"]


_CUPY = []  # memo: [module or None]


def cupy_or_none():
    """The ``cupy`` module, or ``None`` when it is not installed (the reference needs only NumPy)."""
    if not _CUPY:
        try:
            import cupy
        except ImportError:
            cupy = None
        _CUPY.append(cupy)
    return _CUPY[0]


def is_torch(x: Any) -> bool:
    """``x`` is a torch object (a tensor, a stream...)."""
    t = type(x)
    return (_KINDS.get(t) or _kind(t)) == _TORCH


class HostTensorView(np.ndarray):
    """A NumPy view of a torch CPU tensor, so the argument checks can read it; never launched.
    ``move_hint`` is how :func:`require_device` tells the caller to move it."""

    move_hint = "{name}.cuda()"


_TORCH_TO_NUMPY = {"torch.bfloat16": BF16, "torch.float8_e4m3fn": FP8_E4M3}
_SAME_SIZE_INT = {1: "uint8", 2: "int16"}


def _torch_host_view(x: Any) -> np.ndarray:
    import torch

    x = x.detach()
    try:
        a = x.numpy()
    except TypeError:  # bfloat16 / float8 have no NumPy dtype of their own: view the bits
        target = _TORCH_TO_NUMPY.get(str(x.dtype))
        if target is None:
            raise
        a = x.view(getattr(torch, _SAME_SIZE_INT[x.element_size()])).numpy().view(target)
    return a.view(HostTensorView)


def checkable(x: Any, name: str):
    """``x`` as an array the checks can read without moving it: device arrays as in
    :func:`as_device` (zero-copy), NumPy arrays as they are, torch CPU tensors as NumPy views.
    Raises ``TypeError`` for anything that is not an array."""
    cp = cupy_or_none()
    if cp is not None and isinstance(x, cp.ndarray):
        return x
    if isinstance(x, np.ndarray):
        return x
    if is_torch(x) and hasattr(x, "is_cuda") and not x.is_cuda:
        return _torch_host_view(x)
    return as_device(x, name)


#: How to install CuPy with the NVRTC the kernels compile with: a command run in the checkout (the
#: package is installed from its source tree), quoted so that no shell expands the brackets.
INSTALL_GPU = 'pip install ".[cuda13]" (CUDA 13 driver) or ".[cuda12]" (CUDA 12 driver) in the mla_cupy checkout'


def _cuda_version(v: int) -> str:
    """CUDA's integer version as people write it: ``13020`` -> ``'13.2'``."""
    return f"{v // 1000}.{v % 1000 // 10}"


def gpu_missing() -> Optional[str]:
    """Why no CUDA GPU can run a kernel here, or ``None`` when one can: CuPy not installed, no
    NVIDIA driver (what a machine without a GPU has: ``CuPy sees no CUDA device``), a driver older
    than CuPy's CUDA runtime, no device."""
    cp = cupy_or_none()
    if cp is None:
        return f"CuPy is not installed: {INSTALL_GPU}"
    try:
        driver = cp.cuda.runtime.driverGetVersion()
    except Exception:  # no libcuda at all
        driver = 0
    if driver == 0:
        return "CuPy sees no CUDA device: no NVIDIA driver is loaded on this machine"
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # a driver too old for this CuPy, or a broken installation
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        runtime = cp.cuda.runtime.runtimeGetVersion()
        if driver < runtime:
            return (f"the NVIDIA driver supports CUDA {_cuda_version(driver)}, older than CuPy's CUDA "
                    f"{_cuda_version(runtime)} runtime; install the extra of the driver's CUDA version "
                    f"({INSTALL_GPU}) ({first})")
        return f"CuPy cannot use the CUDA driver: {first}"
    return None if count > 0 else "CuPy sees no CUDA device"


def require_gpu(api: str, cpu_alternative: str = "mla_cupy.reference.mla_prefill") -> None:
    """Raise ``RuntimeError`` saying that ``api`` needs a CUDA GPU and what runs on the CPU, when
    :func:`gpu_missing` finds none."""
    why = gpu_missing()
    if why is not None:
        raise RuntimeError(f"{api} needs a CUDA GPU: none found ({why}); use {cpu_alternative} on the CPU")


def is_device(x: Any) -> bool:
    """True unless ``x`` is host memory (a NumPy array or the view of a torch CPU tensor)."""
    return not isinstance(x, np.ndarray) or hasattr(x, "__cuda_array_interface__")


def require_device(x: Any, name: str, api: Optional[str] = None) -> None:
    """Raise ``TypeError`` naming ``name``, and how to move the data, when ``x`` is host memory.
    With ``api`` (the function called) and no GPU on this machine, the ``RuntimeError`` of
    :func:`require_gpu` instead: moving the data would not help."""
    if is_device(x):
        return
    if api is not None:
        require_gpu(api, f"mla_cupy.reference.{api}")
    what = "a torch tensor on the CPU" if isinstance(x, HostTensorView) else "a NumPy array"
    hint = getattr(type(x), "move_hint", "cupy.asarray({name})").format(name=name)
    raise TypeError(
        f"{name}: expected a device array (CuPy array, torch CUDA tensor, or an object with "
        f"__cuda_array_interface__ / DLPack), got {what}; move it with {hint} "
        f"or call mla_cupy.reference.mla_prefill for the CPU reference"
    )


def as_device(x: Any, name: str):
    """Return ``x`` as an array the kernels can read in place, or raise ``TypeError`` naming ``name``.

    CuPy arrays pass through. Objects with ``shape``/``dtype``/``strides`` and
    ``__cuda_array_interface__`` (Numba device arrays) are kept as they are. Torch CUDA tensors and
    other DLPack producers become zero-copy CuPy views; so do other CUDA-array-interface objects.
    """
    cp = cupy_or_none()
    if cp is not None and isinstance(x, cp.ndarray):
        return x
    if isinstance(x, np.ndarray):
        require_device(x, name)
        return x
    if hasattr(x, "__cuda_array_interface__") and all(hasattr(x, a) for a in ("shape", "dtype", "strides")) and not is_torch(x):
        return x
    if is_torch(x) and hasattr(x, "is_cuda") and not x.is_cuda:
        raise TypeError(f"{name}: expected a CUDA tensor, got a torch tensor on {x.device}; move it with {name}.cuda()")
    if cp is None and (hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__")):
        raise TypeError(f"{name}: CuPy is not installed, so device arrays cannot be used ({INSTALL_GPU})")
    if hasattr(x, "__dlpack__"):
        return cp.from_dlpack(x)
    if hasattr(x, "__cuda_array_interface__"):
        return cp.asarray(x)
    raise TypeError(f"{name}: expected an array, got {type(x).__module__}.{type(x).__name__}")


def to_host(x: Any) -> np.ndarray:
    """Copy a (small) device array to a NumPy array (a torch tensor through torch, on its current
    stream)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "copy_to_host"):  # Numba-style device arrays
        return np.asarray(x.copy_to_host())
    if is_torch(x):
        return np.asarray(_torch_host_view(x.detach().cpu()))
    return x.get()


# ---------------------------------------------------------------------------------------------
# Reading small device arrays back with one synchronization

_STAGE_ALIGN = 16  # each array's bytes start on this boundary of the staging buffer
_STAGE_MIN = 4096  # the smallest staging buffer (bytes)
#: the dtypes read back through the staging buffer (offsets, positions, page tables, scales)
_STAGEABLE = frozenset(np.dtype(n) for n in ("int32", "int64", "uint32", "uint8", "float32"))
_TORCH_NUMPY: dict = {}  # torch dtype -> its NumPy dtype in _STAGEABLE, or None


class _Stage(threading.local):
    """A thread's page-locked staging buffer (grown to the largest read so far), so that reads of
    concurrent threads never share memory."""

    mem: Any = None
    host: Optional[np.ndarray] = None
    nbytes: int = 0


_STAGE = _Stage()


def _pinned(nbytes: int) -> Tuple[int, np.ndarray]:
    """``(address, NumPy bytes over it)`` of the thread's staging buffer of at least ``nbytes``
    bytes: page-locked (portable, for the contexts of every device), so a device-to-host copy
    into it is asynchronous and takes no staging copy in the driver."""
    st = _STAGE
    if st.nbytes < nbytes:
        import cupy

        size = max(_STAGE_MIN, 1 << (nbytes - 1).bit_length())
        st.mem = cupy.cuda.PinnedMemory(size, cupy.cuda.runtime.hostAllocPortable)
        st.nbytes = size
        st.host = np.frombuffer((ctypes.c_uint8 * size).from_address(st.mem.ptr), np.uint8)
    return st.mem.ptr, st.host


def _current_device() -> int:
    import cupy

    return cupy.cuda.runtime.getDevice()


def _copy_to_host_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    import cupy

    rt = cupy.cuda.runtime
    rt.memcpyAsync(dst, src, nbytes, rt.memcpyDeviceToHost, stream)


def _synchronize(stream: int) -> None:
    import cupy

    cupy.cuda.runtime.streamSynchronize(stream)


def _cupy_stream() -> int:
    import cupy

    return cupy.cuda.get_current_stream().ptr


def _staged(x: Any, device: int) -> Optional[Tuple[int, int, np.dtype, tuple, int]]:
    """``(pointer, bytes, dtype, shape, stream)`` of a contiguous CuPy array or torch CUDA tensor
    on ``device`` (read on the stream :func:`to_host` reads it on: CuPy's current stream, torch's
    current stream), or None when it is read by :func:`to_host`."""
    t = type(x)
    kind = _KINDS.get(t) or _kind(t)
    if kind == _CUPY_ARRAY:
        d = x.data
        if d.device_id != device or x.dtype not in _STAGEABLE or not x.flags.c_contiguous:
            return None
        return d.ptr, x.nbytes, x.dtype, x.shape, _cupy_stream()
    if kind == _TORCH and getattr(x, "is_cuda", False):
        dt = _TORCH_NUMPY.get(x.dtype, False)
        if dt is False:  # first sight of this torch dtype
            try:
                dt = np.dtype(str(x.dtype).replace("torch.", ""))
            except TypeError:  # bfloat16, float8...: no NumPy dtype of that name
                dt = None
            dt = _TORCH_NUMPY[x.dtype] = dt if dt in _STAGEABLE else None
        if dt is None or x.get_device() != device or not x.is_contiguous():
            return None
        return x.data_ptr(), x.numel() * dt.itemsize, dt, tuple(x.shape), (_TORCH_STREAM[0] if _TORCH_STREAM
                                                                             else _torch_stream())()
    return None


def read_back(arrays: Sequence[Any]) -> List[Optional[np.ndarray]]:
    """Small device arrays (offsets, page tables, scales) as NumPy arrays, as :func:`to_host`
    reads them, with one synchronization in all.

    Parameters
    ----------
    arrays : sequence
        Arrays of any kind, or None.

    Returns
    -------
    list
        A NumPy array of its own (or None) per entry of ``arrays``: host arrays as they are, other
        arrays copied.

    Notes
    -----
    Contiguous CuPy arrays and torch CUDA tensors of the current device are copied asynchronously
    into the thread's page-locked staging buffer, each on the stream :func:`to_host` would read it
    on (CuPy's current stream, torch's current stream), and each stream used is synchronized once:
    one wait for the work already queued there, instead of one synchronous copy per array. Any
    other array goes through :func:`to_host`.
    """
    res: List[Optional[np.ndarray]] = [None] * len(arrays)
    staged = []
    total = 0
    device = None
    for i, x in enumerate(arrays):
        if x is None:
            continue
        if isinstance(x, np.ndarray):
            res[i] = to_host(x)
            continue
        if device is None:
            device = _current_device()
        s = _staged(x, device)
        if s is None:
            res[i] = to_host(x)
            continue
        staged.append((i, total, s))
        total += -(-s[1] // _STAGE_ALIGN) * _STAGE_ALIGN
    if not staged:
        return res
    base, host = _pinned(total)
    streams = []
    for _, off, (ptr, nbytes, _, _, stream) in staged:
        if nbytes:
            _copy_to_host_async(base + off, ptr, nbytes, stream)
            if stream not in streams:
                streams.append(stream)
    for stream in streams:
        _synchronize(stream)
    for i, off, (_, nbytes, dtype, shape, _) in staged:
        a = np.frombuffer(host, dtype, nbytes // dtype.itemsize, off)
        res[i] = (a if len(shape) == 1 else a.reshape(shape)).copy()
    return res


def device_pointer(x: Any) -> int:
    """The data pointer of a device array: CuPy's ``.data.ptr``, torch's ``data_ptr()``, else
    ``__cuda_array_interface__``; of a NumPy array (the reference's layout checks), its address."""
    t = type(x)
    kind = _KINDS.get(t) or _kind(t)
    if kind == _CUPY_ARRAY:
        return x.data.ptr
    if kind == _TORCH:
        return x.data_ptr()
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is None and isinstance(x, np.ndarray):
        return int(x.__array_interface__["data"][0])
    return int(cai["data"][0])


# ---------------------------------------------------------------------------------------------
# What a launch reads of its arrays, without converting them

_CUPY_ARRAY, _TORCH, _OTHER = 1, 2, 3  # CuPy arrays, torch objects (tensors), anything else
_KINDS: dict = {}  # type -> its kind


def _kind(t: type) -> int:
    kind = _KINDS.get(t)
    if kind is None:
        cp = cupy_or_none()
        kind = (_CUPY_ARRAY if cp is not None and t is cp.ndarray else
                _TORCH if t.__module__.startswith("torch") else _OTHER)
        _KINDS[t] = kind
    return kind


def _layout_key(x: Any) -> tuple:
    """The layout of an array of another kind (a Numba device array, a NumPy array...)."""
    return (type(x), tuple(int(n) for n in x.shape), tuple(int(n) for n in getattr(x, "strides", None) or ()),
            str(x.dtype))


def _other_pointer(x: Any) -> int:
    """The data pointer of an array of another kind, from ``__cuda_array_interface__``; 0 for host
    arrays (the checks refuse them)."""
    if not is_device(x):
        return 0
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is None:
        raise TypeError(f"{type(x).__name__} has no __cuda_array_interface__: read it through its CuPy view")
    return int(cai["data"][0])


def pointers_and_layouts(arrays) -> Tuple[list, list]:
    """``(pointers, layouts)`` of ``arrays`` (``None`` entries give 0 and ``None``), read straight
    from CuPy arrays (``.data.ptr``, shape, strides, dtype, device) and torch tensors
    (``data_ptr()``, shape, ``stride()``, dtype, device, type), without converting them; other
    arrays through ``__cuda_array_interface__`` (host arrays: pointer 0). Equal layouts are arrays
    of one kind, shape, strides, dtype and device. Raises ``TypeError`` for an object that is
    neither a host array nor has a pointer to read this way (a DLPack-only array, not an array)."""
    ptrs, layouts = [], []
    ptr, layout = ptrs.append, layouts.append
    kinds = _KINDS
    for x in arrays:
        if x is None:
            ptr(0)
            layout(None)
            continue
        t = type(x)
        kind = kinds.get(t) or _kind(t)
        if kind == _CUPY_ARRAY:
            d = x.data
            ptr(d.ptr)
            layout((x.shape, x.strides, x.dtype, d.device_id))
        elif kind == _TORCH:
            ptr(x.data_ptr())
            layout((t, x.shape, x.stride(), x.dtype, x.get_device()))
        else:
            ptr(_other_pointer(x))
            layout(_layout_key(x))
    return ptrs, layouts


def result_wrapper(like: Any) -> Callable[[Any], Any]:
    """Results come back as the kind of array ``like`` is: a torch tensor for torch input (zero-copy)."""
    if is_torch(like):
        import torch

        def wrap(a):
            return None if a is None else torch.from_dlpack(a)

        return wrap
    return lambda a: a


def stream_ptr(stream: Any, torch_input: bool) -> int:
    """The raw ``cudaStream_t`` of a ``stream=`` argument: a CuPy stream, a torch stream, or a raw
    int; ``None`` is CuPy's current stream, or torch's current stream for torch inputs
    (``torch_input``). Raises ``TypeError`` naming ``stream`` for anything else."""
    if stream is None:
        if torch_input:
            return (_TORCH_STREAM[0] if _TORCH_STREAM else _torch_stream())()
        import cupy

        return cupy.cuda.get_current_stream().ptr
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    ptr = getattr(stream, "ptr", None)
    if isinstance(ptr, int):
        return ptr
    if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        return int(stream.cuda_stream)
    raise TypeError(f"stream: expected a cupy.cuda.Stream, a torch.cuda.Stream or a raw cudaStream_t int, got "
                    f"{type(stream).__name__}")


_TORCH_STREAM: list = []  # memo: [the function giving torch's current raw stream]


def _torch_stream() -> Callable[[], int]:
    """A function giving ``torch.cuda.current_stream().cuda_stream`` (the current device's), through
    torch's raw accessors where it has them (no stream object per call)."""
    import torch

    raw, current = (getattr(torch._C, n, None) for n in ("_cuda_getCurrentRawStream", "_cuda_getDevice"))
    if raw is not None and current is not None:
        torch.cuda.init()  # what torch.cuda.current_stream() does first

        def fn() -> int:
            return raw(current())
    else:  # pragma: no cover - a torch without them
        def fn() -> int:
            return int(torch.cuda.current_stream().cuda_stream)
    _TORCH_STREAM.append(fn)
    return fn


class _StreamHandle:
    """A raw CUDA stream behind the CUDA stream protocol (``__cuda_stream__``: version 0, the
    pointer), what ``cupy.cuda.Stream.from_external`` takes."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = int(ptr)

    def __cuda_stream__(self) -> Tuple[int, int]:
        return (0, self.ptr)


def cupy_stream(ptr: int):
    """CuPy's stream object over the raw CUDA stream ``ptr``, which it does not own (never
    destroys): ``cupy.cuda.Stream.from_external`` where CuPy has it (``ExternalStream``, which it
    replaces, warns from CuPy 14 on), else ``ExternalStream``."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None:  # pragma: no cover - a CuPy before the stream protocol
        return cupy.cuda.ExternalStream(ptr)
    return from_external(_StreamHandle(ptr))


def _cupy_stream_types(cupy) -> tuple:
    """CuPy's stream classes (``ExternalStream`` while CuPy still has it)."""
    return tuple(getattr(cupy.cuda, n) for n in ("Stream", "ExternalStream") if hasattr(cupy.cuda, n))


def stream_of(stream: Any, torch_input: bool):
    """A ``stream=`` argument as a CuPy stream object (to run CuPy work under ``with``): a CuPy
    stream as it is, CuPy's current stream by default for CuPy inputs, otherwise
    :func:`cupy_stream` over :func:`stream_ptr`'s pointer."""
    import cupy

    if isinstance(stream, _cupy_stream_types(cupy)):
        return stream
    if stream is None and not torch_input:
        return cupy.cuda.get_current_stream()
    return cupy_stream(stream_ptr(stream, torch_input))


def optional_ptr(x: Optional[Any]) -> int:
    return 0 if x is None else device_pointer(x)

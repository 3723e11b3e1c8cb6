"""The launch path without a GPU: the device queries, the compiled kernels' parameter structs, the
tensor-map encoder, the tile counters and the launch itself stubbed, so that a call goes through
every host step (checks, plan, packing, the launch record) and stops where the driver would be
called. CuPy arrays over host memory (:func:`host_cupy`) stand in for device arrays: CuPy builds
them without touching a device, and nothing dereferences them; what reads or allocates device
memory (the offsets' values, the one-shot calls' results, fp8 workspaces and widened
``q_start_pos``) reads or allocates host memory instead.

Used by the CPU tests of the plan cache and by ``benchmarks/host_cpu_proxy.py`` (the host time of
the call paths, as a proxy of the GPU numbers). The device-to-host reads are counted: ``copies``
(one per array copied) and ``syncs`` (one per stream synchronized, and one per synchronous copy
of :func:`mla_cupy._arrays.to_host`)."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import time
import warnings
from types import SimpleNamespace
from typing import List

import numpy as np
import pytest

from mla_cupy._arrays import BF16
from mla_cupy._launch import ArgPack
from mla_cupy._registry import sm90_schedule
from mla_cupy.dims import param_fields

#: Why the tests built on this module skip where CuPy is not installed: it needs no GPU, but its
#: device arrays are CuPy arrays over host memory.
NEEDS_CUPY = "needs CuPy (not a GPU): the stubbed device's arrays are CuPy arrays over host memory"


def require_cupy() -> None:
    """Skip the calling test (or module, at import) with :data:`NEEDS_CUPY` when CuPy is missing."""
    if importlib.util.find_spec("cupy") is None:
        pytest.skip(NEEDS_CUPY, allow_module_level=True)


class _Kernel:
    """Stands in for a RawKernel (a launch of it never reaches the driver)."""


def _compiled(params: str, threads: int, smem: int, geometry: dict):
    """A compiled kernel as mla_cupy._geometry gives it, its parameter struct read from the kernel's
    own parameter list (the modules export the same: tests/test_compile.py)."""
    return SimpleNamespace(params=ArgPack.from_fields(param_fields(params)), fn=_Kernel(), threads=threads,
                           smem=smem, geometry=dict(geometry, threads=threads, smem=smem))


def _kernels():
    """(the Hopper kernel of a variant and mask, the portable kernel, the V^T pre-pass, the gather)."""
    @functools.lru_cache(maxsize=None)  # a compiled kernel per variant and mask, as mla_cupy._geometry keeps them
    def sm90(variant, mask):
        sched = sm90_schedule(variant, mask)
        return _compiled("MLA_SM90_PARAMS", 128 * (1 + sched.block_m // sched.q_rows), 200 * 1024,
                         dict(sched._asdict(), scale_box=sched.block_n + 16,
                              out_tma=int(sched.end_aligned)))
    sm80 = _compiled("MLA_SM80_PARAMS", 256, 100 * 1024, dict(block_m=128))
    vt = _compiled("MLA_VT_PARAMS", 128, 0, dict(cols_per_cta=128))
    gather = _compiled("MLA_ROPE_GATHER_PARAMS", 128, 0, dict(rows_per_cta=16))
    return sm90, sm80, vt, gather


def _backward_kernels():
    """The backward's kernels by name: the Hopper and portable main kernels and the three passes
    (their geometry as kernels/sm90_bwd/config.cuh, mla_backward_sm80.cu and
    mla_backward_prepost.cu set it)."""
    return dict(sm90=_compiled("MLA_BWD_SM90_PARAMS", 384, 200 * 1024, dict(block_m=64, block_n=96)),
                sm80=_compiled("MLA_BWD_COMMON_PARAMS", 256, 140 * 1024, dict(block_m=64, block_n=64)),
                pre=_compiled("MLA_BWD_PRE_PARAMS", 256, 0, dict(heads_per_cta=8)),
                dq=_compiled("MLA_BWD_DQ_PARAMS", 256, 48 * 1024, {}),
                rope=_compiled("MLA_BWD_ROPE_PARAMS", 256, 0, dict(rows_per_cta=16)))


class FakeGpu:
    """What the stubs saw: ``launches`` (prepared launch, stream, a copy of its argument buffer)
    when ``record`` (the launch itself is stubbed), else only ``count`` (the driver's launch is
    stubbed); ``encodes``, the tensor maps encoded; ``packs``, the kernels looked up to pack a
    launch; ``copies`` and ``syncs``, the device-to-host copies and the synchronizations they
    waited on (an asynchronous copy and its stream's synchronization, or a synchronous copy).
    A launch sleeps ``pause`` seconds before it is recorded."""

    def __init__(self, record: bool, capability: str):
        self.record, self.capability = record, capability
        self.launches: List[tuple] = []
        self.count = 0
        self.encodes = 0
        self.packs = 0
        self.copies = 0
        self.syncs = 0
        self.pause = 0.0

    def values(self, i: int = -1) -> dict:
        """The named argument values of launch ``i`` (prefill launches only)."""
        pl, _, raw = self.launches[i]
        buf = np.frombuffer(raw, pl.pack.dtype, count=1)[0]
        return {n: buf[n] for n in pl.pack.names}

    def prefill_launches(self) -> list:
        return [x for x in self.launches if "num_heads" in x[0].pack.names]

    def backward_kernels(self) -> List[str]:
        """Which of the backward's kernels each recorded launch is (``main``, ``pre``, ``dq``,
        ``rope``; ``other`` for a forward one), by a field only that kernel's parameters have."""
        marks = (("num_n_blocks", "main"), ("dlse_st", "pre"), ("dq_st", "dq"), ("dkr_st", "rope"))
        return [next((kind for field, kind in marks if field in x[0].pack.names), "other") for x in self.launches]


@contextlib.contextmanager
def fake_gpu(capability: str = "90", record: bool = True, stream: int = 0x5000):
    """Stub the device for the duration (a :class:`FakeGpu` records what reached the launch)."""
    import cupy

    import mla_cupy._arrays as arrays
    import mla_cupy._backward as backward
    import mla_cupy._plan_cache as launch_services
    import mla_cupy._plan_checks as plan_checks
    import mla_cupy.fp8 as fp8
    import mla_cupy.prefill_plan as prefill_plan
    import mla_cupy._geometry as geometry
    import mla_cupy._launch as launch
    import mla_cupy._packing as packing
    import mla_cupy._select as select
    import mla_cupy.tma as tma

    gpu = FakeGpu(record, capability)
    sm90, sm80, vt, gather = _kernels()
    bwd = _backward_kernels()

    def backward_kernel(kernel, dtype, mask, dev):
        gpu.packs += 1
        return bwd[kernel]

    def prefill_kernel(kernel, dtype, out_dtype, mask, paged, variant, *a, **kw):
        gpu.packs += 1
        return sm90(variant, mask) if kernel == "sm90" else sm80

    def encode(buf, dtype_code, rank, ptr, dims, strides, box, elem, *flags):
        """Writes what a map encodes (pointer, dtype, dims, strides, box) in its first words."""
        gpu.encodes += 1
        words = (ctypes.c_uint64 * 16).from_address(buf)
        words[0], words[1] = ptr.value or 0, dtype_code
        for i in range(rank):
            words[2 + i], words[10 + i] = dims[i], box[i]
        for i in range(rank - 1):
            words[6 + i] = strides[i]
        return 0

    def launched(self, stream_ptr):
        gpu.count += 1
        if gpu.pause:  # let another thread run between the packing and the launch
            time.sleep(gpu.pause)
        if gpu.record:
            gpu.launches.append((self, stream_ptr, bytes(self._mem)))

    class _Stream:
        ptr = stream

    host_read = arrays.to_host

    def to_host(x):  # CuPy arrays over host memory: read where they are, a synchronous copy each
        if isinstance(x, cupy.ndarray):
            gpu.copies += 1
            gpu.syncs += 1
            return host_array(x)
        return host_read(x)

    stage = {}

    def pinned(nbytes):  # the staging buffer: host memory (64-byte aligned), grown as needed
        if stage.get("n", 0) < nbytes:
            stage["buf"] = host_array(host_cupy(np.zeros(max(nbytes, 4096), np.uint8)))
            stage["n"] = stage["buf"].nbytes
        return stage["buf"].ctypes.data, stage["buf"]

    def copy_async(dst, src, nbytes, stream_ptr):
        gpu.copies += 1
        ctypes.memmove(dst, src, nbytes)

    def synchronize(stream_ptr):
        gpu.syncs += 1

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(arrays, "gpu_missing", lambda: None)
        mp.setattr(select, "device_id", lambda: 0)
        mp.setattr(select, "_capability", lambda dev: capability)
        mp.setattr(select, "_sm_count_and_l2", lambda dev: (132, 50 << 20))
        mp.setattr(packing, "prefill_kernel", prefill_kernel)
        mp.setattr(geometry, "transpose_v_kernel", lambda dev: vt)
        mp.setattr(backward, "backward_kernel", backward_kernel)
        mp.setattr(backward, "backward_passes", lambda dtype, out_dtype, kernel, dev: (bwd["pre"], bwd["dq"],
                                                                                        bwd["rope"]))
        mp.setattr(geometry, "rope_gather_kernel", lambda dev: gather)
        mp.setattr(packing, "scratch_on", lambda shape, sp: host_cupy(np.zeros(max(int(np.prod(shape)), 1), np.uint8)))
        mp.setattr(packing, "tile_counter", lambda dev, sp: 0x7000 + (sp & 0xff) * 8)
        mp.setattr(tma, "_driver", lambda: encode)
        if record:
            mp.setattr(launch.PreparedLaunch, "launch", launched)
        else:  # only the driver call is left out: PreparedLaunch.launch runs as on a GPU
            from cupy.cuda import driver

            mp.setattr(driver, "launchKernel", lambda *args: setattr(gpu, "count", gpu.count + 1))
        mp.setattr(cupy.cuda, "get_current_stream", lambda: _Stream)
        mp.setattr(arrays, "to_host", to_host)
        mp.setattr(arrays, "_pinned", pinned)
        mp.setattr(arrays, "_copy_to_host_async", copy_async)
        mp.setattr(arrays, "_synchronize", synchronize)
        mp.setattr(arrays, "_current_device", lambda: 0)
        mp.setattr(fp8, "to_host", to_host)
        mp.setattr(plan_checks, "to_host", to_host)
        mp.setattr(prefill_plan, "_require_gpu", lambda: None)
        # device memory the one-shot calls allocate: host memory here
        for module in (launch_services, prefill_plan, backward):
            mp.setattr(module, "empty_result", lambda shape, dtype, like, name="out": host_cupy(np.zeros(shape, dtype)))
        mp.setattr(launch_services, "workspace_on",
                   lambda shape, raw_stream: host_cupy(np.zeros(max(int(np.prod(shape)), 1), np.uint8)))
        mp.setattr(launch_services, "widened",
                   lambda q_start_pos, raw_stream: host_cupy(host_array(q_start_pos).astype(np.int64)))
        tma._encode_cached.cache_clear()
        try:
            yield gpu
        finally:
            tma._encode_cached.cache_clear()


@contextlib.contextmanager
def fake_gpu_empty_cache(capability: str):
    """:func:`fake_gpu` of ``capability`` with the one-shot calls' plan cache empty and of its default
    size, before and after (the plan-cache tests' fixture)."""
    import mla_cupy
    from mla_cupy._plan_cache import DEFAULT_MAXSIZE

    mla_cupy.plan_cache_clear()
    mla_cupy.set_plan_cache_size(DEFAULT_MAXSIZE)
    try:
        with fake_gpu(capability) as g:
            yield g
    finally:
        mla_cupy.plan_cache_clear()
        mla_cupy.set_plan_cache_size(DEFAULT_MAXSIZE)


@contextlib.contextmanager
def torch_as_cuda(stream: int = 0x5000):
    """Inside :func:`fake_gpu`: torch CPU tensors pose as CUDA tensors of device 0 (``is_cuda``,
    ``get_device()``), torch's current stream is ``stream``, and the torch ops' CuPy views are CuPy
    arrays over the tensors' host memory, so that the torch entry points (:mod:`mla_cupy.torch_ops`,
    :mod:`mla_cupy.flash_attn`) reach the stubbed launch. Every tensor poses, and the ops'
    registered CPU kernels are their CUDA implementations for the duration (the dispatcher routes
    these tensors to the CPU key), so the CPU reference of the ops cannot run inside. Where the package would view a tensor through DLPack it gets
    such a CuPy array too."""
    import torch

    from torch._library.custom_ops import OPDEFS

    import mla_cupy._arrays as arrays
    import mla_cupy.torch_ops as torch_ops

    def view(x):  # a torch_ops._cupy stand-in: zero-copy, over the tensor's memory
        import cupy

        if x is None:
            return None
        x = x.detach()
        dtype = {torch.bfloat16: BF16, torch.float8_e4m3fn: np.dtype(np.uint8)}.get(x.dtype)
        dtype = dtype if dtype is not None else np.dtype(str(x.dtype).replace("torch.", ""))
        nbytes = max(x.untyped_storage().nbytes(), 1)
        mem = cupy.cuda.UnownedMemory(x.untyped_storage().data_ptr(), nbytes, x, device_id=0)
        ptr = cupy.cuda.MemoryPointer(mem, x.data_ptr() - x.untyped_storage().data_ptr())
        return cupy.ndarray(tuple(x.shape), dtype, memptr=ptr, strides=tuple(n * x.element_size() for n in x.stride()))

    device_view = arrays.as_device

    @contextlib.contextmanager
    def torch_stream_context(device):  # torch_ops._torch_context: CuPy's current stream is torch's
        import cupy

        with pytest.MonkeyPatch.context() as m:
            m.setattr(cupy.cuda, "get_current_stream", lambda: SimpleNamespace(ptr=arrays._TORCH_STREAM[0]()))
            yield

    def as_device(x, name):
        return view(x) if isinstance(x, torch.Tensor) else device_view(x, name)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(arrays, "as_device", as_device)
        mp.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        mp.setattr(torch.Tensor, "get_device", lambda self: 0)
        mp.setattr(arrays, "_TORCH_STREAM", [lambda: stream])
        mp.setattr(torch_ops, "_torch_context", torch_stream_context)
        mp.setattr(torch_ops, "_cupy", view)
        lib = torch.library.Library("mla_cupy", "IMPL")  # dropped on the way out: the CPU kernels come back
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
                for name, opdef in OPDEFS.items():
                    if name.startswith("mla_cupy::"):
                        lib.impl(name.split("::")[1], opdef._backend_fns["cuda"], "CPU", allow_override=True)
            yield
        finally:
            lib._destroy()


def host_cupy(a) -> "cupy.ndarray":
    """A CuPy array over a 64-byte aligned host copy of ``a`` (it keeps the copy alive)."""
    import cupy

    a = np.asarray(a)
    buf = np.empty(a.nbytes + 64, np.uint8)
    off = (-buf.ctypes.data) % 64
    host = buf[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    host[...] = a
    mem = cupy.cuda.UnownedMemory(host.ctypes.data, max(a.nbytes, 1), buf, device_id=0)
    return cupy.ndarray(a.shape, a.dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))


def host_array(x) -> np.ndarray:
    """The host memory under a CuPy array made by :func:`host_cupy` (or a view of one), as NumPy."""
    nbytes = sum((s - 1) * abs(st) for s, st in zip(x.shape, x.strides)) + x.itemsize if x.size else 1
    raw = (ctypes.c_char * nbytes).from_address(x.data.ptr)
    return np.ndarray(x.shape, x.dtype, buffer=raw, strides=x.strides).copy()


def write_host(x, values) -> None:
    """Overwrite the host memory under a contiguous CuPy array made by :func:`host_cupy`."""
    a = np.ascontiguousarray(np.asarray(values, x.dtype).reshape(x.shape))
    ctypes.memmove(x.data.ptr, a.ctypes.data, a.nbytes)

"""The compiled kernels and their launch geometry.

Threads per CTA come from each kernel's ``__launch_bounds__`` (the CUfunction's
``max_threads_per_block``), and the Hopper kernel's shared-memory size from the table its module
exports (``kSmemBytesOf``, read once per module and device). The few tile constants below are not
exported by the modules yet; each is the kernel's ``constexpr`` of the same name, and a CPU test
(tests/test_launch.py) compares them with the kernel sources.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Dict, Tuple

import numpy as np

from . import _registry as reg
from .jit import get_function, get_global

__all__ = ["BLOCK_M", "SM90_BLOCK_N", "SM80_SMEM_BYTES", "VT_COLS_PER_CTA", "CompiledKernel", "prefill_kernel",
           "transpose_v_kernel"]

BLOCK_M = 128  #: kBlockM of both prefill kernels: query rows per CTA (sizes the grid)
SM90_BLOCK_N = 128  #: kBlockN of mla_prefill_sm90.cu: keys per tile (rows of a K / V / rope TMA box)
SM80_SMEM_BYTES = 128 * 384 + 2 * (64 * 384 + 64 * 256) + 2 * 64  #: kSmemBytes of mla_prefill_sm80.cu
VT_COLS_PER_CTA = 128  #: kVtCols of transpose_v.cu: V^T columns per CTA


@dataclass(frozen=True)
class CompiledKernel:
    """A compiled kernel, its threads per CTA and its dynamic shared memory in bytes (the
    function's limit is raised to it)."""

    fn: Any
    threads: int
    smem: int


_KERNELS: Dict[Tuple, CompiledKernel] = {}
_LOCK = threading.Lock()


def _compiled(key: Tuple, fn: Any, smem: int) -> CompiledKernel:
    if fn.max_dynamic_shared_size_bytes < smem:  # a driver call, once per kernel and device
        fn.max_dynamic_shared_size_bytes = smem
    ck = CompiledKernel(fn, int(fn.max_threads_per_block), int(smem))
    with _LOCK:
        return _KERNELS.setdefault(key, ck)


def sm90_variant(fp8: bool, rope8: bool) -> str:
    return "fp8" if fp8 else "fp8_rope" if rope8 else "bf16"


def prefill_kernel(kernel: str, dtype: np.dtype, out_dtype: np.dtype, mask, paged: bool, fp8: bool, rope8: bool,
                   device_id: int) -> CompiledKernel:
    """The instantiation of ``kernel`` (``'sm80'`` or ``'sm90'``) for these template arguments on
    device ``device_id`` (the current one), compiled on first use."""
    key = (device_id, kernel, dtype, out_dtype, mask.cpp_name, paged, fp8, rope8)
    ck = _KERNELS.get(key)
    if ck is not None:
        return ck
    if kernel == "sm90":
        variant = sm90_variant(fp8, rope8)
        fam = reg.prefill_sm90(dtype, mask, variant)
        fn = get_function(*fam, reg.prefill_sm90_name(dtype, out_dtype, mask, paged, variant))
        smem = int(get_global(*fam, reg.SM90_SMEM_TABLE, np.int32, 2)[int(fp8)])
    else:
        fn = get_function(*reg.prefill_sm80(dtype, mask), reg.prefill_sm80_name(dtype, out_dtype, mask, paged))
        smem = SM80_SMEM_BYTES
    return _compiled(key, fn, smem)


def transpose_v_kernel(device_id: int) -> CompiledKernel:
    """The fp8 per-token variant's V^T pre-pass (static shared memory only)."""
    key = (device_id, "transpose_v")
    ck = _KERNELS.get(key)
    if ck is not None:
        return ck
    return _compiled(key, get_function(*reg.transpose_v_family(), reg.TRANSPOSE_V[1][0]), 0)

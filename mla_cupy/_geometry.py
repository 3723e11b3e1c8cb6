"""The compiled kernels and their launch geometry, read from the compiled modules.

The prefill kernels and the V^T pre-pass export their parameter struct's layout
(``kParamLayout``, ``kParamNames``: kernels/params_abi.cuh) and their geometry (``kGeometry``:
shared memory, threads per CTA, tile sizes), read once per module and device; nothing here
restates a kernel constant.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import _registry as reg
from ._launch import ArgPack
from .jit import get_function, get_global

__all__ = ["CompiledKernel", "prefill_kernel", "transpose_v_kernel", "rope_gather_kernel"]

#: kGeometry's fields, in order: kernels/mla_prefill_sm90.cu (a row per variant, a table per mask),
#: kernels/mla_prefill_sm80.cu, kernels/transpose_v.cu and kernels/rope_gather.cu.
SM90_GEOMETRY = ("smem", "threads", "block_m", "block_n", "scale_box", "q_rows", "out_tma")
SM80_GEOMETRY = ("smem", "threads", "block_m")
VT_GEOMETRY = ("threads", "cols_per_cta")
GATHER_GEOMETRY = ("threads", "rows_per_cta")


@dataclass(frozen=True)
class CompiledKernel:
    """A compiled kernel, its threads per CTA, its dynamic shared memory in bytes (the function's
    limit is raised to it), and for the prefill kernels their parameter struct and geometry."""

    fn: Any
    threads: int
    smem: int
    params: Optional[ArgPack] = None
    geometry: Dict[str, int] = field(default_factory=dict)


_KERNELS: Dict[Tuple, CompiledKernel] = {}
_LOCK = threading.Lock()


def _compiled(key: Tuple, fn: Any, smem: int, params: Optional[ArgPack] = None,
              geometry: Optional[Dict[str, int]] = None) -> CompiledKernel:
    if fn.max_dynamic_shared_size_bytes < smem:  # a driver call, once per kernel and device
        fn.max_dynamic_shared_size_bytes = smem
    ck = CompiledKernel(fn, int(fn.max_threads_per_block), int(smem), params, dict(geometry or {}))
    with _LOCK:
        return _KERNELS.setdefault(key, ck)


def _exports(fam, names: Tuple[str, ...], geometry_size: int, what: str) -> Tuple[ArgPack, np.ndarray]:
    """The parameter struct and the geometry table (``geometry_size`` ints) a module exports
    (names: the layout, the field names and the geometry table). The layout's header says how long
    it and the names are (kernels/params_abi.cuh)."""
    size, count, nchars = (int(x) for x in get_global(*fam, names[0], np.int32, 3))
    layout = get_global(*fam, names[0], np.int32, 3 + 3 * count)
    param_names = get_global(*fam, names[1], np.uint8, nchars)
    return ArgPack.from_export(layout, param_names.tobytes(), what), get_global(*fam, names[2], np.int32, geometry_size)


def prefill_kernel(kernel: str, dtype: np.dtype, out_dtype: np.dtype, mask, paged: bool, variant: str,
                   device_id: int, pairs: bool = False) -> CompiledKernel:
    """The instantiation of ``kernel`` (``'sm80'`` or ``'sm90'``) for these template arguments on
    device ``device_id`` (the current one), compiled on first use, with its parameter struct
    (``.params``) and geometry (``.geometry``: smem, threads, block_m and, on Hopper, block_n and
    scale_box). ``variant``: one of :data:`~mla_cupy._registry.SM90_VARIANTS` (the portable
    kernel has the 16-bit one only); ``pairs``: an fp8 variant's kernel for even first key rows
    (:data:`~mla_cupy._registry.SCALE_PAIRS`, the Hopper kernel only)."""
    key = (device_id, kernel, dtype, out_dtype, mask.cpp_name, paged, variant, pairs)
    ck = _KERNELS.get(key)
    if ck is not None:
        return ck
    if kernel == "sm90":
        fam = reg.prefill_sm90(dtype, mask, variant, pairs)
        fn = get_function(*fam, reg.prefill_sm90_name(dtype, out_dtype, mask, paged, variant, pairs))
        params, table = _exports(fam, reg.sm90_exports(mask), len(SM90_GEOMETRY) * len(reg.SM90_VARIANTS),
                                 "the Hopper prefill kernel")
        row = table.reshape(-1, len(SM90_GEOMETRY))[reg.SM90_VARIANTS[variant][1]]
        geometry = dict(zip(SM90_GEOMETRY, (int(x) for x in row)))
    else:
        fam = reg.prefill_sm80(dtype, mask)
        fn = get_function(*fam, reg.prefill_sm80_name(dtype, out_dtype, mask, paged))
        params, table = _exports(fam, reg.SM80_EXPORTS, len(SM80_GEOMETRY), "the portable prefill kernel")
        geometry = dict(zip(SM80_GEOMETRY, (int(x) for x in table)))
    return _compiled(key, fn, geometry["smem"], params, geometry)


def transpose_v_kernel(device_id: int) -> CompiledKernel:
    """The fp8 per-token variant's V^T pre-pass (static shared memory only), with its parameter
    struct and geometry (threads, cols_per_cta)."""
    return _prepass_kernel(device_id, reg.transpose_v_family(), VT_GEOMETRY, "the V^T pre-pass")


def rope_gather_kernel(device_id: int) -> CompiledKernel:
    """The Hopper kernel's paged-rope gather (static shared memory only), with its parameter
    struct and geometry (threads, rows_per_cta)."""
    return _prepass_kernel(device_id, reg.rope_gather_family(), GATHER_GEOMETRY, "the paged-rope gather")


def _prepass_kernel(device_id: int, fam, geometry_names: Tuple[str, ...], what: str) -> CompiledKernel:
    """A kernel launched before the prefill kernel (family: the kernel, then its exports)."""
    key = (device_id, fam[1][0])
    ck = _KERNELS.get(key)
    if ck is not None:
        return ck
    params, table = _exports(fam, fam[1][1:], len(geometry_names), what)
    return _compiled(key, get_function(*fam, fam[1][0]), 0, params,
                     dict(zip(geometry_names, (int(x) for x in table))))

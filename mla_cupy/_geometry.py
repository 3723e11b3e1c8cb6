"""The compiled kernels and their launch geometry, read from the compiled modules.

The prefill kernels and the V^T pre-pass export their parameter struct's layout
(``kParamLayout``, ``kParamNames``: kernels/params_abi.cuh) and their geometry by name
(``kGeometryNames``, ``kGeometry``: shared memory, threads per CTA, tile sizes, how the work is
cut), read once per module and device; nothing here restates a kernel constant or a field order.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import _registry as reg
from ._launch import ArgPack
from .jit import get_function, get_global

__all__ = ["CompiledKernel", "prefill_kernel", "transpose_v_kernel", "rope_gather_kernel", "backward_kernel",
           "backward_passes", "geometry_of"]


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


def geometry_of(table, names: bytes, what: str = "kernel") -> Dict[str, int]:
    """A module's exported geometry by name (kernels/params_abi.cuh): ``table`` is its
    ``kGeometry`` (int32: field count, bytes of the names, then the values), ``names`` its
    ``kGeometryNames`` (``"a,b,...,"``)."""
    table = np.asarray(table, np.int64)
    count = int(table[0])
    fields = bytes(names).rstrip(b"\0").decode("ascii").split(",")[:-1]
    if len(fields) != count or len(table) < 2 + count:
        raise RuntimeError(f"{what}: malformed geometry export ({count} fields, names {fields})")
    return dict(zip(fields, (int(x) for x in table[2:2 + count])))


def _exports(fam, names: Tuple[str, ...], what: str) -> Tuple[ArgPack, Dict[str, int]]:
    """The parameter struct and the geometry a module exports (names: the layout, the field names,
    the geometry's names and its table, :func:`mla_cupy._registry._exports`). The headers of the
    layout and of the table say how long they and the names are (kernels/params_abi.cuh)."""
    layout_name, param_names_name, geometry_names_name, geometry_name = names
    size, count, nchars = (int(x) for x in get_global(*fam, layout_name, np.int32, 3))
    layout = get_global(*fam, layout_name, np.int32, 3 + 3 * count)
    param_names = get_global(*fam, param_names_name, np.uint8, nchars)
    fields, nbytes = (int(x) for x in get_global(*fam, geometry_name, np.int32, 2))
    table = get_global(*fam, geometry_name, np.int32, 2 + fields)
    geometry = geometry_of(table, get_global(*fam, geometry_names_name, np.uint8, nbytes).tobytes(), what)
    return ArgPack.from_export(layout, param_names.tobytes(), what), geometry


def prefill_kernel(kernel: str, dtype: np.dtype, out_dtype: np.dtype, mask, paged: bool, variant: str,
                   device_id: int, pairs: bool = False) -> CompiledKernel:
    """The instantiation of ``kernel`` (``'sm80'`` or ``'sm90'``) for these template arguments on
    device ``device_id`` (the current one), compiled on first use, with its parameter struct
    (``.params``) and geometry (``.geometry``: smem, threads, block_m and, on Hopper, block_n,
    scale_box, q_rows, out_tma and how the work is cut: kernels/mla_prefill_sm90.cu).
    ``variant``: one of :data:`~mla_cupy._registry.SM90_VARIANTS` (the portable kernel has the
    16-bit one only); ``pairs``: an fp8 variant's kernel for even first key rows
    (:data:`~mla_cupy._registry.SCALE_PAIRS`, the Hopper kernel only)."""
    key = (device_id, kernel, dtype, out_dtype, mask.cpp_name, paged, variant, pairs)
    ck = _KERNELS.get(key)
    if ck is not None:
        return ck
    if kernel == "sm90":
        fam = reg.prefill_sm90(dtype, mask, variant, pairs)
        fn = get_function(*fam, reg.prefill_sm90_name(dtype, out_dtype, mask, paged, variant, pairs))
        params, geometry = _exports(fam, reg.sm90_exports(dtype, mask, variant, pairs), "the Hopper prefill kernel")
    else:
        fam = reg.prefill_sm80(dtype, mask)
        fn = get_function(*fam, reg.prefill_sm80_name(dtype, out_dtype, mask, paged))
        params, geometry = _exports(fam, reg.SM80_EXPORTS, "the portable prefill kernel")
    return _compiled(key, fn, geometry["smem"], params, geometry)


def transpose_v_kernel(device_id: int) -> CompiledKernel:
    """The fp8 per-token variant's V^T pre-pass (static shared memory only), with its parameter
    struct and geometry (threads, cols_per_cta)."""
    return _prepass_kernel(device_id, reg.transpose_v_family(), "the V^T pre-pass")


def rope_gather_kernel(device_id: int) -> CompiledKernel:
    """The Hopper kernel's paged-rope gather (static shared memory only), with its parameter
    struct and geometry (threads, rows_per_cta)."""
    return _prepass_kernel(device_id, reg.rope_gather_family(), "the paged-rope gather")


def _prepass_kernel(device_id: int, fam, what: str) -> CompiledKernel:
    """A kernel launched before the prefill kernel (family: the kernel, then its exports)."""
    key = (device_id, fam[1][0])
    ck = _KERNELS.get(key)
    if ck is not None:
        return ck
    params, geometry = _exports(fam, fam[1][1:], what)
    return _compiled(key, get_function(*fam, fam[1][0]), 0, params, geometry)


def backward_kernel(kernel: str, dtype: np.dtype, mask, device_id: int) -> CompiledKernel:
    """The backward main kernel ``kernel`` (``'sm90'`` or ``'sm80'``) for ``dtype`` and ``mask``,
    with its parameter struct and geometry (smem, threads, block_m, block_n)."""
    key = (device_id, "backward", kernel, dtype, mask.cpp_name)
    ck = _KERNELS.get(key)
    if ck is not None:
        return ck
    fam = reg.backward_family(kernel, dtype, mask)
    params, geometry = _exports(fam, reg.backward_exports(kernel), f"the {kernel} backward kernel")
    return _compiled(key, get_function(*fam, reg.backward_name(kernel, dtype, mask)), geometry["smem"], params,
                     geometry)


def backward_passes(dtype: np.dtype, out_dtype: np.dtype, kernel: str, device_id: int):
    """The passes around the backward main kernel ``kernel`` (kernels/mla_backward_prepost.cu): the
    pre-pass for dout in ``dtype`` and out in ``out_dtype``, the dq pass reading the main kernel's
    dq_accum layout (:data:`~mla_cupy._registry.BWD_DQ_LAYOUT`), the rope pass; each with its
    parameter struct and geometry."""
    fam = reg.backward_prepost(dtype)
    layout = reg.BWD_DQ_LAYOUT[kernel]
    out = []
    for name, exports, what in ((reg.backward_pre_name(dtype, out_dtype), reg.BWD_PRE_EXPORTS, "the backward pre-pass"),
                                (reg.backward_dq_name(dtype, layout), reg.BWD_DQ_EXPORTS, "the backward dq pass"),
                                (reg.backward_rope_name(dtype), reg.BWD_ROPE_EXPORTS, "the backward rope pass")):
        key = (device_id, name)
        ck = _KERNELS.get(key)
        if ck is None:
            params, geometry = _exports(fam, exports, what)
            ck = _compiled(key, get_function(*fam, name), geometry.get("smem", 0), params, geometry)
        out.append(ck)
    return tuple(out)

"""The fp8 per-token variant of the Hopper kernel: its inputs and its V^T layout.

``mla_prefill_fp8`` takes MAX's per-token fp8 inputs: the 128 nope values of q and k, and v, as
float8_e4m3fn bytes (uint8), q's rope in bfloat16 (or, the all-e4m3 mode, both rope parts as e4m3
bytes under the same scales), and one float32 scale per query and per key
token (:mod:`mla_cupy.quant` makes them from 16-bit data). This module holds what only that variant
needs: viewing fp8 data as the bytes the kernels read, and V^T, the layout
of V that the e4m3 tensor cores read for P V (``kernels/vt_layout.cuh``): its size, its NumPy model,
the device pre-pass that writes it (``kernels/transpose_v.cu``), and :class:`TransposedV`, a V^T
made ahead of the call (by :func:`mla_cupy.quant.quantize_per_token`), which a call takes in place
of ``v`` and then launches no pre-pass.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from ._arrays import BF16, FP8_E4M3, as_device, checkable, device_pointer, is_device, is_torch, to_host
from ._checks import OFFSET_DTYPES, U8, check_array, check_layout, check_offsets_layout, check_offsets_values, check_shape
from ._registry import VARIANT_FP8, sm90_schedule
from .dims import DV, kernel_int

__all__ = ["VT_ALIGN", "VT_SIGMA", "TransposedV", "fp8_bytes", "check_transposed_v", "check_transposed_v_offsets",
           "check_contiguous", "vt_columns", "vt_shape", "transpose_v_host",
           "untranspose_v_host", "transpose_v", "scale_pairs"]


class E4m3HostView(np.ndarray):
    """The bytes of a NumPy float8_e4m3fn array, so the checks can read it; never launched."""

    move_hint = "cupy.asarray({name}.view(numpy.uint8))"


def fp8_bytes(x: Any, name: str) -> Any:
    """e4m3 data as the uint8 bytes the kernels read: torch float8_e4m3fn tensors are viewed as
    uint8 (no copy); NumPy float8_e4m3fn arrays as uint8 host views (the device check then says how
    to upload them). CuPy has no fp8 dtype, so CuPy data comes as uint8 already."""
    if is_torch(x) and str(x.dtype) == "torch.float8_e4m3fn":
        import torch

        return x.view(torch.uint8)
    if FP8_E4M3 is not None and isinstance(x, np.ndarray) and x.dtype == FP8_E4M3:
        return x.view(np.uint8).view(E4m3HostView)
    return x


# ---------------------------------------------------------------------------------------------
# The key offsets' parity

def scale_pairs(mask, paged: bool, cache_row_offsets) -> bool:
    """Whether the Hopper kernel's fp8 variants under ``mask`` read each key tile's scales in
    pairs for a batch of these key offsets (host values; None when the host did not read them):
    where their consumer warpgroups read the scales from shared memory (three of them: a mask
    without a lower bound, :func:`mla_cupy._registry.sm90_schedule`), the rope is plain (a paged
    rope's kernels, with their rope warp, spill with the pairs under the null mask) and every
    sequence's first key row is even, so that a key tile's first scale sits at an even float of its
    box (``kernels/sm90/config.cuh``: EvenKeyRows). Otherwise, or with offsets not read, the kernel
    that reads them one at a time."""
    sched = sm90_schedule(VARIANT_FP8, mask)
    if cache_row_offsets is None or paged or sched.block_m != 3 * sched.q_rows:
        return False
    return not np.any(np.asarray(cache_row_offsets, np.int64)[:-1] & 1)


# ---------------------------------------------------------------------------------------------
# V^T (kernels/vt_layout.cuh, kernels/transpose_v.cu)

#: kernels/vt_layout.cuh: kVtAlign, keys per aligned column group
VT_ALIGN = kernel_int("vt_layout.cuh", "kVtAlign")
#: kernels/vt_tile.cuh: (kVtThreads, kVtCols), the threads and V^T columns of a CTA of the kernels
#: that write V^T (the pre-pass also exports them; V's quantizer launches with these)
VT_TILE = (kernel_int("vt_tile.cuh", "kVtThreads"), kernel_int("vt_tile.cuh", "kVtCols"))
#: column p of a 16-column group holds key VT_SIGMA[p] of the group (vt_layout.cuh: sigma)
VT_SIGMA = np.array([2 * (p // 4) + (p & 1) + 8 * ((p >> 1) & 1) for p in range(VT_ALIGN)])


def vt_columns(tk: int, batch: int) -> int:
    """Columns of the V^T buffer for ``Tk`` keys in ``batch`` sequences: a multiple of 16 past every
    sequence's region (region b starts at ``16 * (ceil(cache_row_offsets[b] / 16) + b)``)."""
    return max(VT_ALIGN, -(-(tk + VT_ALIGN * batch) // VT_ALIGN) * VT_ALIGN)


def vt_shape(heads: int, tk: int, batch: int) -> Tuple[int, int, int]:
    """Shape ``[H, 128, cols]`` (uint8) of the V^T of ``Tk`` keys of ``H`` heads in ``batch`` sequences."""
    return int(heads), DV, vt_columns(tk, batch)


def vt_col0(kv_begin: int, b: int) -> int:
    """First column of sequence ``b``'s region (``kv_begin``: its first key's row in v)."""
    return (-(-int(kv_begin) // VT_ALIGN) + b) * VT_ALIGN


def _regions(cro: np.ndarray):
    """Per sequence b of the offsets ``cro`` (int64, host): (its first key's row, its key count
    Sk, its first V^T column, its keys in column order: key ``order[i]`` of the sequence at column
    ``c0 + i``, for the ``16 * ceil(Sk / 16)`` columns of its region)."""
    for b in range(len(cro) - 1):
        sk = int(cro[b + 1] - cro[b])
        n = -(-sk // VT_ALIGN) * VT_ALIGN
        order = (np.arange(n) // VT_ALIGN) * VT_ALIGN + VT_SIGMA[np.arange(n) % VT_ALIGN]
        yield int(cro[b]), sk, vt_col0(cro[b], b), order


def transpose_v_host(v, cache_row_offsets) -> np.ndarray:
    """NumPy model of :func:`transpose_v`: e4m3 ``v[Tk, H, 128]`` (uint8 or ml_dtypes bytes) ->
    ``vt[H, 128, vt_columns(Tk, B)]`` uint8: sequence b's keys from column
    ``16 * (ceil(cache_row_offsets[b] / 16) + b)``, each group of 16 in the VT_SIGMA order, zeros
    elsewhere."""
    v8 = np.ascontiguousarray(v).view(np.uint8)
    cro = np.asarray(cache_row_offsets, np.int64)
    tk, heads = int(v8.shape[0]), int(v8.shape[1])
    vt = np.zeros(vt_shape(heads, tk, len(cro) - 1), np.uint8)
    for row, sk, c0, order in _regions(cro):
        keys = np.zeros((len(order), heads, DV), np.uint8)
        keys[:sk] = v8[row:row + sk]
        vt[:, :, c0:c0 + len(order)] = keys[order].transpose(1, 2, 0)
    return vt


def untranspose_v_host(vt, cache_row_offsets, tk: int) -> np.ndarray:
    """The inverse of :func:`transpose_v_host` on the keys of the sequences: ``vt[H, 128, cols]``
    -> uint8 ``v[Tk, H, 128]``, zeros in the rows of no sequence (which V^T does not hold)."""
    vt8 = np.asarray(vt).view(np.uint8)
    cro = np.asarray(cache_row_offsets, np.int64)
    v = np.zeros((int(tk), int(vt8.shape[0]), DV), np.uint8)
    for row, sk, c0, order in _regions(cro):
        keys = np.empty((len(order), vt8.shape[0], DV), np.uint8)
        keys[order] = vt8[:, :, c0:c0 + len(order)].transpose(2, 0, 1)
        v[row:row + sk] = keys[:sk]
    return v


class TransposedV:
    """V^T, made ahead of the call for one batch's key offsets: what :func:`mla_cupy.mla_prefill_fp8`,
    :meth:`PrefillPlan.run_fp8 <mla_cupy.PrefillPlan.run_fp8>` and the torch op take in place of
    ``v``, launching then the attention kernel alone (no V^T pre-pass, no workspace).

    :func:`mla_cupy.quant.quantize_per_token` with ``cache_row_offsets=`` returns one (``"v_t"``),
    written by the kernel that quantizes V (device data) or by :func:`transpose_v_host` (NumPy).

    Parameters
    ----------
    data : ``[H, 128, vt_columns(Tk, B)]`` uint8 array, C-contiguous
        V^T in the layout of ``kernels/vt_layout.cuh`` (:func:`transpose_v_host` is its model):
        device data for the kernels, NumPy data from the host quantizer.
    cache_row_offsets : ``[B + 1]`` int32 / uint32 array (device or host)
        The offsets it was laid out for (a sequence's columns depend on their values,
        :func:`vt_col0`), kept by reference, not copied.
    num_keys : int
        Tk, the rows of the v it holds.

    Attributes
    ----------
    data, cache_row_offsets, num_keys
        As given.
    num_heads : int
        H, ``data.shape[0]``.
    batch : int
        B, ``len(cache_row_offsets) - 1``.

    Notes
    -----
    A call checks, before any launch, that ``data`` is a contiguous uint8 device array of shape
    ``vt_shape(H, Tk, B)``, 16-byte aligned, that H, Tk and B are the call's, and that
    ``cache_row_offsets`` is the call's: the same array object, or an array of the same length at
    the same device address; failing that, with ``validate=True`` (a plan: one that read its
    offsets), the values of both are read and compared; without, the call refuses it. The data is
    read as it is then: change v and make a new one (the kernel does not see v).
    """

    __slots__ = ("_data", "_offsets", "_num_keys", "_num_heads", "_batch")

    def __init__(self, data, cache_row_offsets, num_keys: int):
        if isinstance(num_keys, bool) or not isinstance(num_keys, (int, np.integer)) or num_keys < 0:
            raise ValueError(f"num_keys: expected a non-negative int, got {num_keys!r}")
        d, cro = _metadata(data), _metadata(cache_row_offsets)
        check_array(cro, "cache_row_offsets", 1, OFFSET_DTYPES)
        if cro.shape[0] < 1:
            raise ValueError("cache_row_offsets: expected B + 1 >= 1 offsets, got an empty array")
        check_array(d, "data", 3, (U8,))
        heads, batch = int(d.shape[0]), int(cro.shape[0]) - 1
        check_shape(d, "data", vt_shape(heads, int(num_keys), batch),
                    f"[H, 128, vt_columns(Tk, B)] uint8 with Tk = {int(num_keys)}, B = {batch}")
        self._data, self._offsets, self._num_keys = data, cache_row_offsets, int(num_keys)
        self._num_heads, self._batch = heads, batch

    data = property(lambda self: self._data)
    cache_row_offsets = property(lambda self: self._offsets)
    num_keys = property(lambda self: self._num_keys)
    num_heads = property(lambda self: self._num_heads)
    batch = property(lambda self: self._batch)

    def with_data(self, data) -> "TransposedV":
        """The same V^T over another view of its data (a CuPy view of a tensor, say)."""
        return TransposedV(data, self._offsets, self._num_keys)

    def __repr__(self) -> str:
        return (f"TransposedV(num_heads={self._num_heads}, num_keys={self._num_keys}, batch={self._batch}, "
                f"data={type(self._data).__module__}.{type(self._data).__name__} {list(self._data.shape)})")


def _metadata(x):
    """What the checks read of an array (shape, dtype), without a conversion: a torch tensor's
    (per call on the torch ops' path) as a stand-in, any other array as it is."""
    if not is_torch(x):
        return x
    from types import SimpleNamespace

    name = str(x.dtype).replace("torch.", "")
    dtype = {"bfloat16": BF16, "float8_e4m3fn": FP8_E4M3}.get(name) or np.dtype(name)
    return SimpleNamespace(shape=tuple(int(n) for n in x.shape), dtype=dtype)


def check_contiguous(x, name: str) -> None:
    """``x`` (as :func:`~mla_cupy._arrays.checkable` gives it) is C-contiguous (dimensions of one
    element aside)."""
    step, item = 1, int(np.dtype(x.dtype).itemsize)
    for n, st in reversed(list(zip(x.shape, x.strides))):
        if int(n) > 1 and int(st) != step * item:
            raise ValueError(f"{name}: expected a C-contiguous array, got shape {list(x.shape)} strides "
                             f"{tuple(int(s) for s in x.strides)} bytes")
        step *= int(n)


def check_transposed_v(tv: TransposedV, heads: int, tk: int) -> None:
    """A :class:`TransposedV` given as ``v``: its heads and keys are the call's."""
    if tv.num_heads != heads:
        raise ValueError(f"v: a TransposedV of H = {tv.num_heads} heads, the call has H = {heads} (q_nope)")
    if tv.num_keys != tk:
        raise ValueError(f"v: a TransposedV of Tk = {tv.num_keys} keys, the call's k has Tk = {tk} rows")


def same_offsets(tv: TransposedV, cache_row_offsets) -> bool:
    """``tv`` was laid out for ``cache_row_offsets`` as far as metadata tell: the same object, or
    device arrays of the same length at the same address (no value is read)."""
    mine = tv.cache_row_offsets
    if mine is cache_row_offsets:
        return True
    if not (_on_device(mine) and _on_device(cache_row_offsets)):
        return False
    return (int(mine.shape[0]) == int(cache_row_offsets.shape[0])
            and device_pointer(mine) == device_pointer(cache_row_offsets))


def _on_device(x) -> bool:
    return x is not None and is_device(x) and not (is_torch(x) and not x.is_cuda)


def check_transposed_v_offsets(tv: TransposedV, batch: int, cache_row_offsets, compare: bool,
                               values: Optional[np.ndarray] = None, also=None) -> None:
    """A :class:`TransposedV` given as ``v`` was laid out for the call's ``batch`` sequences and its
    ``cache_row_offsets`` (or ``also``, the same offsets in another array: a plan's device copy of
    host offsets): :func:`same_offsets`, else, with ``compare``, equal values (``values``: those
    of the call's offsets when the host has them; else they are read)."""
    if tv.batch != batch:
        raise ValueError(f"v: a TransposedV of B = {tv.batch} sequences, the call has B = {batch} (cache_row_offsets)")
    if same_offsets(tv, cache_row_offsets) or (also is not None and same_offsets(tv, also)):
        return
    if not compare:
        raise ValueError("v: the TransposedV was laid out for another cache_row_offsets array than the call's (not the "
                         "same array, nor one of the same length at the same device address); pass the array it was "
                         "made with, or validate=True to compare their values")
    mine = to_host(checkable(tv.cache_row_offsets, "v.cache_row_offsets")).astype(np.int64)
    theirs = (to_host(checkable(cache_row_offsets, "cache_row_offsets")) if values is None else values).astype(np.int64)
    if not np.array_equal(mine, theirs):
        i = int(np.argmax(mine != theirs))
        raise ValueError(f"v: the TransposedV was laid out for other cache_row_offsets: its offset [{i}] is {mine[i]}, "
                         f"the call's {theirs[i]}")


def check_no_workspace(workspace) -> None:
    """A call given V^T (``v`` a :class:`TransposedV`) writes none: a workspace is a mistake."""
    if workspace is not None:
        raise ValueError("workspace: a call given V^T (v a TransposedV) launches no pre-pass and needs no workspace; "
                         "leave workspace out")


def offsets_values(cache_row_offsets, tk: int) -> np.ndarray:
    """The int64 host values of the offsets V^T of ``tk`` keys is laid out for, checked (``[B + 1]``
    int32 / uint32 with B >= 0, starting at 0, non-decreasing, the last <= Tk); host or device."""
    cro = checkable(cache_row_offsets, "cache_row_offsets")
    check_array(cro, "cache_row_offsets", 1, OFFSET_DTYPES)
    if cro.shape[0] < 1:
        raise ValueError("cache_row_offsets: expected B + 1 >= 1 offsets, got an empty array")
    h = to_host(cro).astype(np.int64)
    check_offsets_values(h, "cache_row_offsets", int(tk), False, "Tk (v.shape[0])")
    return h


def checked_offsets(cache_row_offsets, tk: int):
    """:func:`offsets_values`, and the offsets as the kernels read them (host offsets uploaded):
    (a contiguous device array, its int64 host values)."""
    h = offsets_values(cache_row_offsets, tk)
    if is_device(cache_row_offsets) and not (is_torch(cache_row_offsets) and not cache_row_offsets.is_cuda):
        cro = as_device(cache_row_offsets, "cache_row_offsets")
        check_offsets_layout(cro, "cache_row_offsets")
    else:
        import cupy as cp

        cro = cp.asarray(np.ascontiguousarray(checkable(cache_row_offsets, "cache_row_offsets")))
    return cro, h


def transpose_v_values(v, kv_begin_ptr: int, kv_end_ptr: int, batch: int, vt_ptr: int, cols: int) -> dict:
    """The pre-pass's parameters for device e4m3 bytes ``v[Tk, H, 128]`` into ``cols`` columns at ``vt_ptr``."""
    return dict(v=device_pointer(v), v_st=int(v.strides[0]), v_sh=int(v.strides[1]), kv_begin=kv_begin_ptr,
                kv_end=kv_end_ptr, batch=batch, vt=vt_ptr, cols=cols)


def transpose_v(v, cache_row_offsets, *, stream=None, out=None):
    """V^T as :func:`mla_cupy.mla_prefill_fp8` reads it (``kernels/vt_layout.cuh``), on the device:
    e4m3 ``v[Tk, H, 128]`` (uint8) and ``cache_row_offsets[B + 1]`` (int32 or uint32, device) ->
    uint8 ``[H, 128, vt_columns(Tk, B)]``, bit for bit :func:`transpose_v_host`. ``out`` (a
    contiguous uint8 array of that shape) is written instead of a new array when given."""
    import cupy as cp

    from ._select import device_id

    v = as_device(v, "v")
    check_array(v, "v", 3, (U8,))
    check_layout(v, "v")
    if int(v.shape[2]) != DV:
        raise ValueError(f"v: expected [Tk, H, {DV}] e4m3 bytes, got shape {list(v.shape)}")
    cro, _ = checked_offsets(cache_row_offsets, int(v.shape[0]))
    batch, tk, heads = int(cro.shape[0]) - 1, int(v.shape[0]), int(v.shape[1])
    shape = vt_shape(heads, tk, batch)
    s = stream if stream is not None else cp.cuda.get_current_stream()
    if out is None:
        with s:
            out = cp.empty(shape, cp.uint8)
    else:
        out = as_device(out, "out")
        check_array(out, "out", 3, (U8,))
        check_shape(out, "out", shape, "[H, 128, vt_columns(Tk, B)] uint8")
        if not out.flags.c_contiguous:
            raise ValueError("out: expected a contiguous array")
    ptr = device_pointer(cro)
    if batch and tk:
        vt_launch(v, ptr, ptr + 4, batch, out, device_id()).launch(s.ptr)
    else:
        with s:
            out.fill(0)
    return out


def vt_launch(v, kv_begin_ptr: int, kv_end_ptr: int, batch: int, vt, dev: int):
    """The pre-pass of ``v`` (at least one key) into ``vt`` (``[H, 128, cols]`` contiguous uint8)
    for ``batch >= 1`` sequences, as a :class:`~mla_cupy._launch.PreparedLaunch`."""
    from ._geometry import transpose_v_kernel
    from ._launch import PreparedLaunch

    ck = transpose_v_kernel(dev)
    heads, cols = int(vt.shape[0]), int(vt.shape[2])
    values = transpose_v_values(v, kv_begin_ptr, kv_end_ptr, batch, device_pointer(vt), cols)
    grid = (-(-cols // ck.geometry["cols_per_cta"]), heads, 1)
    return PreparedLaunch(ck.params, ck.fn, grid, ck.threads, 0, values)

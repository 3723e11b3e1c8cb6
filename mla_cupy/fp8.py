"""The fp8 per-token variant of the Hopper kernel: its inputs and its V^T layout.

``mla_prefill_fp8`` takes MAX's per-token fp8 inputs: the 128 nope values of q and k, and v, as
float8_e4m3fn bytes (uint8), q's rope in bfloat16 (or, the all-e4m3 mode, both rope parts as e4m3
bytes under the same scales), and one float32 scale per query and per key
token (:mod:`mla_cupy.quant` makes them from 16-bit data). This module holds what only that variant
needs: viewing fp8 data as the bytes the kernels read, the checks of its arrays, and V^T, the layout
of V that the e4m3 tensor cores read for P V (``kernels/vt_layout.cuh``): its size, its NumPy model
and the device pre-pass that writes it (``kernels/transpose_v.cu``).
"""
from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from ._arrays import BF16, FP8_E4M3, FP32, as_device, device_pointer, is_torch, to_host
from ._checks import OFFSET_DTYPES, U8, check_aligned, check_array, check_layout, check_offsets_layout, check_offsets_values, check_shape
from .dims import DR, DV

__all__ = ["VT_ALIGN", "VT_SIGMA", "fp8_bytes", "check_fp8_arrays", "check_fp8_layout", "check_q_scale_values",
           "vt_columns", "vt_shape", "transpose_v_host", "transpose_v"]


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


def check_fp8_arrays(q_nope, q_rope, q_scale, k, k_scales, v) -> Tuple[int, int, int]:
    """Rank, dtype and shape of the per-token variant's arrays, in argument order (SPEC "Data
    types"): e4m3 bytes of q_nope / k / v, bfloat16 q_rope (or e4m3 bytes: the all-e4m3 mode,
    k_rope then e4m3 too), float32 scales. Returns (Tq, H, Tk)."""
    check_array(q_nope, "q_nope", 3, (U8,))
    tq, heads = int(q_nope.shape[0]), int(q_nope.shape[1])
    check_shape(q_nope, "q_nope", (None, None, DV), f"[Tq, H, Dv] e4m3 bytes with Dv = {DV}")
    if heads < 1:
        raise ValueError(f"q_nope: expected at least one head, got shape {list(q_nope.shape)}")
    check_array(q_rope, "q_rope", 3, (BF16, U8))
    check_shape(q_rope, "q_rope", (tq, heads, DR), f"[Tq, H, Dr] bfloat16 or e4m3 bytes with Dr = {DR}")
    check_array(q_scale, "q_scale", 2, (FP32,))
    check_shape(q_scale, "q_scale", (tq, 1), "[Tq, 1] float32, one scale per query token")
    check_array(k, "k", 3, (U8,))
    tk = int(k.shape[0])
    check_shape(k, "k", (None, heads, DV), f"[Tk, H, Dv] e4m3 bytes with H = {heads} from q_nope")
    check_array(k_scales, "k_scales", 2, (FP32,))
    check_shape(k_scales, "k_scales", (tk, 1), "[Tk, 1] float32, one scale per key token")
    check_array(v, "v", 3, (U8,))
    check_shape(v, "v", (tk, heads, DV), "the shape of k, [Tk, H, Dv] e4m3 bytes")
    return tq, heads, tk


def check_fp8_layout(q_nope, q_rope, k, k_scales, v) -> None:
    """Device layout of the per-token variant's arrays (q_scale is read one value per row: any
    layout)."""
    for name, x in (("q_nope", q_nope), ("q_rope", q_rope), ("k", k)):
        check_layout(x, name)
    tk = int(k_scales.shape[0])
    if tk > 1 and int(k_scales.strides[0]) != 4:
        raise ValueError(f"k_scales: expected contiguous scales (stride 4 bytes; they are copied by TMA), got strides "
                         f"{tuple(k_scales.strides)}")
    if tk:
        check_aligned(device_pointer(k_scales), "k_scales")
    check_layout(v, "v")


def check_q_scale_values(q_scale) -> None:
    """The kernel folds q_scale into each row's softmax scale (max of q_scale * x): negative (or NaN)
    scales would break that; the quantizers give amax / 448, or 1 for an all-zero row."""
    qs = to_host(q_scale).reshape(-1)
    if not (qs >= 0).all():
        i = int(np.argmax(~(qs >= 0)))
        raise ValueError(f"q_scale: expected non-negative scales, got q_scale[{i}] = {qs[i]}")


# ---------------------------------------------------------------------------------------------
# V^T (kernels/vt_layout.cuh, kernels/transpose_v.cu)

VT_ALIGN = 16  #: kVtAlign: keys per aligned column group
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


def transpose_v_host(v, cache_row_offsets) -> np.ndarray:
    """NumPy model of :func:`transpose_v`: e4m3 ``v[Tk, H, 128]`` (uint8 or ml_dtypes bytes) ->
    ``vt[H, 128, vt_columns(Tk, B)]`` uint8: sequence b's keys from column
    ``16 * (ceil(cache_row_offsets[b] / 16) + b)``, each group of 16 in the VT_SIGMA order, zeros
    elsewhere."""
    v8 = np.ascontiguousarray(v).view(np.uint8)
    cro = np.asarray(cache_row_offsets, np.int64)
    tk, heads = int(v8.shape[0]), int(v8.shape[1])
    vt = np.zeros(vt_shape(heads, tk, len(cro) - 1), np.uint8)
    for b in range(len(cro) - 1):
        sk = int(cro[b + 1] - cro[b])
        n = -(-sk // VT_ALIGN) * VT_ALIGN
        keys = np.zeros((n, heads, DV), np.uint8)
        keys[:sk] = v8[cro[b]:cro[b + 1]]
        order = (np.arange(n) // VT_ALIGN) * VT_ALIGN + VT_SIGMA[np.arange(n) % VT_ALIGN]
        c0 = vt_col0(cro[b], b)
        vt[:, :, c0:c0 + n] = keys[order].transpose(1, 2, 0)
    return vt


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
    cro = as_device(cache_row_offsets, "cache_row_offsets")
    check_array(cro, "cache_row_offsets", 1, OFFSET_DTYPES)
    if cro.shape[0] < 1:
        raise ValueError("cache_row_offsets: expected B + 1 >= 1 offsets, got an empty array")
    check_offsets_layout(cro, "cache_row_offsets")
    check_offsets_values(to_host(cro).astype(np.int64), "cache_row_offsets", int(v.shape[0]), False, "Tk (v.shape[0])")
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

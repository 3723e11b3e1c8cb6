"""fp8 (float8_e4m3fn) quantization of MLA prefill inputs, as the SPEC ("Data types") and MAX
define it, on the host (NumPy) and on the device.

Two schemes:

* per token (``quantize_per_token``): ``q_scale[i] = amax over heads and all 192 values of
  |q[i]| / 448``; ``k_scales[j] = amax over heads of |k[j]| (the 128 nope values) / 448``; the nope
  parts are stored as e4m3 of value / scale, the rope parts stay 16-bit but divided by the same
  scale (a per-token cache holds scaled rope values, as MAX's does); V is cast to e4m3 with
  saturation and no scale. The true query is ``q_scale[i] * concat(q_nope, q_rope)``, the true key
  ``k_scales[j] * concat(k, rope)``. With ``e4m3_rope=True`` (the all-e4m3 mode) the rope parts are
  e4m3 of value / scale as well, and ``k_scales[j] = max(amax over heads of |k[j]|, amax |k_rope[j]|)
  / 448``: the scale covers all 192 values of key j (q_scale already does for query i).
* per 64-value rope block (``quantize_rope_blocks``): ``k_rope_scales[j, 0, c] = amax |rope_j block c| / 448``.

A token whose amax is 0 gets scale 1 (its values are zeros either way).

NumPy inputs are quantized on the host: fp8 data comes back as ``ml_dtypes.float8_e4m3fn`` arrays
(``.view(numpy.uint8)`` gives the bytes a device array carries). CuPy (or other device) inputs are
quantized by CUDA kernels (``kernels/quantize.cu``, compute capability 8.9 or newer) into CuPy
arrays, fp8 data as uint8: bit for bit the same values, ready for :func:`mla_cupy.mla_prefill_fp8`
and ``mla_prefill(..., k_rope_scales=...)``.

The per-token kernel reads V transposed (keys contiguous, as the e4m3 tensor cores need):
:func:`transpose_v`, :func:`transpose_v_host` and :func:`vt_columns` are those of
:mod:`mla_cupy.fp8`, the home of that layout, available here too. Given the batch's
``cache_row_offsets``, :func:`quantize_per_token` writes V^T as it quantizes V (a
:class:`~mla_cupy.fp8.TransposedV`, ``"v_t"``), so that the prefill call launches no pre-pass.
"""
from __future__ import annotations

from typing import Dict

import numpy as np

from ._arrays import FP8_E4M3, device_pointer
from .dims import DR, DV
from .fp8 import (VT_SIGMA, VT_TILE, TransposedV, checked_offsets, offsets_values, transpose_v, transpose_v_host,
                  vt_columns, vt_shape)

__all__ = ["E4M3_MAX", "to_e4m3", "quantize_per_token", "quantize_rope_blocks", "dequantize_rope_blocks",
           "transpose_v", "transpose_v_host", "vt_columns", "VT_SIGMA"]

E4M3_MAX = 448.0  #: largest finite float8_e4m3fn


def to_e4m3(x: np.ndarray) -> np.ndarray:
    """Round to float8_e4m3fn (nearest even) with saturation to +-448 (the format has no inf)."""
    return np.clip(np.asarray(x, np.float32), -E4M3_MAX, E4M3_MAX).astype(FP8_E4M3)


def _scale(amax: np.ndarray) -> np.ndarray:
    s = (amax / E4M3_MAX).astype(np.float32)
    return np.where(s > 0, s, np.float32(1.0))


def _row_amax(x: np.ndarray) -> np.ndarray:
    """max |x| over everything but the first axis (0 for a row of zeros; fine with no rows)."""
    return np.abs(x).reshape(x.shape[0], int(np.prod(x.shape[1:]))).max(axis=1, initial=0.0)


def _on_device(*xs) -> bool:
    return any(not isinstance(x, np.ndarray) and (hasattr(x, "__cuda_array_interface__") or hasattr(x, "__dlpack__"))
               for x in xs)


def _device_input(x, name: str):
    """A device array to quantize: 3-D, the last dimension contiguous, bf16 / fp16 / float32."""
    from . import _registry as reg
    from ._arrays import as_device

    x = as_device(x, name)
    if x.ndim != 3 or (x.shape[2] > 1 and x.strides[2] != x.itemsize):
        raise ValueError(f"{name}: expected a 3-D array with a contiguous last dimension, got shape {tuple(x.shape)}")
    if np.dtype(x.dtype) not in reg.CPP_TYPE:
        raise TypeError(f"{name}: expected bfloat16, float16 or float32 data to quantize, got {np.dtype(x.dtype).name}")
    return x


def _device_rows(x, n8: int, side=None, use_scale: bool = True, name: str = "x", e4m3_rope: bool = False, q8=None):
    """kernels/quantize.cu over the rows of ``x[R, H, W]`` (last dim contiguous): (e4m3 bytes of the
    first n8 values per head [R, H, n8] (into ``q8`` when given), the rest in x's dtype
    [R, H, W - n8] or None, scales [R, 1] or None, side row scaled [R, 1, 64] or None). ``e4m3_rope``:
    the rest and the side row as e4m3 bytes too, the side row counted in the scale's amax."""
    import cupy as cp

    from . import _registry as reg
    from ._arrays import as_device
    from .jit import get_function

    x = _device_input(x, name)
    r, h, w = (int(n) for n in x.shape)
    dt = np.dtype(x.dtype)
    q8 = cp.empty((r, h, n8), cp.uint8) if q8 is None else q8
    rest = cp.empty((r, h, w - n8), cp.uint8 if e4m3_rope else dt) if w > n8 else None
    scale = cp.empty((r, 1), cp.float32) if use_scale else None
    side_out = None
    if side is not None:
        side = as_device(side, "k_rope")
        if tuple(side.shape) != (r, 1, DR) or side.strides[2] != side.itemsize or np.dtype(side.dtype) != dt:
            raise ValueError(f"k_rope: expected [{r}, 1, {DR}] {dt.name} with a contiguous last dimension, got "
                             f"{list(side.shape)} {np.dtype(side.dtype).name}")
        side_out = cp.empty((r, 1, DR), cp.uint8 if e4m3_rope else dt)
    if r:
        fn = get_function(*reg.quantize_family(), reg.quantize_name(dt))
        it = dt.itemsize
        null = np.uintp(0)  # a null pointer argument
        fn((r,), (256,), (x, np.int64(x.strides[0] // it), np.int64(x.strides[1] // it), np.int32(h), np.int32(w),
                          np.int32(n8), q8, rest if rest is not None else null, scale if scale is not None else null,
                          side if side is not None else null, np.int64(side.strides[0] // it if side is not None else 0),
                          side_out if side_out is not None else null, np.int32(use_scale), np.int32(e4m3_rope)))
    return q8, rest, scale, side_out


def _device_v(v, cache_row_offsets):
    """V cast to e4m3 on the device, with its V^T for ``cache_row_offsets``: (v8 ``[Tk, H, 128]``,
    :class:`~mla_cupy.fp8.TransposedV`). One kernel (quantize.cu: quantize_v_transposed_kernel)
    writes both for the keys of the sequences; the rows past the last sequence, in no column of
    V^T, go through the row quantizer."""
    import cupy as cp

    from . import _registry as reg
    from .jit import get_function

    v = _device_input(v, "v")
    tk, heads = int(v.shape[0]), int(v.shape[1])
    if int(v.shape[2]) != DV:
        raise ValueError(f"v: expected [Tk, H, {DV}] values, got shape {list(v.shape)}")
    cro, h = checked_offsets(cache_row_offsets, tk)
    batch, covered = len(h) - 1, int(h[-1])
    v8 = cp.empty((tk, heads, DV), cp.uint8)
    shape = vt_shape(heads, tk, batch)
    vt = cp.empty(shape, cp.uint8)
    if batch and tk:
        dt = np.dtype(v.dtype)
        it = dt.itemsize
        vec = device_pointer(v) % 16 == 0 and all(int(s) % 16 == 0 for s, n in zip(v.strides[:2], v.shape[:2]) if n > 1)
        fn = get_function(*reg.quantize_family(), reg.quantize_v_name(dt))
        ptr = device_pointer(cro)
        threads, cols_per_cta = VT_TILE
        grid = (-(-shape[2] // cols_per_cta), heads)
        fn(grid, (threads,), (v, np.int64(v.strides[0] // it), np.int64(v.strides[1] // it), np.uintp(ptr),
                              np.uintp(ptr + 4), np.int32(batch), v8, vt, np.int64(shape[2]), np.int32(vec)))
    else:
        vt.fill(0)
    if covered < tk:  # rows past the last sequence: in no V^T column
        _device_rows(v[covered:], DV, use_scale=False, name="v", q8=v8[covered:])
    return v8, TransposedV(vt, cache_row_offsets, tk)


def quantize_per_token(q, k, v, k_rope, *, e4m3_rope: bool = False, cache_row_offsets=None) -> Dict[str, np.ndarray]:
    """``q[Tq, H, 192]``, ``k[Tk, H, 128]``, ``v[Tk, H, 128]``, ``k_rope[Tk, 1, 64]`` (any float
    dtype) -> the inputs of the fp8 per-token variant: ``q_nope`` / ``k`` / ``v`` e4m3,
    ``q_rope`` / ``k_rope`` in q's 16-bit dtype (scaled), ``q_scale[Tq, 1]`` / ``k_scales[Tk, 1]``
    float32. Device inputs (one dtype for all four) are quantized on the device.

    ``e4m3_rope=True`` (the all-e4m3 mode of :func:`mla_cupy.mla_prefill_fp8`): ``q_rope`` and
    ``k_rope`` are e4m3 too, under the same scales, and ``k_scales[j]`` covers the rope: the amax of
    key j's 128 nope values of every head and its 64 rope values (``q_scale`` covers all 192
    values of every head either way).

    ``cache_row_offsets`` (``[B + 1]`` int32 / uint32, host or device; the batch's key offsets, as
    the prefill call will get them): also ``"v_t"``, a :class:`~mla_cupy.fp8.TransposedV` of V for
    those offsets, to pass as the call's ``v`` (the call then launches no V^T pre-pass). On the
    device the kernel that casts V writes V^T in the same pass (its e4m3 bytes, ``"v"``, are the
    same either way); on the host :func:`transpose_v_host` makes it; bit for bit the same bytes.
    The offsets are read (checked: starting at 0, non-decreasing, the last <= Tk) and kept by
    reference in the result, which is valid for a call with these offsets only."""
    if _on_device(q, k, v, k_rope):
        q_nope, q_rope, q_scale, _ = _device_rows(q, DV, name="q", e4m3_rope=e4m3_rope)
        k8, _, k_scales, k_rope_scaled = _device_rows(k, DV, side=k_rope, name="k", e4m3_rope=e4m3_rope)
        out = {"q_nope": q_nope, "q_rope": q_rope, "q_scale": q_scale, "k": k8, "k_scales": k_scales,
               "k_rope": k_rope_scaled}
        if cache_row_offsets is None:
            out["v"] = _device_rows(v, DV, use_scale=False, name="v")[0]
        else:
            out["v"], out["v_t"] = _device_v(v, cache_row_offsets)
        return out
    q32, k32, r32 = (np.asarray(a, np.float32) for a in (q, k, k_rope))
    out_dtype = np.asarray(q).dtype if np.asarray(q).dtype.itemsize == 2 else np.dtype(np.float32)
    q_scale = _scale(_row_amax(q32))[:, None]
    k_amax = np.maximum(_row_amax(k32), _row_amax(r32)) if e4m3_rope else _row_amax(k32)
    k_scales = _scale(k_amax)[:, None]
    q_scaled = q32 / q_scale[:, :, None]
    rope_of = to_e4m3 if e4m3_rope else (lambda x: x.astype(out_dtype))
    out = {
        "q_nope": to_e4m3(q_scaled[:, :, :DV]),
        "q_rope": rope_of(q_scaled[:, :, DV:]),
        "q_scale": q_scale,
        "k": to_e4m3(k32 / k_scales[:, :, None]),
        "k_scales": k_scales,
        "v": to_e4m3(v),
        "k_rope": rope_of(r32 / k_scales[:, :, None]),
    }
    if cache_row_offsets is not None:
        h = offsets_values(cache_row_offsets, int(out["v"].shape[0]))
        out["v_t"] = TransposedV(transpose_v_host(out["v"], h), cache_row_offsets, int(out["v"].shape[0]))
    return out


def quantize_rope_blocks(k_rope):
    """``k_rope[Tk, 1, 64]`` -> (e4m3 ``[Tk, 1, 64]``, float32 ``k_rope_scales[Tk, 1, 64 // 64]``).
    A device input is quantized on the device (e4m3 as uint8)."""
    if _on_device(k_rope):
        r8, _, sc, _ = _device_rows(k_rope, DR, name="k_rope")
        return r8, sc.reshape(sc.shape[0], 1, 1)
    r = np.asarray(k_rope, np.float32)
    blocks = r.reshape(r.shape[0], r.shape[1], DR // 64, 64)
    scales = _scale(np.abs(blocks).max(axis=3, initial=0.0))
    return to_e4m3((blocks / scales[..., None]).reshape(r.shape)), scales


def dequantize_rope_blocks(k_rope_fp8: np.ndarray, k_rope_scales: np.ndarray) -> np.ndarray:
    """The float64 rope an fp8 rope with per-64-value scales stands for."""
    r = np.asarray(k_rope_fp8).astype(np.float64)
    blocks = r.reshape(r.shape[0], r.shape[1], r.shape[2] // 64, 64) * np.asarray(k_rope_scales, np.float64)[..., None]
    return blocks.reshape(r.shape)

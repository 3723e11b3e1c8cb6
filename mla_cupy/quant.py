"""fp8 (float8_e4m3fn) quantization of MLA prefill inputs, as the SPEC ("Data types") and MAX
define it: the host-side (NumPy) reference of issue 6's quantizers.

Two schemes:

* per token (``quantize_per_token``): ``q_scale[i] = amax over heads and all 192 values of
  |q[i]| / 448``; ``k_scales[j] = amax over heads of |k[j]| (the 128 nope values) / 448``; the nope
  parts are stored as e4m3 of value / scale, the rope parts stay 16-bit but divided by the same
  scale (a per-token cache holds scaled rope values, as MAX's does); V is cast to e4m3 with
  saturation and no scale. The true query is ``q_scale[i] * concat(q_nope, q_rope)``, the true key
  ``k_scales[j] * concat(k, rope)``.
* per 64-value rope block (``quantize_rope_blocks``): ``k_rope_scales[j, 0, c] = amax |rope_j block c| / 448``.

A token whose amax is 0 gets scale 1 (its values are zeros either way).

NumPy inputs are quantized on the host: fp8 data comes back as ``ml_dtypes.float8_e4m3fn`` arrays
(``.view(numpy.uint8)`` gives the bytes a device array carries). CuPy (or other device) inputs are
quantized by CUDA kernels (``kernels/quantize.cu``, compute capability 8.9 or newer) into CuPy
arrays, fp8 data as uint8: bit for bit the same values, ready for :func:`mla_cupy.mla_prefill_fp8`
and ``mla_prefill(..., k_rope_scales=...)``.

The per-token kernel reads V transposed (keys contiguous, as the e4m3 tensor cores need):
:func:`transpose_v` writes that layout (``kernels/vt_layout.cuh``) on the device, and
:func:`mla_cupy.mla_prefill_fp8` calls it once per call; :func:`transpose_v_host` is its NumPy model.
"""
from __future__ import annotations

from typing import Dict

import numpy as np

from ._arrays import FP8_E4M3
from .validation import DR, DV

__all__ = ["E4M3_MAX", "to_e4m3", "quantize_per_token", "quantize_rope_blocks", "dequantize_rope_blocks",
           "transpose_v", "transpose_v_host", "vt_columns"]

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


def _device_rows(x, n8: int, side=None, use_scale: bool = True, name: str = "x"):
    """kernels/quantize.cu over the rows of ``x[R, H, W]`` (last dim contiguous): (e4m3 bytes of the
    first n8 values per head [R, H, n8], the rest in x's dtype [R, H, W - n8] or None, scales [R, 1]
    or None, side row scaled [R, 1, 64] or None)."""
    import cupy as cp

    from . import _registry as reg
    from ._arrays import as_device
    from .jit import get_function

    x = as_device(x, name)
    if x.ndim != 3 or (x.shape[2] > 1 and x.strides[2] != x.itemsize):
        raise ValueError(f"{name}: expected a 3-D array with a contiguous last dimension, got shape {tuple(x.shape)}")
    r, h, w = (int(n) for n in x.shape)
    dt = np.dtype(x.dtype)
    if dt not in reg.CPP_TYPE:
        raise TypeError(f"{name}: expected bfloat16, float16 or float32 data to quantize, got {dt.name}")
    q8 = cp.empty((r, h, n8), cp.uint8)
    rest = cp.empty((r, h, w - n8), dt) if w > n8 else None
    scale = cp.empty((r, 1), cp.float32) if use_scale else None
    side_out = None
    if side is not None:
        side = as_device(side, "k_rope")
        if tuple(side.shape) != (r, 1, DR) or side.strides[2] != side.itemsize or np.dtype(side.dtype) != dt:
            raise ValueError(f"k_rope: expected [{r}, 1, {DR}] {dt.name} with a contiguous last dimension, got "
                             f"{list(side.shape)} {np.dtype(side.dtype).name}")
        side_out = cp.empty((r, 1, DR), dt)
    if r:
        fn = get_function(*reg.quantize_family(), reg.quantize_name(dt))
        it = dt.itemsize
        null = np.uintp(0)  # a null pointer argument
        fn((r,), (256,), (x, np.int64(x.strides[0] // it), np.int64(x.strides[1] // it), np.int32(h), np.int32(w),
                          np.int32(n8), q8, rest if rest is not None else null, scale if scale is not None else null,
                          side if side is not None else null, np.int64(side.strides[0] // it if side is not None else 0),
                          side_out if side_out is not None else null, np.int32(use_scale)))
    return q8, rest, scale, side_out


def quantize_per_token(q, k, v, k_rope) -> Dict[str, np.ndarray]:
    """``q[Tq, H, 192]``, ``k[Tk, H, 128]``, ``v[Tk, H, 128]``, ``k_rope[Tk, 1, 64]`` (any float
    dtype) -> the inputs of the fp8 per-token variant: ``q_nope`` / ``k`` / ``v`` e4m3,
    ``q_rope`` / ``k_rope`` in q's 16-bit dtype (scaled), ``q_scale[Tq, 1]`` / ``k_scales[Tk, 1]``
    float32. Device inputs (one dtype for all four) are quantized on the device."""
    if _on_device(q, k, v, k_rope):
        q_nope, q_rope, q_scale, _ = _device_rows(q, DV, name="q")
        k8, _, k_scales, k_rope_scaled = _device_rows(k, DV, side=k_rope, name="k")
        v8, _, _, _ = _device_rows(v, DV, use_scale=False, name="v")
        return {"q_nope": q_nope, "q_rope": q_rope, "q_scale": q_scale, "k": k8, "k_scales": k_scales, "v": v8,
                "k_rope": k_rope_scaled}
    q32, k32, r32 = (np.asarray(a, np.float32) for a in (q, k, k_rope))
    out_dtype = np.asarray(q).dtype if np.asarray(q).dtype.itemsize == 2 else np.dtype(np.float32)
    q_scale = _scale(_row_amax(q32))[:, None]
    k_scales = _scale(_row_amax(k32))[:, None]
    qs = q32 / q_scale[:, :, None]
    return {
        "q_nope": to_e4m3(qs[:, :, :DV]),
        "q_rope": qs[:, :, DV:].astype(out_dtype),
        "q_scale": q_scale,
        "k": to_e4m3(k32 / k_scales[:, :, None]),
        "k_scales": k_scales,
        "v": to_e4m3(v),
        "k_rope": (r32 / k_scales[:, :, None]).astype(out_dtype),
    }


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


# ---------------------------------------------------------------------------------------------
# V^T for the per-token kernel (kernels/vt_layout.cuh, kernels/transpose_v.cu)

VT_ALIGN = 16  #: kVtAlign: keys per aligned column group
_VT_COLS_PER_CTA, _VT_THREADS = 128, 128  # kernels/transpose_v.cu: kVtCols, kVtThreads
#: column p of a 16-column group holds key VT_SIGMA[p] of the group (vt_layout.cuh: sigma)
VT_SIGMA = np.array([2 * (p // 4) + (p & 1) + 8 * ((p >> 1) & 1) for p in range(VT_ALIGN)])


def vt_columns(tk: int, batch: int) -> int:
    """Columns of the V^T buffer for ``Tk`` keys in ``batch`` sequences: a multiple of 16 past every
    sequence's region (region b starts at ``16 * (ceil(cache_row_offsets[b] / 16) + b)``)."""
    return max(VT_ALIGN, -(-(tk + VT_ALIGN * batch) // VT_ALIGN) * VT_ALIGN)


def _vt_col0(kv_begin: int, b: int) -> int:
    return (-(-int(kv_begin) // VT_ALIGN) + b) * VT_ALIGN


def transpose_v_host(v, cache_row_offsets) -> np.ndarray:
    """NumPy model of :func:`transpose_v`: e4m3 ``v[Tk, H, 128]`` (uint8 or ml_dtypes bytes) ->
    ``vt[H, 128, vt_columns(Tk, B)]`` uint8: sequence b's keys from column
    ``16 * (ceil(cache_row_offsets[b] / 16) + b)``, each group of 16 in the VT_SIGMA order, zeros
    elsewhere."""
    v8 = np.ascontiguousarray(v).view(np.uint8)
    cro = np.asarray(cache_row_offsets, np.int64)
    tk, heads = int(v8.shape[0]), int(v8.shape[1])
    vt = np.zeros((heads, DV, vt_columns(tk, len(cro) - 1)), np.uint8)
    for b in range(len(cro) - 1):
        sk = int(cro[b + 1] - cro[b])
        n = -(-sk // VT_ALIGN) * VT_ALIGN
        keys = np.zeros((n, heads, DV), np.uint8)
        keys[:sk] = v8[cro[b]:cro[b + 1]]
        order = (np.arange(n) // VT_ALIGN) * VT_ALIGN + VT_SIGMA[np.arange(n) % VT_ALIGN]
        c0 = _vt_col0(cro[b], b)
        vt[:, :, c0:c0 + n] = keys[order].transpose(1, 2, 0)
    return vt


def _transpose_v_device(v, kv_begin_ptr: int, kv_end_ptr: int, batch: int, stream=None):
    """kernels/transpose_v.cu on device e4m3 bytes ``v[Tk, H, 128]`` (16-byte aligned rows, last dim
    contiguous; unchecked) with raw pointers to the key offsets: a new uint8 ``[H, 128, cols]``
    CuPy array, written on ``stream`` (the current one when None)."""
    import cupy as cp

    from . import _registry as reg
    from .jit import get_function

    tk, heads = int(v.shape[0]), int(v.shape[1])
    cols = vt_columns(tk, batch)
    s = stream if stream is not None else cp.cuda.get_current_stream()
    with s:
        vt = cp.empty((heads, DV, cols), cp.uint8)
        if batch and tk:
            fn = get_function(*reg.transpose_v_family(), reg.TRANSPOSE_V[1][0])
            fn((-(-cols // _VT_COLS_PER_CTA), heads), (_VT_THREADS,),
               (v, np.int64(v.strides[0]), np.int64(v.strides[1]), np.uintp(kv_begin_ptr), np.uintp(kv_end_ptr),
                np.int32(batch), vt, np.int64(cols)))
        else:
            vt.fill(0)
    return vt


def transpose_v(v, cache_row_offsets, *, stream=None):
    """V^T as :func:`mla_cupy.mla_prefill_fp8` reads it (``kernels/vt_layout.cuh``), on the device:
    e4m3 ``v[Tk, H, 128]`` (uint8) and ``cache_row_offsets[B + 1]`` (int32 or uint32, device) ->
    uint8 ``[H, 128, vt_columns(Tk, B)]``, bit for bit :func:`transpose_v_host`."""
    from ._arrays import as_device, to_host
    from .validation import OFFSET_DTYPES, check_array, check_offsets_values

    v = as_device(v, "v")
    check_array(v, "v", 3, (np.dtype(np.uint8),), device=True)
    if int(v.shape[2]) != DV:
        raise ValueError(f"v: expected [Tk, H, {DV}] e4m3 bytes, got shape {list(v.shape)}")
    cro = as_device(cache_row_offsets, "cache_row_offsets")
    check_array(cro, "cache_row_offsets", 1, OFFSET_DTYPES, device=False)
    if cro.shape[0] < 1 or (cro.shape[0] > 1 and cro.strides[0] != cro.itemsize):
        raise ValueError(f"cache_row_offsets: expected a contiguous [B + 1] array, got shape {list(cro.shape)}")
    check_offsets_values(to_host(cro).astype(np.int64), "cache_row_offsets", int(v.shape[0]), False, "Tk (v.shape[0])")
    batch = int(cro.shape[0]) - 1
    ptr = int(cro.data.ptr)
    return _transpose_v_device(v, ptr, ptr + 4, batch, stream)

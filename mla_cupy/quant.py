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

A token whose amax is 0 gets scale 1 (its values are zeros either way). fp8 data is returned as
``ml_dtypes.float8_e4m3fn`` arrays; ``.view(numpy.uint8)`` gives the bytes a device array carries.
The fused fp8 kernels are not written yet: today these functions and ``reference.mla_prefill_fp8``
serve as the oracle for them.
"""
from __future__ import annotations

from typing import Dict

import numpy as np

from ._arrays import FP8_E4M3
from .validation import DR, DV

__all__ = ["E4M3_MAX", "to_e4m3", "quantize_per_token", "quantize_rope_blocks", "dequantize_rope_blocks"]

E4M3_MAX = 448.0  #: largest finite float8_e4m3fn


def to_e4m3(x: np.ndarray) -> np.ndarray:
    """Round to float8_e4m3fn (nearest even) with saturation to +-448 (the format has no inf)."""
    return np.clip(np.asarray(x, np.float32), -E4M3_MAX, E4M3_MAX).astype(FP8_E4M3)


def _scale(amax: np.ndarray) -> np.ndarray:
    s = (amax / E4M3_MAX).astype(np.float32)
    return np.where(s > 0, s, np.float32(1.0))


def quantize_per_token(q: np.ndarray, k: np.ndarray, v: np.ndarray, k_rope: np.ndarray) -> Dict[str, np.ndarray]:
    """``q[Tq, H, 192]``, ``k[Tk, H, 128]``, ``v[Tk, H, 128]``, ``k_rope[Tk, 1, 64]`` (any float
    dtype) -> the inputs of the fp8 per-token variant: ``q_nope`` / ``k`` / ``v`` e4m3,
    ``q_rope`` / ``k_rope`` in q's 16-bit dtype (scaled), ``q_scale[Tq, 1]`` / ``k_scales[Tk, 1]``
    float32."""
    q32, k32, r32 = (np.asarray(a, np.float32) for a in (q, k, k_rope))
    out_dtype = np.asarray(q).dtype if np.asarray(q).dtype.itemsize == 2 else np.dtype(np.float32)
    q_scale = _scale(np.abs(q32).reshape(q32.shape[0], -1).max(axis=1, initial=0.0))[:, None]
    k_scales = _scale(np.abs(k32).reshape(k32.shape[0], -1).max(axis=1, initial=0.0))[:, None]
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


def quantize_rope_blocks(k_rope: np.ndarray):
    """``k_rope[Tk, 1, 64]`` -> (e4m3 ``[Tk, 1, 64]``, float32 ``k_rope_scales[Tk, 1, 64 // 64]``)."""
    r = np.asarray(k_rope, np.float32)
    blocks = r.reshape(r.shape[0], r.shape[1], DR // 64, 64)
    scales = _scale(np.abs(blocks).max(axis=3, initial=0.0))
    return to_e4m3((blocks / scales[..., None]).reshape(r.shape)), scales


def dequantize_rope_blocks(k_rope_fp8: np.ndarray, k_rope_scales: np.ndarray) -> np.ndarray:
    """The float64 rope an fp8 rope with per-64-value scales stands for."""
    r = np.asarray(k_rope_fp8).astype(np.float64)
    blocks = r.reshape(r.shape[0], r.shape[1], -1, 64) * np.asarray(k_rope_scales, np.float64)[..., None]
    return blocks.reshape(r.shape)

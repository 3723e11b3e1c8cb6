"""Argument checks of the prefill entry points and plans (SPEC "Errors"): each bad input raises
``ValueError`` or ``TypeError`` naming the argument, what was expected and what came, before
anything is launched.

The checks run in three steps, so that what a caller hears first is the real problem whatever
kind of array it passed:

1. rank, shape and dtype of every argument, the scalar keywords, then the values (offsets, page
   table, fp8 scales), in argument order; these read NumPy arrays as well as device arrays;
2. the device check: every array must be a device array (a NumPy array is told how to move);
3. the device layout: strides and alignment for vector and TMA loads, one device for all.

The same checks serve the device API (``device=True``) and the NumPy reference (``device=False``).
Given the kernels' inputs (16-bit, or the fp8 variants' e4m3 bytes), the reference makes every
check of the device API but the device check (step 2), with the same messages, so that what runs
on the reference runs on a GPU. What the reference takes beyond them: inputs in a wider float dtype
(float32, float64: the oracle's), where the dtype and layout checks of the kernels do not apply,
and float64 results (``out``, ``out_dtype``, ``lse``), whose messages then name float64 too.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from ._arrays import BF16, FP16, FP32, FP8_E4M3, device_pointer, read_back, require_device, to_host
from ._checks import (OFFSET_DTYPES, QSTART_DTYPES, U8, check_aligned, check_array, check_layout, check_offsets_array,
                      check_offsets_layout, check_offsets_values, check_shape, dtype_of, step_range)
from .dims import DQK, DR, DV
from . import fp8 as _fp8
from .fp8 import TransposedV, check_contiguous, check_transposed_v, check_transposed_v_offsets
from ._registry import VARIANT_16, VARIANT_E4M3, VARIANT_FP8, VARIANT_FP8_ROPE, sm90_schedule
from ._select import check_kernel_name
from .masks import CausalMask, Mask
from .paged import PagedKVCache

__all__ = ["Problem", "variant_of", "check_inputs", "check_fp8_arrays", "check_fp8_layout", "check_lse_and_accumulate", "check_scalars", "check_offsets",
           "check_offset_values", "check_values", "check_paged_table", "check_same_device", "check_merge_inputs",
           "check_merge_outputs", "check_backward_inputs", "DEVICE_DTYPES", "OFFSET_DTYPES"]

DEVICE_DTYPES = tuple(d for d in (BF16, FP16) if d is not None)
_MAX_I32 = 2**31 - 1


@dataclass(frozen=True)
class Problem:
    """What the checks established about one call.

    ``variant`` (:func:`variant_of`) is what the inputs are, one of the kernel variants of
    :data:`~mla_cupy._registry.SM90_VARIANTS`; the properties name what each part of the package
    reads of it.
    """

    batch: int
    heads: int
    tq: int
    tk: int
    dtype: np.dtype
    out_dtype: np.dtype
    mask: Mask
    scale: float
    max_sq: Optional[int]  # None when offsets were not read and no bound was given
    paged: bool
    variant: str = VARIANT_16
    # fp8: v given as V^T (a fp8.TransposedV): the kernel reads it, no pre-pass writes one
    v_transposed: bool = False
    # fp8: the kernel that reads a key tile's scales in pairs (fp8.scale_pairs of the key offsets)
    scale_pairs: bool = False
    # the largest key count of a sequence (the backward's key blocks), when the offsets were read
    max_sk: Optional[int] = None

    @property
    def fp8(self) -> bool:
        """The fp8 per-token variant: q, k and v are e4m3 nope parts under per-token scales
        (``dtype`` is then that of the output, bfloat16)."""
        return self.variant in (VARIANT_FP8, VARIANT_E4M3)

    @property
    def rope_scaled_e4m3(self) -> bool:
        """The 16-bit variant's e4m3 rope with per-key float32 scales (``k_rope_scales``), which
        the Hopper kernel's rope warp reads and dequantizes (no tensor map)."""
        return self.variant == VARIANT_FP8_ROPE

    @property
    def all_e4m3(self) -> bool:
        """The fp8 per-token variant's all-e4m3 mode: q_rope and a plain k_rope are e4m3 bytes
        under the per-token scales, read by TMA."""
        return self.variant == VARIANT_E4M3

    @property
    def fp8_rope(self) -> bool:
        """An e4m3 rope, under per-key scales or under the per-token ones (what a plan's
        ``fp8_rope`` says)."""
        return self.rope_scaled_e4m3 or self.all_e4m3


def with_key_offsets(p: Problem, cache_row_offsets) -> Problem:
    """``p`` with what its kernel takes from the values of its key offsets (host int64 values,
    None when not read): an fp8 variant's scale pairs (:func:`mla_cupy.fp8.scale_pairs`); any
    other problem as it is."""
    if not p.fp8:
        return p
    return replace(p, scale_pairs=_fp8.scale_pairs(p.mask, p.paged, cache_row_offsets))


def variant_of(fp8: bool, fp8_rope: bool) -> str:
    """The variant (:data:`~mla_cupy._registry.SM90_VARIANTS`) of a call or plan from its
    arguments: the fp8 per-token inputs (``fp8``) and an e4m3 rope (``fp8_rope``), which is under
    the per-token scales with ``fp8`` (the all-e4m3 mode) and under per-key scales without."""
    if fp8:
        return VARIANT_E4M3 if fp8_rope else VARIANT_FP8
    return VARIANT_FP8_ROPE if fp8_rope else VARIANT_16


# ---------------------------------------------------------------------------------------------
# step 1: metadata and values


def kernel_dtypes(dtype: np.dtype, device: bool) -> bool:
    """Whether the checks of the kernels' dtypes apply to a call whose q (or rope) is of ``dtype``:
    always on the device; for the reference, when it is a dtype the kernels take (bfloat16,
    float16)."""
    return device or dtype in DEVICE_DTYPES


def check_qkv(q, k, v, *, device: bool) -> Tuple[int, int, int, np.dtype]:
    """q ``[Tq, H, 192]``, k and v ``[Tk, H, 128]``, one float dtype (any float dtype for the
    reference, whose 16-bit inputs are checked as the device's). Returns (Tq, H, Tk, dtype)."""
    check_array(q, "q", 3, DEVICE_DTYPES if device else None)
    tq, heads, dqk = (int(n) for n in q.shape)
    if dqk != DQK:
        raise ValueError(f"q: expected head size Dqk = {DQK} (Dv {DV} + Dr {DR}), got {dqk}")
    if heads < 1:
        raise ValueError(f"q: expected at least one head, got shape {list(q.shape)}")
    dtype = dtype_of(q)
    if not device and dtype.kind not in "fV":
        raise TypeError(f"q: expected a floating-point dtype, got {dtype.name}")
    strict = kernel_dtypes(dtype, device)
    for name, x in (("k", k), ("v", v)):
        check_array(x, name, 3, DEVICE_DTYPES if strict else None)
        if strict and dtype_of(x) != dtype:
            raise TypeError(f"{name}: expected dtype {dtype.name} (the dtype of q), got {dtype_of(x).name}")
    tk = int(k.shape[0])
    check_shape(k, "k", (None, heads, DV), f"[Tk, H, Dv] with H = {heads} from q and Dv = {DV}")
    check_shape(v, "v", (tk, heads, DV), "the shape of k, [Tk, H, Dv]")
    return tq, heads, tk, dtype


def _is_fp8(x, device: bool) -> bool:
    """e4m3 data: uint8 bytes, or (host, for the reference) an ``ml_dtypes.float8_e4m3fn`` array."""
    return dtype_of(x) == U8 or (not device and FP8_E4M3 is not None and dtype_of(x) == FP8_E4M3)


def check_rope(k_rope, k_rope_scales, tk: Optional[int], dtype: np.dtype, *, device: bool, fp8: bool,
               all_e4m3: bool = False) -> bool:
    """A ``[Tk, 1, 64]`` k_rope (``tk=None``: any number of rows) or a :class:`PagedKVCache`, in
    q's dtype or (bfloat16 q, 16-bit variant) e4m3 bytes with float32 scales. The reference
    (``device=False``) takes any float dtype for a 16-bit rope; the fp8 per-token variant's rope is
    bfloat16 everywhere, or (``all_e4m3``: its q_rope is e4m3, the all-e4m3 mode) e4m3 bytes of a
    plain ``[Tk, 1, 64]`` k_rope without scales. Returns whether the rope is fp8."""
    if fp8 and _check_fp8_rope_kind(k_rope, k_rope_scales, tk, all_e4m3, device):
        return True
    strict = fp8 or kernel_dtypes(dtype, device)
    e4m3 = (U8,) if device else (U8,) + ((FP8_E4M3,) if FP8_E4M3 is not None else ())  # the host's e4m3 dtype too
    rope_dtypes = (DEVICE_DTYPES + (e4m3 if dtype == BF16 and not fp8 else ())) if strict else None
    if isinstance(k_rope, PagedKVCache):
        blocks = k_rope.blocks
        check_array(blocks, "k_rope.blocks", 4, rope_dtypes)
        fp8_rope = _is_fp8(blocks, device)
        if strict and dtype_of(blocks) not in (dtype,) + e4m3:
            raise TypeError(f"k_rope.blocks: expected dtype {dtype.name} (the dtype of q), got {dtype_of(blocks).name}")
        check_shape(blocks, "k_rope.blocks", (None, k_rope.page_size, 1, None),
                    f"[num_blocks, page_size, 1, Dc] with page_size = {k_rope.page_size}")
        if k_rope.rope_offset + DR > blocks.shape[3]:
            raise ValueError(f"k_rope.rope_offset: rope_offset + {DR} must be <= Dc = {blocks.shape[3]}, got {k_rope.rope_offset}")
        check_array(k_rope.lookup_table, "k_rope.lookup_table", 2, OFFSET_DTYPES)
        if fp8_rope:
            if k_rope.scales is None:
                raise ValueError("k_rope.scales: an fp8 (uint8) cache needs its float32 scales")
            check_array(k_rope.scales, "k_rope.scales", 4, (FP32,))
            check_shape(k_rope.scales, "k_rope.scales", (blocks.shape[0], k_rope.page_size, 1, blocks.shape[3] // 64),
                        "[num_blocks, page_size, 1, Dc / 64] float32")
        elif k_rope.scales is not None:
            raise ValueError(f"k_rope.scales: only an fp8 (uint8) cache has scales, these blocks are {dtype_of(blocks).name}")
    else:
        check_array(k_rope, "k_rope", 3, rope_dtypes)
        fp8_rope = _is_fp8(k_rope, device)
        if strict and dtype_of(k_rope) not in (dtype,) + e4m3:
            raise TypeError(f"k_rope: expected dtype {dtype.name} (the dtype of q), got {dtype_of(k_rope).name}")
        check_shape(k_rope, "k_rope", (tk, 1, DR), f"[Tk, 1, Dr] with Tk = {tk} from k and Dr = {DR}")
        if fp8_rope:
            if k_rope_scales is None:
                raise ValueError("k_rope_scales: an fp8 (uint8) k_rope needs its float32 scales [Tk, 1, 1]")
            check_array(k_rope_scales, "k_rope_scales", 3, (FP32,))
            check_shape(k_rope_scales, "k_rope_scales", (tk, 1, DR // 64), "[Tk, 1, Dr / 64] float32")
    if not fp8_rope and k_rope_scales is not None:
        raise ValueError("k_rope_scales: only an fp8 (uint8) k_rope has scales")
    return fp8_rope


def check_fp8_arrays(q_nope, q_rope, q_scale, k, k_scales, v) -> Tuple[int, int, int]:
    """Rank, dtype and shape of the per-token variant's arrays, in argument order (SPEC "Data
    types"): e4m3 bytes of q_nope / k / v (or a :class:`TransposedV` of the call's H and Tk for
    v), bfloat16 q_rope (or e4m3 bytes: the all-e4m3 mode, k_rope then e4m3 too), float32 scales.
    Returns (Tq, H, Tk)."""
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
    if isinstance(v, TransposedV):
        check_transposed_v(v, heads, tk)
    else:
        check_array(v, "v", 3, (U8,))
        check_shape(v, "v", (tk, heads, DV), "the shape of k, [Tk, H, Dv] e4m3 bytes")
    return tq, heads, tk


def check_q_scale_values(q_scale) -> None:
    """The kernel folds q_scale into each row's softmax scale (max of q_scale * x): negative (or NaN)
    scales would break that; the quantizers give amax / 448, or 1 for an all-zero row."""
    scales = to_host(q_scale).reshape(-1)
    if not (scales >= 0).all():
        i = int(np.argmax(~(scales >= 0)))
        raise ValueError(f"q_scale: expected non-negative scales, got q_scale[{i}] = {scales[i]}")


def check_offsets(valid_length, cache_row_offsets) -> int:
    """``valid_length`` and ``cache_row_offsets``: ``[B + 1]`` int32/uint32 each. Returns B."""
    check_array(valid_length, "valid_length", 1, OFFSET_DTYPES)
    nb1 = int(valid_length.shape[0])
    if nb1 < 1:
        raise ValueError("valid_length: expected B + 1 >= 1 offsets, got an empty array")
    check_offsets_array(cache_row_offsets, "cache_row_offsets", nb1, OFFSET_DTYPES)
    return nb1 - 1


def check_scalars(scale, mask, q_max_seq_len) -> Tuple[float, Mask]:
    """``scale`` (default ``1 / sqrt(192)``), ``mask`` (default causal) and ``q_max_seq_len``."""
    if scale is None:
        scale = 1.0 / np.sqrt(DQK)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)) or not np.isfinite(scale):
        raise TypeError(f"scale: expected a finite float, got {scale!r}")
    if scale <= 0:
        raise ValueError(f"scale: expected a positive float (the kernels find row maxima on unscaled scores), got {scale!r}")
    if mask is None:
        mask = CausalMask()
    if not isinstance(mask, Mask):
        raise TypeError(f"mask: expected a mla_cupy mask (CausalMask(), NullMask(), ...), got {type(mask).__name__}")
    if q_max_seq_len is not None and (isinstance(q_max_seq_len, bool) or not isinstance(q_max_seq_len, (int, np.integer))
                                      or q_max_seq_len < 0):
        raise ValueError(f"q_max_seq_len: expected a non-negative int, got {q_max_seq_len!r}")
    return float(scale), mask


def check_positions(cache_offsets, q_start_pos, batch: int) -> None:
    if cache_offsets is not None:
        check_offsets_array(cache_offsets, "cache_offsets", batch, OFFSET_DTYPES)
    if q_start_pos is not None:
        check_offsets_array(q_start_pos, "q_start_pos", batch, QSTART_DTYPES)


def check_out_dtype(out, out_dtype, dtype: np.dtype, *, device: bool) -> np.dtype:
    """The result dtype: ``out_dtype``, else that of ``out``, else q's (float64 for the reference)."""
    if out_dtype is None:
        out_dtype = dtype_of(out) if out is not None and hasattr(out, "dtype") else (dtype if device else np.dtype(np.float64))
    out_dtype = np.dtype(out_dtype)
    if device and out_dtype not in (dtype, FP32):
        raise TypeError(f"out_dtype: expected {dtype.name} (the dtype of q) or float32, got {out_dtype.name}")
    if not device and kernel_dtypes(dtype, device) and out_dtype not in (dtype, FP32, np.dtype(np.float64)):
        raise TypeError(f"out_dtype: expected {dtype.name} (the dtype of q) or float32 or float64, got {out_dtype.name}")
    return out_dtype


def check_out(out, out_dtype: np.dtype, tq: Optional[int], heads: int) -> None:
    if out is not None:
        check_array(out, "out", 3, (out_dtype,))
        check_shape(out, "out", (tq, heads, DV), "[Tq, H, Dv]")


def check_lse_and_accumulate(p: Problem, out: Any, lse: Any, accumulate: Any,
                             merge_dtypes: Sequence[np.dtype] = (FP32,)) -> None:
    """The ``lse=`` buffer (``[Tq, H]`` of ``merge_dtypes``) and ``accumulate`` (needs an ``out``
    of ``merge_dtypes`` and ``lse`` holding an earlier partial result). The kernels merge in
    float32; the reference also in float64."""
    check_accumulate(accumulate)
    if lse is not None:
        check_array(lse, "lse", 2, merge_dtypes)
        check_shape(lse, "lse", (p.tq, p.heads), "[Tq, H]")
    if accumulate:
        if out is None or lse is None:
            raise ValueError("accumulate: needs out= and lse= holding the partial result to merge into")
        if p.out_dtype not in merge_dtypes:
            names = " or ".join(np.dtype(d).name for d in merge_dtypes)
            raise TypeError(f"accumulate: out must be {names} (partial results are merged in {names}), got {p.out_dtype.name}")


def check_accumulate(accumulate: Any) -> None:
    if not isinstance(accumulate, (bool, np.bool_)):
        raise TypeError(f"accumulate: expected a bool, got {type(accumulate).__name__}")


def check_offset_values(valid_length, cache_row_offsets, cache_offsets, *, tq: Optional[int], tk: Optional[int],
                        q_max_seq_len: Optional[int], validate: bool) -> Tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """Read the offsets (device arrays with one synchronization, :func:`~mla_cupy._arrays.read_back`)
    and, with ``validate``, check their values against Tq / Tk (unchecked when None) and
    ``q_max_seq_len``. Returns (the largest query count, valid_length, cache_row_offsets,
    cache_offsets) on the host, as int64."""
    vl, cro, co = read_back((valid_length, cache_row_offsets, cache_offsets))
    return _offset_values(vl, cro, co, tq=tq, tk=tk, q_max_seq_len=q_max_seq_len, validate=validate)


def _offset_values(vl: np.ndarray, cro: np.ndarray, co: Optional[np.ndarray], *, tq: Optional[int], tk: Optional[int],
                   q_max_seq_len: Optional[int], validate: bool) -> Tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`check_offset_values` on offsets already on the host."""
    vl, cro = vl.astype(np.int64), cro.astype(np.int64)
    batch = len(vl) - 1
    given = co is not None
    co = np.zeros(batch, np.int64) if co is None else co.astype(np.int64)
    if validate:
        observed = check_offsets_values(vl, "valid_length", tq, True, "Tq (q.shape[0])")
        check_offsets_values(cro, "cache_row_offsets", tk, False, "Tk (k.shape[0])")
    else:
        observed = step_range(vl)[1]
    if validate and q_max_seq_len is not None and observed > q_max_seq_len:
        raise ValueError(f"q_max_seq_len: a sequence has {observed} queries, more than q_max_seq_len = {q_max_seq_len}")
    if validate and given and batch and co.min() < 0:
        raise ValueError(f"cache_offsets: expected non-negative positions, got {co[co < 0][0]}")
    return observed, vl, cro, co


def check_values(valid_length, cache_row_offsets, cache_offsets, k_rope, q_scale, *, tq: int, tk: int,
                 q_max_seq_len: Optional[int], validate: bool) -> Tuple[int, np.ndarray]:
    """The values of a call whose arrays passed their checks: the offsets are read (and, with
    ``validate``, checked against Tq / Tk and ``q_max_seq_len``), and with ``validate`` a paged
    ``k_rope``'s block ids and the fp8 variant's ``q_scale`` (None for the 16-bit call). Every
    array read is read with one synchronization (:func:`~mla_cupy._arrays.read_back`). Returns the
    largest query count of a sequence and the key offsets (int64, on the host)."""
    paged = validate and isinstance(k_rope, PagedKVCache)
    scales = validate and q_scale is not None and tq
    vl, cro, co, lut, q_scales = read_back((valid_length, cache_row_offsets, cache_offsets,
                                            k_rope.lookup_table if paged else None, q_scale if scales else None))
    observed, _vl, cro, co = _offset_values(vl, cro, co, tq=tq, tk=tk, q_max_seq_len=q_max_seq_len, validate=validate)
    if paged:
        check_paged_table(lut.astype(np.int64), k_rope.page_size, int(k_rope.blocks.shape[0]), co, np.diff(cro))
    if scales:
        check_q_scale_values(q_scales)
    return observed, cro


def check_paged_table(lut: np.ndarray, page_size: int, num_blocks: Optional[int], co: np.ndarray, sk: np.ndarray,
                      name: str = "k_rope.lookup_table") -> None:
    """Every page that a sequence's keys touch exists in the page table and names a real block
    (``num_blocks=None``: any non-negative id)."""
    max_pages = int(lut.shape[1])
    for b in range(len(sk)):
        if sk[b] == 0:
            continue
        first, last = co[b] // page_size, (co[b] + sk[b] - 1) // page_size
        if last >= max_pages:
            raise ValueError(
                f"{name}: sequence {b} needs pages up to {last} (cache_offsets + Sk = {co[b] + sk[b]} "
                f"keys at page_size {page_size}), but the table has {max_pages} columns"
            )
        ids = lut[b, first:last + 1]
        bad = (ids < 0) | (ids >= (num_blocks if num_blocks is not None else np.iinfo(np.int64).max))
        if bad.any():
            p = int(first + np.argmax(bad))
            shown = f"[0, {num_blocks}) (num_blocks)" if num_blocks is not None else "[0, 2^31)"
            raise ValueError(f"{name}: block id {lut[b, p]} at [{b}, {p}] is outside {shown}")


def check_grid(max_sq: int, batch: int, heads: int, variant: str, mask: Mask) -> None:
    """The work tiles of the grid (query blocks of the variant's Hopper kernel under ``mask``, as
    many as the portable kernel's) fit in an int."""
    nmb = -(-max_sq // sm90_schedule(variant, mask).block_m)
    if nmb * max(batch, 1) * heads > _MAX_I32:
        raise ValueError(f"q_max_seq_len: grid of {nmb} x {batch} x {heads} blocks exceeds 2^31 - 1")


def check_merge_inputs(out_a, lse_a, out_b, lse_b, *, device: bool) -> None:
    """The partial results of ``merge_states``: ``out_a`` / ``out_b`` ``[T, H, Dv]`` of one dtype
    (float32, bfloat16 or float16 on the device; any float dtype for the reference, which checks
    those three as the device does), ``lse_a`` / ``lse_b`` ``[T, H]`` float32 (the reference: also
    float64), and the kernel's layout."""
    dtypes = (FP32,) + DEVICE_DTYPES
    lse_dtypes = (FP32,) if device else (FP32, np.dtype(np.float64))
    check_array(out_a, "out_a", 3, dtypes if device else None)
    strict = device or dtype_of(out_a) in dtypes  # the kernel's partial results: its checks, on the host too
    if strict:
        check_layout(out_a, "out_a")
    t, h, dv = (int(n) for n in out_a.shape)
    if strict and dv % 4:
        raise ValueError(f"out_a: the last dimension must be a multiple of 4, got {dv}")
    check_array(out_b, "out_b", 3, (dtype_of(out_a),) if strict else None)
    if strict:
        check_layout(out_b, "out_b")
    check_shape(out_b, "out_b", (t, h, dv), "the shape of out_a")
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        check_array(x, name, 2, lse_dtypes)
        check_shape(x, name, (t, h), "[T, H] matching out_a")
        if strict and x.size and int(x.strides[1]) != dtype_of(x).itemsize:
            raise ValueError(f"{name}: the last dimension must be contiguous, got strides {tuple(x.strides)}")


def check_merge_outputs(out, lse_out, shape: Tuple[int, int, int], *, device: bool) -> None:
    """The optional results of ``merge_states``: ``out`` ``[T, H, Dv]`` (float32 or a 16-bit dtype
    on the device; any float dtype for the reference) and ``lse_out`` ``[T, H]`` float32 (the
    reference: also float64)."""
    t, h, dv = shape
    if out is not None:
        check_array(out, "out", 3, (FP32,) + DEVICE_DTYPES if device else None)
        if device:
            check_layout(out, "out")
        check_shape(out, "out", (t, h, dv), "the shape of out_a")
    if lse_out is not None:
        check_array(lse_out, "lse_out", 2, (FP32,) if device else (FP32, np.dtype(np.float64)))
        check_shape(lse_out, "lse_out", (t, h), "[T, H]")


# ---------------------------------------------------------------------------------------------
# steps 2 and 3: on the device, laid out for the kernels


def rope_arrays(k_rope, k_rope_scales) -> Sequence[Tuple[str, Any]]:
    """(name, array) of a k_rope argument, in the order they are checked."""
    if isinstance(k_rope, PagedKVCache):
        return [("k_rope.blocks", k_rope.blocks), ("k_rope.lookup_table", k_rope.lookup_table),
                ("k_rope.scales", k_rope.scales)]
    return [("k_rope", k_rope), ("k_rope_scales", k_rope_scales)]


def require_devices(named: Sequence[Tuple[str, Any]], api: Optional[str] = None) -> None:
    """Step 2: every (name, array) with an array is device memory, in the given order. With
    ``api`` (the function called), host data on a machine without a GPU hears that ``api`` needs
    one (:func:`mla_cupy._arrays.require_gpu`) rather than how to move the data."""
    for name, x in named:
        if x is not None:
            require_device(x, name, api)


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
    if isinstance(v, TransposedV):
        check_contiguous(v.data, "v.data")
        check_aligned(device_pointer(v.data), "v.data")
    else:
        check_layout(v, "v")


def check_rope_layout(k_rope) -> None:
    if isinstance(k_rope, PagedKVCache):
        check_layout(k_rope.blocks, "k_rope.blocks")
        lut = k_rope.lookup_table
        if lut.shape[1] > 1 and int(lut.strides[1]) != dtype_of(lut).itemsize:
            raise ValueError(f"k_rope.lookup_table: the last dimension must be contiguous, got strides {tuple(lut.strides)}")
    else:
        check_layout(k_rope, "k_rope")


def check_lse_layout(lse, heads: int, name: str = "lse") -> None:
    item = dtype_of(lse).itemsize if lse is not None else 4  # float32 (the reference: also float64)
    if lse is not None and heads > 1 and lse.shape[0] > 0 and int(lse.strides[1]) != item:
        raise ValueError(f"{name}: the head dimension must be contiguous (stride {item} bytes), got strides "
                         f"{tuple(lse.strides)}")


def check_same_device(arrays) -> None:
    ids = set()
    for a in arrays:
        dev = getattr(a, "device", None)
        if a is not None and dev is not None and hasattr(dev, "id"):
            ids.add(int(dev.id))
    if len(ids) > 1:
        raise ValueError(f"inputs live on different devices: {sorted(ids)}")


def _check_fp8_rope_kind(k_rope, k_rope_scales, tk: Optional[int], all_e4m3: bool, device: bool) -> bool:
    """The per-token variant's two rope parts are both bfloat16 or both e4m3 (the all-e4m3 mode,
    where k_rope is stored under k_scales as q_rope is under q_scale, so no scales of its own), and
    an e4m3 k_rope is a plain array: the all-e4m3 kernel has no paged instantiation. Returns True
    when the e4m3 k_rope is checked (else the bfloat16 checks follow)."""
    paged = isinstance(k_rope, PagedKVCache)
    name, arr = ("k_rope.blocks", k_rope.blocks) if paged else ("k_rope", k_rope)
    check_array(arr, name, 4 if paged else 3)
    if _is_fp8(arr, device) != all_e4m3:
        raise TypeError(f"{name}: expected {'e4m3 bytes (uint8)' if all_e4m3 else 'bfloat16'} like q_rope (the rope "
                        f"parts of mla_prefill_fp8 are both bfloat16 or both e4m3), got {dtype_of(arr).name}")
    if not all_e4m3:
        return False
    if paged:
        raise ValueError("k_rope: an e4m3 rope under the per-token scales (e4m3 q_rope) must be a plain [Tk, 1, 64] "
                         "array; a PagedKVCache is not supported in this mode (use a bfloat16 rope for a paged cache)")
    check_shape(k_rope, "k_rope", (tk, 1, DR), f"[Tk, 1, Dr] e4m3 bytes with Tk = {tk} from k and Dr = {DR}")
    if k_rope_scales is not None:
        raise ValueError("k_rope_scales: an e4m3 k_rope of mla_prefill_fp8 is scaled by k_scales; it has no scales "
                         "of its own")
    return True


# ---------------------------------------------------------------------------------------------
# one call


def check_inputs(
    q, k, v, k_rope, valid_length, cache_row_offsets, *, scale, mask, q_max_seq_len, cache_offsets, q_start_pos,
    out, out_dtype, validate: bool, device: bool, read_offsets: bool, fp8: Optional[tuple] = None,
    k_rope_scales: Any = None, lse: Any = None, accumulate: Any = False, kernel: Optional[str] = None,
    api: Optional[str] = None,
) -> Problem:
    """Check every argument of ``mla_prefill`` / ``mla_prefill_fp8`` (device) or of their
    references (``device=False``), in the three steps of this module. ``fp8 = (q_rope, q_scale,
    k_scales)``: the per-token fp8 variant, where q, k, v are the e4m3 (uint8) nope parts; the
    problem's ``dtype`` is then that of the rope parts, and v may be a
    :class:`~mla_cupy.fp8.TransposedV` (its data as :func:`~mla_cupy._arrays.checkable` gives it),
    checked against the call's H, Tk, B and ``cache_row_offsets``
    (:func:`~mla_cupy.fp8.check_transposed_v_offsets`: values compared with ``validate``);
    ``kernel`` is the kernel argument; ``api`` names the function called, for the message of host
    data on a machine without a GPU. Offsets are read to the host when ``validate`` or
    ``read_offsets``."""
    if fp8 is not None:
        tq, heads, tk = check_fp8_arrays(q, fp8[0], fp8[1], k, fp8[2], v)
        dtype = BF16
    else:
        tq, heads, tk, dtype = check_qkv(q, k, v, device=device)
    paged = isinstance(k_rope, PagedKVCache)
    fp8_rope = check_rope(k_rope, k_rope_scales, tk, dtype, device=device, fp8=fp8 is not None,
                          all_e4m3=fp8 is not None and _is_fp8(fp8[0], device))
    batch = check_offsets(valid_length, cache_row_offsets)
    vt = isinstance(v, TransposedV)
    if vt and not device:
        raise TypeError("v: the reference takes v as [Tk, H, 128] e4m3 bytes, not a TransposedV (its "
                        "mla_cupy.fp8.untranspose_v_host gives them back)")
    if vt:
        check_transposed_v_offsets(v, batch, cache_row_offsets, validate)
    if paged and k_rope.lookup_table.shape[0] != batch:
        raise ValueError(f"k_rope.lookup_table: expected {batch} rows (B), got {k_rope.lookup_table.shape[0]}")
    scale, mask = check_scalars(scale, mask, q_max_seq_len)
    check_positions(cache_offsets, q_start_pos, batch)
    out_dtype = check_out_dtype(out, out_dtype, dtype, device=device)
    check_out(out, out_dtype, tq, heads)
    max_sq = None if q_max_seq_len is None else int(q_max_seq_len)
    variant = variant_of(fp8 is not None, fp8_rope)
    p = Problem(batch, heads, tq, tk, dtype, out_dtype, mask, scale, max_sq, paged, variant, vt)
    check_lse_and_accumulate(p, out, lse, accumulate, (FP32,) if device else (FP32, np.dtype(np.float64)))
    if kernel is not None:
        check_kernel_name(kernel)

    if validate or read_offsets:
        observed, cro = check_values(valid_length, cache_row_offsets, cache_offsets, k_rope,
                                     None if fp8 is None else fp8[1], tq=tq, tk=tk, q_max_seq_len=max_sq,
                                     validate=validate)
        if max_sq is None:
            max_sq = observed
            p = replace(p, max_sq=max_sq)
        p = replace(with_key_offsets(p, cro), max_sk=int(np.diff(cro).max()) if len(cro) > 1 else 0)
    if not device:
        if kernel_dtypes(dtype, device):  # the kernels' inputs on the host: their layout checks too
            check_layouts(q, k, v, k_rope, fp8, (valid_length, cache_row_offsets, cache_offsets, q_start_pos), out,
                          lse, heads)
            if max_sq is not None:
                check_grid(max_sq, batch, heads, variant, mask)
        return p

    named = [("q_nope" if fp8 is not None else "q", q)]
    named += [("q_rope", fp8[0]), ("q_scale", fp8[1]), ("k", k), ("k_scales", fp8[2])] if fp8 is not None else [("k", k)]
    named += [("v.data", v.data) if vt else ("v", v)] + list(rope_arrays(k_rope, k_rope_scales))
    named += [("valid_length", valid_length), ("cache_row_offsets", cache_row_offsets), ("cache_offsets", cache_offsets),
              ("q_start_pos", q_start_pos), ("out", out), ("lse", lse)]
    require_devices(named, api)
    check_layouts(q, k, v, k_rope, fp8, (valid_length, cache_row_offsets, cache_offsets, q_start_pos), out, lse, heads)
    check_same_device([x for _, x in named])
    if max_sq is not None:
        check_grid(max_sq, batch, heads, variant, mask)
    return p


def check_layouts(q, k, v, k_rope, fp8: Optional[tuple], offsets: Sequence[Any], out: Any, lse: Any,
                  heads: int) -> None:
    """Step 3 (without the one-device check): the layout the kernels read, of every array of a
    call whose other checks passed; ``offsets`` are valid_length, cache_row_offsets, cache_offsets
    and q_start_pos (None where not given)."""
    if fp8 is not None:
        check_fp8_layout(q, fp8[0], k, fp8[2], v)
    else:
        for name, x in (("q", q), ("k", k), ("v", v)):
            check_layout(x, name)
    check_rope_layout(k_rope)
    for name, x in zip(("valid_length", "cache_row_offsets", "cache_offsets", "q_start_pos"), offsets):
        if x is not None:
            check_offsets_layout(x, name)
    if out is not None:
        check_layout(out, "out")
    check_lse_layout(lse, heads)


# ---------------------------------------------------------------------------------------------
# the backward


def _check_backward_dtype(x, name: str, allowed: Optional[Sequence[np.dtype]], what: str = "") -> None:
    """The dtype of an array of the backward: one of ``allowed`` (the device's rule; ``what`` says
    whose dtype they are), or (``allowed=None``: the reference) any float of 16 bits or more. fp8
    data (uint8 bytes or an 8-bit float) is refused either way, with a message that says so."""
    d = dtype_of(x)
    if d.itemsize == 1:
        raise TypeError(f"{name}: the backward takes no fp8 data (16-bit floats; the reference: any float of 16 bits "
                        f"or more), got {d.name}")
    if allowed is None and d.kind != "f" and d != BF16:
        raise TypeError(f"{name}: expected a floating-point dtype, got {d.name}")
    if allowed is not None and d not in allowed:
        raise TypeError(f"{name}: expected dtype {' or '.join(np.dtype(a).name for a in allowed)}{what}, got {d.name}")


def check_backward_rope(k_rope, dtype: np.dtype, device: bool) -> None:
    """The backward's ``k_rope``: a plain ``[Tk, 1, 64]`` array (its shape is checked with the
    forward's), 16-bit on the device."""
    if isinstance(k_rope, PagedKVCache):
        raise ValueError("k_rope: the backward takes a plain [Tk, 1, 64] array (its gradient is dk_rope [Tk, 1, 64]); "
                         "a PagedKVCache is not supported")
    check_array(k_rope, "k_rope", 3)
    _check_backward_dtype(k_rope, "k_rope", (dtype,) if device else None, " (the dtype of q)")


def check_backward_arrays(dout, out, lse, dq, dk, dv, dk_rope, dlse, *, tq: int, heads: int, tk: int, dtype: np.dtype,
                          device: bool) -> list:
    """The backward's own arrays (ranks, dtypes, shapes; ``dq``, ``dk``, ``dv``, ``dk_rope``, ``dlse``
    may be None): :func:`check_backward_inputs`' rules. Returns ``(name, array)`` of all but ``lse``
    (which the forward's checks place), for :func:`check_backward_layouts`."""
    rows, keys = f"with Tq = {tq} from q, H = {heads}", f"with Tk = {tk} from k, H = {heads}"
    same, or32 = ((dtype,), " (the dtype of q)"), ((dtype, FP32), " (the dtype of q, or float32)")
    arrays = [("dout", dout, (tq, heads, DV), same, f"[Tq, H, Dv] {rows}"),
              ("out", out, (tq, heads, DV), or32, f"[Tq, H, Dv], the forward's result, {rows}"),
              ("lse", lse, (tq, heads), None, f"[Tq, H], the forward's natural-log lse, {rows}"),
              ("dlse", dlse, (tq, heads), None, f"[Tq, H], the gradient of the forward's lse, {rows}"),
              ("dq", dq, (tq, heads, DQK), same, f"[Tq, H, Dqk] {rows}"),
              ("dk", dk, (tk, heads, DV), same, f"[Tk, H, Dv] {keys}"),
              ("dv", dv, (tk, heads, DV), same, f"[Tk, H, Dv] {keys}"),
              ("dk_rope", dk_rope, (tk, 1, DR), same, f"[Tk, 1, Dr] with Tk = {tk} from k")]
    for name, x, shape, allowed, what in arrays:
        if x is None and name not in ("dout", "out", "lse"):
            continue  # a result not given: the call allocates it
        if allowed is None:  # lse, dlse: float32 (the reference: also float64), as the forward's lse= buffer
            check_array(x, name, 2, (FP32,) if device else (FP32, np.dtype(np.float64)))
        else:
            check_array(x, name, 3)
            _check_backward_dtype(x, name, allowed[0] if device else None, allowed[1])
        check_shape(x, name, shape, what)
    return [(name, x) for name, x, *_ in arrays if name != "lse"]


def check_deterministic(deterministic) -> None:
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")


def check_backward_layouts(named: list, q, heads: int, api: Optional[str] = None) -> None:
    """Where the backward's own arrays live and their layout (``named``: from
    :func:`check_backward_arrays`), after the forward's arrays' (all on ``q``'s device)."""
    require_devices(named, api)
    for name, x in named:
        if x is not None and name != "dlse":
            check_layout(x, name)
    check_lse_layout(dict(named).get("dlse"), heads, "dlse")
    check_same_device([q] + [x for _, x in named])


def check_backward_inputs(
    dout, q, k, v, k_rope, out, lse, valid_length, cache_row_offsets, *, scale, mask, q_max_seq_len, cache_offsets,
    q_start_pos, dq: Any = None, dk: Any = None, dv: Any = None, dk_rope: Any = None, deterministic: Any = False,
    validate: bool, device: bool, read_offsets: bool, kernel: Optional[str] = None, api: Optional[str] = None,
    dlse: Any = None,
) -> Problem:
    """Check every argument of the backward (``mla_prefill_backward``: the GPU function with
    ``device=True``, its float64 reference with ``device=False``) before anything is computed.

    The forward's arguments are checked by :func:`check_inputs` (the same messages); the backward
    adds ``dout`` ``[Tq, H, 128]`` (q's dtype), ``out`` ``[Tq, H, 128]`` (q's dtype or float32, as the
    forward returned it), ``lse`` ``[Tq, H]`` float32 (a required argument here) and the optional
    results ``dq`` ``[Tq, H, 192]``, ``dk`` / ``dv`` ``[Tk, H, 128]``, ``dk_rope`` ``[Tk, 1, 64]``
    (each in q's dtype), ``deterministic`` (a bool) and the optional ``dlse`` ``[Tq, H]`` float32
    (heads contiguous, as ``lse``). The reference (``device=False``)
    takes any float dtype of 16 bits or more for the arrays and float32 or float64 for ``lse``.
    Refused on both: a :class:`PagedKVCache` ``k_rope`` (``ValueError``) and fp8 data in any array
    (``TypeError``). Order: q, k, v (ranks, shapes, dtypes), then the refusals, then ``dout``,
    ``out``, ``lse``, the results and ``deterministic``, then everything :func:`check_inputs` checks
    (k_rope's shape, the offsets, the scalars, the values read back), then, on the device, where
    the backward's own arrays live and their layout. Returns the :class:`Problem` of the forward's
    arguments."""
    if not device:  # before check_qkv: fp8 data gets the backward's message
        for name, x in (("q", q), ("k", k), ("v", v)):
            _check_backward_dtype(x, name, None)
    tq, heads, tk, dtype = check_qkv(q, k, v, device=device)
    check_backward_rope(k_rope, dtype, device)
    named = check_backward_arrays(dout, out, lse, dq, dk, dv, dk_rope, dlse, tq=tq, heads=heads, tk=tk, dtype=dtype,
                                  device=device)
    check_deterministic(deterministic)
    p = check_inputs(q, k, v, k_rope, valid_length, cache_row_offsets, scale=scale, mask=mask,
                     q_max_seq_len=q_max_seq_len, cache_offsets=cache_offsets, q_start_pos=q_start_pos, out=None,
                     out_dtype=None, validate=validate, device=device, read_offsets=read_offsets, lse=lse,
                     kernel=kernel, api=api)
    if device:
        check_backward_layouts(named, q, heads, api)
    return p

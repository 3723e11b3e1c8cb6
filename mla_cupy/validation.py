"""Argument checks for every entry point (SPEC "Errors"): each bad input raises ``ValueError`` or
``TypeError`` naming the argument, what was expected and what came, before anything is launched.

The same checks serve the device API (``device=True``: 16-bit inputs, stride and alignment rules
for vector loads) and the NumPy reference (``device=False``: any float dtype, any strides).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from ._arrays import BF16, FP16, FP32, device_pointer, to_host
from .masks import CausalMask, Mask
from .paged import PagedKVCache

DV = 128  #: value / per-head ("nope") key size
DR = 64  #: shared rope size
DQK = DV + DR  #: query / full key size

OFFSET_DTYPES = (np.dtype(np.int32), np.dtype(np.uint32))
QSTART_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
DEVICE_DTYPES = tuple(d for d in (BF16, FP16) if d is not None)
_MAX_I32 = 2**31 - 1
U8 = np.dtype(np.uint8)  #: float8_e4m3fn data travels as its bytes


def _dt(x: Any) -> np.dtype:
    return np.dtype(x.dtype)


def _dtname(d: Any) -> str:
    return np.dtype(d).name


def check_array(x: Any, name: str, ndim: int, dtypes: Optional[Sequence[np.dtype]] = None, *, device: bool) -> None:
    """Rank, dtype and (on the device) layout of one array argument."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
    if len(x.shape) != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {tuple(x.shape)} ({len(x.shape)}-D)")
    if dtypes is not None and _dt(x) not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(_dtname(d) for d in dtypes)}, got {_dtname(_dt(x))}")
    if device:
        check_layout(x, name)


def check_layout(x: Any, name: str) -> None:
    """Last dimension contiguous, other strides and the base address multiples of 16 bytes."""
    if math.prod(x.shape) == 0:
        return
    item = _dt(x).itemsize
    strides = tuple(int(s) for s in x.strides)
    if x.shape[-1] > 1 and strides[-1] != item:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride {item} bytes), got strides {strides} bytes")
    if len(x.shape) > 1 and any(s % 16 for s, n in zip(strides[:-1], x.shape[:-1]) if n > 1):
        raise ValueError(f"{name}: every stride but the last must be a multiple of 16 bytes, got strides {strides} bytes")
    if device_pointer(x) % 16:
        raise ValueError(f"{name}: the data must start at a 16-byte aligned address, got {device_pointer(x):#x}")


def check_shape(x: Any, name: str, expected: Tuple[Optional[int], ...], what: str) -> None:
    got = tuple(int(n) for n in x.shape)
    if len(got) != len(expected) or any(e is not None and e != g for e, g in zip(expected, got)):
        shown = ", ".join("*" if e is None else str(e) for e in expected)
        raise ValueError(f"{name}: expected shape [{shown}] ({what}), got {list(got)}")


def check_offsets_array(x: Any, name: str, length: int, dtypes: Sequence[np.dtype], *, device: bool) -> None:
    check_array(x, name, 1, dtypes, device=False)
    if x.shape[0] != length:
        raise ValueError(f"{name}: expected {length} entries, got {x.shape[0]}")
    if device and length > 1 and int(x.strides[0]) != _dt(x).itemsize:
        raise ValueError(f"{name}: expected a contiguous 1-D array, got stride {int(x.strides[0])} bytes")


def check_offsets_values(h: np.ndarray, name: str, last: int, exact_last: bool, what: str) -> None:
    """Offsets start at 0, never decrease, and end at (or before) ``last``."""
    if h[0] != 0:
        raise ValueError(f"{name}: expected offsets starting at 0, got {name}[0] = {h[0]}")
    d = np.diff(h)
    if (d < 0).any():
        i = int(np.argmax(d < 0))
        raise ValueError(f"{name}: offsets must be non-decreasing, got {name}[{i}] = {h[i]} > {name}[{i + 1}] = {h[i + 1]}")
    if exact_last and h[-1] != last:
        raise ValueError(f"{name}: the last offset must equal {what} = {last}, got {h[-1]}")
    if not exact_last and h[-1] > last:
        raise ValueError(f"{name}: the last offset must be <= {what} = {last}, got {h[-1]}")


@dataclass
class Problem:
    """What the checks established about one call."""

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
    fp8: bool = False  # the fp8 per-token variant (dtype is then that of the rope parts)
    rope8: bool = False  # an fp8 (e4m3) rope with per-key scales


def check_inputs(
    q, k, v, k_rope, valid_length, cache_row_offsets, *, scale, mask, q_max_seq_len, cache_offsets, q_start_pos,
    out, out_dtype, validate: bool, device: bool, read_offsets: bool, fp8: Optional[tuple] = None,
    k_rope_scales: Any = None,
) -> Problem:
    """Check every argument of ``mla_prefill`` (device) or of the reference (``device=False``).
    ``fp8 = (q_rope, q_scale, k_scales)``: the per-token fp8 variant (device only), where q, k, v are
    the e4m3 (uint8) nope parts; ``dtype`` is then that of the rope parts."""
    float_dtypes = DEVICE_DTYPES if device else None
    if fp8 is not None:
        tq, heads, tk, dtype = _check_fp8_qkv(q, k, v, *fp8)
    else:
        check_array(q, "q", 3, float_dtypes, device=device)
        tq, heads, dqk = (int(n) for n in q.shape)
        if dqk != DQK:
            raise ValueError(f"q: expected head size Dqk = {DQK} (Dv {DV} + Dr {DR}), got {dqk}")
        if heads < 1:
            raise ValueError(f"q: expected at least one head, got shape {list(q.shape)}")
        dtype = _dt(q)
        if not device and dtype.kind not in "fV":
            raise TypeError(f"q: expected a floating-point dtype, got {dtype.name}")

        for name, x in (("k", k), ("v", v)):
            check_array(x, name, 3, float_dtypes, device=device)
            if device and _dt(x) != dtype:
                raise TypeError(f"{name}: expected dtype {dtype.name} (the dtype of q), got {_dt(x).name}")
        tk = int(k.shape[0])
        check_shape(k, "k", (None, heads, DV), f"[Tk, H, Dv] with H = {heads} from q and Dv = {DV}")
        check_shape(v, "v", (tk, heads, DV), "the shape of k, [Tk, H, Dv]")

    paged = isinstance(k_rope, PagedKVCache)
    # fp8 rope (device, bfloat16 q): e4m3 bytes with one float32 scale per key and 64 values
    rope_dtypes = float_dtypes + ((U8,) if device and dtype == BF16 and fp8 is None else ()) if device else None
    if paged:
        blocks, lut = k_rope.blocks, k_rope.lookup_table
        check_array(blocks, "k_rope.blocks", 4, rope_dtypes, device=device)
        rope8 = device and _dt(blocks) == U8
        if device and _dt(blocks) not in (dtype, U8):
            raise TypeError(f"k_rope.blocks: expected dtype {dtype.name} (the dtype of q), got {_dt(blocks).name}")
        check_shape(blocks, "k_rope.blocks", (None, k_rope.page_size, 1, None),
                    f"[num_blocks, page_size, 1, Dc] with page_size = {k_rope.page_size}")
        if k_rope.rope_offset + DR > blocks.shape[3]:
            raise ValueError(f"k_rope.rope_offset: rope_offset + {DR} must be <= Dc = {blocks.shape[3]}, got {k_rope.rope_offset}")
        check_array(lut, "k_rope.lookup_table", 2, OFFSET_DTYPES, device=False)
        if device and lut.shape[1] > 1 and int(lut.strides[1]) != 4:
            raise ValueError(f"k_rope.lookup_table: the last dimension must be contiguous, got strides {tuple(lut.strides)}")
        if rope8:
            if k_rope.scales is None:
                raise ValueError("k_rope.scales: an fp8 (uint8) cache needs its float32 scales")
            check_array(k_rope.scales, "k_rope.scales", 4, (FP32,), device=False)
            check_shape(k_rope.scales, "k_rope.scales", (blocks.shape[0], k_rope.page_size, 1, blocks.shape[3] // 64),
                        "[num_blocks, page_size, 1, Dc / 64] float32")
        elif k_rope.scales is not None:
            raise ValueError(f"k_rope.scales: only an fp8 (uint8) cache has scales, these blocks are {_dt(blocks).name}")
    else:
        check_array(k_rope, "k_rope", 3, rope_dtypes, device=device)
        rope8 = device and _dt(k_rope) == U8
        if device and _dt(k_rope) not in (dtype, U8):
            raise TypeError(f"k_rope: expected dtype {dtype.name} (the dtype of q), got {_dt(k_rope).name}")
        check_shape(k_rope, "k_rope", (tk, 1, DR), f"[Tk, 1, Dr] with Tk = {tk} from k and Dr = {DR}")
        if rope8:
            if k_rope_scales is None:
                raise ValueError("k_rope_scales: an fp8 (uint8) k_rope needs its float32 scales [Tk, 1, 1]")
            check_array(k_rope_scales, "k_rope_scales", 3, (FP32,), device=False)
            check_shape(k_rope_scales, "k_rope_scales", (tk, 1, DR // 64), "[Tk, 1, Dr / 64] float32")
    if not rope8 and k_rope_scales is not None:
        raise ValueError("k_rope_scales: only an fp8 (uint8) k_rope has scales")

    check_array(valid_length, "valid_length", 1, OFFSET_DTYPES, device=False)
    nb1 = int(valid_length.shape[0])
    if nb1 < 1:
        raise ValueError("valid_length: expected B + 1 >= 1 offsets, got an empty array")
    batch = nb1 - 1
    check_offsets_array(valid_length, "valid_length", nb1, OFFSET_DTYPES, device=device)
    check_offsets_array(cache_row_offsets, "cache_row_offsets", nb1, OFFSET_DTYPES, device=device)
    if cache_offsets is not None:
        check_offsets_array(cache_offsets, "cache_offsets", batch, OFFSET_DTYPES, device=device)
    if q_start_pos is not None:
        check_offsets_array(q_start_pos, "q_start_pos", batch, QSTART_DTYPES, device=device)
    if paged and k_rope.lookup_table.shape[0] != batch:
        raise ValueError(f"k_rope.lookup_table: expected {batch} rows (B), got {k_rope.lookup_table.shape[0]}")

    if mask is None:
        mask = CausalMask()
    if not isinstance(mask, Mask):
        raise TypeError(f"mask: expected a mla_cupy mask (CausalMask(), NullMask(), ...), got {type(mask).__name__}")
    if scale is None:
        scale = 1.0 / np.sqrt(DQK)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)) or not np.isfinite(scale):
        raise TypeError(f"scale: expected a finite float, got {scale!r}")
    if scale <= 0:
        raise ValueError(f"scale: expected a positive float (the kernels find row maxima on unscaled scores), got {scale!r}")

    if out_dtype is None:
        out_dtype = _dt(out) if out is not None else (dtype if device else np.dtype(np.float64))
    out_dtype = np.dtype(out_dtype)
    if device and out_dtype not in (dtype, FP32):
        raise TypeError(f"out_dtype: expected {dtype.name} (the dtype of q) or float32, got {out_dtype.name}")
    if out is not None:
        check_array(out, "out", 3, (out_dtype,), device=device)
        check_shape(out, "out", (tq, heads, DV), "[Tq, H, Dv]")

    if q_max_seq_len is not None and (isinstance(q_max_seq_len, bool) or not isinstance(q_max_seq_len, (int, np.integer)) or q_max_seq_len < 0):
        raise ValueError(f"q_max_seq_len: expected a non-negative int, got {q_max_seq_len!r}")

    if device:
        _check_same_device((q, k, v, valid_length, cache_row_offsets, cache_offsets, q_start_pos, out,
                            k_rope.blocks if paged else k_rope, k_rope.lookup_table if paged else None)
                           + (tuple(fp8) if fp8 is not None else ()) + (k_rope_scales, k_rope.scales if paged else None))

    max_sq = None if q_max_seq_len is None else int(q_max_seq_len)
    if validate or read_offsets:
        vl = to_host(valid_length).astype(np.int64)
        cro = to_host(cache_row_offsets).astype(np.int64)
        if validate:
            check_offsets_values(vl, "valid_length", tq, True, "Tq (q.shape[0])")
            check_offsets_values(cro, "cache_row_offsets", tk, False, "Tk (k.shape[0])")
        sq = np.diff(vl)
        observed = int(sq.max()) if batch else 0
        if validate and max_sq is not None and observed > max_sq:
            raise ValueError(f"q_max_seq_len: a sequence has {observed} queries, more than q_max_seq_len = {max_sq}")
        if max_sq is None:
            max_sq = observed
        if validate:
            co = np.zeros(batch, np.int64) if cache_offsets is None else to_host(cache_offsets).astype(np.int64)
            if cache_offsets is not None and (co < 0).any():
                raise ValueError(f"cache_offsets: expected non-negative positions, got {co[co < 0][0]}")
            if paged:
                _check_paged(k_rope, co, np.diff(cro))
            if fp8 is not None and tq:
                # the kernel folds q_scale into each row's softmax scale (max of q_scale * x):
                # negative (or NaN) scales would break that; quantizers give amax / 448 or 1
                qs = to_host(fp8[1]).reshape(-1)
                if not (qs >= 0).all():
                    i = int(np.argmax(~(qs >= 0)))
                    raise ValueError(f"q_scale: expected non-negative scales, got q_scale[{i}] = {qs[i]}")
    if device and max_sq is not None:
        nmb = -(-max_sq // 128)
        if nmb * max(batch, 1) * heads > _MAX_I32:
            raise ValueError(f"q_max_seq_len: grid of {nmb} x {batch} x {heads} blocks exceeds 2^31 - 1")
    return Problem(batch, heads, tq, tk, dtype, out_dtype, mask, float(scale), max_sq, paged, fp8 is not None, rope8)


def _check_fp8_qkv(q_nope, k, v, q_rope, q_scale, k_scales) -> Tuple[int, int, int, np.dtype]:
    """The arrays of the fp8 per-token variant (SPEC "Data types"): e4m3 bytes of q_nope / k / v,
    bfloat16 q_rope, float32 scales. Returns (Tq, H, Tk, the rope dtype)."""
    check_array(q_nope, "q_nope", 3, (U8,), device=True)
    tq, heads = int(q_nope.shape[0]), int(q_nope.shape[1])
    check_shape(q_nope, "q_nope", (None, None, DV), f"[Tq, H, Dv] e4m3 bytes with Dv = {DV}")
    if heads < 1:
        raise ValueError(f"q_nope: expected at least one head, got shape {list(q_nope.shape)}")
    check_array(k, "k", 3, (U8,), device=True)
    tk = int(k.shape[0])
    check_shape(k, "k", (None, heads, DV), f"[Tk, H, Dv] e4m3 bytes with H = {heads} from q_nope")
    check_array(v, "v", 3, (U8,), device=True)
    check_shape(v, "v", (tk, heads, DV), "the shape of k, [Tk, H, Dv] e4m3 bytes")
    check_array(q_rope, "q_rope", 3, (BF16,), device=True)
    check_shape(q_rope, "q_rope", (tq, heads, DR), f"[Tq, H, Dr] with Dr = {DR}")
    check_array(q_scale, "q_scale", 2, (FP32,), device=False)  # read one value per row
    check_shape(q_scale, "q_scale", (tq, 1), "[Tq, 1] float32, one scale per query token")
    check_array(k_scales, "k_scales", 2, (FP32,), device=False)
    check_shape(k_scales, "k_scales", (tk, 1), "[Tk, 1] float32, one scale per key token")
    if tk > 1 and int(k_scales.strides[0]) != 4:
        raise ValueError(f"k_scales: expected contiguous scales (stride 4 bytes; they are copied by TMA), got strides "
                         f"{tuple(k_scales.strides)}")
    if tk and device_pointer(k_scales) % 16:
        raise ValueError(f"k_scales: the data must start at a 16-byte aligned address, got {device_pointer(k_scales):#x}")
    return tq, heads, tk, BF16


def check_lse_and_accumulate(p: Problem, out: Any, lse: Any, accumulate: Any) -> None:
    """The ``lse=`` buffer (float32 [Tq, H], heads contiguous) and ``accumulate`` (needs float32
    ``out`` and ``lse`` holding an earlier partial result)."""
    if not isinstance(accumulate, (bool, np.bool_)):
        raise TypeError(f"accumulate: expected a bool, got {type(accumulate).__name__}")
    if lse is not None:
        check_array(lse, "lse", 2, (FP32,), device=False)  # scalar stores: no 16-byte rule
        check_shape(lse, "lse", (p.tq, p.heads), "[Tq, H]")
        if p.heads > 1 and int(lse.strides[1]) != 4:
            raise ValueError(f"lse: the head dimension must be contiguous (stride 4 bytes), got strides {tuple(lse.strides)}")
    if accumulate:
        if out is None or lse is None:
            raise ValueError("accumulate: needs out= and lse= holding the partial result to merge into")
        if p.out_dtype != FP32:
            raise TypeError(f"accumulate: out must be float32 (partial results are merged in float32), got {p.out_dtype.name}")


def _check_paged(cache: PagedKVCache, co: np.ndarray, sk: np.ndarray) -> None:
    """Every page that a sequence's keys touch exists in the lookup table and names a real block."""
    lut = to_host(cache.lookup_table).astype(np.int64)
    num_blocks, max_pages = int(cache.blocks.shape[0]), int(lut.shape[1])
    for b in range(len(sk)):
        if sk[b] == 0:
            continue
        first, last = co[b] // cache.page_size, (co[b] + sk[b] - 1) // cache.page_size
        if last >= max_pages:
            raise ValueError(
                f"k_rope.lookup_table: sequence {b} needs pages up to {last} (cache_offsets + Sk = {co[b] + sk[b]} "
                f"keys at page_size {cache.page_size}), but the table has {max_pages} columns"
            )
        ids = lut[b, first:last + 1]
        bad = (ids < 0) | (ids >= num_blocks)
        if bad.any():
            p = int(first + np.argmax(bad))
            raise ValueError(
                f"k_rope.lookup_table: block id {lut[b, p]} at [{b}, {p}] is outside [0, {num_blocks}) (num_blocks)"
            )


def _check_same_device(arrays) -> None:
    ids = set()
    for a in arrays:
        dev = getattr(a, "device", None)
        if a is not None and dev is not None and hasattr(dev, "id"):
            ids.add(int(dev.id))
    if len(ids) > 1:
        raise ValueError(f"inputs live on different devices: {sorted(ids)}")

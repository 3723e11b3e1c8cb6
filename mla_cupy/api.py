"""The public one-shot entry points, ``mla_prefill``, ``mla_prefill_fp8`` and the backward
``mla_prefill_backward``: each a cached plan
of the launch services (:mod:`mla_cupy._plan_cache`), which check every argument, plan and launch
the call, or launch the plan of a call seen before."""
from __future__ import annotations

from typing import Any, Optional, Tuple, Union

from ._arrays import Array, Stream
from ._plan_cache import backward, prefill
from .fp8 import TransposedV, fp8_bytes
from .masks import Mask
from .paged import PagedKVCache

#: What a prefill returns: ``out``, or ``(out, lse)`` with ``return_lse=True``.
Result = Union[Array, Tuple[Array, Array]]

__all__ = ["mla_prefill", "mla_prefill_fp8", "mla_prefill_backward"]


def mla_prefill(
    q: Array, k: Array, v: Array, k_rope: Union[Array, PagedKVCache], valid_length: Array, cache_row_offsets: Array,
    *, scale: Optional[float] = None, mask: Optional[Mask] = None, q_max_seq_len: Optional[int] = None,
    cache_offsets: Optional[Array] = None, q_start_pos: Optional[Array] = None, out: Optional[Array] = None,
    out_dtype: Any = None, return_lse: bool = False, lse: Optional[Array] = None, accumulate: bool = False,
    stream: Stream = None, validate: bool = True, kernel: str = "auto", k_rope_scales: Optional[Array] = None,
) -> Result:
    """Multi-head Latent Attention prefill over a ragged batch (MAX's ``flare_mla_prefill``).

    Parameters
    ----------
    q : ``[Tq, H, 192]`` bfloat16 or float16 device array
        Queries of all sequences, packed. The last 64 values of each head are its rope part.
    k, v : ``[Tk, H, 128]``, same dtype
        Per-head ("nope") part of the keys, and the values, packed.
    k_rope : ``[Tk, 1, 64]`` array (any row stride, e.g. ``latent[:, :, 512:576]``) or :class:`PagedKVCache`
        The rotary part of the keys: one vector per key, shared by every head. Read once per key
        tile; the full ``[Tk, H, 192]`` keys are never built.
    valid_length : ``[B + 1]`` int32/uint32 device array
        Row offsets of each sequence in ``q`` (0, ..., Tq). Despite its name, offsets, as in MAX.
    cache_row_offsets : ``[B + 1]`` int32/uint32 device array
        Row offsets of each sequence's keys in ``k``/``v`` (and a plain ``k_rope``); last <= Tk.
    scale : float, optional
        Score scale; default ``1 / sqrt(192)``.
    mask : Mask, optional
        ``CausalMask()`` (default), ``NullMask()``, ``SlidingWindowCausalMask(w)``, ``ChunkedMask(c)``
        or ``ChunkedCausalMask(c)``, on absolute positions.
    q_max_seq_len : int, optional
        Upper bound on any sequence's query count. Sizes the grid without reading offsets back to
        the host; with ``validate=False`` the call then does no device-to-host copy (CUDA-graph
        capturable once its kernel is compiled). A bound below the true maximum leaves rows
        unwritten (checked when ``validate``).
    cache_offsets : ``[B]`` int32/uint32 device array, optional
        Absolute position of each sequence's first key (default 0).
    q_start_pos : ``[B]`` int32/int64 device array, optional
        Absolute position of each sequence's first query. Default ``cache_offsets + Sk - Sq``:
        queries aligned to the end of the keys (bottom-right causal).
    out : ``[Tq, H, 128]`` device array, optional
        Written in place (any 16-byte-aligned strides, last dim contiguous).
    out_dtype : dtype, optional
        ``q.dtype`` (default) or ``numpy.float32``.
    return_lse : bool
        Also return ``lse[Tq, H]`` float32: the NATURAL-log log-sum-exp of the scaled scores
        (``-inf`` for rows that see no key). Base e, not base 2 as in FlashInfer/TRT-LLM.
    lse : ``[Tq, H]`` float32 device array, optional
        Where to write the lse (heads contiguous); implies it is computed.
    accumulate : bool
        ``out`` (float32) and ``lse`` already hold a partial result of these queries over OTHER
        keys (an earlier chunk of the context): this call's result is merged into them in place,
        exactly as :func:`merge_states` would, inside the kernel's epilogue (no extra pass).
    stream : cupy / torch stream or raw ``cudaStream_t`` int, optional
        Default: CuPy's current stream, or torch's current stream for torch inputs.
    validate : bool
        Check offset values and paged block ids on the host (small device-to-host copies, one
        synchronization in all).
    kernel : {"auto", "sm80", "sm90"}
        ``"auto"`` runs the Hopper TMA + wgmma kernel on compute capability 9.0 (plain or paged
        k_rope) and the portable mma.sync kernel elsewhere; the others force one.
    k_rope_scales : ``[Tk, 1, 1]`` float32 device array, optional
        With an fp8 rope (MAX's ``k_rope_scales`` overload): ``k_rope`` holds float8_e4m3fn bytes
        (uint8) and key j's rope is ``k_rope[j] * k_rope_scales[j]``; q, k, v bfloat16, Hopper
        only. A paged fp8 cache carries its scales in :class:`PagedKVCache` ``scales``.

    Returns
    -------
    out : ``[Tq, H, 128]``, same kind of array as ``q`` (CuPy in, CuPy out; torch in, torch out)
    lse : ``[Tq, H]`` float32, only with ``return_lse=True``

    Notes
    -----
    A query row that sees no key gets output 0 and lse ``-inf`` (MAX would return the mean of V).
    Inputs are read in place; nothing is copied except an int32 ``q_start_pos`` (widened).

    Every argument is checked before anything runs, in argument order: shapes, dtypes and values
    first (also for NumPy data, so a CPU caller hears about the real problem), then that the arrays
    are on the device, then their layout. Valid host arrays on a machine without a GPU (or without
    CuPy) raise ``RuntimeError`` naming :func:`mla_cupy.reference.mla_prefill`, which takes these
    same arguments on the CPU. This is a one-shot wrapper of :func:`mla_cupy.plan`: to run many
    layers of one batch layout, build the plan once and call its ``run``.

    A call is kept in the plan cache (:func:`mla_cupy.plan_cache_info`): a later call with the same
    arrays' kinds, shapes, strides, dtypes and devices, the same offset arrays (pointers) and the
    same other arguments skips the checks that these prove and the packing, and launches as
    ``plan.run`` does; the offsets' values are still read per call without ``q_max_seq_len`` and
    checked per call with ``validate``.
    """

    return prefill(q, k, v, k_rope, valid_length, cache_row_offsets, scale=scale, mask=mask,
                   q_max_seq_len=q_max_seq_len, cache_offsets=cache_offsets, q_start_pos=q_start_pos, out=out,
                   out_dtype=out_dtype, return_lse=return_lse, lse=lse, accumulate=accumulate, stream=stream,
                   validate=validate, kernel=kernel, k_rope_scales=k_rope_scales)


def mla_prefill_fp8(
    q_nope: Array, q_rope: Array, q_scale: Array, k: Array, k_scales: Array, v: Union[Array, TransposedV],
    k_rope: Union[Array, PagedKVCache], valid_length: Array, cache_row_offsets: Array, *,
    scale: Optional[float] = None, mask: Optional[Mask] = None, q_max_seq_len: Optional[int] = None,
    cache_offsets: Optional[Array] = None, q_start_pos: Optional[Array] = None, out: Optional[Array] = None,
    out_dtype: Any = None, return_lse: bool = False, lse: Optional[Array] = None, accumulate: bool = False,
    stream: Stream = None, validate: bool = True, kernel: str = "auto", workspace: Optional[Array] = None,
) -> Result:
    """MLA prefill with fp8 per-token inputs (MAX's ``q_nope, q_rope, q_scale, k, k_scales``
    overload), on the Hopper kernel: Q K^T of the nope part and P V on the e4m3 tensor cores.

    Parameters
    ----------
    q_nope : ``[Tq, H, 128]`` float8_e4m3fn as uint8 (a torch float8_e4m3fn tensor is viewed as uint8)
    q_rope : ``[Tq, H, 64]`` bfloat16, or e4m3 bytes (uint8 / torch float8_e4m3fn: the all-e4m3 mode)
    q_scale : ``[Tq, 1]`` float32, non-negative (checked with ``validate=True``)
        The true query is ``q_scale[i] * concat(q_nope[i], q_rope[i])``. The kernel folds
        ``q_scale[i]`` into row i's softmax scale, which needs it non-negative (the quantizers give
        ``amax / 448``, or 1 for an all-zero row).
    k : ``[Tk, H, 128]`` float8_e4m3fn as uint8
        The nope keys.
    v : ``[Tk, H, 128]`` float8_e4m3fn as uint8, or :class:`mla_cupy.fp8.TransposedV`
        The values (used as stored, no scale). Or V^T made ahead for this call's
        ``cache_row_offsets`` (``quant.quantize_per_token(..., cache_row_offsets=cro)["v_t"]``):
        the call then launches the attention kernel alone, no V^T pre-pass (see Notes).
    k_scales : ``[Tk, 1]`` float32, contiguous
        The true key is ``k_scales[j] * concat(k[j], rope_j)``.
    k_rope : ``[Tk, 1, 64]`` bfloat16 array or bfloat16 :class:`PagedKVCache`
        The shared rope, stored divided by ``k_scales`` as MAX's per-token cache holds it. With an
        e4m3 ``q_rope`` (all-e4m3 mode): ``[Tk, 1, 64]`` e4m3 bytes, quantized under ``k_scales``
        (``quant.quantize_per_token(..., e4m3_rope=True)``), and Q K^T is one 192-deep e4m3 GEMM; a
        PagedKVCache is refused in this mode (``ValueError`` naming ``k_rope``).
    valid_length, cache_row_offsets, and the keywords
        As in :func:`mla_prefill` (``scale`` defaults to ``1 / sqrt(192)``; ``kernel`` must be
        ``"auto"`` or ``"sm90"``).
    workspace : uint8 device array, optional
        Where V^T is written: contiguous, at least ``prod(mla_cupy.fp8.vt_shape(H, Tk, B))``
        bytes. Default: a workspace from CuPy's pool for the call. Refused with a TransposedV.

    Returns
    -------
    out : ``[Tq, H, 128]`` bfloat16 (or ``out_dtype`` float32), and ``lse`` with ``return_lse=True``.

    Notes
    -----
    P (times 256) is rounded to e4m3 for P V (as in FlashAttention-3's fp8 path): to nearest in the
    key tiles on a mask's edge; under the causal mask and no mask, in the key tiles that a 64-row
    group of queries sees whole, its byte is made from the exponent, with a mantissa linear between
    powers of 2 (``docs/contract.md``, Accuracy). The row sums are those of the e4m3 P under the
    causal mask and no mask, of the float32 P under the others.
    :func:`mla_cupy.quant.quantize_per_token` produces these inputs from bf16 ones (on the host for
    NumPy data, on the device for CuPy data).

    Each call writes V transposed (:func:`mla_cupy.fp8.transpose_v`, the layout the e4m3 tensor
    cores read) into a workspace of about V's size: ``workspace=``, or one taken from CuPy's memory
    pool on the call's stream and returned to it when the call returns; the transpose is part of the
    call's time. A plan (``mla_cupy.plan(..., fp8=True)``) keeps its workspace across runs.
    Given V^T instead (``v`` a :class:`~mla_cupy.fp8.TransposedV`, which the device quantizer
    writes as it casts V), the call launches the attention kernel alone and reads that V^T. It is
    checked before any launch: its data a contiguous, 16-byte aligned uint8 device array of shape
    ``vt_shape(H, Tk, B)``; its H, Tk and B the call's; its ``cache_row_offsets`` the call's (the
    same array, or one of the same length at the same device address; else, with
    ``validate=True``, equal values, read back; without, a ``ValueError`` naming ``v``).
    Key tiles start on multiples of 16 keys of a sequence, so a NaN in the v of a key also reaches
    query blocks whose visible keys start up to 15 keys after it (never another sequence).
    """
    return prefill(fp8_bytes(q_nope, "q_nope"), fp8_bytes(k, "k"), fp8_bytes(v, "v"), fp8_bytes(k_rope, "k_rope"),
                   valid_length, cache_row_offsets, scale=scale, mask=mask, q_max_seq_len=q_max_seq_len,
                   cache_offsets=cache_offsets, q_start_pos=q_start_pos, out=out, out_dtype=out_dtype,
                   return_lse=return_lse, lse=lse, accumulate=accumulate, stream=stream, validate=validate,
                   kernel=kernel, fp8=(fp8_bytes(q_rope, "q_rope"), q_scale, k_scales), workspace=workspace)


#: What the backward returns: the gradients ``(dq, dk, dv, dk_rope)``.
Gradients = Tuple[Array, Array, Array, Array]


def mla_prefill_backward(
    dout: Array, q: Array, k: Array, v: Array, k_rope: Array, out: Array, lse: Array, valid_length: Array,
    cache_row_offsets: Array, *, scale: Optional[float] = None, mask: Optional[Mask] = None,
    q_max_seq_len: Optional[int] = None, cache_offsets: Optional[Array] = None, q_start_pos: Optional[Array] = None,
    dq: Optional[Array] = None, dk: Optional[Array] = None, dv: Optional[Array] = None,
    dk_rope: Optional[Array] = None, deterministic: bool = False, stream: Stream = None, validate: bool = True,
    kernel: str = "auto", dlse: Optional[Array] = None,
) -> Gradients:
    """Gradients of :func:`mla_prefill` with respect to q, k, v and the shared rope.

    Parameters
    ----------
    dout : ``[Tq, H, 128]``, q's dtype
        The gradient of the loss with respect to the forward's ``out``.
    q, k, v, k_rope, valid_length, cache_row_offsets
        The forward's inputs (``k_rope`` a plain ``[Tk, 1, 64]`` array: a paged cache is refused).
    out, lse
        The forward's results: ``out`` ``[Tq, H, 128]`` (q's dtype or float32) and its natural-log
        ``lse`` ``[Tq, H]`` float32 (``mla_prefill(..., return_lse=True)``).
    scale, mask, q_max_seq_len, cache_offsets, q_start_pos, stream, validate, kernel
        As in :func:`mla_prefill`.
    dq, dk, dv, dk_rope : device arrays, optional
        Where to write the gradients (``[Tq, H, 192]``, ``[Tk, H, 128]`` twice, ``[Tk, 1, 64]``, q's
        dtype); new ones of the kind of ``q`` where not given.
    deterministic : bool
        dq summed over key blocks in a fixed order: the same bits on every run (slower).
    dlse : ``[Tq, H]`` float32 device array, optional
        The gradient of the loss with respect to the forward's ``lse``, when the loss reads it
        (``d lse_i / d S_ij = P_ij``: it enters as ``dS = P (dP - D + dlse)``).

    Returns
    -------
    dq, dk, dv, dk_rope
        ``dk_rope`` is the sum over heads of the rope part of each key's gradient.

    Notes
    -----
    Every argument is checked before anything runs, as :func:`mla_prefill` checks its own, and the
    call is kept in the plan cache the same way. A call reads the key offsets back (one
    synchronization) to span the longest sequence's key blocks, unless ``q_max_seq_len`` is given
    and ``validate=False``: then nothing is read back (Tk's key blocks bound the grid), and the
    call can be captured in a CUDA graph, as :func:`mla_prefill` can. The float32 workspace
    (about 780 bytes per query row and head) comes from CuPy's pool for the call. To run many
    layers of one batch layout, :meth:`PrefillPlan.run_backward <mla_cupy.PrefillPlan.run_backward>`
    reads nothing back and keeps its workspace.
    """
    return backward(dout, q, k, v, k_rope, out, lse, valid_length, cache_row_offsets, scale=scale, mask=mask,
                    q_max_seq_len=q_max_seq_len, cache_offsets=cache_offsets, q_start_pos=q_start_pos, dq=dq, dk=dk,
                    dv=dv, dk_rope=dk_rope, dlse=dlse, deterministic=deterministic, stream=stream, validate=validate,
                    kernel=kernel)

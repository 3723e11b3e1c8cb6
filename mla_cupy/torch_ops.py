"""``torch.library`` custom ops over the kernels, for ``torch.compile`` and CUDA graphs.

Importing this module registers, in the namespace ``mla_cupy``:

============================  ==========================================================================
``mla_prefill``               functional: returns ``(out, lse)`` (new tensors)
``mla_prefill_out``           writes ``out`` (and ``lse``) in place; ``accumulate=True`` merges into them
``mla_prefill_fp8``           functional, fp8 per-token inputs (:func:`mla_cupy.mla_prefill_fp8`)
``mla_prefill_fp8_out``       in place, fp8 per-token inputs
``merge_states``              functional :func:`mla_cupy.merge_states`
``merge_states_``             folds ``(out_b, lse_b)`` into ``(out_a, lse_a)`` in place
============================  ==========================================================================

Each has a fake (meta) implementation, so ``torch.compile(..., fullgraph=True)`` traces through
it, and declares the tensors it writes (``mutates_args``), so functionalization and CUDA graphs
see them. The schemas take what the Python API takes: the mask as ``mask_kind`` (its index in
:data:`mla_cupy.masks.MASK_KINDS`, also reached as ``MASK_KINDS`` here) and ``mask_arg`` (window
or chunk size), positions as optional tensors, a paged cache as its tensors (``k_rope`` holds the
blocks, ``lookup_table``, ``page_size``, ``rope_offset``, the fp8 scales in ``k_rope_scales``),
``out_dtype``, ``q_max_seq_len``, ``scale``, ``validate`` and ``kernel_choice`` (the API's
``kernel``: inductor's fallback lowering reserves the name ``kernel``). The fp8 ops take V^T made
ahead (a :class:`~mla_cupy.fp8.TransposedV`) as its tensors: ``v`` holds its data and
``vt_offsets`` the offsets it was laid out for (``vt_offsets`` given: ``v`` is V^T, and the op
launches no pre-pass). The functions of this
module (:func:`mla_prefill`, :func:`mla_prefill_fp8`, :func:`merge_states`, :func:`merge_states_`)
take the Python API's arguments (mask objects, :class:`~mla_cupy.PagedKVCache`) and call the ops.
In plain eager execution on CUDA tensors (:func:`eager_cuda`: nothing traces, compiles or
intercepts the call) the prefill functions run the ops' CUDA implementation directly, skipping
the dispatcher's cost (tens of microseconds a call) with the same arguments, results, errors and
streams; whenever anything else would see the op, they call it.

On CUDA tensors the ops run the kernels on torch's current stream; every device buffer they need
(outputs, the fp8 V^T workspace, a paged rope's key rows, a widened ``q_start_pos``) comes from
torch's caching allocator, so a call captured in a ``torch.cuda.CUDAGraph`` owns its memory like any torch op. A
call seen before launches from the plan cache (:func:`mla_cupy.plan_cache_info`) on the tensors
themselves, without CuPy views.
Capture needs ``q_max_seq_len`` and ``validate=False`` (no device-to-host copy) and a first,
eager call per shape (it compiles the kernel). On CPU tensors they run the float64 reference
(:mod:`mla_cupy.reference`), slowly: for tests, and for code that runs without a GPU.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Optional, Tuple, Union

import numpy as np

from ._optional import require

torch = require("torch", "mla_cupy.torch_ops")

from . import _plan_cache, _select, reference  # noqa: E402
from ._arrays import checkable, cupy_stream, is_device
from .fp8 import TransposedV, check_transposed_v_offsets, untranspose_v_host
from .masks import MASK_KINDS, CausalMask, Mask
from .paged import PagedKVCache
from .dims import DV

__all__ = ["MASK_KINDS", "mask_args", "mask_from_args", "eager_cuda", "mla_prefill", "mla_prefill_fp8",
           "mla_prefill_backward", "merge_states", "merge_states_"]

Tensor = torch.Tensor


def mask_args(mask: Optional[Mask]) -> Tuple[int, int]:
    """``(mask_kind, mask_arg)`` of a mask object (``None`` is the default ``CausalMask()``)."""
    mask = CausalMask() if mask is None else mask
    for kind, cls in enumerate(MASK_KINDS):
        if type(mask) is cls:
            return kind, mask.arg
    raise TypeError(f"mask: expected one of {', '.join(c.__name__ for c in MASK_KINDS)}, got {type(mask).__name__}")


@functools.lru_cache(maxsize=64)
def mask_from_args(mask_kind: int, mask_arg: int) -> Mask:
    """The mask object of an op's ``(mask_kind, mask_arg)`` (masks are immutable: one object per
    pair)."""
    if not 0 <= mask_kind < len(MASK_KINDS):
        raise ValueError(f"mask_kind: expected 0..{len(MASK_KINDS) - 1} (mla_cupy.torch_ops.MASK_KINDS), got {mask_kind}")
    return MASK_KINDS[mask_kind].from_arg(mask_arg)


# ---------------------------------------------------------------------------------------------
# Schemas (shared pieces: the ops differ in their leading tensors and in what they return)

_BF16_IN = "Tensor q, Tensor k, Tensor v, Tensor k_rope, Tensor valid_length, Tensor cache_row_offsets"
_FP8_IN = ("Tensor q_nope, Tensor q_rope, Tensor q_scale, Tensor k, Tensor k_scales, Tensor v, Tensor k_rope, "
           "Tensor valid_length, Tensor cache_row_offsets")
_OUT_IN = "Tensor(a!) out, Tensor(b!)? lse"
_OPTIONAL = "Tensor? cache_offsets=None, Tensor? q_start_pos=None, Tensor? lookup_table=None"
_SCALES = ", Tensor? k_rope_scales=None"  # an fp8 rope's scales (bf16 inputs only)
_VT = ", Tensor? vt_offsets=None"  # fp8 ops: v is V^T laid out for these offsets (a TransposedV's tensors)
#: (schema type, name, default) of the keyword arguments every prefill op takes
_KEYWORD_ARGS = (("float?", "scale", None), ("int", "mask_kind", 1), ("int", "mask_arg", 0),
                 ("SymInt?", "q_max_seq_len", None), ("int", "page_size", 0), ("int", "rope_offset", 512),
                 ("bool", "validate", True), ("str", "kernel_choice", "auto"))
_KEYWORD_DEFAULTS = {name: default for _, name, default in _KEYWORD_ARGS}
_KEYWORDS = ", ".join(f"{t} {name}={default!r}".replace("'", '"') for t, name, default in _KEYWORD_ARGS)


def _schema(inputs: str, optional: str, out: bool) -> str:
    if out:
        return f"({inputs}, {_OUT_IN}, {optional}, *, bool accumulate=False, {_KEYWORDS}) -> ()"
    return f"({inputs}, {optional}, *, ScalarType? out_dtype=None, {_KEYWORDS}) -> (Tensor, Tensor)"


# ---------------------------------------------------------------------------------------------
# CUDA: the kernels on torch's stream, with torch's allocator


def _torch_malloc(nbytes: int):
    """A CuPy allocator drawing from torch's caching allocator (graph-capture aware)."""
    import cupy

    buf = torch.empty((max(int(nbytes), 1),), dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
    return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(buf.data_ptr(), int(nbytes), buf), 0)


@contextlib.contextmanager
def _torch_context(device: torch.device):
    """CuPy on ``device``, on torch's current stream and allocating through torch."""
    import cupy

    with torch.cuda.device(device), cupy.cuda.Device(device.index if device.index is not None else torch.cuda.current_device()):
        stream = cupy_stream(torch.cuda.current_stream().cuda_stream)
        with stream, cupy.cuda.using_allocator(_torch_malloc):
            yield


def _cupy(x: Optional[Tensor]):
    """A zero-copy CuPy view of a CUDA tensor (float8 as its bytes). The DLPack export asks for
    no stream synchronization: producer and consumer are both torch's current stream (which may
    be capturing a graph)."""
    if x is None:
        return None
    import cupy

    x = x.detach()
    if x.dtype == torch.float8_e4m3fn:
        x = x.view(torch.uint8)
    return cupy.from_dlpack(x.__dlpack__(stream=-1))


def _rope_source(k_rope: Tensor, lookup_table: Optional[Tensor], page_size: int, rope_offset: int,
                 k_rope_scales: Optional[Tensor]):
    """``(k_rope or PagedKVCache, k_rope_scales of a plain rope)``."""
    if lookup_table is None:
        return k_rope, k_rope_scales
    return PagedKVCache(k_rope, lookup_table, int(page_size), int(rope_offset), k_rope_scales), None


def _api_kwargs(cache_offsets, q_start_pos, scale, mask_kind, mask_arg, q_max_seq_len, validate) -> dict:
    """The Python API's keywords from an op's arguments."""
    return dict(scale=scale, mask=mask_from_args(mask_kind, mask_arg),
                q_max_seq_len=None if q_max_seq_len is None else int(q_max_seq_len), cache_offsets=cache_offsets,
                q_start_pos=q_start_pos, validate=validate)


def _prefill_cuda(fp8: bool, inputs: tuple, out: Tensor, lse: Optional[Tensor], cache_offsets, q_start_pos,
                  lookup_table, last_optional, accumulate: bool, **kw) -> None:
    """The CUDA kernel of the prefill ops: the plan cache first (on the torch tensors, when the
    current device is ``out``'s), else the checked call on CuPy views, in :func:`_torch_context`.
    ``last_optional``: the 16-bit ops' ``k_rope_scales``, the fp8 ops' ``vt_offsets``."""
    *head, k_rope, vl, cro = inputs
    k_rope_scales = None if fp8 else last_optional
    if fp8 and last_optional is not None:  # v is V^T
        head[5] = TransposedV(head[5], last_optional, int(head[3].shape[0]))
    rope, plain_scales = _rope_source(k_rope, lookup_table, kw.pop("page_size"), kw.pop("rope_offset"), k_rope_scales)
    if q_start_pos is not None and q_start_pos.dtype == torch.int32:
        q_start_pos = q_start_pos.to(torch.int64)  # the kernels read int64 positions
    kernel = kw.pop("kernel_choice")
    args = _api_kwargs(cache_offsets, q_start_pos, **kw)
    call = dict(out=out, lse=lse, accumulate=accumulate, kernel=kernel, out_dtype=None, return_lse=False, stream=None,
                **args)
    if fp8:  # q_nope, q_rope, q_scale, k, k_scales, v
        arrays, extra = (head[0], head[3], head[5], rope, vl, cro), (head[1], head[2], head[4])
    else:
        arrays, extra = (*head, rope, vl, cro), plain_scales
    key = None
    if out.get_device() == _select.device_id():
        served, key = _plan_cache.from_cache(*arrays, **call, **_variant(fp8, extra),
                                             new_workspace=_torch_workspace(out.device))
        if served:
            return
    with _torch_context(out.device):
        q, k, v, rope, vl, cro = arrays
        views = dict(call, out=_cupy(out), lse=_cupy(lse), cache_offsets=_cupy(args["cache_offsets"]),
                     q_start_pos=_cupy(args["q_start_pos"]))
        extra = tuple(_cupy(x) for x in extra) if fp8 else _cupy(extra)
        v = v.with_data(_cupy(v.data)) if isinstance(v, TransposedV) else _cupy(v)
        _plan_cache.checked_call(_cupy(q), _cupy(k), v, _cupy_rope(rope), _cupy(vl), _cupy(cro), **views,
                                 **_variant(fp8, extra), key=key)


def _variant(fp8: bool, extra) -> dict:
    """The keywords of the fp8 per-token call (``fp8=(q_rope, q_scale, k_scales)``) or of the
    16-bit one (``k_rope_scales``)."""
    return dict(fp8=extra) if fp8 else dict(k_rope_scales=extra)


def _cupy_rope(rope):
    """A rope tensor, or a PagedKVCache of tensors, as CuPy views."""
    if isinstance(rope, PagedKVCache):
        return PagedKVCache(_cupy(rope.blocks), _cupy(rope.lookup_table), rope.page_size, rope.rope_offset,
                            _cupy(rope.scales))
    return _cupy(rope)


def _torch_workspace(device: torch.device):
    """The fp8 variant's per-call V^T workspace and a paged rope's per-call key rows, from torch's
    allocator (on its current stream)."""
    def new(shape, stream_ptr: int) -> Tensor:
        return torch.empty((max(math.prod(shape), 1),), dtype=torch.uint8, device=device)
    return new


# ---------------------------------------------------------------------------------------------
# CPU: the float64 reference


def _np(x: Optional[Tensor]) -> Optional[np.ndarray]:
    """A CPU tensor as a NumPy view of its memory (bfloat16 and float8 through ml_dtypes), so the
    reference reads the inputs as they are and writes the results in place."""
    return None if x is None else checkable(x, "tensor")


def _prefill_cpu(fp8: bool, inputs: tuple, out: Tensor, lse: Optional[Tensor], cache_offsets, q_start_pos,
                 lookup_table, last_optional, accumulate: bool, **kw) -> None:
    *head, k_rope, vl, cro = (_np(x) for x in inputs)
    k_rope_scales = None if fp8 else last_optional
    if fp8 and last_optional is not None:  # v is V^T: the reference reads v, its keys given back
        tv = TransposedV(head[5], _np(last_optional), int(head[3].shape[0]))
        check_transposed_v_offsets(tv, len(cro) - 1, cro, True)
        head[5] = untranspose_v_host(tv.data, cro, tv.num_keys)
    ps, ro = kw.pop("page_size"), kw.pop("rope_offset")
    kw.pop("kernel_choice")  # one reference for every kernel
    args = _api_kwargs(_np(cache_offsets), _np(q_start_pos), **kw)
    rope, plain_scales = _rope_source(k_rope, _np(lookup_table), ps, ro, _np(k_rope_scales))
    if accumulate and (lse is None or out.dtype != torch.float32):
        raise ValueError("accumulate: needs a float32 out and an lse holding the partial result to merge into")
    call = dict(out=_np(out), lse=_np(lse), accumulate=accumulate, **args)
    if fp8:
        reference.mla_prefill_fp8(*head, rope, vl, cro, **call)
    else:
        reference.mla_prefill(*head, rope, vl, cro, k_rope_scales=plain_scales, **call)


# ---------------------------------------------------------------------------------------------
# The prefill ops


def _outputs(like: Tensor, tq, heads, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    return like.new_empty((tq, heads, DV), dtype=dtype), like.new_empty((tq, heads), dtype=torch.float32)


def _define_prefill(name: str, inputs: str, fp8: bool) -> None:
    """``name`` (functional) and ``name + '_out'`` (in place). Their leading tensors are
    ``inputs``; the query count and heads come from the first, the default output dtype from
    ``q`` (bf16) or ``q_rope`` (fp8; bfloat16 for an e4m3 one). The fp8 per-token ops take no
    ``k_rope_scales``, and ``vt_offsets`` in its place."""
    n_in = inputs.count("Tensor ")
    like_index = 1 if fp8 else 0
    optional = _OPTIONAL + (_VT if fp8 else _SCALES)

    def make_out(run):
        def out_impl(*args, accumulate=False, **kw):
            kw = {**_KEYWORD_DEFAULTS, **kw}  # the dispatcher leaves out keywords at their defaults
            inputs, (out, lse, *opt) = args[:n_in], args[n_in:]
            cache_offsets, q_start_pos, lookup_table, last_optional = opt + [None] * (4 - len(opt))
            run(fp8, inputs, out, lse, cache_offsets, q_start_pos, lookup_table, last_optional, accumulate, **kw)
        return out_impl

    def make_functional(run):
        write = make_out(run)

        def impl(*args, out_dtype=None, **kw):
            out, lse = _fake(*args, out_dtype=out_dtype)
            write(*args[:n_in], out, lse, *args[n_in:], **kw)
            return out, lse
        return impl

    def _fake(*args, out_dtype=None, **kw):
        q = args[0]
        return _outputs(q, q.shape[0], q.shape[1], out_dtype or _result_dtype(args[like_index].dtype))

    functional = torch.library.custom_op(f"mla_cupy::{name}", make_functional(_prefill_cuda), mutates_args=(),
                                         device_types="cuda", schema=_schema(inputs, optional, False))
    functional.register_kernel("cpu")(make_functional(_prefill_cpu))
    functional.register_fake(_fake)
    in_place = torch.library.custom_op(f"mla_cupy::{name}_out", make_out(_prefill_cuda), mutates_args=("out", "lse"),
                                       device_types="cuda", schema=_schema(inputs, optional, True))
    in_place.register_kernel("cpu")(make_out(_prefill_cpu))
    in_place.register_fake(lambda *args, **kw: None)


_define_prefill("mla_prefill", _BF16_IN, fp8=False)
_define_prefill("mla_prefill_fp8", _FP8_IN, fp8=True)


# ---------------------------------------------------------------------------------------------
# The backward: its op, and the autograd formula of the functional 16-bit prefill op

_BWD_SCHEMA = ("(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor k_rope, Tensor out, Tensor lse, "
               "Tensor valid_length, Tensor cache_row_offsets, Tensor? cache_offsets=None, Tensor? q_start_pos=None, "
               "Tensor? dlse=None, *, float? scale=None, int mask_kind=1, int mask_arg=0, SymInt? q_max_seq_len=None, "
               "bool validate=True, bool deterministic=False, str kernel_choice=\"auto\") "
               "-> (Tensor, Tensor, Tensor, Tensor)")


def _gradients_like(q: Tensor, k: Tensor, k_rope: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """New ``(dq, dk, dv, dk_rope)``: q's and k's shapes, ``[Tk, 1, 64]``, q's dtype."""
    return (q.new_empty(q.shape), k.new_empty(k.shape), k.new_empty(k.shape),
            k_rope.new_empty((k_rope.shape[0], 1, k_rope.shape[-1]), dtype=q.dtype))


@torch.library.custom_op("mla_cupy::mla_prefill_backward", mutates_args=(), device_types=("cuda", "cpu"),
                         schema=_BWD_SCHEMA)
def _backward_op(dout, q, k, v, k_rope, out, lse, valid_length, cache_row_offsets, cache_offsets=None,
                 q_start_pos=None, dlse=None, *, scale=None, mask_kind=1, mask_arg=0, q_max_seq_len=None,
                 validate=True, deterministic=False, kernel_choice="auto"):
    if q.is_cuda:
        return _backward_cuda(dout, q, k, v, k_rope, out, lse, valid_length, cache_row_offsets, cache_offsets,
                              q_start_pos, dlse, (None,) * 4, scale=scale, mask_kind=mask_kind, mask_arg=mask_arg,
                              q_max_seq_len=q_max_seq_len, validate=validate, deterministic=deterministic,
                              kernel_choice=kernel_choice)
    grads = _gradients_like(q, k, k_rope)
    kw = dict(scale=scale, mask=mask_from_args(mask_kind, mask_arg),
              q_max_seq_len=None if q_max_seq_len is None else int(q_max_seq_len), validate=validate,
              deterministic=deterministic, kernel=kernel_choice)
    n = [_np(x) for x in (dout, q, k, v, k_rope, out, lse, valid_length, cache_row_offsets)]
    reference.mla_prefill_backward(*n, cache_offsets=_np(cache_offsets), q_start_pos=_np(q_start_pos),
                                   dq=_np(grads[0]), dk=_np(grads[1]), dv=_np(grads[2]), dk_rope=_np(grads[3]),
                                   dlse=_np(dlse), **kw)
    return grads


def _backward_cuda(dout, q, k, v, k_rope, out, lse, valid_length, cache_row_offsets, cache_offsets, q_start_pos,
                   dlse, given: tuple, *, scale, mask_kind, mask_arg, q_max_seq_len, validate, deterministic,
                   kernel_choice) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The CUDA kernels of the backward op, on torch's stream: ``(dq, dk, dv, dk_rope)``, the
    tensors of ``given`` (None: new ones) written."""
    grads = tuple(n if g is None else g for g, n in zip(given, _gradients_like(q, k, k_rope)))
    with _torch_context(q.device):
        c = [_cupy(x) for x in (dout, q, k, v, k_rope, out, lse, valid_length, cache_row_offsets)]
        _plan_cache.backward(*c, cache_offsets=_cupy(cache_offsets), q_start_pos=_cupy(q_start_pos),
                             dq=_cupy(grads[0]), dk=_cupy(grads[1]), dv=_cupy(grads[2]), dk_rope=_cupy(grads[3]),
                             dlse=_cupy(dlse), stream=None, scale=scale, mask=mask_from_args(mask_kind, mask_arg),
                             q_max_seq_len=None if q_max_seq_len is None else int(q_max_seq_len), validate=validate,
                             deterministic=deterministic, kernel=kernel_choice)
    _written(*(g for g in given if g is not None))
    return grads


@_backward_op.register_fake
def _(dout, q, k, v, k_rope, *args, **kw):
    return _gradients_like(q, k, k_rope)


def _prefill_setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v, k_rope, valid_length, cache_row_offsets, cache_offsets, q_start_pos, lookup_table, k_rope_scales = inputs
    out, lse = output
    ctx.unsupported = ("k_rope: the backward takes a plain 16-bit rope, not a paged cache" if lookup_table is not None
                       else "k_rope_scales: the backward takes a 16-bit rope, not an fp8 one"
                       if k_rope_scales is not None else None)
    ctx.kw = {name: keyword_only_inputs.get(name, _KEYWORD_DEFAULTS[name])
              for name in ("scale", "mask_kind", "mask_arg", "q_max_seq_len", "validate", "kernel_choice")}
    ctx.save_for_backward(q, k, v, k_rope, valid_length, cache_row_offsets, cache_offsets, q_start_pos, out, lse)


def _prefill_backward(ctx, grad_out, grad_lse):
    if ctx.unsupported is not None:
        raise ValueError(ctx.unsupported)
    q, k, v, k_rope, valid_length, cache_row_offsets, cache_offsets, q_start_pos, out, lse = ctx.saved_tensors
    dout = torch.zeros_like(out, dtype=q.dtype) if grad_out is None else grad_out.to(q.dtype).contiguous()
    dlse = None if grad_lse is None else grad_lse.to(torch.float32).contiguous()
    dq, dk, dv, dk_rope = torch.ops.mla_cupy.mla_prefill_backward(
        dout, q, k, v, k_rope, out, lse, valid_length, cache_row_offsets, cache_offsets, q_start_pos, dlse,
        deterministic=torch.are_deterministic_algorithms_enabled(), **ctx.kw)
    return dq, dk, dv, dk_rope, None, None, None, None, None, None


torch.library.register_autograd("mla_cupy::mla_prefill", _prefill_backward, setup_context=_prefill_setup_context)


def mla_prefill_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, k_rope: Tensor, out: Tensor, lse: Tensor,
                         valid_length: Tensor, cache_row_offsets: Tensor, *, scale: Optional[float] = None,
                         mask: Optional[Mask] = None, q_max_seq_len: Optional[int] = None,
                         cache_offsets: Optional[Tensor] = None, q_start_pos: Optional[Tensor] = None,
                         dlse: Optional[Tensor] = None, validate: bool = True, deterministic: bool = False,
                         kernel: str = "auto", dq: Optional[Tensor] = None, dk: Optional[Tensor] = None,
                         dv: Optional[Tensor] = None,
                         dk_rope: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`mla_cupy.mla_prefill_backward` through the ``mla_cupy::mla_prefill_backward`` op
    (traceable by ``torch.compile``); ``(dq, dk, dv, dk_rope)``. ``loss.backward()`` through
    :func:`mla_prefill` (and ``flash_attn_varlen_func``) calls it: the functional op's autograd
    formula, with ``deterministic`` from ``torch.are_deterministic_algorithms_enabled()``.

    ``dq``, ``dk``, ``dv``, ``dk_rope``: tensors to write the gradients into (any strides the
    kernel reads: rows and heads strided, the last dimension contiguous; the transformers backend
    passes views of its inputs' gradients). In eager execution on CUDA the kernels write them
    directly; otherwise the functional op's results are copied into them. New tensors where not
    given."""
    kind, arg = mask_args(mask)
    given = (dq, dk, dv, dk_rope)
    kw = dict(scale=None if scale is None else float(scale), mask_kind=kind, mask_arg=arg, q_max_seq_len=q_max_seq_len,
              validate=validate, deterministic=deterministic, kernel_choice=kernel)
    args = (dout, q, k, v, k_rope, out, lse, valid_length, cache_row_offsets, cache_offsets, q_start_pos, dlse)
    if all(g is None for g in given):
        return torch.ops.mla_cupy.mla_prefill_backward(*args, **kw)
    if eager_cuda((*args, *given)) and _plain_scalars(q_max_seq_len, validate, False, kernel, None):
        return _backward_cuda(*args, given, **kw)
    new = torch.ops.mla_cupy.mla_prefill_backward(*args, **kw)
    for g, n in zip(given, new):
        if g is not None:
            with torch.no_grad():
                g.copy_(n)
    return tuple(n if g is None else g for g, n in zip(given, new))


# ---------------------------------------------------------------------------------------------
# merge_states


def _merge_into(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, out: Tensor, lse_out: Tensor) -> None:
    if out_a.device.type == "cpu":
        reference.merge_states(_np(out_a), _np(lse_a), _np(out_b), _np(lse_b), out=_np(out), lse_out=_np(lse_out))
        return
    from . import merge

    with _torch_context(out_a.device):
        merge.merge_states(*(_cupy(x) for x in (out_a, lse_a, out_b, lse_b)), out=_cupy(out), lse_out=_cupy(lse_out))


@torch.library.custom_op("mla_cupy::merge_states", mutates_args=(), device_types=("cuda", "cpu"),
                         schema="(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b, *, "
                                "ScalarType? out_dtype=None) -> (Tensor, Tensor)")
def _merge_states_op(out_a, lse_a, out_b, lse_b, *, out_dtype=None):
    out, lse = out_a.new_empty(out_a.shape, dtype=out_dtype or out_a.dtype), torch.empty_like(lse_a, dtype=torch.float32)
    _merge_into(out_a, lse_a, out_b, lse_b, out, lse)
    return out, lse


@_merge_states_op.register_fake
def _(out_a, lse_a, out_b, lse_b, *, out_dtype=None):
    return out_a.new_empty(out_a.shape, dtype=out_dtype or out_a.dtype), torch.empty_like(lse_a, dtype=torch.float32)


@torch.library.custom_op("mla_cupy::merge_states_", mutates_args=("out_a", "lse_a"), device_types=("cuda", "cpu"),
                         schema="(Tensor(a!) out_a, Tensor(b!) lse_a, Tensor out_b, Tensor lse_b) -> ()")
def _merge_states_inplace_op(out_a, lse_a, out_b, lse_b):
    _merge_into(out_a, lse_a, out_b, lse_b, out_a, lse_a)


_merge_states_inplace_op.register_fake(lambda out_a, lse_a, out_b, lse_b: None)


# ---------------------------------------------------------------------------------------------
# The Python API over the ops


def _rope_tensors(k_rope: Any, k_rope_scales: Optional[Tensor]) -> tuple:
    """``(k_rope tensor, lookup_table, page_size, rope_offset, scales)`` of a plain or paged rope."""
    if isinstance(k_rope, PagedKVCache):
        if k_rope_scales is not None:
            raise ValueError("k_rope_scales: a paged cache carries its scales in PagedKVCache.scales")
        return k_rope.blocks, k_rope.lookup_table, k_rope.page_size, k_rope.rope_offset, k_rope.scales
    return k_rope, None, 0, 512, k_rope_scales


def eager_cuda(tensors: tuple) -> bool:
    """Whether a call of this module's functions on ``tensors`` (None entries allowed) may run the
    ops' CUDA implementation directly instead of through ``torch.ops.mla_cupy``: the dispatcher
    costs tens of microseconds a call, and in plain eager execution it only routes the call there.

    True when nothing but eager execution would see the op: no ``torch.compile`` / dynamo tracing,
    no ``torch.jit`` tracing, no ``TorchDispatchMode`` or ``TorchFunctionMode`` active (FakeTensor,
    functionalization, ``make_fx``, user modes), no functorch transform (``vmap``, ``grad``), every
    tensor a plain ``torch.Tensor`` on a CUDA device, and none requiring grad while grad mode is
    on (the ops have no autograd formula: the dispatcher says so). Otherwise the call goes through
    the registered op, which tracing, compilation and the modes record.
    """
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack()
            or torch._C._are_functorch_transforms_active() or torch._C._get_tracing_state() is not None):
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) is not Tensor or not t.is_cuda or (grad and t.requires_grad)):
            return False
    return True


def _result_dtype(like):
    """The default output dtype of a prefill op: that of ``q`` (16-bit) or ``q_rope`` (fp8), and
    bfloat16 for an e4m3 ``q_rope`` (the all-e4m3 mode)."""
    return torch.bfloat16 if like.itemsize == 1 else like


def _plain_scalars(q_max_seq_len, validate, accumulate, kernel, out_dtype) -> bool:
    """The keywords have the exact types the ops' schemas take (anything else goes through the op,
    whose argument parsing says what is wrong)."""
    return ((q_max_seq_len is None or (type(q_max_seq_len) is int)) and type(validate) is bool
            and type(accumulate) is bool and type(kernel) is str
            and (out_dtype is None or isinstance(out_dtype, torch.dtype)))


def _call_prefill(name: str, inputs: tuple, k_rope, rest: tuple, *, k_rope_scales=None, scale=None, mask=None,
                  q_max_seq_len=None, cache_offsets=None, q_start_pos=None, out=None, out_dtype=None,
                  return_lse=False, lse=None, accumulate=False, validate=True, kernel="auto", vt_offsets=None):
    """The functional or the in-place op of ``name``, called with the Python API's arguments; in
    eager execution on CUDA tensors (:func:`eager_cuda`) the op's CUDA implementation runs directly,
    with the same arguments, results and errors. ``vt_offsets`` (fp8): v is V^T laid out for them."""
    rope, lut, page_size, rope_offset, scales = _rope_tensors(k_rope, k_rope_scales)
    kind, arg = mask_args(mask)
    kw = dict(scale=None if scale is None else float(scale), mask_kind=kind, mask_arg=arg, q_max_seq_len=q_max_seq_len,
              page_size=page_size, rope_offset=rope_offset, validate=validate, kernel_choice=kernel)
    fp8 = name == "mla_prefill_fp8"
    opt = (cache_offsets, q_start_pos, lut, vt_offsets if fp8 else scales)
    if fp8 and scales is not None:
        raise ValueError("k_rope: the fp8 per-token variant reads a 16-bit rope (PagedKVCache without scales)")
    direct = (_plain_scalars(q_max_seq_len, validate, accumulate, kernel, out_dtype) and type(page_size) is int
              and type(rope_offset) is int and eager_cuda((*inputs, rope, *rest, *opt, out, lse)))
    if out is None and lse is None:
        if accumulate:
            raise ValueError("accumulate: needs out= and lse= holding the partial result to merge into")
        if not direct:
            o, l = getattr(torch.ops.mla_cupy, name)(*inputs, rope, *rest, *opt, out_dtype=out_dtype, **kw)
            return (o, l) if return_lse else o
        o, l = _outputs(inputs[0], inputs[0].shape[0], inputs[0].shape[1],
                        out_dtype or _result_dtype(inputs[1 if fp8 else 0].dtype))
        _prefill_cuda(fp8, (*inputs, rope, *rest), o, l, *opt, False, **kw)
        return (o, l) if return_lse else o
    if out is None:
        raise ValueError("out: lse= needs out= too (or call without both to get new tensors)")
    if out_dtype is not None and out.dtype != out_dtype:
        raise TypeError(f"out_dtype: {out_dtype} does not match out ({out.dtype})")
    if lse is None and return_lse:
        lse = out.new_empty(out.shape[:2], dtype=torch.float32)
    if not direct:
        getattr(torch.ops.mla_cupy, name + "_out")(*inputs, rope, *rest, out, lse, *opt, accumulate=accumulate, **kw)
        return (out, lse) if return_lse else out
    _prefill_cuda(fp8, (*inputs, rope, *rest), out, lse, *opt, accumulate, **kw)
    _written(out, lse)
    return (out, lse) if return_lse else out


def _written(*tensors) -> None:
    """Bump the version counters of tensors written in place, as the dispatcher does for the
    arguments an op mutates (autograd then refuses a backward through their old values)."""
    for t in tensors:
        if t is not None:
            torch.autograd.graph.increment_version(t)


def mla_prefill(q: Tensor, k: Tensor, v: Tensor, k_rope: Any, valid_length: Tensor, cache_row_offsets: Tensor, *,
                scale: Optional[float] = None, mask: Optional[Mask] = None, q_max_seq_len: Optional[int] = None,
                cache_offsets: Optional[Tensor] = None, q_start_pos: Optional[Tensor] = None, out: Optional[Tensor] = None,
                out_dtype: Optional[torch.dtype] = None, return_lse: bool = False, lse: Optional[Tensor] = None,
                accumulate: bool = False, validate: bool = True, kernel: str = "auto",
                k_rope_scales: Optional[Tensor] = None) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """:func:`mla_cupy.mla_prefill` through the ``mla_cupy::mla_prefill`` ops (traceable by
    ``torch.compile``; capturable in a CUDA graph with ``q_max_seq_len`` and ``validate=False``).

    Takes the same arguments (torch tensors; ``k_rope`` a tensor or a :class:`~mla_cupy.PagedKVCache`
    of tensors; ``out_dtype`` a torch dtype) except ``stream``: it runs on torch's current stream.
    Without ``out`` / ``lse`` it calls the functional op, else the in-place one (which
    ``accumulate=True`` needs).

    Returns
    -------
    out : ``[Tq, H, 128]`` tensor; and ``lse[Tq, H]`` float32 (natural log) with ``return_lse=True``
    """
    return _call_prefill("mla_prefill", (q, k, v), k_rope, (valid_length, cache_row_offsets),
                         k_rope_scales=k_rope_scales, scale=scale, mask=mask, q_max_seq_len=q_max_seq_len,
                         cache_offsets=cache_offsets, q_start_pos=q_start_pos, out=out, out_dtype=out_dtype,
                         return_lse=return_lse, lse=lse, accumulate=accumulate, validate=validate, kernel=kernel)


def mla_prefill_fp8(q_nope: Tensor, q_rope: Tensor, q_scale: Tensor, k: Tensor, k_scales: Tensor, v: Any,
                    k_rope: Any, valid_length: Tensor, cache_row_offsets: Tensor, *, scale: Optional[float] = None,
                    mask: Optional[Mask] = None, q_max_seq_len: Optional[int] = None,
                    cache_offsets: Optional[Tensor] = None, q_start_pos: Optional[Tensor] = None,
                    out: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None, return_lse: bool = False,
                    lse: Optional[Tensor] = None, accumulate: bool = False, validate: bool = True,
                    kernel: str = "auto") -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """:func:`mla_cupy.mla_prefill_fp8` through the ``mla_cupy::mla_prefill_fp8`` ops; arguments
    as there (fp8 data as ``torch.float8_e4m3fn`` or uint8 tensors), without ``stream``. The V^T
    workspace of each call comes from torch's allocator.

    ``v`` may be a :class:`~mla_cupy.fp8.TransposedV` (from ``quant.quantize_per_token(...,
    cache_row_offsets=cache_row_offsets)``): the op then gets its data as ``v`` and its offsets as
    ``vt_offsets`` (``cache_row_offsets`` itself when the TransposedV names that tensor; CuPy or
    NumPy data viewed as tensors), and launches no pre-pass. The op checks them as the Python API
    does; its offsets pass as the call's when they are the same tensor or at the same address."""
    vt_offsets = None
    if isinstance(v, TransposedV):
        vt_offsets = (cache_row_offsets if v.cache_row_offsets is cache_row_offsets
                      else _as_tensor(v.cache_row_offsets))
        v = _as_tensor(v.data)
    return _call_prefill("mla_prefill_fp8", (q_nope, q_rope, q_scale, k, k_scales, v), k_rope,
                         (valid_length, cache_row_offsets), scale=scale, mask=mask, q_max_seq_len=q_max_seq_len,
                         cache_offsets=cache_offsets, q_start_pos=q_start_pos, out=out, out_dtype=out_dtype,
                         return_lse=return_lse, lse=lse, accumulate=accumulate, validate=validate, kernel=kernel,
                         vt_offsets=vt_offsets)


def _as_tensor(x) -> Tensor:
    """A tensor over ``x`` without a copy: tensors as they are, device arrays through DLPack, NumPy
    arrays as CPU tensors."""
    if isinstance(x, Tensor):
        return x
    return torch.from_dlpack(x) if is_device(x) else torch.from_numpy(np.asarray(x))


def merge_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, *,
                 out_dtype: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor]:
    """:func:`mla_cupy.merge_states` into new tensors (``out_dtype``: float32 or the inputs' dtype)."""
    return torch.ops.mla_cupy.merge_states(out_a, lse_a, out_b, lse_b, out_dtype=out_dtype)


def merge_states_(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tuple[Tensor, Tensor]:
    """Fold ``(out_b, lse_b)`` into ``(out_a, lse_a)`` in place; returns them."""
    torch.ops.mla_cupy.merge_states_(out_a, lse_a, out_b, lse_b)
    return out_a, lse_a

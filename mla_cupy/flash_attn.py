"""A FlashAttention-style entry point: ``flash_attn_varlen_func`` with FlashAttention 2's
arguments and returns, for callers that hand MLA prefill to FlashAttention today (vLLM's MLA
prefill does, with a K built at 192 width).

The kernel reads the shared rope once per key instead of a ``[Tk, H, 192]`` K: pass the 192-wide K
you already have (its rope is read from head 0 through a strided view, no copy), or drop the K
build and pass the 128-wide per-head K with ``k_rope=``.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

from ._optional import require

torch = require("torch", "mla_cupy.flash_attn")

from . import torch_ops  # noqa: E402
from .masks import CausalMask, Mask, NullMask, SlidingWindowCausalMask
from .dims import DQK, DR, DV

__all__ = ["flash_attn_varlen_func"]


_FULL = {True: CausalMask(), False: NullMask()}  # masks are immutable: one object each


def _mask(causal: bool, window_size: Tuple[int, int]) -> Mask:
    """FlashAttention's ``causal`` / ``window_size`` as one of our masks (both bottom-right aligned)."""
    left, right = (int(w) for w in window_size)
    if (left, right) == (-1, -1):
        return _FULL[bool(causal)]
    if causal or right == 0:
        return CausalMask() if left < 0 else SlidingWindowCausalMask(left + 1)
    raise ValueError(f"window_size: only (-1, -1), or (left, 0) / causal windows are supported, got {tuple(window_size)}")


def _k_parts(k: torch.Tensor, k_rope: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(k_nope [Tk, H, 128], k_rope [Tk, 1, 64])`` as views of the caller's tensors."""
    if k.dim() != 3 or k.shape[-1] not in (DV, DQK):
        raise ValueError(f"k: expected [Tk, H, {DQK}] (rope in the last {DR}) or [Tk, H, {DV}] with k_rope=, "
                         f"got {list(k.shape)}")
    if k_rope is None:
        if k.shape[-1] != DQK:
            raise ValueError(f"k: a [Tk, H, {DV}] K needs its shared rope as k_rope=[Tk, {DR}] or [Tk, 1, {DR}]")
        return k[..., :DV], k[:, :1, DV:]
    if k_rope.dim() == 2:
        k_rope = k_rope.unsqueeze(1)
    if k_rope.dim() != 3 or k_rope.shape[0] != k.shape[0] or k_rope.shape[1] != 1 or k_rope.shape[2] != DR:
        raise ValueError(f"k_rope: expected [{k.shape[0]}, {DR}] or [{k.shape[0]}, 1, {DR}], got {list(k_rope.shape)}")
    return (k if k.shape[-1] == DV else k[..., :DV]), k_rope


def flash_attn_varlen_func(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
    causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
    deterministic: bool = False, return_attn_probs: bool = False, block_table=None, *,
    return_softmax_lse: bool = False, k_rope: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, tuple]:
    """MLA prefill with ``flash_attn.flash_attn_varlen_func``'s arguments and returns.

    Parameters
    ----------
    q : ``[Tq, H, 192]`` bfloat16 / float16 CUDA tensor
        Queries, packed; the last 64 values of each head are its rope part.
    k : ``[Tk, H, 192]``, or ``[Tk, H, 128]`` with ``k_rope``
        Keys. A 192-wide K's rope (its last 64 values) MUST be the same on every head, as MLA
        builds it: only head 0's is read (a strided view, no copy; not checked).
    v : ``[Tk, H, 128]``
        Values (no need to pad them to 192 as FlashAttention callers do).
    cu_seqlens_q, cu_seqlens_k : ``[B + 1]`` int32 CUDA tensors
        Cumulative sequence lengths (row offsets) of the queries and keys.
    max_seqlen_q : int
        Upper bound on any sequence's query count; sizes the grid. No offset is read back to the
        host and no argument value is checked on the host (as in FlashAttention), so the call
        can be captured in a CUDA graph.
    max_seqlen_k : int
        Accepted for compatibility; not needed.
    dropout_p, softcap, alibi_slopes, block_table
        Must be 0 / None (not supported: ``ValueError`` otherwise).
    softmax_scale : float, optional
        Default ``1 / sqrt(192)`` (FlashAttention's ``1 / sqrt(q.shape[-1])``).
    causal : bool
        Causal mask aligned to the bottom right (the last query sees the last key), as in
        FlashAttention >= 2.1; ``False`` lets every query see every key of its sequence.
    window_size : (left, right)
        ``(-1, -1)``, or a causal window ``(left, 0)``: query i sees the ``left + 1`` keys ending
        at its diagonal.
    deterministic : bool
        Ignored (the forward pass is deterministic).
    return_attn_probs : bool
        FlashAttention 2's flag: return ``(out, softmax_lse, None)`` (no probabilities).
    return_softmax_lse : bool
        vLLM's flag: return ``(out, softmax_lse)``.
    k_rope : ``[Tk, 64]`` or ``[Tk, 1, 64]``, optional
        The shared rope of the keys, with a 128-wide ``k`` (any row stride, e.g. a view into the
        latent cache): then no 192-wide K is built at all.
    out : ``[Tq, H, 128]`` tensor, optional
        Written in place.

    Returns
    -------
    out : ``[Tq, H, 128]``
    softmax_lse : ``[H, Tq]`` float32, with ``return_softmax_lse`` or ``return_attn_probs``
        FlashAttention's layout and base: the NATURAL-log log-sum-exp of each row of
        ``softmax_scale * Q K^T`` over the visible keys. It is a transposed view of a
        ``[Tq, H]`` buffer (``.contiguous()`` gives FlashAttention's strides). A row that sees no
        key gets ``-inf`` (FlashAttention 2 returns ``+inf`` there); its output is 0 in both.

    Notes
    -----
    Runs through the ``mla_cupy::mla_prefill`` torch ops (:mod:`mla_cupy.torch_ops`), so it
    traces under ``torch.compile``. On CPU tensors it runs the float64 reference.
    """
    if dropout_p:
        raise ValueError(f"dropout_p: dropout is not supported, got {dropout_p}")
    if softcap:
        raise ValueError(f"softcap: soft-capping is not supported, got {softcap}")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: ALiBi is not supported")
    if block_table is not None:
        raise ValueError("block_table: a paged K/V is not supported here; mla_cupy.mla_prefill reads a paged rope "
                         "(PagedKVCache)")
    if q.dim() != 3 or q.shape[-1] != DQK:
        raise ValueError(f"q: expected [Tq, H, {DQK}], got {list(q.shape)}")
    k_nope, rope = _k_parts(k, k_rope)
    if k_nope.shape[1] != q.shape[1]:
        raise ValueError(f"k: expected {q.shape[1]} heads (one K head per query head), got {k_nope.shape[1]}")
    if v.dim() != 3 or v.shape[-1] != DV:
        raise ValueError(f"v: expected [Tk, H, {DV}], got {list(v.shape)}")
    scale = 1.0 / math.sqrt(DQK) if softmax_scale is None else float(softmax_scale)
    want_lse = bool(return_softmax_lse or return_attn_probs)  # else the kernel writes no lse
    result = torch_ops.mla_prefill(q, k_nope, v, rope, cu_seqlens_q, cu_seqlens_k, scale=scale,
                                   mask=_mask(causal, window_size), q_max_seq_len=max_seqlen_q, validate=False,
                                   out=out, return_lse=want_lse)
    if not want_lse:
        return result
    o, lse = result
    if return_softmax_lse:
        return o, lse.t()
    if return_attn_probs:
        return o, lse.t(), None
    return o

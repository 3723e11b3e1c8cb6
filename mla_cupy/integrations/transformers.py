"""HuggingFace transformers backend: ``register()`` once, then
``model.set_attn_implementation("mla_cupy")`` runs DeepSeek V2/V3 attention on the kernel.

transformers' DeepSeek attention hands every backend ``query [B, H, Sq, 192]``, ``key
[B, H, Sk, 192]`` (the nope part per head, then the rope, the same on every head) and ``value
[B, H, Sk, 128]``, plus the 2-D padding mask. Each sequence of the batch becomes one kernel call
on zero-copy views: the nope keys are ``key[..., :128]``, the rope is head 0's ``key[:, 0, :,
128:]``, the values and queries are read in place, and the result is written straight into the
``[B, Sq, H, 128]`` output transformers expects.

Handled: batches without padding, right padding (prefill) and left padding (prefill and
``generate``), decode steps (the queries are the last positions of the keys: one query over a
growing cache), caches longer than the mask (static caches: keys past the mask are unused).
Trains: with gradients enabled the attention is one autograd function whose backward runs the
backward kernels per sequence, their gradients written into views of the inputs' gradients (the
rope's, summed over the heads in the kernel, into head 0's rope values of ``key``, which
transformers' expansion of the shared rope sums back). Refused with a clear error: dropout, a
mask with holes inside a sequence (right padding during ``generate``), 4-D masks, and mask
patterns other than causal (sliding windows, packed sequences).
"""
from __future__ import annotations

import math
import threading
import weakref
from collections import OrderedDict
from typing import Any, List, Optional, Tuple

import numpy as np

from .._optional import require

torch = require("torch", "mla_cupy.integrations.transformers", extra="transformers")

from .. import torch_ops  # noqa: E402
from ..masks import CausalMask, NullMask
from ..dims import DQK, DR, DV

__all__ = ["NAME", "register", "mla_attention_forward", "padding_mask", "sequence_ranges"]

#: The name ``register`` uses for ``attn_implementation``.
NAME = "mla_cupy"


def register(name: str = NAME) -> None:
    """Register the attention function (``AttentionInterface``) and its mask builder
    (``AttentionMaskInterface``: the 2-D padding mask, or None without padding) under ``name``,
    so that ``model.set_attn_implementation(name)`` or ``from_pretrained(...,
    attn_implementation=name)`` uses them."""
    require("transformers", "mla_cupy.integrations.transformers.register")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, mla_attention_forward)
    AttentionMaskInterface.register(name, padding_mask)


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function: Any = None, attention_mask: Optional[torch.Tensor] = None, **kwargs: Any):
    """The mask builder: the causal pattern is the kernel's, so only the 2-D padding mask is
    passed on (its last ``kv_length`` columns), or None when nothing is padded. Any other mask
    pattern is refused here, before the model runs attention."""
    from transformers.masking_utils import causal_mask_function, flash_attention_mask

    if mask_function is not None and mask_function is not causal_mask_function:
        raise ValueError(f"attention_mask: the {NAME} attention expresses causal masks with padding only; this model "
                         f"asks for {getattr(mask_function, '__name__', mask_function)!s} (sliding window, packed "
                         f"sequences or another pattern): use another attn_implementation")
    return flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask=attention_mask)


_RANGES: List[Any] = [None, None, None]  # the last mask seen (weak), its version, its ranges


def sequence_ranges(attention_mask: Optional[torch.Tensor], batch: int, kv_length: int) -> List[Tuple[int, int]]:
    """``[(first, end)]`` of each row's attended keys: the ones of the 2-D mask, which must be one
    run per row (left or right padding); all ``kv_length`` keys without a mask. Read back to the
    host once per mask (every layer of a forward pass gets the same mask)."""
    if attention_mask is None:
        return [(0, kv_length)] * batch
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] > kv_length:
        raise ValueError(f"attention_mask: expected a 2-D padding mask [{batch}, <= {kv_length}], got "
                         f"{list(attention_mask.shape)} (4-D or custom masks cannot be expressed)")
    ref, version, ranges = _RANGES
    if ref is not None and ref() is attention_mask and version == attention_mask._version:
        return ranges
    m = attention_mask.detach().to("cpu", torch.bool).numpy()
    ranges = []
    for b, row in enumerate(m):
        ones = np.flatnonzero(row)
        first, end = (int(ones[0]), int(ones[-1]) + 1) if ones.size else (0, 0)
        if ones.size != end - first:
            raise ValueError(f"attention_mask: row {b} has padding between attended tokens (right padding during "
                             f"generate?); only left or right padding can be expressed: pad on the left")
        ranges.append((first, end))
    _RANGES[:] = [weakref.ref(attention_mask), attention_mask._version, ranges]
    return ranges


_OFFSETS: "OrderedDict[tuple, Tuple[torch.Tensor, torch.Tensor]]" = OrderedDict()
_OFFSETS_MAX = 16
_OFFSETS_LOCK = threading.Lock()


def _device_offsets(ranges: List[Tuple[int, int]], sq: int, span: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's ``[0, sq, 0, keys]`` (int32) and its first query's position (int64) on
    ``device``, kept for the next call with the same layout: every layer of a forward pass has the
    same one, and a copy from host memory per layer would make the host wait for the device each
    time (a pageable copy synchronizes), so that it could no longer queue work ahead. The tensors
    are only read."""
    key = (str(device), sq, span, tuple(ranges))
    with _OFFSETS_LOCK:
        hit = _OFFSETS.get(key)
        if hit is not None:
            _OFFSETS.move_to_end(key)
            return hit
    offsets = torch.tensor([[0, sq, 0, end - first] for first, end in ranges], dtype=torch.int32).to(device)
    q_start = torch.tensor([span - sq - first for first, _ in ranges], dtype=torch.int64).to(device)
    with _OFFSETS_LOCK:
        _OFFSETS[key] = (offsets, q_start)
        if len(_OFFSETS) > _OFFSETS_MAX:
            _OFFSETS.popitem(last=False)
    return offsets, q_start


def _check(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float,
           kwargs: dict) -> torch.Tensor:
    """Refuse what the kernel cannot do; returns the 128 values of ``value`` (a view)."""
    if dropout:
        raise ValueError(f"dropout: the {NAME} attention has no dropout (got {dropout}); call model.eval()")
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"sliding_window: not supported by the {NAME} attention")
    if query.dim() != 4 or query.shape[-1] != DQK or key.dim() != 4 or key.shape[-1] != DQK:
        raise ValueError(f"query, key: expected [B, H, S, {DQK}] (qk_nope_head_dim={DV}, qk_rope_head_dim={DR}), got "
                         f"{list(query.shape)} and {list(key.shape)}")
    if key.shape[1] != query.shape[1] or value.shape[1] != query.shape[1]:
        raise ValueError(f"key: expected {query.shape[1]} heads like the query (one K/V head per query head), got "
                         f"{key.shape[1]} / {value.shape[1]}")
    if value.shape[-1] != DV:
        if value.shape[-1] < DV or getattr(module, "v_head_dim", None) != DV:
            raise ValueError(f"value: expected v_head_dim={DV}, got {value.shape[-1]}")
        value = value[..., :DV]  # padded to the key width by the caller: the padding is dropped
    return value


def mla_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                          dropout: float = 0.0, **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """transformers attention function (the ``AttentionInterface`` signature).

    Parameters
    ----------
    module : the attention module (read for ``v_head_dim`` and ``is_causal``)
    query : ``[B, H, Sq, 192]``
    key : ``[B, H, Sk, 192]``: rope in the last 64 values, the same on every head (head 0's is read)
    value : ``[B, H, Sk, 128]`` (or wider, zero-padded, when ``module.v_head_dim`` is 128)
    attention_mask : ``[B, <= Sk]`` 2-D padding mask (from :func:`padding_mask`), or None
    scaling : softmax scale (default ``1 / sqrt(192)``)
    dropout : must be 0

    Returns
    -------
    (attn_output ``[B, Sq, H, 128]``, None): no attention weights.
    """
    value = _check(module, query, key, value, dropout, kwargs)
    batch, _, sq, _ = query.shape
    sk = key.shape[2]
    ranges = sequence_ranges(attention_mask, batch, sk)
    span = sk if attention_mask is None else attention_mask.shape[1]  # the queries are its last sq columns
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    mask = CausalMask() if causal else NullMask()
    scale = 1.0 / math.sqrt(DQK) if scaling is None else float(scaling)
    offsets, q_start = _device_offsets(ranges, sq, span, query.device)
    calls = _Calls(ranges, offsets, q_start, sq, scale, mask)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return _Attention.apply(query, key, value, calls), None
    return calls.forward(query, key, value, want_lse=False)[0], None


class _Calls:
    """The kernel calls of one attention: one per sequence of the batch, on views of the
    ``[B, H, S, D]`` tensors transformers hands over, the results written into place (the output's
    ``[B, Sq, H, 128]``, the gradients' ``[B, H, S, D]``), so that no copy or zero-filled
    intermediate of a whole tensor is made on the way in or out."""

    def __init__(self, ranges, offsets, q_start, sq: int, scale: float, mask):
        self.ranges, self.offsets, self.q_start = ranges, offsets, q_start
        self.sq, self.scale, self.mask = sq, scale, mask

    def _views(self, b: int, query, key, value):
        """Sequence ``b``'s ``(q, k, v, k_rope)`` views in the kernels' ``[T, H, D]`` layout."""
        first, end = self.ranges[b]
        keys = key[b, :, first:end]  # [H, Lk, 192]
        return (query[b].transpose(0, 1), keys[..., :DV].transpose(0, 1), value[b, :, first:end].transpose(0, 1),
                keys[0, :, None, DV:])

    def _kw(self, b: int) -> dict:
        return dict(scale=self.scale, mask=self.mask, q_max_seq_len=self.sq, q_start_pos=self.q_start[b:b + 1],
                    validate=False)

    def forward(self, query, key, value, *, want_lse: bool):
        """``(out [B, Sq, H, 128], lse [B, Sq, H] float32 or None)``."""
        batch, heads, sq, _ = query.shape
        out = query.new_empty((batch, sq, heads, DV))
        lse = query.new_empty((batch, sq, heads), dtype=torch.float32) if want_lse else None
        for b in range(batch):
            torch_ops.mla_prefill(*self._views(b, query, key, value), self.offsets[b, :2], self.offsets[b, 2:],
                                  out=out[b], lse=None if lse is None else lse[b], **self._kw(b))
        return out, lse

    def backward(self, dout, query, key, value, out, lse):
        """The gradients of ``query``, ``key`` and ``value`` (their shapes and dtypes). The rope's
        gradient, summed over the heads in the kernel, goes to head 0's rope values of ``key`` and
        zeros to the other heads' (transformers' expansion of the shared rope sums them); keys
        outside a sequence's attended run get zeros."""
        dout = dout.contiguous()
        dquery, dkey, dvalue = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
        dkey[:, 1:, :, DV:].zero_()
        deterministic = torch.are_deterministic_algorithms_enabled()
        for b, (first, end) in enumerate(self.ranges):
            for g in (dkey, dvalue):  # padding: keys no query of this sequence attends
                g[b, :, :first].zero_()
                g[b, :, end:].zero_()
            dk = dkey[b, :, first:end]
            torch_ops.mla_prefill_backward(dout[b], *self._views(b, query, key, value), out[b], lse[b],
                                           self.offsets[b, :2], self.offsets[b, 2:], deterministic=deterministic,
                                           dq=dquery[b].transpose(0, 1), dk=dk[..., :DV].transpose(0, 1),
                                           dv=dvalue[b, :, first:end].transpose(0, 1),
                                           dk_rope=dk[0, :, None, DV:], **self._kw(b))
        return dquery, dkey, dvalue


class _Attention(torch.autograd.Function):
    """The attention with the backward kernels as its gradient: :class:`_Calls` forward and backward."""

    @staticmethod
    def forward(ctx, query, key, value, calls: _Calls):
        out, lse = calls.forward(query, key, value, want_lse=True)
        ctx.calls = calls
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        query, key, value, out, lse = ctx.saved_tensors
        return (*ctx.calls.backward(dout, query, key, value, out, lse), None)

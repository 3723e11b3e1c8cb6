"""The local attention of context-parallel prefill: what one rank does with one call of its
schedule. Each backend merges the call's partial result into a running ``(out, lse)`` by lse.

* :class:`KernelAttention`: :func:`mla_cupy.mla_prefill` on CUDA tensors, merged inside the
  kernel's epilogue (``accumulate=True``) into a float32 result;
* :class:`ReferenceAttention`: the float64 reference on CPU tensors, merged on the host (the same
  ring code then runs under gloo without a GPU);
* :class:`NoAttention`: nothing (times the ring's communication alone).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np

from .. import reference
from ..api import mla_prefill
from ..masks import Mask
from .schedule import AttentionCall

__all__ = ["LocalAttention", "KernelAttention", "ReferenceAttention", "NoAttention", "default_attention", "merge_into",
           "upload"]


def upload(a: np.ndarray, device):
    """A host array as a torch tensor on ``device``: to a GPU through pinned memory without
    waiting (torch keeps the pinned buffer until the copy is done), so the host runs ahead."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a))
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class LocalAttention:
    """Interface of a local attention backend (subclass and override every method)."""

    #: dtype name of the running result (a torch dtype attribute: "float32", "float64")
    acc_dtype = "float32"

    def prepare(self, calls: Sequence[AttentionCall], device: Any) -> List[Any]:
        """Per call, whatever :meth:`attend` needs besides the call (device copies of its offsets)."""
        return [None] * len(calls)

    def attend(self, call: AttentionCall, prepared: Any, q, k, v, k_rope, out, lse, *, mask: Mask,
               scale: Optional[float]) -> None:  # pragma: no cover - interface
        """Merge the attention of ``q`` (the call's query rows) over ``k, v, k_rope`` (the call's key
        rows) into ``out`` / ``lse`` (the same query rows of the running result)."""
        raise NotImplementedError


class KernelAttention(LocalAttention):
    """:func:`mla_cupy.mla_prefill` on CUDA tensors, on torch's current stream, with
    ``accumulate=True``, ``validate=False`` and ``q_max_seq_len`` (no device-to-host copy per call).

    Parameters
    ----------
    kernel : {"auto", "sm80", "sm90"}
        Passed to :func:`mla_cupy.mla_prefill`.
    """

    acc_dtype = "float32"

    def __init__(self, kernel: str = "auto"):
        self.kernel = kernel

    def prepare(self, calls, device):
        """Every call's offsets and positions in two device tensors (two host-to-device copies)."""
        if not calls:
            return []
        i32 = np.concatenate([np.concatenate([c.q_offsets, c.k_offsets, c.k_pos0]) for c in calls]).astype(np.int32)
        i64 = np.concatenate([c.q_pos0 for c in calls]).astype(np.int64)
        d32, d64 = upload(i32, device), upload(i64, device)
        prepared, a, b = [], 0, 0
        for c in calls:
            n = len(c.q_pos0)
            prepared.append((d32[a:a + n + 1], d32[a + n + 1:a + 2 * n + 2], d32[a + 2 * n + 2:a + 3 * n + 2],
                             d64[b:b + n]))
            a, b = a + 3 * n + 2, b + n
        return prepared

    def attend(self, call, prepared, q, k, v, k_rope, out, lse, *, mask, scale):
        import torch

        q_off, k_off, k_pos0, q_pos0 = prepared
        mla_prefill(q, k, v, k_rope, q_off, k_off, scale=scale, mask=mask, q_max_seq_len=call.max_q,
                    cache_offsets=k_pos0, q_start_pos=q_pos0, out=out, lse=lse, accumulate=True, return_lse=True,
                    validate=False, kernel=self.kernel, stream=torch.cuda.current_stream(q.device))


def _host64(x) -> np.ndarray:
    """A torch tensor as a float64 NumPy array on the host (a view when it is one already)."""
    import torch

    return x.detach().to("cpu", torch.float64).numpy()


def merge_into(out, lse, part_out, part_lse) -> None:
    """Fold a partial result over other keys into ``out`` / ``lse`` in place (torch tensors), exactly:
    :func:`mla_cupy.reference.merge_states` in float64 on the host (``out = (e^(lse - m) out +
    e^(part_lse - m) part_out) / (e^(lse - m) + e^(part_lse - m))``; a side with lse ``-inf``
    contributes nothing, two empty sides give 0 and ``-inf``), written back in ``out``'s and
    ``lse``'s dtypes and devices."""
    import torch

    o, l = reference.merge_states(_host64(out), _host64(lse), _host64(part_out), _host64(part_lse))
    out.copy_(torch.from_numpy(o))
    lse.copy_(torch.from_numpy(l))


class ReferenceAttention(LocalAttention):
    """The float64 reference (:func:`mla_cupy.reference.mla_prefill`) on CPU tensors, merged into a
    float64 running result with :func:`merge_into`."""

    acc_dtype = "float64"

    def attend(self, call, prepared, q, k, v, k_rope, out, lse, *, mask, scale):
        import torch

        o, l = reference.mla_prefill(_host64(q), _host64(k), _host64(v), _host64(k_rope),
                                     call.q_offsets.astype(np.int32), call.k_offsets.astype(np.int32), scale=scale,
                                     mask=mask, cache_offsets=call.k_pos0.astype(np.uint32), q_start_pos=call.q_pos0,
                                     return_lse=True)
        merge_into(out, lse, torch.from_numpy(o), torch.from_numpy(l))


class NoAttention(LocalAttention):
    """Computes nothing: the ring with this backend takes the time of its communication alone."""

    def attend(self, call, prepared, q, k, v, k_rope, out, lse, *, mask, scale):
        return None


def default_attention(q) -> LocalAttention:
    """:class:`KernelAttention` for CUDA tensors, :class:`ReferenceAttention` otherwise."""
    return KernelAttention() if getattr(q, "is_cuda", False) else ReferenceAttention()

"""From a one-GPU call to a W-rank call: take this rank's rows of the batch's tensors, and put
the ranks' results back into the one-GPU order.

Example
-------
One GPU::

    out = mla_cupy.mla_prefill(q, k, v, k_rope, valid_length, cache_row_offsets, mask=mask)

W ranks (every rank runs the same two lines; ``torch.distributed`` is initialized)::

    sh = shard(q, k, v, k_rope, valid_length, cache_row_offsets)
    out = gather(context_parallel_prefill(*sh, mask=mask), sh.layout)
"""
from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Sequence

from ..paged import PagedKVCache
from .attention import upload
from .layout import ZigzagLayout, check_layout_arg
from .transport import TorchTransport

__all__ = ["Shard", "shard", "take_rows", "gather", "unshard"]


class Shard(NamedTuple):
    """This rank's arguments of :func:`context_parallel_prefill`, in its order."""

    q: Any
    k: Any
    v: Any
    k_rope: Any
    layout: ZigzagLayout


def take_rows(x, rows):
    """``x[rows]`` for a NumPy index array ``rows`` (a torch gather on ``x``'s device)."""
    return x[upload(rows, x.device)]


def shard(q, k, v, k_rope, valid_length, cache_row_offsets, *, cache_offsets=None, q_start_pos=None,
          group: Any = None, transport: Any = None, layout: Optional[ZigzagLayout] = None) -> Shard:
    """This rank's rows of a one-GPU call's arguments (torch tensors), and the batch's layout.

    Parameters
    ----------
    q, k, v, k_rope, valid_length, cache_row_offsets, cache_offsets, q_start_pos
        The arguments of the one-GPU :func:`mla_cupy.mla_prefill` call. A :class:`PagedKVCache`
        ``k_rope`` is passed through: it must hold this rank's keys (see
        :func:`context_parallel_prefill`); a cache that holds every key serves every rank.
    group : ProcessGroup, optional
        Gives the rank and W (default: the world group).
    transport : optional
        Instead of ``group`` (see :func:`context_parallel_prefill`).
    layout : ZigzagLayout, optional
        Reuse a layout built for these offsets (default: built here, reading the offsets once).

    Returns
    -------
    Shard
        ``(q, k, v, k_rope, layout)``: pass ``*shard`` to :func:`context_parallel_prefill`.
    """
    transport = TorchTransport(group) if transport is None else transport
    if layout is None:
        layout = ZigzagLayout.from_offsets(valid_length, cache_row_offsets, transport.world_size,
                                           cache_offsets=cache_offsets, q_start_pos=q_start_pos)
    layout = check_layout_arg(layout)
    r = transport.rank
    qr, kr = layout.q.rows(r), layout.k.rows(r)
    rope = k_rope if isinstance(k_rope, PagedKVCache) else take_rows(k_rope, kr)
    return Shard(take_rows(q, qr), take_rows(k, kr), take_rows(v, kr), rope, layout)


def unshard(parts: Sequence[Any], layout: ZigzagLayout):
    """The one-GPU tensor ``[Tq, ...]`` from every rank's result ``parts[r]`` (``[q.count(r), ...]``)."""
    import torch

    layout = check_layout_arg(layout)
    if len(parts) != layout.world_size:
        raise ValueError(f"parts: expected {layout.world_size} results (one per rank), got {len(parts)}")
    first = parts[0]
    full = torch.empty((layout.total_q,) + tuple(first.shape[1:]), dtype=first.dtype, device=first.device)
    for r, part in enumerate(parts):
        full[upload(layout.q.rows(r), full.device)] = part[:layout.q.count(r)].to(full.device)
    return full


def gather(local, layout: ZigzagLayout, *, group: Any = None, transport: Any = None):
    """Every rank's per-query result (``out`` or ``lse``) in the one-GPU order, on every rank.

    Parameters
    ----------
    local : ``[layout.q.count(rank), ...]`` tensor
        This rank's result.
    layout : ZigzagLayout
    group, transport
        As in :func:`shard`.

    Returns
    -------
    ``[Tq, ...]`` tensor (one all-gather, rows padded to the largest rank's count)
    """
    import torch

    layout = check_layout_arg(layout)
    transport = TorchTransport(group) if transport is None else transport
    pad = layout.q.max_count()
    mine = torch.zeros((pad,) + tuple(local.shape[1:]), dtype=local.dtype, device=local.device)
    mine[:local.shape[0]] = local
    parts: List[Any] = [torch.empty_like(mine) for _ in range(layout.world_size)]
    transport.wait(transport.start_all_gather(parts, mine))
    return unshard(parts, layout)

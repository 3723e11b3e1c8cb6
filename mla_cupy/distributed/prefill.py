"""Context-parallel MLA prefill: each rank attends its own queries over every rank's keys, which
travel around a ring (or are all-gathered) while the rank computes on the block it holds."""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np

from ..masks import CausalMask, Mask
from ..paged import PagedKVCache
from .attention import LocalAttention, default_attention, upload
from .layout import ZigzagLayout, check_layout_arg
from .schedule import AttentionCall, rank_schedule, ring_source
from .transport import TorchTransport

__all__ = ["context_parallel_prefill", "VARIANTS"]

VARIANTS = ("ring", "all_gather")
DV, DR = 128, 64


class KeyBlock:
    """One rank's keys packed in one ``[rows, H * 256 + 64]`` tensor (k, then v, then the rope
    of each key), so a ring step moves them with one send; rows past the rank's own count are
    padding up to the largest rank's count, so every rank sends and receives the same size."""

    def __init__(self, heads: int, rows: int, like):
        import torch

        self.heads = heads
        self.data = torch.empty((rows, heads * 2 * DV + DR), dtype=like.dtype, device=like.device)

    def views(self, data=None) -> Tuple[Any, Any, Any]:
        """``(k [rows, H, 128], v [rows, H, 128], k_rope [rows, 1, 64])`` views of ``data``
        (default: this block's own tensor)."""
        d = self.data if data is None else data
        n, h = d.shape[0], self.heads
        return (d[:, :h * DV].view(n, h, DV), d[:, h * DV:2 * h * DV].view(n, h, DV),
                d[:, 2 * h * DV:].view(n, 1, DR))

    def fill(self, k, v, k_rope, layout: ZigzagLayout, rank: int) -> None:
        """Copy the rank's keys in; a paged rope is gathered from the rank's own pages."""
        n = int(k.shape[0])
        dk, dv, dr = self.views()
        dk[:n].copy_(k)
        dv[:n].copy_(v)
        dr[:n].copy_(paged_rope_rows(k_rope, layout, rank) if isinstance(k_rope, PagedKVCache) else k_rope)


def paged_rope_rows(cache: PagedKVCache, layout: ZigzagLayout, rank: int):
    """``[count, 1, 64]`` rope rows of ``rank``'s keys, read from its own paged cache: key at absolute
    position ``t`` of sequence ``b`` is ``blocks[lookup_table[b, t // page_size], t % page_size, 0,
    rope_offset:rope_offset + 64]``, as in :func:`mla_cupy.mla_prefill`."""
    blocks, lut = cache.blocks, cache.lookup_table
    dev = blocks.device
    pos = upload(layout.k.positions(rank), dev)
    seq = upload(layout.k.sequences(rank), dev)
    page, slot = pos // cache.page_size, pos % cache.page_size
    if len(pos):
        need = int(layout.k.positions(rank).max()) // cache.page_size
        if need >= lut.shape[1]:
            raise ValueError(f"k_rope.lookup_table: rank {rank}'s keys need pages up to {need}, but the table has "
                             f"{lut.shape[1]} columns")
    ids = lut.to(dev)[seq, page].long()
    ro = cache.rope_offset
    return blocks[ids, slot, 0, ro:ro + DR].unsqueeze(1)


def _check_shard(q, k, v, k_rope, layout: ZigzagLayout, rank: int) -> None:
    """The local tensors match the layout's rows for ``rank``."""
    for name, x, nd in (("q", q, 3), ("k", k, 3), ("v", v, 3)):
        if not hasattr(x, "shape") or len(x.shape) != nd:
            raise ValueError(f"{name}: expected a {nd}-D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    heads = int(q.shape[1])
    want = (("q", q, (layout.q.count(rank), heads, DV + DR)), ("k", k, (layout.k.count(rank), heads, DV)),
            ("v", v, (layout.k.count(rank), heads, DV)))
    if not isinstance(k_rope, PagedKVCache):
        want += (("k_rope", k_rope, (layout.k.count(rank), 1, DR)),)
    for name, x, shape in want:
        if tuple(x.shape) != shape:
            raise ValueError(f"{name}: expected shape {list(shape)} (rank {rank}'s rows of the layout), got {list(x.shape)}")
    for name, x in (("k", k), ("v", v)) + ((("k_rope", k_rope),) if not isinstance(k_rope, PagedKVCache) else ()):
        if x.dtype != q.dtype or x.device != q.device:
            raise TypeError(f"{name}: expected {q.dtype} on {q.device} (as q), got {x.dtype} on {x.device}")


def context_parallel_prefill(
    q, k, v, k_rope, layout: ZigzagLayout, *, group: Any = None, mask: Optional[Mask] = None,
    scale: Optional[float] = None, out_dtype: Any = None, return_lse: bool = False, variant: str = "ring",
    attention: Optional[LocalAttention] = None, transport: Any = None,
):
    """MLA prefill of this rank's queries over the keys of every rank of ``group``.

    Every rank calls it with its own rows (:func:`mla_cupy.distributed.shard` gives them); the
    result equals the rows of the one-GPU :func:`mla_cupy.mla_prefill` call that ``layout``
    describes (:func:`mla_cupy.distributed.gather` puts them back in order).

    Parameters
    ----------
    q : ``[layout.q.count(rank), H, 192]`` torch tensor
        This rank's queries, in the layout's order.
    k, v : ``[layout.k.count(rank), H, 128]``
        This rank's keys and values.
    k_rope : ``[layout.k.count(rank), 1, 64]`` tensor, or :class:`mla_cupy.PagedKVCache`
        This rank's rope rows, or this rank's own paged cache: ``lookup_table[b, t // page_size]``
        names the page holding absolute position ``t`` of sequence ``b``, for the positions of this
        rank's keys (other entries are not read; a page that two ranks' chunks share is a page of
        each rank).
    layout : ZigzagLayout
        The batch's rank layout (``ZigzagLayout.from_offsets``), the same on every rank.
    group : ProcessGroup, optional
        The ``torch.distributed`` group of the W ranks (default: the world).
    mask, scale, out_dtype, return_lse
        As in :func:`mla_cupy.mla_prefill` (masks act on the true positions).
    variant : {"ring", "all_gather"}
        ``"ring"``: W - 1 steps of point-to-point sends (``batch_isend_irecv``) of one key block to
        the next rank, each posted before the current block is computed (two buffers).
        ``"all_gather"``: one all-gather of every block, overlapped with the local block's compute.
    attention : LocalAttention, optional
        Default :class:`KernelAttention` for CUDA tensors, :class:`ReferenceAttention` for CPU tensors.
    transport : optional
        Replaces ``group``: a :class:`~mla_cupy.distributed.transport.ThreadTransport` from
        :func:`~mla_cupy.distributed.transport.simulate` runs W ranks as threads of one process.

    Returns
    -------
    out : ``[layout.q.count(rank), H, 128]``, ``out_dtype`` (default ``q.dtype``)
    lse : ``[layout.q.count(rank), H]``, natural-log, float32 (float64 with the reference), with ``return_lse``

    Notes
    -----
    Each step's calls come from :func:`~mla_cupy.distributed.schedule.rank_schedule`: a call whose
    sequences the mask removes entirely is not made, decided on the host from positions.
    """
    layout = check_layout_arg(layout)
    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {VARIANTS}, got {variant!r}")
    mask = CausalMask() if mask is None else mask
    if not isinstance(mask, Mask):
        raise TypeError(f"mask: expected a mla_cupy Mask, got {type(mask).__name__}")
    transport = TorchTransport(group) if transport is None else transport
    if transport.world_size != layout.world_size:
        raise ValueError(f"layout: built for world_size {layout.world_size}, but the group has {transport.world_size} ranks")
    rank = transport.rank
    _check_shard(q, k, v, k_rope, layout, rank)
    attention = default_attention(q) if attention is None else attention
    out, lse = run_prefill(q, k, v, k_rope, layout, transport, attention, mask=mask, scale=scale, variant=variant)
    out = out.to(q.dtype if out_dtype is None else _torch_dtype(out_dtype))
    return (out, lse) if return_lse else out


def _torch_dtype(d):
    """``out_dtype`` as a torch float dtype (torch dtypes, NumPy dtypes and their names)."""
    import torch

    if isinstance(d, torch.dtype):
        return d
    name = np.dtype(d).name
    if name not in ("float16", "bfloat16", "float32", "float64"):
        raise TypeError(f"out_dtype: expected a float dtype (float16, bfloat16, float32, float64), got {name}")
    return getattr(torch, name)


def run_prefill(q, k, v, k_rope, layout: ZigzagLayout, transport, attention: LocalAttention, *, mask: Mask,
                scale: Optional[float], variant: str = "ring", exchange: bool = True):
    """The body of :func:`context_parallel_prefill` on checked arguments: returns the running
    result ``(out, lse)`` in the backend's precision. ``exchange=False`` moves nothing (every step
    computes on the rank's own block: the compute alone, for timing; the result is then wrong)."""
    import torch

    rank, w = transport.rank, transport.world_size
    steps = rank_schedule(layout, rank, mask)
    flat = [c for s in steps for c in s]
    prepared = iter(attention.prepare(flat, q.device))
    plan = [[(c, next(prepared)) for c in s] for s in steps]
    acc_dtype = getattr(torch, attention.acc_dtype)
    tq, heads = int(q.shape[0]), int(q.shape[1])
    out = torch.zeros((tq, heads, DV), dtype=acc_dtype, device=q.device)
    lse = torch.full((tq, heads), -np.inf, dtype=acc_dtype, device=q.device)
    block = KeyBlock(heads, layout.k.max_count(), k)
    block.fill(k, v, k_rope, layout, rank)

    def compute(step_calls: Sequence[Tuple[AttentionCall, Any]], data) -> None:
        keys = block.views(data)
        for call, prep in step_calls:
            qa, qb = call.q_rows
            ka, kb = call.k_rows
            attention.attend(call, prep, q[qa:qb], *(x[ka:kb] for x in keys), out[qa:qb], lse[qa:qb], mask=mask,
                             scale=scale)

    if variant == "ring":
        bufs = (block.data, torch.empty_like(block.data))
        for step in range(w):
            cur = bufs[step % 2] if exchange else bufs[0]
            pending = transport.start_ring(cur, bufs[(step + 1) % 2]) if exchange and step + 1 < w else None
            compute(plan[step], cur)
            if pending is not None:
                transport.wait(pending)
    else:
        gathered = torch.empty((w,) + tuple(block.data.shape), dtype=block.data.dtype, device=block.data.device)
        pending = transport.start_all_gather(list(gathered.unbind(0)), block.data) if exchange and w > 1 else None
        compute(plan[0], block.data)
        if pending is not None:
            transport.wait(pending)
        for step in range(1, w):
            compute(plan[step], gathered[ring_source(rank, step, w)] if exchange else block.data)
    return out, lse

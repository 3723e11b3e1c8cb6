"""Where each rank's tokens lie: the zigzag split of every sequence's queries and keys over W ranks.

Pure host code (NumPy): every rank computes the whole layout from the batch's lengths and
positions, so no rank ever asks another where its rows are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Tuple

import numpy as np

__all__ = ["Split", "ZigzagLayout", "chunk_bounds", "rank_chunks"]

_MAX_I32 = 2**31 - 1


def rank_chunks(rank: int, world_size: int) -> Tuple[int, int]:
    """The two chunks (of ``2 * world_size``) that ``rank`` holds: ``rank`` and ``2W - 1 - rank``.

    Under a causal mask chunk ``c`` of the queries sees ``c + 1/2`` chunks of keys, so every rank
    gets ``2W`` chunk-pairs of work: the zigzag balances causal attention."""
    return rank, 2 * world_size - 1 - rank


def chunk_bounds(lengths: np.ndarray, parts: int) -> np.ndarray:
    """``[B, parts + 1]`` bounds splitting each length into ``parts`` near-equal chunks
    (``floor(c * n / parts)``; chunk sizes differ by at most one)."""
    lengths = np.asarray(lengths, np.int64)
    return (np.arange(parts + 1, dtype=np.int64)[None, :] * lengths[:, None]) // parts


@dataclass(frozen=True)
class Split:
    """One side (queries or keys) of a ragged batch, zigzag-split over ``world_size`` ranks.

    Attributes
    ----------
    lengths, pos0, row0 : ``[B]`` int64
        Each sequence's row count, absolute position of its first row, and first row in the
        packed one-GPU tensor.
    world_size : int
    """

    lengths: np.ndarray
    pos0: np.ndarray
    row0: np.ndarray
    world_size: int

    @property
    def bounds(self) -> np.ndarray:
        return chunk_bounds(self.lengths, 2 * self.world_size)

    def half(self, rank: int, half: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(lengths, pos0, row0)`` (each ``[B]``) of the chunk that ``rank`` holds in ``half`` (0 or 1):
        chunk ``rank`` or ``2W - 1 - rank`` of every sequence."""
        c = rank_chunks(rank, self.world_size)[half]
        b = self.bounds
        return b[:, c + 1] - b[:, c], self.pos0 + b[:, c], self.row0 + b[:, c]

    def half_rows(self, rank: int) -> Tuple[int, int]:
        """Rows of ``rank``'s first half and of its second half; the local tensor is the first half's
        chunks of every sequence in order, then the second half's."""
        return int(self.half(rank, 0)[0].sum()), int(self.half(rank, 1)[0].sum())

    def count(self, rank: int) -> int:
        """Rows ``rank`` holds."""
        return sum(self.half_rows(rank))

    def max_count(self) -> int:
        return max(self.count(r) for r in range(self.world_size))

    def _local(self, rank: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(sequence, position, one-GPU row)`` of each local row of ``rank``."""
        halves = [self.half(rank, h) for h in (0, 1)]
        n = np.concatenate([h[0] for h in halves])
        seq = np.repeat(np.tile(np.arange(len(self.lengths), dtype=np.int64), 2), n)
        within = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
        pos0 = np.repeat(np.concatenate([h[1] for h in halves]), n)
        row0 = np.repeat(np.concatenate([h[2] for h in halves]), n)
        return seq, pos0 + within, row0 + within

    def rows(self, rank: int) -> np.ndarray:
        """Row of the one-GPU tensor of each local row of ``rank`` (``[count(rank)]`` int64)."""
        return self._local(rank)[2]

    def positions(self, rank: int) -> np.ndarray:
        """Absolute position of each local row of ``rank``."""
        return self._local(rank)[1]

    def sequences(self, rank: int) -> np.ndarray:
        """Sequence index of each local row of ``rank``."""
        return self._local(rank)[0]


def _host_ints(x: Any, name: str) -> np.ndarray:
    """A small integer array (NumPy, CuPy or torch, any device) as int64 on the host."""
    if hasattr(x, "detach"):  # torch
        x = x.detach().cpu().numpy()
    elif hasattr(x, "get") and not isinstance(x, np.ndarray):  # CuPy
        x = x.get()
    a = np.asarray(x)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected a 1-D integer array, got {a.dtype.name} of shape {list(a.shape)}")
    return a.astype(np.int64)


@dataclass(frozen=True)
class ZigzagLayout:
    """The rank layout of one ragged batch over ``world_size`` ranks.

    Every sequence's queries are split into ``2W`` near-equal chunks, and so are its keys; rank
    ``r`` holds chunks ``r`` and ``2W - 1 - r`` of both (:func:`rank_chunks`). A rank's local
    tensors hold its first chunk of every sequence in batch order, then its second chunk of every
    sequence. True positions are kept, so any mask acts exactly as in the one-GPU call.

    Build it with :meth:`from_offsets` from the one-GPU call's arguments.

    Attributes
    ----------
    q, k : Split
        The queries and the keys.
    """

    q: Split
    k: Split

    @property
    def world_size(self) -> int:
        return self.q.world_size

    @property
    def batch(self) -> int:
        return int(len(self.q.lengths))

    @property
    def total_q(self) -> int:
        """Rows of the one-GPU query tensor (``valid_length[-1]``)."""
        return int(self.q.row0[-1] + self.q.lengths[-1]) if self.batch else 0

    @classmethod
    def from_offsets(cls, valid_length, cache_row_offsets, world_size: int, *, cache_offsets=None,
                     q_start_pos=None) -> "ZigzagLayout":
        """The layout of the one-GPU call ``mla_prefill(q, k, v, k_rope, valid_length,
        cache_row_offsets, cache_offsets=..., q_start_pos=...)`` over ``world_size`` ranks.

        Parameters
        ----------
        valid_length, cache_row_offsets : ``[B + 1]`` integer arrays (NumPy, CuPy or torch; read once)
        world_size : int
        cache_offsets, q_start_pos : ``[B]`` integer arrays, optional
            As in :func:`mla_cupy.mla_prefill` (queries default to the end of the keys).

        Raises
        ------
        ValueError
            Offsets that do not start at 0 or decrease, a ``[B]`` array of another length, or key
            positions beyond the int32 range the kernels' ``cache_offsets`` take.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
            raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
        vl, cro = _host_ints(valid_length, "valid_length"), _host_ints(cache_row_offsets, "cache_row_offsets")
        for name, off in (("valid_length", vl), ("cache_row_offsets", cro)):
            if len(off) < 1 or off[0] != 0 or np.any(np.diff(off) < 0):
                raise ValueError(f"{name}: expected non-decreasing offsets starting at 0, got {off.tolist()[:8]}")
        if len(vl) != len(cro):
            raise ValueError(f"cache_row_offsets: expected {len(vl)} entries (B + 1 with B from valid_length), got {len(cro)}")
        batch = len(vl) - 1
        sq, sk = np.diff(vl), np.diff(cro)
        co = np.zeros(batch, np.int64) if cache_offsets is None else _host_ints(cache_offsets, "cache_offsets")
        if len(co) != batch:
            raise ValueError(f"cache_offsets: expected {batch} entries (B), got {len(co)}")
        if np.any(co < 0) or np.any(co + sk > _MAX_I32):
            raise ValueError(f"cache_offsets: key positions must lie in [0, {_MAX_I32}], got first positions {co.tolist()[:8]}")
        q_start = co + sk - sq if q_start_pos is None else _host_ints(q_start_pos, "q_start_pos")
        if len(q_start) != batch:
            raise ValueError(f"q_start_pos: expected {batch} entries (B), got {len(q_start)}")
        w = int(world_size)
        return cls(Split(sq, q_start, vl[:-1], w), Split(sk, co, cro[:-1], w))


def check_layout_arg(layout: Any) -> ZigzagLayout:
    """``layout`` itself, or a ``TypeError`` naming it."""
    if not isinstance(layout, ZigzagLayout):
        raise TypeError(f"layout: expected a ZigzagLayout (ZigzagLayout.from_offsets or shard()), got {type(layout).__name__}")
    return layout

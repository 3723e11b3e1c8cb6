"""The ring schedule of one rank: at step ``s`` it holds the keys of rank ``(rank - s) mod W`` and
attends its queries to them in up to four calls (its two query halves x the two key halves),
leaving out every call that the mask removes entirely. Pure host code."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import numpy as np

from ..masks import Mask
from .layout import ZigzagLayout
from .visibility import block_visible

__all__ = ["AttentionCall", "ring_source", "rank_schedule"]


@dataclass(frozen=True)
class AttentionCall:
    """One local attention call: a ragged batch of some of this rank's query chunks over the key
    chunks of one half of rank ``src``'s keys, at their true positions.

    Attributes
    ----------
    src, q_half, k_half : int
        Whose keys, which half of this rank's queries, which half of ``src``'s keys.
    q_rows, k_rows : (start, stop)
        Rows of this rank's local queries, and of ``src``'s local keys.
    q_offsets, k_offsets : ``[n + 1]`` int64
        Row offsets of the ``n`` sequences of the call, relative to ``q_rows[0]`` / ``k_rows[0]``.
    q_pos0, k_pos0 : ``[n]`` int64
        Absolute position of each sequence's first query and first key in the call.
    max_q : int
        Most queries of one sequence in the call.
    """

    src: int
    q_half: int
    k_half: int
    q_rows: Tuple[int, int]
    k_rows: Tuple[int, int]
    q_offsets: np.ndarray
    k_offsets: np.ndarray
    q_pos0: np.ndarray
    k_pos0: np.ndarray
    max_q: int


def ring_source(rank: int, step: int, world_size: int) -> int:
    """The rank whose keys ``rank`` holds at ``step`` (keys travel from rank r to rank r + 1)."""
    return (rank - step) % world_size


def _offsets(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _call(layout: ZigzagLayout, mask: Mask, rank: int, src: int, qh: int, kh: int):
    """The call of query half ``qh`` over ``src``'s key half ``kh``, trimmed to the sequences from the
    first to the last one that sees a key, or None when none does."""
    qn, qp, _ = layout.q.half(rank, qh)
    kn, kp, _ = layout.k.half(src, kh)
    seen = [block_visible(mask, int(qp[b]), int(qp[b] + qn[b]), int(kp[b]), int(kp[b] + kn[b]))
            for b in range(layout.batch)]
    if not any(seen):
        return None
    b0 = seen.index(True)
    b1 = len(seen) - seen[::-1].index(True)
    q_base = 0 if qh == 0 else layout.q.half_rows(rank)[0]
    k_base = 0 if kh == 0 else layout.k.half_rows(src)[0]
    qo, ko = _offsets(qn), _offsets(kn)
    return AttentionCall(src, qh, kh, (q_base + int(qo[b0]), q_base + int(qo[b1])),
                         (k_base + int(ko[b0]), k_base + int(ko[b1])), qo[b0:b1 + 1] - qo[b0],
                         ko[b0:b1 + 1] - ko[b0], qp[b0:b1].copy(), kp[b0:b1].copy(), int(qn[b0:b1].max()))


def rank_schedule(layout: ZigzagLayout, rank: int, mask: Mask) -> List[List[AttentionCall]]:
    """The calls ``rank`` makes at each of the ``W`` ring steps (a step may have none)."""
    w = layout.world_size
    if not 0 <= rank < w:
        raise ValueError(f"rank: expected 0 <= rank < {w} (the layout's world_size), got {rank}")
    steps = []
    for step in range(w):
        src = ring_source(rank, step, w)
        calls = [_call(layout, mask, rank, src, qh, kh) for qh in (0, 1) for kh in (0, 1)]
        steps.append([c for c in calls if c is not None])
    return steps

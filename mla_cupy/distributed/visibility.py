"""Whether a mask leaves any (query, key) pair visible between two ranges of positions: decided on
the host from the positions alone, so work a mask removes entirely is never launched."""
from __future__ import annotations

from ..masks import CausalMask, ChunkedCausalMask, ChunkedMask, Mask, NullMask, SlidingWindowCausalMask

__all__ = ["block_visible"]


def block_visible(mask: Mask, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> bool:
    """True when some query position in ``[q_lo, q_hi)`` sees some key position in ``[k_lo, k_hi)``.

    Exact for the package's masks; a mask of another class is assumed to see something (the
    block is then computed, which is always correct).
    """
    if q_lo >= q_hi or k_lo >= k_hi:
        return False
    q_last, k_last = q_hi - 1, k_hi - 1
    kind = type(mask)
    if kind is NullMask:
        return True
    if kind is CausalMask:
        return k_lo <= q_last
    if kind is SlidingWindowCausalMask:
        # query q sees keys [q - w + 1, q]; together the queries see [q_lo - w + 1, q_last]
        return k_lo <= q_last and k_last >= q_lo - mask.window + 1
    if kind in (ChunkedMask, ChunkedCausalMask):
        c = mask.chunk
        shared = max(q_lo // c, k_lo // c) <= min(q_last // c, k_last // c)
        # in a shared chunk g the last query of g (>= every key of g in range) sees the first key
        return shared and (kind is ChunkedMask or k_lo <= q_last)
    return True

"""Properties of the masks that the Hopper kernel relies on, checked on their Python predicates
(mla_cupy/masks.py states the same predicates as kernels/mask.cuh)."""
import numpy as np
import pytest

from mla_cupy import CausalMask, ChunkedCausalMask, ChunkedMask, NullMask, SlidingWindowCausalMask

MASKS = [NullMask(), CausalMask(), SlidingWindowCausalMask(1), SlidingWindowCausalMask(37), ChunkedMask(1),
         ChunkedMask(50), ChunkedCausalMask(7), ChunkedCausalMask(128)]


@pytest.mark.parametrize("mask", MASKS, ids=repr)
def test_first_and_last_visible_key_never_decrease(mask):
    """kernels/mask.cuh: common_key_range takes the keys every query of a block sees as [first
    key of the last query, last key of the first query]; that holds when both ends are
    non-decreasing in the query position (and each query sees one interval)."""
    ks = np.arange(-400, 400)
    prev = None
    for q in range(-150, 151):
        idx = np.flatnonzero(mask.visible(np.int64(q), ks))
        if idx.size == 0:
            continue
        assert idx[-1] - idx[0] + 1 == idx.size, f"q={q}: visible keys are not one interval"
        ends = (ks[idx[0]], ks[idx[-1]])
        if prev is not None:
            assert ends[0] >= prev[0] and ends[1] >= prev[1], f"q={q}: {ends} after {prev}"
        prev = ends


def test_the_check_can_fail():
    """A predicate whose window shrinks as the query moves on is caught by the test above."""

    class Shrinking:
        def visible(self, q, k):
            return (k >= -q) & (k <= q)

    with pytest.raises(AssertionError, match="after"):
        test_first_and_last_visible_key_never_decrease(Shrinking())

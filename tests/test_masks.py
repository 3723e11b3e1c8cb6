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



def test_one_table_of_mask_kinds():
    """MASK_KINDS is the one order of the mask kinds (the torch ops' mask_kind); the package's
    MASKS holds one of each in that order, and every mask is rebuilt from its kind and its
    run-time argument."""
    from mla_cupy import masks

    assert tuple(type(m) for m in masks.MASKS) == masks.MASK_KINDS
    kernel_masks = {c for c in _subclasses(masks.Mask) if c.cpp_name}
    assert set(masks.MASK_KINDS) == kernel_masks and len(masks.MASK_KINDS) == len(kernel_masks)
    assert [m.arg for m in masks.MASKS] == [0, 0, 64, 128, 128]
    for m in masks.MASKS + tuple(MASKS):
        assert type(m).from_arg(m.arg) == m
    with pytest.raises(ValueError, match="window must be >= 1"):
        SlidingWindowCausalMask.from_arg(0)
    with pytest.raises(TypeError, match="chunk must be an int"):
        ChunkedMask(2.0)


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)

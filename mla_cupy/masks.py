"""Attention masks. Each mask is one C++ template instantiation (``kernels/mask.cuh``); its window
or chunk size is a run-time argument, so changing it never recompiles.

A mask is a predicate on absolute positions ``(q_pos, k_pos)``; ``True`` means visible. ``//`` is
floor division (toward minus infinity, also for negative positions). From one query, every mask
sees one interval of key positions; :meth:`Mask.key_range` gives it (``key_range`` of
``kernels/mask.cuh``), which is how a kernel bounds the keys a block of queries reads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

__all__ = ["Mask", "NullMask", "CausalMask", "SlidingWindowCausalMask", "ChunkedMask", "ChunkedCausalMask",
           "MASK_KINDS", "MASKS", "POS_MIN", "POS_MAX"]

#: Key positions that stand for "no bound" in :meth:`Mask.key_range` (kPosMin / kPosMax of kernels/common.cuh).
POS_MIN, POS_MAX = -(1 << 62), 1 << 62


@dataclass(frozen=True)
class Mask:
    """Base class. Subclasses define ``cpp_name``, ``arg`` and ``visible``."""

    cpp_name: ClassVar[str] = ""
    #: Whether a query's visible keys start at a position that depends on the query (the window and
    #: chunked masks), as the kernels' ``kBoundedBelow`` (kernels/mask.cuh).
    bounded_below: ClassVar[bool] = False
    #: Whether they end at a position that depends on the query (every mask but ``NullMask``), as the
    #: kernels' ``kBoundedAbove``.
    bounded_above: ClassVar[bool] = True

    @property
    def arg(self) -> int:
        """The run-time argument passed to the kernel (window or chunk size; 0 if none)."""
        return 0

    @classmethod
    def from_arg(cls, arg: int) -> "Mask":
        """The mask of this kind whose run-time argument is ``arg`` (ignored by a mask without a
        size): ``type(m).from_arg(m.arg) == m``."""
        return cls()

    def visible(self, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def key_range(self, q_lo, q_hi):  # pragma: no cover - abstract
        """Half-open key positions ``[k_lo, k_hi)`` holding every key that a query in ``[q_lo, q_hi]``
        sees (int64 arrays, or :data:`POS_MIN` / :data:`POS_MAX` for no bound). For one query
        (``q_lo == q_hi``) exactly its visible keys; for a block of queries the kernels read
        nothing outside it."""
        raise NotImplementedError

    def _check_positive(self, name: str, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{type(self).__name__}: {name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{type(self).__name__}: {name} must be >= 1, got {value}")


@dataclass(frozen=True)
class NullMask(Mask):
    """Every key is visible to every query."""

    cpp_name: ClassVar[str] = "mla::NullMask"
    bounded_above: ClassVar[bool] = False

    def visible(self, q_pos, k_pos):
        return np.ones(np.broadcast_shapes(np.shape(q_pos), np.shape(k_pos)), dtype=bool)

    def key_range(self, q_lo, q_hi):
        return np.full(np.shape(q_lo), POS_MIN, np.int64), np.full(np.shape(q_hi), POS_MAX, np.int64)


@dataclass(frozen=True)
class CausalMask(Mask):
    """``k_pos <= q_pos`` (the default)."""

    cpp_name: ClassVar[str] = "mla::CausalMask"

    def visible(self, q_pos, k_pos):
        return k_pos <= q_pos

    def key_range(self, q_lo, q_hi):
        return np.full(np.shape(q_lo), POS_MIN, np.int64), np.asarray(q_hi, np.int64) + 1


@dataclass(frozen=True)
class _SizedMask(Mask):
    """A mask with one size, its run-time argument: a positive int in the field that
    ``size_field`` names."""

    size_field: ClassVar[str] = ""

    def __post_init__(self):
        self._check_positive(self.size_field, getattr(self, self.size_field))

    @property
    def arg(self) -> int:
        return int(getattr(self, self.size_field))

    @classmethod
    def from_arg(cls, arg: int) -> "Mask":
        return cls(int(arg))


@dataclass(frozen=True)
class SlidingWindowCausalMask(_SizedMask):
    """``k_pos <= q_pos`` and ``q_pos - k_pos < window``: ``window`` keys, the diagonal included
    (FlashAttention's ``window_left = window - 1``)."""

    window: int
    cpp_name: ClassVar[str] = "mla::SlidingWindowCausalMask"
    bounded_below: ClassVar[bool] = True
    size_field: ClassVar[str] = "window"

    def visible(self, q_pos, k_pos):
        return (k_pos <= q_pos) & (q_pos - k_pos < self.window)

    def key_range(self, q_lo, q_hi):
        return np.asarray(q_lo, np.int64) - self.window + 1, np.asarray(q_hi, np.int64) + 1


@dataclass(frozen=True)
class _ChunkMask(_SizedMask):
    chunk: int
    size_field: ClassVar[str] = "chunk"

    def _same_chunk(self, q_pos, k_pos):
        return np.floor_divide(q_pos, self.chunk) == np.floor_divide(k_pos, self.chunk)


@dataclass(frozen=True)
class ChunkedMask(_ChunkMask):
    """``q_pos // chunk == k_pos // chunk`` (bidirectional inside each chunk)."""

    cpp_name: ClassVar[str] = "mla::ChunkedMask"
    bounded_below: ClassVar[bool] = True

    def visible(self, q_pos, k_pos):
        return self._same_chunk(q_pos, k_pos)

    def key_range(self, q_lo, q_hi):
        c = self.chunk
        return np.floor_divide(np.asarray(q_lo, np.int64), c) * c, (np.floor_divide(np.asarray(q_hi, np.int64), c) + 1) * c


@dataclass(frozen=True)
class ChunkedCausalMask(_ChunkMask):
    """Causal and in the same chunk: ``k_pos <= q_pos`` and ``q_pos // chunk == k_pos // chunk``."""

    cpp_name: ClassVar[str] = "mla::ChunkedCausalMask"
    bounded_below: ClassVar[bool] = True

    def visible(self, q_pos, k_pos):
        return (k_pos <= q_pos) & self._same_chunk(q_pos, k_pos)

    def key_range(self, q_lo, q_hi):
        return np.floor_divide(np.asarray(q_lo, np.int64), self.chunk) * self.chunk, np.asarray(q_hi, np.int64) + 1


#: Every kind of mask, in one order: the ``mask_kind`` of the torch ops (:mod:`mla_cupy.torch_ops`) is
#: an index into this tuple.
MASK_KINDS = (NullMask, CausalMask, SlidingWindowCausalMask, ChunkedMask, ChunkedCausalMask)

#: One representative instance of every mask kind, in :data:`MASK_KINDS` order (a window of 64 keys,
#: chunks of 128): the compile matrix and the tests iterate it.
MASKS = tuple(kind.from_arg(64 if kind is SlidingWindowCausalMask else 128) for kind in MASK_KINDS)

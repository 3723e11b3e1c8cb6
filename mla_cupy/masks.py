"""Attention masks. Each mask is one C++ template instantiation (``kernels/mask.cuh``); its window
or chunk size is a run-time argument, so changing it never recompiles.

A mask is a predicate on absolute positions ``(q_pos, k_pos)``; ``True`` means visible. ``//`` is
floor division (toward minus infinity, also for negative positions).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

__all__ = ["Mask", "NullMask", "CausalMask", "SlidingWindowCausalMask", "ChunkedMask", "ChunkedCausalMask", "MASKS"]


@dataclass(frozen=True)
class Mask:
    """Base class. Subclasses define ``cpp_name``, ``arg`` and ``visible``."""

    cpp_name: ClassVar[str] = ""

    @property
    def arg(self) -> int:
        """The run-time argument passed to the kernel (window or chunk size; 0 if none)."""
        return 0

    def visible(self, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
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

    def visible(self, q_pos, k_pos):
        return np.ones(np.broadcast_shapes(np.shape(q_pos), np.shape(k_pos)), dtype=bool)


@dataclass(frozen=True)
class CausalMask(Mask):
    """``k_pos <= q_pos`` (the default)."""

    cpp_name: ClassVar[str] = "mla::CausalMask"

    def visible(self, q_pos, k_pos):
        return k_pos <= q_pos


@dataclass(frozen=True)
class SlidingWindowCausalMask(Mask):
    """``k_pos <= q_pos`` and ``q_pos - k_pos < window``: ``window`` keys, the diagonal included
    (FlashAttention's ``window_left = window - 1``)."""

    window: int
    cpp_name: ClassVar[str] = "mla::SlidingWindowCausalMask"

    def __post_init__(self):
        self._check_positive("window", self.window)

    @property
    def arg(self) -> int:
        return int(self.window)

    def visible(self, q_pos, k_pos):
        return (k_pos <= q_pos) & (q_pos - k_pos < self.window)


@dataclass(frozen=True)
class _ChunkMask(Mask):
    chunk: int

    def __post_init__(self):
        self._check_positive("chunk", self.chunk)

    @property
    def arg(self) -> int:
        return int(self.chunk)

    def _same_chunk(self, q_pos, k_pos):
        return np.floor_divide(q_pos, self.chunk) == np.floor_divide(k_pos, self.chunk)


@dataclass(frozen=True)
class ChunkedMask(_ChunkMask):
    """``q_pos // chunk == k_pos // chunk`` (bidirectional inside each chunk)."""

    cpp_name: ClassVar[str] = "mla::ChunkedMask"

    def visible(self, q_pos, k_pos):
        return self._same_chunk(q_pos, k_pos)


@dataclass(frozen=True)
class ChunkedCausalMask(_ChunkMask):
    """Causal and in the same chunk: ``k_pos <= q_pos`` and ``q_pos // chunk == k_pos // chunk``."""

    cpp_name: ClassVar[str] = "mla::ChunkedCausalMask"

    def visible(self, q_pos, k_pos):
        return (k_pos <= q_pos) & self._same_chunk(q_pos, k_pos)


#: One representative instance of every mask kind (the compile matrix and the tests iterate it).
MASKS = (NullMask(), CausalMask(), SlidingWindowCausalMask(64), ChunkedMask(128), ChunkedCausalMask(128))

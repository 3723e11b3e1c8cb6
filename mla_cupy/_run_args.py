"""What a run of a plan takes and what a plan fixes, described once for the checks and the
packing: the slots of a run's arrays (:data:`SLOTS`), the offsets a launch reads (:class:`Offsets`)
and what a plan fixes besides its :class:`~mla_cupy.validation.Problem` (:class:`Target`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["SLOTS", "Q", "K", "V", "ROPE", "OUT", "LSE", "RSC", "QR", "QS", "KS", "WS", "Offsets", "Target"]

#: Argument slots of a run, in this order: the arrays (and pointers) of a run are a list over them.
SLOTS = ("q", "k", "v", "k_rope", "out", "lse", "k_rope_scales", "q_rope", "q_scale", "k_scales", "workspace")
Q, K, V, ROPE, OUT, LSE, RSC, QR, QS, KS, WS = range(len(SLOTS))


@dataclass(frozen=True)
class Offsets:
    """Device pointers of the offset arrays a launch reads, and the arrays they belong to."""

    keep: tuple
    q_offsets: int
    kv_begin: int
    kv_end: int
    cache_offsets: int
    q_start: int


@dataclass(frozen=True)
class Target:
    """What a plan fixes besides its :class:`~mla_cupy.validation.Problem`: the kernel and device,
    the offsets, ``accumulate``, and a paged rope's table and geometry."""

    kernel: str
    device_id: int
    offsets: Offsets
    accumulate: bool
    page_table: Any = None
    page_size: int = 0
    rope_offset: int = 0

"""The plan cache of the one-shot calls: a bounded, least-recently-used map from everything a call's
launch record bakes in to that record, so that a call seen before skips its checks, its plan and
its packing and only rewrites its data pointers and launches, as :meth:`PrefillPlan.run
<mla_cupy.prefill_plan.PrefillPlan.run>` does.

What the key holds, and why an entry can never launch stale arguments, is told where the keys are
built (:mod:`mla_cupy.api`) and in the README ("The one-shot calls' plan cache"). This module holds
the store: its bound, its counts, and the entries (a record with the lock its launches take).
"""
from __future__ import annotations

import threading
from collections import OrderedDict, namedtuple
from typing import Hashable, Optional, Tuple

from ._packing import Record, launch_record
from .validation import Problem

__all__ = ["PlanCacheInfo", "CallEntry", "CACHE", "plan_cache_info", "plan_cache_clear", "set_plan_cache_size",
           "DEFAULT_MAXSIZE", "MAPS_MAX"]

#: Entries kept unless :func:`set_plan_cache_size` says otherwise.
DEFAULT_MAXSIZE = 256
#: Tensor-map sets (one per set of data pointers) that one cached record remembers.
MAPS_MAX = 64

PlanCacheInfo = namedtuple("PlanCacheInfo", ["hits", "misses", "maxsize", "currsize"])
PlanCacheInfo.__doc__ = """The counts of the plan cache (as ``functools``' ``cache_info``): calls launched from a cached
record (``hits``), calls that checked their arguments and packed a record (``misses``), the bound
(``maxsize``) and the entries held (``currsize``)."""


class CallEntry:
    """A cached call: its checked problem and launch record, and what a launch from it needs.

    Attributes
    ----------
    problem : Problem
        The problem the checks returned (its ``max_sq`` read from the offsets when the call did not
        bound it: a call then reads them and uses the entry only when they give the same maximum).
    record : Record
        The packed launch; it keeps no reference to any array (a paged rope's gathered rows are
        allocated per launch).
    align : tuple of int
        The slots (:data:`~mla_cupy._run_args.SLOTS`) whose data must start 16-byte aligned, as the
        checks of the call require: a call with a misaligned pointer is checked again (and hears
        which argument).
    workspace_shape : tuple or None
        The V^T shape of an fp8 call that allocates its workspace per call.
    widen_q_start : bool
        ``q_start_pos`` is int32: each call widens it to int64 and passes the copy's pointer.
    lock : threading.Lock
        Held around each launch: a record is rewritten and launched by one thread at a time.
    """

    __slots__ = ("problem", "record", "align", "workspace_shape", "widen_q_start", "lock")

    def __init__(self, problem: Problem, record: Record, align: Tuple[int, ...] = (),
                 workspace_shape: Optional[tuple] = None, widen_q_start: bool = False):
        self.problem, self.record, self.align = problem, record, align
        self.workspace_shape, self.widen_q_start = workspace_shape, widen_q_start
        self.lock = threading.Lock()

    def launch(self, ptrs, sp: int, q_start: Optional[int] = None, new_rows=None) -> None:
        """Rewrite the pointers into the record and launch it on stream ``sp``
        (:func:`~mla_cupy._packing.launch_record`; ``new_rows`` allocates a paged rope's key rows),
        holding the entry's lock."""
        with self.lock:
            launch_record(self.record, ptrs, sp, q_start, new_rows)


class PlanCache:
    """A bounded map of keys to :class:`CallEntry`, least recently used first out, safe to share
    between threads; ``maxsize=0`` keeps nothing."""

    def __init__(self, maxsize: int = DEFAULT_MAXSIZE):
        self._entries: "OrderedDict[Hashable, CallEntry]" = OrderedDict()
        self._lock = threading.Lock()
        self.maxsize = maxsize
        self.hits = self.misses = 0

    def get(self, key: Hashable) -> Optional[CallEntry]:
        """The entry of ``key`` (now the most recently used), or None. Raises ``TypeError`` for an
        unhashable key."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: Hashable, entry: CallEntry) -> None:
        with self._lock:
            if self.maxsize <= 0:
                return
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)

    def count(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1

    def info(self) -> PlanCacheInfo:
        with self._lock:
            return PlanCacheInfo(self.hits, self.misses, self.maxsize, len(self._entries))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0

    def resize(self, maxsize: int) -> None:
        with self._lock:
            self.maxsize = maxsize
            while len(self._entries) > max(maxsize, 0):
                self._entries.popitem(last=False)


#: The cache of every one-shot call of the process.
CACHE = PlanCache()


def plan_cache_info() -> PlanCacheInfo:
    """The counts of the one-shot calls' plan cache.

    Returns
    -------
    PlanCacheInfo
        A named tuple ``(hits, misses, maxsize, currsize)``, as ``functools``' ``cache_info``:
        calls of :func:`mla_cupy.mla_prefill` (and of what is built on it: ``mla_prefill_fp8``,
        the chunks of ``mla_prefill_chunked``, the torch ops, ``flash_attn_varlen_func``, the
        transformers and context-parallel backends) that launched a cached record, calls that
        checked their arguments and packed one, the bound and the entries held.

    Notes
    -----
    An entry is a launch record (host memory: its packed arguments and up to 64 sets of tensor
    maps), never an array: the cache holds no device memory and keeps no array alive.
    """
    return CACHE.info()


def plan_cache_clear() -> None:
    """Drop every entry of the one-shot calls' plan cache and reset its counts."""
    CACHE.clear()


def set_plan_cache_size(maxsize: int) -> None:
    """Bound the one-shot calls' plan cache to ``maxsize`` entries (default 256), dropping the least
    recently used ones beyond it; ``0`` disables it (every call checks its arguments and packs its
    launch, as a :func:`mla_cupy.plan` built and dropped per call).

    Parameters
    ----------
    maxsize : int
        A non-negative int.
    """
    if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 0:
        raise ValueError(f"maxsize: expected a non-negative int, got {maxsize!r}")
    CACHE.resize(maxsize)

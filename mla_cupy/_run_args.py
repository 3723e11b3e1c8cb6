"""What a run of a plan takes and what a plan fixes, described once for the checks and the
packing: a run's arrays by name (:class:`PrefillArrays`), the offsets a launch reads
(:class:`Offsets`) and what a plan fixes besides its :class:`~mla_cupy.validation.Problem`
(:class:`Target`).

A direction of the pipeline (the forward prefill here) has its run's arrays as one ``NamedTuple``:
the checks read them by name, and the packing turns each field into a slot of the launch record,
its position in the tuple, so that a launch rewrites the pointers of a list in that order
(:func:`mla_cupy._arrays.pointers_and_layouts`) without naming anything. Another direction brings
its own tuple of arrays to the same record and launch machinery."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["PrefillArrays", "prefill_arrays", "BackwardArrays", "backward_arrays", "Offsets", "Target"]


class PrefillArrays(NamedTuple):
    """The arrays of one forward run, in the order of its launch record's pointer slots; None
    where a run has none. The fp8 per-token variant's ``q`` and ``k`` are its e4m3 nope parts, its
    ``v`` the e4m3 values or the data of V^T made ahead; a paged rope's ``k_rope`` is its blocks,
    ``k_rope_scales`` their scales."""

    q: Any
    k: Any
    v: Any
    k_rope: Any
    out: Any = None
    lse: Any = None
    k_rope_scales: Any = None
    q_rope: Any = None
    q_scale: Any = None
    k_scales: Any = None
    workspace: Any = None  #: fp8: where the pre-pass writes V^T


_new_tuple = tuple.__new__


def prefill_arrays(q, k, v, k_rope, out=None, lse=None, k_rope_scales=None, q_rope=None, q_scale=None, k_scales=None,
                   workspace=None) -> PrefillArrays:
    """A forward run's arrays, as ``PrefillArrays(...)`` makes them but without the class call's
    dispatch: every run and every one-shot call builds one."""
    return _new_tuple(PrefillArrays, (q, k, v, k_rope, out, lse, k_rope_scales, q_rope, q_scale, k_scales, workspace))


class BackwardArrays(NamedTuple):
    """The arrays of one backward run (:meth:`~mla_cupy.prefill_plan.PrefillPlan.run_backward`,
    :func:`mla_cupy.mla_prefill_backward`), in the order of its launch record's pointer slots: the
    gradient of the output, the forward's inputs and results, the gradients written, and the
    gradient of lse where the loss reads it (None where a run has none)."""

    dout: Any
    q: Any
    k: Any
    v: Any
    k_rope: Any
    out: Any
    lse: Any
    dq: Any = None
    dk: Any = None
    dv: Any = None
    dk_rope: Any = None
    dlse: Any = None


def backward_arrays(dout, q, k, v, k_rope, out, lse, dq=None, dk=None, dv=None, dk_rope=None,
                    dlse=None) -> BackwardArrays:
    """A backward run's arrays, as :func:`prefill_arrays` makes a forward run's."""
    return _new_tuple(BackwardArrays, (dout, q, k, v, k_rope, out, lse, dq, dk, dv, dk_rope, dlse))


@dataclass(frozen=True)
class Offsets:
    """Device pointers of the offset arrays a launch reads, and the arrays they belong to (kept
    alive with a plan's launches; none for the one-shot calls' cached plans)."""

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

"""``mla-cupy bench --host``: the host time of one call, for every way of calling the kernel and
for the peers' calls, side by side.

Each call runs ``calls`` times back to back on a problem small enough that the GPU never limits
the rate (:data:`HOST_CASE`), with ``out=`` given wherever the call takes it, from an idle device;
the wall time divided by ``calls`` is one sample (:func:`mla_cupy.bench.per_call_us`). The samples
of all calls are taken in interleaved rounds, one sample of each call per round in alternating
order, and each row reports the median over the rounds with the smallest and largest sample.
Before the rounds every call runs a few times (kernel compilation, first-layout packing); a call
that raises there or in a round is reported as failed and timed no further.

The rows (``group`` "ours" or "peer"):

* ``plan.run``: a plan built once (:func:`mla_cupy.plan`), run on CuPy arrays and on torch tensors;
* ``mla_prefill``: the one-shot call with ``q_max_seq_len=`` and ``validate=False``, and with the
  default arguments (``out=`` and the case's mask given, ``q_max_seq_len`` and ``validate`` left at
  their defaults), on CuPy arrays and on torch tensors: calls seen before, launched from the plan
  cache; and the first form with the plan cache not looked up (the call checks its arguments and
  packs its launch, as the first call of a key does), on CuPy arrays;
* ``torch_ops.mla_prefill``: the ``torch.ops`` route, ``q_max_seq_len=`` and ``validate=False``;
* ``flash_attn.flash_attn_varlen_func``: the FlashAttention-style call with ``k_rope=``;
* other implementations' calls, given by the caller (``peers=``: ``benchmarks/peers.py``'s
  :func:`host_peer_calls`, FlashAttention-3's and cuDNN's, through ``benchmarks/matrix.py --host``).

Rows that need torch, or a peer that does not import, are left out with one line each
(``left_out`` in the result).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

from .bench import BenchCase, device_info, make_inputs, per_call_us
from .dims import DV

__all__ = ["HOST_CASE", "HostCall", "HostRow", "host_calls", "time_calls", "run", "format_table"]

#: The problem of every host-time row: one causal sequence of 64 queries and keys, 16 heads.
HOST_CASE = BenchCase("host-1x64-H16", (64,), (64,), heads=16)


@dataclass
class HostCall:
    """One call to time: ``fn(i)`` makes the call (``i``, the call's index, is not used)."""

    impl: str
    group: str  # "ours" or "peer"
    fn: Callable[[int], object]
    note: str = ""


@dataclass
class HostRow:
    """The host time of one call: median, smallest and largest sample in microseconds per call."""

    impl: str
    group: str
    us: float
    us_min: float
    us_max: float
    samples: List[float] = field(default_factory=list)
    note: str = ""


def time_calls(calls: Sequence[HostCall], *, reps: int, n: int, sync: Callable[[], object],
               clock: Callable[[], float] = time.perf_counter, warmup: int = 3) -> List[HostRow]:
    """Host time of each call: ``warmup`` calls each, then ``reps`` interleaved rounds of one sample
    per call, in the order of ``calls`` in even rounds and reversed in odd ones.

    Parameters
    ----------
    calls : sequence of HostCall
    reps : int
        Rounds; each gives one sample per call.
    n : int
        Calls back to back in one sample (:func:`mla_cupy.bench.per_call_us`).
    sync : callable
        Waits until the device is idle.
    clock : callable
        Seconds, for the wall time of a sample.
    warmup : int
        Untimed calls of each call before the rounds.

    Returns
    -------
    list of HostRow
        In the order of ``calls``: the median, smallest and largest sample. A call that raised is
        timed no further; its row has NaN times and says why in ``note``.
    """
    calls = list(calls)
    failed = {}
    samples = {c.impl: [] for c in calls}

    def warm(c: HostCall) -> None:
        for i in range(warmup):
            c.fn(i)
        sync()

    def sample(c: HostCall) -> None:
        samples[c.impl].append(per_call_us(c.fn, n, n, sync, clock))

    def attempt(step: Callable[[HostCall], None], c: HostCall) -> None:
        if c.impl in failed:
            return
        try:
            step(c)
        except Exception as exc:  # the row reports it; the other calls go on
            failed[c.impl] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"

    for c in calls:
        attempt(warm, c)
    for r in range(reps):
        for c in (calls if r % 2 == 0 else calls[::-1]):
            attempt(sample, c)
    sync()
    rows = []
    nan = float("nan")
    for c in calls:
        xs = samples[c.impl] if c.impl not in failed else []
        note = failed.get(c.impl, c.note)
        if xs:
            rows.append(HostRow(c.impl, c.group, statistics.median(xs), min(xs), max(xs), xs, note))
        else:
            rows.append(HostRow(c.impl, c.group, nan, nan, nan, [], note))
    return rows


#: ``peers(case, tensors, out) -> (calls, left_out)``: more calls to time beside ours, on the torch
#: tensors of the case's input set (``q``, ``k``, ``v``, ``k_rope``) with a torch ``out`` buffer.
PeerCalls = Callable[[BenchCase, dict, object], Tuple[List["HostCall"], List[str]]]


def host_calls(case: BenchCase = HOST_CASE, *,
               peers: Optional[PeerCalls] = None) -> Tuple[List[HostCall], List[str]]:
    """The calls of :func:`run` on the current GPU.

    Parameters
    ----------
    case : BenchCase
        The problem (default :data:`HOST_CASE`); its input set 0, with ``out=`` buffers made once.
    peers : callable, optional
        Other implementations' calls (:data:`PeerCalls`), added after ours when torch imports.

    Returns
    -------
    calls : list of HostCall
    left_out : list of str
        One line for each row left out (torch missing, a peer that does not import).
    """
    import cupy as cp

    from . import api, prefill_plan
    from ._arrays import BF16
    from ._plan_cache import CACHE

    x = make_inputs(case, 0)
    tq, heads, max_q = sum(case.sq), case.heads, max(case.sq)
    q, k, v, kr, vl, cro = (x[n] for n in ("q", "k", "v", "k_rope", "valid_length", "cache_row_offsets"))
    mask = case.mask
    out = cp.empty((tq, heads, DV), BF16)
    pl = prefill_plan.plan(vl, cro, num_heads=heads, dtype=BF16, mask=mask, q_max_seq_len=max_q)
    fast = dict(mask=mask, q_max_seq_len=max_q, validate=False)
    def uncached(i):
        size, CACHE.maxsize = CACHE.maxsize, 0  # not looked up (nothing dropped)
        try:
            api.mla_prefill(q, k, v, kr, vl, cro, out=out, **fast)
        finally:
            CACHE.maxsize = size

    calls = [
        HostCall("plan.run (CuPy)", "ours", lambda i: pl.run(q, k, v, kr, out=out)),
        HostCall("mla_prefill, q_max_seq_len= validate=False (CuPy)", "ours",
                 lambda i: api.mla_prefill(q, k, v, kr, vl, cro, out=out, **fast)),
        HostCall("mla_prefill, default arguments (CuPy)", "ours",
                 lambda i: api.mla_prefill(q, k, v, kr, vl, cro, mask=mask, out=out)),
        HostCall("mla_prefill, q_max_seq_len= validate=False, plan cache off (CuPy)", "ours", uncached),
    ]
    left_out: List[str] = []
    try:
        import torch
    except ImportError:
        left_out.append('torch rows left out: torch is not installed (pip install ".[torch]" in the mla_cupy checkout)')
        return calls, left_out
    from . import flash_attn, torch_ops

    t = {n: torch.from_dlpack(x[n]) for n in ("q", "k", "v", "k_rope")}
    tvl, tcro = (torch.from_dlpack(a.astype(cp.int32)) for a in (vl, cro))
    tout = torch.empty((tq, heads, DV), dtype=torch.bfloat16, device=t["q"].device)
    tq_, tk_, tv_, tkr_ = t["q"], t["k"], t["v"], t["k_rope"]
    calls += [
        HostCall("plan.run (torch)", "ours", lambda i: pl.run(tq_, tk_, tv_, tkr_, out=tout)),
        HostCall("mla_prefill, q_max_seq_len= validate=False (torch)", "ours",
                 lambda i: api.mla_prefill(tq_, tk_, tv_, tkr_, tvl, tcro, out=tout, **fast)),
        HostCall("mla_prefill, default arguments (torch)", "ours",
                 lambda i: api.mla_prefill(tq_, tk_, tv_, tkr_, tvl, tcro, mask=mask, out=tout)),
        HostCall("torch_ops.mla_prefill, q_max_seq_len= validate=False", "ours",
                 lambda i: torch_ops.mla_prefill(tq_, tk_, tv_, tkr_, tvl, tcro, out=tout, **fast)),
        HostCall("flash_attn.flash_attn_varlen_func, k_rope=", "ours",
                 lambda i: flash_attn.flash_attn_varlen_func(tq_, tk_, tv_, tvl, tcro, max_q, max(case.sk),
                                                             causal=case.causal, k_rope=tkr_, out=tout)),
    ]
    if peers is not None:
        more, why = peers(case, t, tout)
        calls += more
        left_out += why
    return calls, left_out


def run(*, calls: int = 300, reps: int = 20, peers: Optional[PeerCalls] = None, case: BenchCase = HOST_CASE) -> dict:
    """Time the calls of :func:`host_calls` on the current GPU (:func:`time_calls`).

    Parameters
    ----------
    calls : int
        Calls back to back in one sample.
    reps : int
        Interleaved rounds (samples per call).
    peers : callable, optional
        Other implementations' calls to time too (:data:`PeerCalls`).
    case : BenchCase
        The problem (default :data:`HOST_CASE`).

    Returns
    -------
    dict
        ``device``, ``compute_capability``, ``date``, ``case``, ``problem``, ``calls``, ``reps``,
        ``rows`` (each :class:`HostRow` as a dict) and ``left_out`` (lines).
    """
    import cupy as cp

    todo, left_out = host_calls(case, peers=peers)
    rows = time_calls(todo, reps=reps, n=calls, sync=cp.cuda.Device().synchronize)
    return dict(device_info(), case=case.name, problem=case.describe(), calls=calls, reps=reps,
                rows=[asdict(r) for r in rows], left_out=left_out)


def _us(x: float) -> str:
    return "" if x != x else f"{x:.1f}"


def format_table(result: dict) -> str:
    """The rows of :func:`run` as a table (microseconds per call), then the lines of what was left
    out."""
    head = ["call", "group", "us/call (median)", "min", "max", "note"]
    body = [[r["impl"], r["group"], _us(r["us"]), _us(r["us_min"]), _us(r["us_max"]), r["note"]]
            for r in result["rows"]]
    widths = [max(len(h), *(len(c[i]) for c in body)) if body else len(h) for i, h in enumerate(head)]

    def fmt(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    lines = [f"device: {result['device']}  host time per call: {result['problem']}, {result['calls']} calls back to "
             f"back, median of {result['reps']} interleaved rounds",
             fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    return "\n".join(lines + [fmt(c) for c in body] + list(result.get("left_out", [])))


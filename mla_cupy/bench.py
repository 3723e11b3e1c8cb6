"""``mla-cupy bench``: the kernels of this package timed on this GPU.

Every number in a table comes from one process on one warm GPU: our 16-bit kernel (and, with
``fp8=True``, the fp8 per-token and all-e4m3 modes) on each case of the matrix, beside the card's
bf16 matmul rate as a roofline. Times are medians of many repeats after warm-up, measured with CUDA
events behind a GPU-busy spin kernel (so they are GPU time; our host time per call is its own
column), rotating through enough input sets to defeat the L2 cache. FLOPs count visible (query,
key) pairs only: ``H * 2 * (192 + 128) * pairs``.

Every row's output is checked against the float64 reference on two heads (the first and the last):
``rel_err`` is the worst relative error over the (sequence, head) slices, as the contract defines
accuracy. fp8 rows are checked twice: against the reference of the inputs they were given (the
dequantized fp8 values, ``rel_err``) and against the reference of the unquantized 16-bit inputs
(``err_vs_16bit``), which is what quantization costs a user.

Other implementations (FlashAttention-3, cuDNN, torch SDPA, FlexAttention) are not part of the
package: ``benchmarks/peers.py`` holds their calls, as row builders that :func:`run` takes
(``builders=``), and ``benchmarks/matrix.py`` runs the matrix with them.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from ._arrays import BF16, FP8_E4M3
from .masks import CausalMask, Mask, NullMask
from .reference import visible_pairs
from .dims import DQK, DR, DV

__all__ = ["BenchCase", "DEFAULT_CASES", "EXTRA_CASES", "CPU_CASES", "ALL_CASES", "resolve_cases", "CaseRun", "Row",
           "FP8_ROWS", "n_input_sets", "make_inputs", "time_ms", "per_call_us", "host_us", "e4m3_to_f64",
           "failed_row", "device_info", "run", "run_cpu", "format_table", "write_csv", "write_json", "plot",
           "check_writable"]

L2_DEFEAT_BYTES = 256 << 20  # rotate input sets until their total passes this (H100/H200 L2: 50-60 MB)


def n_input_sets(case: "BenchCase") -> int:
    """Input sets a case's timed calls rotate through (1 to 8): enough 16-bit q, k and v that their
    total passes :data:`L2_DEFEAT_BYTES`, so that no call finds its inputs in L2."""
    set_bytes = (sum(case.sq) * DQK + 2 * sum(case.sk) * DV) * case.heads * 2
    return int(min(8, max(1, math.ceil(L2_DEFEAT_BYTES / max(set_bytes, 1)))))


@dataclass(frozen=True)
class BenchCase:
    """One problem of the matrix: per-sequence query and key counts, heads, causal or not.
    ``needs_gpu=False`` marks the tiny cases the float64 reference can time on a CPU."""

    name: str
    sq: Sequence[int]
    sk: Sequence[int]
    heads: int = 128
    causal: bool = True
    needs_gpu: bool = True

    @property
    def mask(self) -> Mask:
        return CausalMask() if self.causal else NullMask()

    def offsets(self):
        vl = np.concatenate([[0], np.cumsum(self.sq)]).astype(np.uint32)
        cro = np.concatenate([[0], np.cumsum(self.sk)]).astype(np.uint32)
        return vl, cro

    def flops(self) -> float:
        vl, cro = self.offsets()
        return float(self.heads) * 2 * (DQK + DV) * visible_pairs(vl, cro, self.mask)

    def describe(self) -> str:
        """``Sq=16x512 Sk=16x512 H=128 causal``: lengths per sequence (``n x L`` when all alike)."""
        def lens(xs):
            return f"{len(xs)}x{xs[0]}" if len(set(xs)) == 1 else "+".join(map(str, xs))

        return f"Sq={lens(self.sq)} Sk={lens(self.sk)} H={self.heads} {'causal' if self.causal else 'non-causal'}"


def _c(name, sq, sk=None, heads=128, causal=True, needs_gpu=True):
    return BenchCase(name, tuple(sq), tuple(sk if sk is not None else sq), heads, causal, needs_gpu)


#: The matrix ``mla-cupy bench`` runs on a GPU by default.
DEFAULT_CASES: Dict[str, BenchCase] = {c.name: c for c in [
    _c("1x512", [512]), _c("1x1024", [1024]), _c("1x2048", [2048]), _c("1x4096", [4096]), _c("1x8192", [8192]),
    _c("1x16384", [16384]), _c("4x2048", [2048] * 4), _c("16x512", [512] * 16),
    _c("ragged", [512, 1024, 2048, 4096]), _c("1024+ctx8192", [1024], [9216]),
    _c("H16-1x8192", [8192], heads=16), _c("H16-1x16384", [16384], heads=16),
    _c("noncausal-1x4096", [4096], causal=False),
]}
#: GPU cases run only when named (``--cases``).
EXTRA_CASES: Dict[str, BenchCase] = {c.name: c for c in [_c("1x32768", [32768])]}
#: Cases small enough for the float64 reference on a CPU (the default without a GPU).
CPU_CASES: Dict[str, BenchCase] = {c.name: c for c in [_c("tiny-2x48", [48, 20], [48, 33], heads=4, needs_gpu=False)]}
ALL_CASES: Dict[str, BenchCase] = {**DEFAULT_CASES, **EXTRA_CASES, **CPU_CASES}


def resolve_cases(names: Optional[Sequence[str]], gpu: bool) -> List[BenchCase]:
    """The cases to run: ``names`` (any of :data:`ALL_CASES`), or the default matrix of this
    machine (:data:`DEFAULT_CASES` with a GPU, :data:`CPU_CASES` without).

    Raises
    ------
    ValueError
        A name is unknown, or names a case that needs a GPU when ``gpu`` is False.
    """
    if not names:
        return list((DEFAULT_CASES if gpu else CPU_CASES).values())
    unknown = [n for n in names if n not in ALL_CASES]
    if unknown:
        raise ValueError(f"unknown case(s) {unknown}; known: {list(ALL_CASES)}")
    chosen = [ALL_CASES[n] for n in names]
    need = [c.name for c in chosen if c.needs_gpu and not gpu]
    if need:
        raise ValueError(f"case(s) {need} need a GPU and none is in use; without one, run: "
                         f"{[n for n, c in ALL_CASES.items() if not c.needs_gpu]}")
    return chosen


@dataclass
class Row:
    """One (case, implementation) measurement. ``ratios[p]`` on our rows is p's time over ours
    (> 1: we are faster), against the peers of the same ``group`` ("16-bit" or "fp8")."""

    case: str
    impl: str
    ms: float
    tflops: float
    rel_err: Optional[float] = None  # worst per-slice error against the reference of the inputs given
    extra_mem_mb: Optional[float] = None
    note: str = ""
    host_us: Optional[float] = None  # host time per call (ours, validate=False, out= given)
    ratios: Dict[str, float] = field(default_factory=dict)
    err_vs_16bit: Optional[float] = None  # fp8 rows: worst per-slice error against the unquantized inputs
    group: str = "16-bit"


def _progress(items, desc: str, enabled: bool):
    if not enabled:
        return items
    try:
        from tqdm import tqdm

        return tqdm(items, desc=desc, file=sys.stderr)
    except ImportError:
        def gen():
            n = len(items)
            for i, x in enumerate(items):
                print(f"\r{desc} [{i + 1}/{n}] {getattr(x, 'name', x)}", end="", file=sys.stderr, flush=True)
                yield x
            print(file=sys.stderr)
        return gen()


# ----------------------------------------------------------------------------------------------
# device side
# ----------------------------------------------------------------------------------------------
def make_inputs(case: BenchCase, seed: int) -> dict:
    """Input set ``seed`` of ``case`` on the device: random bf16 ``q``, ``k``, ``v``, ``k_rope`` and the
    offsets, as CuPy arrays."""
    import cupy as cp

    rng = cp.random.default_rng(seed)
    tq, tk, h = sum(case.sq), sum(case.sk), case.heads

    def r(*shape):
        return rng.standard_normal(shape, dtype=cp.float32).astype(BF16)

    vl, cro = case.offsets()
    return dict(q=r(tq, h, DQK), k=r(tk, h, DV), v=r(tk, h, DV), k_rope=r(tk, 1, DR),
                valid_length=cp.asarray(vl), cache_row_offsets=cp.asarray(cro))


SPIN_US = 2000.0  # GPU-busy time enqueued before each timed call (covers the host's launch work)


def _spin(us: float) -> None:
    """Keep the GPU busy for ``us`` microseconds (one thread reading the global timer)."""
    from . import jit
    from ._registry import SPIN

    import cupy as cp

    fn = jit.get_function(SPIN[0], SPIN[1], SPIN[1][0])
    fn((1,), (1,), (cp.uint64(int(us * 1000)),))


def time_ms(fn: Callable[[int], object], n_sets: int, warmup: int = 3, reps: int = 20,
            spin_us: Optional[float] = SPIN_US) -> float:
    """Median GPU time of ``reps`` calls ``fn(i % n_sets)`` after ``warmup`` calls, in ms.

    Each call is bracketed by CUDA events. With ``spin_us`` (the default), a spin kernel enqueued
    first keeps the GPU busy while the host enqueues the call, so the events measure the GPU's work
    only, not the Python/driver launch overhead (reported apart: :func:`host_us`). ``spin_us=None``
    measures from an idle GPU, the host's launch latency included.
    """
    import cupy as cp

    for i in range(warmup):
        fn(i % n_sets)
    times = []
    for i in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        if spin_us:
            _spin(spin_us)
        a.record()
        fn(i % n_sets)
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b))
    return statistics.median(times)


def per_call_us(fn: Callable[[int], object], n_sets: int, calls: int, sync: Callable[[], object],
                clock: Callable[[], float] = time.perf_counter) -> float:
    """Host time per call in microseconds: from an idle device (``sync()`` waits for it), the wall
    time (``clock``) of ``calls`` calls ``fn(i % n_sets)`` back to back, divided by ``calls``; the
    device is synchronized again once the clock has stopped."""
    sync()
    t0 = clock()
    for i in range(calls):
        fn(i % n_sets)
    dt = clock() - t0
    sync()
    return dt / calls * 1e6


def host_us(fn: Callable[[int], object], n_sets: int, reps: int = 200) -> float:
    """Host time per call in microseconds: the wall time to enqueue ``reps`` calls, divided by
    ``reps`` (few enough that the launch queue never fills, so the host never waits for the GPU),
    after one call that is not timed."""
    import cupy as cp

    fn(0)
    return per_call_us(fn, n_sets, reps, cp.cuda.Device().synchronize)


def matmul_tflops(n: int = 8192, reps: int = 20) -> Optional[float]:
    """The card's bf16 matmul rate on random data (torch/cuBLAS if importable, else CuPy)."""
    try:
        import torch

        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        ms = time_ms(lambda i: a @ b, 1, 3, reps)
    except ImportError:
        import cupy as cp

        a = cp.random.standard_normal((n, n), dtype=cp.float32).astype(BF16)
        b = cp.random.standard_normal((n, n), dtype=cp.float32).astype(BF16)
        ms = time_ms(lambda i: a @ b, 1, 3, reps)
    return 2 * n ** 3 / ms / 1e9


def _as_cupy(x):
    """A zero-copy CuPy view of a CuPy array or a torch CUDA tensor (float8 tensors as their bytes)."""
    import cupy as cp

    if isinstance(x, cp.ndarray):
        return x
    if "float8" in str(x.dtype):
        import torch

        x = x.view(torch.uint8)
    return cp.from_dlpack(x)


def e4m3_to_f64(x):
    """float64 values of e4m3 data on the device (CuPy uint8 bytes or a torch float8_e4m3fn
    tensor), through a 256-entry table: CuPy has no fp8 dtype."""
    import cupy as cp

    table = cp.asarray(np.arange(256, dtype=np.uint8).view(FP8_E4M3).astype(np.float64))
    return table[_as_cupy(x)]




_inputs = make_inputs  # the name the benchmark scripts used


@dataclass
class CaseRun:
    """What the row builders of one case share: the case, its device input sets (dicts of ``q``,
    ``k``, ``v``, ``k_rope``, ``valid_length``, ``cache_row_offsets`` as CuPy arrays; set 0 is the
    one checked for accuracy), the repeats, the float64 reference of the 16-bit inputs on
    :attr:`heads` (computed once, on demand), and ``cache``: what other row builders compute once
    per case and share (``benchmarks/peers.py``: torch views of the sets, K built at 192 width)."""

    case: BenchCase
    sets: List[dict]
    reps: int
    _ref16: object = None
    cache: Dict[str, object] = field(default_factory=dict)

    @property
    def heads(self) -> List[int]:
        """The heads every row is checked on: the first and the last."""
        return sorted({0, self.case.heads - 1})

    def reference(self, q, k, v, k_rope):
        """float64 reference ``[Tq, len(heads), 128]`` of full-head device inputs (CuPy or torch, any
        float dtype; ``k_rope`` ``[Tk, 1, 64]`` shared or ``[Tk, H, 64]`` per head, as a K built at
        192 width carries it after a per-head quantization)."""
        import cupy as cp

        from . import reference

        x = self.sets[0]
        q, k, v, k_rope = (_as_cupy(a) for a in (q, k, v, k_rope))
        outs = []
        for h in self.heads:
            hr = h if k_rope.shape[1] > 1 else 0
            one = [cp.ascontiguousarray(a[:, i:i + 1]) for a, i in ((q, h), (k, h), (v, h), (k_rope, hr))]
            outs.append(reference.mla_prefill(*one, x["valid_length"], x["cache_row_offsets"], mask=self.case.mask))
        return cp.concatenate(outs, axis=1)

    def reference16(self):
        """The float64 reference of input set 0 as given (16-bit), computed once."""
        if self._ref16 is None:
            x = self.sets[0]
            self._ref16 = self.reference(x["q"], x["k"], x["v"], x["k_rope"])
        return self._ref16

    def error(self, out, ref=None) -> float:
        """Worst relative error ``||out - ref|| / ||ref||`` over the (sequence, head) slices of
        :attr:`heads`; ``out`` is the full ``[Tq, H, 128]`` output (CuPy or torch), ``ref`` defaults
        to :meth:`reference16`. NaN anywhere in those slices gives NaN."""
        import cupy as cp

        ref = self.reference16() if ref is None else ref
        got = _as_cupy(out)[:, self.heads].astype(cp.float64)
        vl, _ = self.case.offsets()
        worst = 0.0
        for b in range(len(vl) - 1):
            for j in range(len(self.heads)):
                r = ref[int(vl[b]):int(vl[b + 1]), j]
                norm = float(cp.linalg.norm(r))
                if norm > 0:
                    e = float(cp.linalg.norm(got[int(vl[b]):int(vl[b + 1]), j] - r)) / norm
                    worst = float("nan") if e != e or worst != worst else max(worst, e)
        return worst


def failed_row(run: CaseRun, impl: str, exc: Exception, group: str = "16-bit") -> Row:
    """The row of an implementation that raised: NaN times, the exception in ``note``."""
    return Row(run.case.name, impl, float("nan"), float("nan"), note=f"failed: {type(exc).__name__}: {str(exc)[:80]}",
               group=group)


# ----------------------------------------------------------------------------------------------
# our kernels
# ----------------------------------------------------------------------------------------------
def _timed_ours(run: CaseRun, impl: str, call: Callable[[int], object], outs, group: str) -> Row:
    """Time one of our entry points (``call(i)`` writes ``outs[i]``), with its host time per call;
    its memory is the output and what a call keeps from CuPy's pool."""
    import cupy as cp

    ms = time_ms(call, len(run.sets), reps=run.reps)
    launch_us = host_us(call, len(run.sets), reps=max(20, min(200, int(200 / max(ms, 1e-3)))))
    pool = cp.get_default_memory_pool()
    before = pool.used_bytes()
    call(0)
    cp.cuda.Device().synchronize()
    extra = (pool.used_bytes() - before + outs[0].nbytes) / 2**20
    return Row(run.case.name, impl, ms, run.case.flops() / ms / 1e9, None, extra, host_us=launch_us, group=group)


def bench_ours(run: CaseRun) -> Row:
    """mla_prefill on the 16-bit inputs (validate=False, q_max_seq_len and out= given)."""
    import cupy as cp

    from .api import mla_prefill

    case = run.case
    outs = [cp.empty((sum(case.sq), case.heads, DV), BF16) for _ in run.sets]

    def call(i):
        x = run.sets[i]
        mla_prefill(x["q"], x["k"], x["v"], x["k_rope"], x["valid_length"], x["cache_row_offsets"], mask=case.mask,
                    q_max_seq_len=max(case.sq), validate=False, out=outs[i])

    row = _timed_ours(run, "mla_cupy", call, outs, "16-bit")
    row.rel_err = run.error(outs[0])
    return row


def bench_ours_fp8(run: CaseRun, e4m3_rope: bool = False) -> List[Row]:
    """mla_prefill_fp8 on inputs quantized per token (:func:`mla_cupy.quant.quantize_per_token`,
    on the device, not timed): the nope parts, K and V in e4m3, the rope in bf16 (``e4m3_rope``: in
    e4m3 too, the all-e4m3 mode, row ``mla_cupy-fp8-e4m3``)."""
    import cupy as cp

    from .api import mla_prefill_fp8
    from .quant import quantize_per_token

    case = run.case
    impl = "mla_cupy-fp8-e4m3" if e4m3_rope else "mla_cupy-fp8"
    try:
        fp8 = [quantize_per_token(x["q"], x["k"], x["v"], x["k_rope"], e4m3_rope=e4m3_rope) for x in run.sets]
    except Exception as exc:
        return [failed_row(run, impl, exc, "fp8")]
    outs = [cp.empty((sum(case.sq), case.heads, DV), BF16) for _ in run.sets]

    def call(i):
        x, f = run.sets[i], fp8[i]
        mla_prefill_fp8(f["q_nope"], f["q_rope"], f["q_scale"], f["k"], f["k_scales"], f["v"], f["k_rope"],
                        x["valid_length"], x["cache_row_offsets"], mask=case.mask, q_max_seq_len=max(case.sq),
                        validate=False, out=outs[i])

    try:
        row = _timed_ours(run, impl, call, outs, "fp8")
    except Exception as exc:
        return [failed_row(run, impl, exc, "fp8")]
    f = fp8[0]
    rope64 = e4m3_to_f64 if e4m3_rope else (lambda x: x.astype(cp.float64))
    q_true = f["q_scale"][:, :, None].astype(cp.float64) * cp.concatenate(
        [e4m3_to_f64(f["q_nope"]), rope64(f["q_rope"])], axis=-1)
    k_scales = f["k_scales"][:, :, None].astype(cp.float64)
    ref8 = run.reference(q_true, k_scales * e4m3_to_f64(f["k"]), e4m3_to_f64(f["v"]), k_scales * rope64(f["k_rope"]))
    row.rel_err, row.err_vs_16bit = run.error(outs[0], ref8), run.error(outs[0])
    row.note = f"per token: nope, K and V e4m3, rope {'e4m3' if e4m3_rope else 'bf16'}; quantization not timed"
    return [row]


def bench_ours_e4m3(run: CaseRun) -> List[Row]:
    """:func:`bench_ours_fp8` in the all-e4m3 mode (row ``mla_cupy-fp8-e4m3``)."""
    return bench_ours_fp8(run, e4m3_rope=True)


#: Our fp8 row builders, run with ``fp8=True`` (group "fp8": the ratios on the first of these rows
#: are against every other fp8 row). Another fp8 mode of ours plugs in here: a function
#: ``(run: CaseRun) -> List[Row]`` that quantizes ``run.sets`` (not timed), times its calls with
#: :func:`_timed_ours` (impl ``"mla_cupy-fp8-<mode>"``, group ``"fp8"``), and sets ``rel_err``
#: against :meth:`CaseRun.reference` of its dequantized inputs and ``err_vs_16bit`` with
#: :meth:`CaseRun.error`, as :func:`bench_ours_fp8` does.
FP8_ROWS: List[Callable[[CaseRun], List[Row]]] = [bench_ours_fp8, bench_ours_e4m3]


def _set_ratios(rows: List[Row], roofline: Optional[float]) -> None:
    """On our first row of each group: every other timed row's time over ours, and (16-bit) the
    share of the bf16 matmul rate."""
    for group in dict.fromkeys(r.group for r in rows):
        ours = next((r for r in rows if r.group == group and r.impl.startswith("mla_cupy") and r.ms == r.ms), None)
        if ours is None:
            continue
        if roofline and group == "16-bit":  # the roofline is the bf16 matmul rate
            ours.ratios["roofline"] = ours.tflops / roofline
        for r in rows:
            if r.group == group and r is not ours and r.impl != "kbuild" and r.ms == r.ms:
                ours.ratios[r.impl] = r.ms / ours.ms  # > 1: we are faster


def device_info() -> dict:
    """The current GPU's name and compute capability, and the date, as the results record them."""
    import cupy as cp

    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    return {"device": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
            "compute_capability": dev.compute_capability, "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def run(cases: Sequence[BenchCase], *, fp8: bool = False, reps: int = 20, progress: bool = True,
        checkpoint: Optional[str] = None,
        builders: Sequence[Callable[[CaseRun], List[Row]]] = ()) -> dict:
    """Run the matrix on the current GPU; returns {"device", "matmul_tflops", "rows", ...}.

    Each case: our 16-bit kernel (:func:`bench_ours`), with ``fp8`` our fp8 rows (:data:`FP8_ROWS`),
    then the rows of each of ``builders`` (functions of the case's :class:`CaseRun`, such as the
    peers' of ``benchmarks/peers.py``); the ratios on our first row of each group are every other
    row's time over ours. With ``checkpoint``, the rows so far are written there (JSON) after every
    case."""
    import cupy as cp

    info = device_info()
    info["matmul_tflops"] = matmul_tflops()
    rows: List[Row] = []
    for case in _progress(list(cases), "bench", progress):
        n_sets = n_input_sets(case)
        cr = CaseRun(case, [make_inputs(case, seed) for seed in range(n_sets)], reps)
        ours = bench_ours(cr)
        ours.note = f"{n_sets} input set(s)"
        case_rows = [ours]
        for build in (list(FP8_ROWS) if fp8 else []) + list(builders):
            case_rows += build(cr)
        _set_ratios(case_rows, info["matmul_tflops"])
        rows += case_rows
        del cr
        cp.get_default_memory_pool().free_all_blocks()
        if "torch" in sys.modules:
            sys.modules["torch"].cuda.empty_cache()
        info["rows"] = [asdict(r) for r in rows]
        if checkpoint:
            with open(checkpoint, "w") as f:
                json.dump(info, f, indent=1, default=float)
    info["rows"] = [asdict(r) for r in rows]
    return info


def run_cpu(cases: Sequence[BenchCase], reps: int = 20) -> dict:
    """No GPU: time the float64 reference on tiny cases, so the command still works.
    Each case: one warm-up call, then ``reps`` timed calls; the median is reported."""
    from . import reference

    rows = []
    for case in cases:
        rng = np.random.default_rng(0)
        tq, tk, h = sum(case.sq), sum(case.sk), case.heads
        q, k, v = rng.standard_normal((tq, h, DQK)), rng.standard_normal((tk, h, DV)), rng.standard_normal((tk, h, DV))
        kr = rng.standard_normal((tk, 1, DR))
        vl, cro = case.offsets()
        times = []
        for _ in range(1 + max(1, reps)):
            t0 = time.perf_counter()
            reference.mla_prefill(q, k, v, kr, vl, cro, mask=case.mask, progress=False)
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times[1:]) * 1e3
        rows.append(asdict(Row(case.name, "reference-cpu", ms, case.flops() / ms / 1e9, None, None,
                               note=f"float64 NumPy, median of {len(times) - 1} after a warm-up call")))
    return {"device": "cpu (no GPU: reference only)", "compute_capability": None, "dtype": "float64 reference",
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "matmul_tflops": None, "rows": rows}


def _rate(tflops: float) -> str:
    """TFLOP/s for a table: one decimal, or three significant digits below 1 (the CPU reference)."""
    return "" if tflops != tflops else (f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.3g}")


def format_table(result: dict) -> str:
    peers = sorted({k for r in result["rows"] for k in r["ratios"]} - {"roofline"})
    fp8 = any(r.get("err_vs_16bit") is not None for r in result["rows"])
    head = (["case", "impl", "ms", "TFLOP/s", "rel_err"] + (["err vs 16-bit"] if fp8 else [])
            + ["extra MB", "host us", "roof%"] + [f"x {p}" for p in peers])
    lines = [f"device: {result['device']}" + (f"  dtype: {result['dtype']}" if result.get("dtype") else "") + "  bf16 matmul: "
             + (f"{result['matmul_tflops']:.0f} TFLOP/s" if result.get("matmul_tflops") else "n/a")]
    body = []
    for r in result["rows"]:
        cells = [r["case"], r["impl"], f"{r['ms']:.3f}", _rate(r["tflops"]),
                 "" if r["rel_err"] is None else f"{r['rel_err']:.2e}"]
        if fp8:
            cells.append("" if r.get("err_vs_16bit") is None else f"{r['err_vs_16bit']:.2e}")
        cells += ["" if r["extra_mem_mb"] is None else f"{r['extra_mem_mb']:.0f}",
                  "" if r.get("host_us") is None else f"{r['host_us']:.0f}",
                  f"{100 * r['ratios']['roofline']:.0f}" if "roofline" in r["ratios"] else ""]
        cells += [f"{r['ratios'][p]:.2f}" if p in r["ratios"] else "" for p in peers]
        body.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in body)) if body else len(h) for i, h in enumerate(head)]
    fmt = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
    lines += [fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(c) for c in body]
    notes = [f"{r['case']}/{r['impl']}: {r['note']}" for r in result["rows"] if r["note"].startswith(("failed", "skipped"))]
    return "\n".join(lines + notes)


def plot(result: dict, path: str) -> None:
    """TFLOP/s per case and implementation as a bar chart (PNG), titled with the dtype measured."""
    from ._optional import require

    matplotlib = require("matplotlib", "mla-cupy bench --plot")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["tflops"] == r["tflops"]]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(cases)), 4.5))
    w = 0.8 / max(1, len(impls))
    for j, impl in enumerate(impls):
        vals = [next((r["tflops"] for r in rows if r["case"] == c and r["impl"] == impl), 0) for c in cases]
        ax.bar(np.arange(len(cases)) + j * w, vals, w, label=impl)
    if result.get("matmul_tflops"):
        ax.axhline(result["matmul_tflops"], color="k", ls="--", lw=1, label="bf16 matmul")
    ax.set_xticks(np.arange(len(cases)) + 0.4 - w / 2, cases, rotation=30, ha="right")
    ax.set_ylabel("TFLOP/s (visible pairs)")
    ax.set_title(f"MLA prefill, {result.get('dtype', 'bf16')}, {result['device']}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")


def write_csv(result: dict, path: str) -> None:
    import csv

    keys = ["case", "impl", "group", "ms", "tflops", "rel_err", "err_vs_16bit", "extra_mem_mb", "host_us", "note", "ratios"]
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=keys)
        wr.writeheader()
        for r in result["rows"]:
            wr.writerow({**r, "ratios": json.dumps(r["ratios"])})


def check_writable(path: str) -> str:
    """``path`` as an absolute path that a result file can be written to, checked before any
    timing: its folder exists and is writable, and it is not a folder itself.

    Raises
    ------
    ValueError
        Saying what is wrong with the path, in one line.
    """
    import os

    full = os.path.abspath(os.path.expanduser(path))
    folder = os.path.dirname(full)
    if os.path.isdir(full):
        raise ValueError(f"{path} is a folder, not a file")
    if not os.path.isdir(folder):
        raise ValueError(f"cannot write {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(full) and not os.access(full, os.W_OK)):
        raise ValueError(f"cannot write {path}: permission denied")
    return full


def write_json(result: dict, path: str) -> None:
    """``result`` as JSON in ``path``."""
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=float)

"""``mla-cupy bench``: mla_cupy against its peers on this GPU.

Every number in a table comes from one process on one warm GPU: our kernel, the peers that are
importable (torch's cuDNN SDPA, one call per sequence; cuDNN's ragged SDPA from the
``nvidia-cudnn-frontend`` wheel, one call per batch; FlexAttention; FlashAttention-3 from the
``fa3-fwd`` wheel or FA3's own ``flash_attn_interface``: all need K built at full 192 width, and that
build is timed too), and the card's bf16 matmul rate as a roofline. Times are medians of many repeats after
warm-up, measured with CUDA events behind a GPU-busy spin kernel (so they are GPU time, for every
implementation alike; our host time per call is its own column), rotating through enough input sets
to defeat the L2 cache. FLOPs count visible (query, key) pairs only: ``H * 2 * (192 + 128) * pairs``.

Every row's output is checked against the float64 reference on two heads (the first and the last):
``rel_err`` is the worst relative error over the (sequence, head) slices, as the contract defines
accuracy. fp8 rows (``fp8=True``) are checked twice: against the reference of the inputs they were
given (the dequantized fp8 values, ``rel_err``) and against the reference of the unquantized 16-bit
inputs (``err_vs_16bit``), which is what quantization costs a user.
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

__all__ = ["BenchCase", "DEFAULT_CASES", "EXTRA_CASES", "CPU_CASES", "ALL_CASES", "resolve_cases", "CaseRun",
           "PEER_ROWS", "FP8_ROWS", "FP8_PEER_ROWS", "n_input_sets", "k192_of", "fa3_function", "fa3_varlen_call",
           "quantize_per_batch_head", "dequantize_per_batch_head", "quantize_per_tensor", "quantize_inputs", "cudnn_sdpa_function",
           "cudnn_ragged_args", "cudnn_ragged_fn", "cudnn_fp8_fn", "cudnn_fp8_call", "per_call_us", "host_us", "device_info", "run",
           "run_cpu", "format_table", "write_csv", "plot"]

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
def _inputs(case: BenchCase, seed: int):
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


@dataclass
class CaseRun:
    """What the row builders of one case share: the case, its device input sets (dicts of ``q``,
    ``k``, ``v``, ``k_rope``, ``valid_length``, ``cache_row_offsets`` as CuPy arrays; set 0 is the
    one checked for accuracy), the repeats, and what is computed once per case on demand: the
    float64 reference of the 16-bit inputs on :attr:`heads`, torch views of the sets, and K built
    at 192 width (with the time that build takes)."""

    case: BenchCase
    sets: List[dict]
    reps: int
    _ref16: object = None
    _torch: Optional[List[dict]] = None
    _k192: Optional[tuple] = None

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

    def torch_sets(self) -> List[dict]:
        """The input sets as zero-copy torch tensors."""
        if self._torch is None:
            import torch

            self._torch = [{k: torch.from_dlpack(v) for k, v in x.items()} for x in self.sets]
        return self._torch

    def k192(self):
        """(K built at 192 width for every set, the median time of that build in ms): :func:`k192_of`
        of each set, what the peers need."""
        if self._k192 is None:
            h = self.case.heads
            tx = self.torch_sets()
            ms = time_ms(lambda i: k192_of(tx[i], h), len(tx), reps=self.reps)
            self._k192 = ([k192_of(t, h) for t in tx], ms)
        return self._k192


def k192_of(t, heads: int):
    """K at the 192 width the peers take: ``torch.cat`` of ``t["k"]`` ``[Tk, H, 128]`` and
    ``t["k_rope"]`` ``[Tk, 1, 64]`` broadcast to ``[Tk, H, 64]`` (torch tensors)."""
    import torch

    return torch.cat([t["k"], t["k_rope"].expand(t["k"].shape[0], heads, DR)], dim=-1)


def _failed(run: CaseRun, impl: str, exc: Exception, group: str = "16-bit") -> Row:
    return Row(run.case.name, impl, float("nan"), float("nan"), note=f"failed: {type(exc).__name__}: {str(exc)[:80]}",
               group=group)


def _torch_peak(fn: Callable[[], float]):
    """(fn(), peak extra torch memory in MB while it ran)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = fn()
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**20


def _timed_rows(run: CaseRun, impl: str, call: Callable[[int], object], out, note: str = "",
                kbuild: bool = True) -> List[Row]:
    """Rows of a 16-bit peer that reads K at 192 width: its kernel time and, with ``kbuild``, its
    time with the K build; ``out`` is its output on set 0 (checked against the reference)."""
    kfull, ms_build = run.k192()
    ms, extra = _torch_peak(lambda: time_ms(call, len(run.sets), reps=run.reps))
    extra += kfull[0].numel() * kfull[0].element_size() / 2**20
    err, flops = run.error(out), run.case.flops()
    rows = [Row(run.case.name, impl, ms, flops / ms / 1e9, err, extra, note=note)]
    if kbuild:
        rows.append(Row(run.case.name, impl + "+kbuild", ms + ms_build, flops / (ms + ms_build) / 1e9, err, extra))
    return rows


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
        return [_failed(run, impl, exc, "fp8")]
    outs = [cp.empty((sum(case.sq), case.heads, DV), BF16) for _ in run.sets]

    def call(i):
        x, f = run.sets[i], fp8[i]
        mla_prefill_fp8(f["q_nope"], f["q_rope"], f["q_scale"], f["k"], f["k_scales"], f["v"], f["k_rope"],
                        x["valid_length"], x["cache_row_offsets"], mask=case.mask, q_max_seq_len=max(case.sq),
                        validate=False, out=outs[i])

    try:
        row = _timed_ours(run, impl, call, outs, "fp8")
    except Exception as exc:
        return [_failed(run, impl, exc, "fp8")]
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


# ----------------------------------------------------------------------------------------------
# peers (torch); each builder returns its rows, or none when it is not importable
# ----------------------------------------------------------------------------------------------
def sdpa_per_sequence(case: BenchCase, t: dict, k192) -> list:
    """torch SDPA (whichever backend the caller's ``sdpa_kernel`` context allows), one call per
    sequence of ``case``: bottom-right causal when Sq != Sk. ``t`` holds torch views of the inputs,
    ``k192`` the keys built at 192 width; returns each sequence's output ``[1, H, Sq, 128]``."""
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    vl, cro = case.offsets()
    scale = 1.0 / math.sqrt(DQK)
    outs = []
    for b in range(len(case.sq)):
        qb = t["q"][vl[b]:vl[b + 1]].transpose(0, 1).unsqueeze(0)
        kb = k192[cro[b]:cro[b + 1]].transpose(0, 1).unsqueeze(0)
        vb = t["v"][cro[b]:cro[b + 1]].transpose(0, 1).unsqueeze(0)
        sq, sk = case.sq[b], case.sk[b]
        if not case.causal:
            outs.append(sdpa(qb, kb, vb, scale=scale))
        elif sq == sk:
            outs.append(sdpa(qb, kb, vb, is_causal=True, scale=scale))
        else:
            outs.append(sdpa(qb, kb, vb, attn_mask=causal_lower_right(sq, sk), scale=scale))
    return outs


def bench_sdpa(run: CaseRun) -> List[Row]:
    """cuDNN SDPA, one call per sequence (bottom-right causal when Sq != Sk), K built at 192; the
    flash / memory-efficient backends when cuDNN does not run."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return []
    case = run.case
    tx, (kfull, _) = run.torch_sets(), run.k192()

    def sdpa_call(i):
        return sdpa_per_sequence(case, tx[i], kfull[i])

    rows: List[Row] = []
    for label, backends in (("cudnn-sdpa", [SDPBackend.CUDNN_ATTENTION]),
                            ("sdpa-fallback", [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])):
        try:
            with sdpa_kernel(backends):
                out = torch.cat([o[0].transpose(0, 1) for o in sdpa_call(0)])
                return rows + _timed_rows(run, label, sdpa_call, out, note=f"backend={backends[0].name}")
        except Exception as exc:  # record why the backend did not run, try the next
            rows.append(_failed(run, label, exc))
    return rows


def bench_flex(run: CaseRun) -> List[Row]:
    """FlexAttention (torch.compile), one call for the whole batch with a document mask."""
    try:
        import torch
        import torch._dynamo
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return []
    case = run.case
    try:
        # One compiled kernel per case shape: without a higher limit dynamo stops recompiling after
        # 8 shapes and silently runs the unfused (materializing) implementation.
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(64, getattr(torch._dynamo.config, knob)))
        flex = torch.compile(flex_attention, dynamic=False)
        dev = "cuda"
        vl, cro = case.offsets()
        q_doc = torch.repeat_interleave(torch.arange(len(case.sq), device=dev), torch.tensor(case.sq, device=dev))
        k_doc = torch.repeat_interleave(torch.arange(len(case.sk), device=dev), torch.tensor(case.sk, device=dev))
        q_first = torch.tensor(vl[:-1].astype(np.int64), device=dev)
        k_first = torch.tensor(cro[:-1].astype(np.int64), device=dev)
        shift = torch.tensor(np.array(case.sk, np.int64) - np.array(case.sq, np.int64), device=dev)
        causal = case.causal

        def mask_mod(b, hh, qi, kj):
            same = q_doc[qi] == k_doc[kj]
            if not causal:
                return same
            qp = qi - q_first[q_doc[qi]] + shift[q_doc[qi]]  # end-aligned position of the query
            kp = kj - k_first[k_doc[kj]]
            return same & (kp <= qp)

        bm = create_block_mask(mask_mod, None, None, sum(case.sq), sum(case.sk), device=dev)
        tx, (kfull, _) = run.torch_sets(), run.k192()

        def flex_call(i):
            t, kf = tx[i], kfull[i]
            return flex(t["q"].transpose(0, 1).unsqueeze(0), kf.transpose(0, 1).unsqueeze(0),
                        t["v"].transpose(0, 1).unsqueeze(0), block_mask=bm, scale=1.0 / math.sqrt(DQK))

        return _timed_rows(run, "flex", flex_call, flex_call(0)[0].transpose(0, 1), note="torch.compile(flex_attention)")
    except Exception as exc:
        return [_failed(run, "flex", exc)]


#: Modules that provide FlashAttention-3's ``flash_attn_varlen_func``, in the order tried.
FA3_MODULES = ("fa3_fwd_interface", "flash_attn_interface")


def fa3_function():
    """(FlashAttention-3's ``flash_attn_varlen_func``, the module's name), or None when neither of
    :data:`FA3_MODULES` imports."""
    import importlib

    for name in FA3_MODULES:
        try:
            return importlib.import_module(name).flash_attn_varlen_func, name
        except Exception:  # not installed, or built for another torch / CUDA
            continue
    return None


def fa3_varlen_call(case: BenchCase, fn, qs, ks, vs, kw_of: Callable[[int], dict] = lambda i: {}):
    """``call(i)``: one FlashAttention-3 varlen call ``fn`` (:func:`fa3_function`) over set i's whole
    batch of ``case`` (``qs[i]``, ``ks[i]``, ``vs[i]``: torch tensors, K at 192; keywords
    ``kw_of(i)``), the offsets built once, not timed. FA3's causal mask is bottom-right aligned, as
    ours; the output is returned whether the version gives ``out`` or ``(out, lse)``."""
    import torch

    vl, cro = case.offsets()
    dev = qs[0].device
    cu_q, cu_k = torch.tensor(vl.astype(np.int32), device=dev), torch.tensor(cro.astype(np.int32), device=dev)
    scale, causal = 1.0 / math.sqrt(DQK), case.causal
    mq, mk = max(case.sq), max(case.sk)

    def call(i):
        res = fn(qs[i], ks[i], vs[i], cu_q, cu_k, mq, mk, softmax_scale=scale, causal=causal, **kw_of(i))
        return res[0] if isinstance(res, (tuple, list)) else res

    return call


def bench_fa3(run: CaseRun) -> List[Row]:
    """FlashAttention-3 (``fa3-fwd`` wheel or FA3's own build), bf16, K built at 192."""
    found = fa3_function()
    if found is None:
        return []
    fn, module = found
    try:
        tx, (kfull, _) = run.torch_sets(), run.k192()
        call = fa3_varlen_call(run.case, fn, [t["q"] for t in tx], kfull, [t["v"] for t in tx])
        return _timed_rows(run, "fa3", call, call(0), note=f"{module}.flash_attn_varlen_func")
    except Exception as exc:
        return [_failed(run, "fa3", exc)]


#: How to get cuDNN's frontend (module ``cudnn``), which the ``cudnn-ragged`` rows need.
CUDNN_FRONTEND_HINT = ("pip install --no-deps nvidia-cudnn-frontend==1.32.0 (it uses the libcudnn torch ships; "
                       "for a GPU machine without network see the README: bash benchmarks/gpu.sh --wheels DIR)")

_said: set = set()


def _say_once(text: str) -> None:
    """Print ``text`` on stderr the first time only (one line per missing peer and process)."""
    if text not in _said:
        _said.add(text)
        print(text, file=sys.stderr)


def cudnn_sdpa_function():
    """cuDNN frontend's ``sdpa_torch`` (the ``nvidia-cudnn-frontend`` wheel), or None when the
    module ``cudnn`` does not import (see :data:`CUDNN_FRONTEND_HINT`)."""
    try:
        import cudnn

        return cudnn.sdpa_torch
    except Exception:  # not installed, or built for another torch / cuDNN
        return None


def cudnn_ragged_args(case: BenchCase) -> dict:
    """The keywords of ``cudnn.sdpa_torch`` for ``case`` other than the offsets: the mask (causal
    bottom-right aligned, as ours), the scale, the longest sequences.

    Raises
    ------
    ValueError
        The case's mask is one cuDNN's ragged path cannot express as ours does: a mask other than
        none or causal, or a causal sequence with more queries than keys (rows that see no key).
    """
    mask = case.mask
    if isinstance(mask, NullMask):
        kw = dict(is_causal=False)
    elif isinstance(mask, CausalMask):
        if any(q > k for q, k in zip(case.sq, case.sk)):
            raise ValueError("causal with more queries than keys in a sequence (rows that see no key)")
        kw = dict(is_causal=True, causal_bottom_right=True)
    else:
        raise ValueError(f"cuDNN's ragged SDPA has no {type(mask).__name__}")
    return dict(kw, scale=1.0 / math.sqrt(DQK), max_seqlen_q=max(case.sq), max_seqlen_kv=max(case.sk))


def cudnn_ragged_fn(case: BenchCase, fn, device):
    """``attn(q, k192, v, **extra) -> out``: one call of cuDNN's ragged (THD) SDPA ``fn``
    (:func:`cudnn_sdpa_function`) over the whole batch of ``case``: torch tensors ``[T, H, D]``, the
    offsets (``cu_seqlens``) built once on ``device``, the other keywords :func:`cudnn_ragged_args`'s
    (which raises ValueError for a mask cuDNN cannot express) and ``extra``."""
    kw = cudnn_ragged_args(case)
    import torch

    vl, cro = case.offsets()
    kw.update(cu_seqlens_q=torch.tensor(vl.astype(np.int32), device=device),
              cu_seqlens_kv=torch.tensor(cro.astype(np.int32), device=device))

    def attn(q, k192, v, **extra):
        return fn(q, k192, v, **kw, **extra)

    return attn


def bench_cudnn_ragged(run: CaseRun) -> List[Row]:
    """cuDNN's ragged SDPA (``cudnn.sdpa_torch`` with ``cu_seqlens``), one call for the whole
    batch, K built at 192; left out, with one line on stderr, when the frontend does not import."""
    fn = cudnn_sdpa_function()
    if fn is None:
        _say_once(f"cudnn-ragged rows left out: the cuDNN frontend (module cudnn) does not import; {CUDNN_FRONTEND_HINT}")
        return []
    tx = run.torch_sets()
    try:
        attn = cudnn_ragged_fn(run.case, fn, tx[0]["q"].device)
    except ValueError as exc:
        return [Row(run.case.name, "cudnn-ragged", float("nan"), float("nan"), note=f"skipped: {exc}")]
    kfull, _ = run.k192()

    def call(i):
        return attn(tx[i]["q"], kfull[i], tx[i]["v"])

    try:
        return _timed_rows(run, "cudnn-ragged", call, call(0), note="cudnn.sdpa_torch, one call per batch (cu_seqlens)")
    except Exception as exc:
        return [_failed(run, "cudnn-ragged", exc)]


def quantize_per_batch_head(x, offsets):
    """e4m3 of ``x[T, H, D]`` (torch) with one scale per (sequence, head): ``(x8, descale[B, H]
    float32)``, ``descale = amax / 448`` over the sequence's rows and all D values (1 when 0)."""
    import torch

    from .quant import E4M3_MAX

    lens = np.diff(np.asarray(offsets, np.int64))
    descale = torch.ones((len(lens), x.shape[1]), dtype=torch.float32, device=x.device)
    for i in np.flatnonzero(lens):
        amax = x[int(offsets[i]):int(offsets[i + 1])].float().abs().amax(dim=(0, 2))
        descale[i] = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    rows = torch.as_tensor(np.repeat(np.arange(len(lens)), lens), device=x.device)
    x8 = (x.float() / descale[rows][:, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return x8, descale


def dequantize_per_batch_head(x8, descale, offsets):
    """float64 CuPy values of :func:`quantize_per_batch_head`'s output."""
    import cupy as cp

    x = e4m3_to_f64(x8)
    d = _as_cupy(descale).astype(cp.float64)
    rows = cp.asarray(np.repeat(np.arange(len(offsets) - 1), np.diff(offsets.astype(np.int64))))
    return x * d[rows][:, :, None]


def quantize_inputs(case: BenchCase, qs, ks, vs, per_tensor: bool = False):
    """(q8, k8, v8): each set's q, K at 192 and v (torch) in e4m3, lists of ``(x8, descale)``, with one
    descale per (sequence, head) (:func:`quantize_per_batch_head`, FlashAttention-3's) or per tensor
    (:func:`quantize_per_tensor`, cuDNN's). Not timed."""
    vl, cro = case.offsets()

    def one(x, offsets):
        return quantize_per_tensor(x) if per_tensor else quantize_per_batch_head(x, offsets)

    return tuple([one(x, offsets) for x in xs] for xs, offsets in ((qs, vl), (ks, cro), (vs, cro)))


def bench_fa3_fp8(run: CaseRun) -> List[Row]:
    """FlashAttention-3 e4m3: q, K built at 192 and v quantized per (sequence, head) (not timed),
    ``q_descale`` / ``k_descale`` / ``v_descale`` of shape [B, H], bf16 output."""
    found = fa3_function()
    if found is None:
        return []
    fn, module = found
    vl, cro = run.case.offsets()
    try:
        tx, (kfull, _) = run.torch_sets(), run.k192()
        q8, k8, v8 = quantize_inputs(run.case, [t["q"] for t in tx], kfull, [t["v"] for t in tx])
        call = fa3_varlen_call(run.case, fn, [q for q, _ in q8], [k for k, _ in k8], [v for v, _ in v8],
                               lambda i: dict(q_descale=q8[i][1], k_descale=k8[i][1], v_descale=v8[i][1]))
        out = call(0)
        ms = time_ms(call, len(run.sets), reps=run.reps)
    except Exception as exc:
        return [_failed(run, "fa3-fp8", exc, "fp8")]
    k_deq = dequantize_per_batch_head(*k8[0], cro)
    ref8 = run.reference(dequantize_per_batch_head(*q8[0], vl), k_deq[:, :, :DV],
                         dequantize_per_batch_head(*v8[0], cro), k_deq[:, :, DV:])
    return [Row(run.case.name, "fa3-fp8", ms, run.case.flops() / ms / 1e9, run.error(out, ref8), None,
                note=f"{module}, e4m3 per (sequence, head) descales; K build and quantization not timed",
                err_vs_16bit=run.error(out), group="fp8")]


def quantize_per_tensor(x):
    """e4m3 of ``x`` (torch) with one scale for the whole tensor, the form cuDNN's fp8 SDPA takes:
    ``(x8, descale)``, ``descale`` a float32 ``[1, 1, 1, 1]`` tensor holding ``amax / 448`` (1 when
    ``x`` is all zeros)."""
    import torch

    from .quant import E4M3_MAX

    amax = x.float().abs().max()
    descale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).reshape(1, 1, 1, 1)
    x8 = (x.float() / descale.reshape(())).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return x8, descale


# Tensor ids of the cuDNN fp8 graph (cudnn_fp8_fn): inputs, scales, outputs, ragged layout.
_CUDNN_FP8_UIDS = dict(q=0, k=1, v=2, o=3, q_descale=5, k_descale=6, v_descale=7, s_descale=8, s_scale=9, o_scale=10,
                       o_amax=12, kv_len=13, q_len=14, q_off=17, k_off=18, v_off=19, o_off=20)


def cudnn_fp8_fn(case: BenchCase, device):
    """``attn(q8, k8, v8, q_descale, k_descale, v_descale, out) -> out``: one execution of a cuDNN
    frontend graph of fp8 SDPA (``pygraph.sdpa_fp8``, built once here) over the whole batch of
    ``case``: e4m3 ``q`` ``[Tq, H, 192]``, K at 192 and ``v`` ``[Tk, H, 128]`` torch tensors, one
    descale per tensor (:func:`quantize_per_tensor`), P quantized under cuDNN's fixed scale of 448,
    bf16 ``out`` ``[Tq, H, 128]``. Sequences of unequal lengths go through the ragged layout
    (offsets per sequence, a padding mask); the causal mask is bottom-right aligned, as ours.

    Raises
    ------
    ValueError
        A mask cuDNN cannot express as ours does (:func:`cudnn_ragged_args`).
    Exception
        What the frontend raises when this cuDNN does not support the graph (e.g.
        ``cudnn.cudnnGraphNotSupportedError``).
    """
    mask_kw = cudnn_ragged_args(case)
    import cudnn
    import torch

    from .quant import E4M3_MAX

    dt, uid = cudnn.data_type, _CUDNN_FP8_UIDS
    b, h = len(case.sq), case.heads
    s_q, s_kv = max(case.sq), max(case.sk)
    ragged = len(set(case.sq)) > 1 or len(set(case.sk)) > 1
    g = cudnn.pygraph(io_data_type=dt.FP8_E4M3, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT)

    def rows(name, s, d, data_type=dt.FP8_E4M3):  # [T, H, d] rows as (b, h, s, d)
        return g.tensor(uid=uid[name], dim=(b, h, s, d), stride=(s * h * d, d, h * d, 1), data_type=data_type)

    def scalar(name):
        return g.tensor(uid=uid[name], dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=dt.FLOAT)

    q, k, v = rows("q", s_q, DQK), rows("k", s_kv, DQK), rows("v", s_kv, DV)
    sc = {n: scalar(n) for n in ("q_descale", "k_descale", "v_descale", "s_descale", "s_scale", "o_scale")}
    vl, cro = case.offsets()
    fixed = {uid["s_scale"]: E4M3_MAX, uid["s_descale"]: 1.0 / E4M3_MAX, uid["o_scale"]: 1.0}
    fixed = {u: torch.full((1, 1, 1, 1), x, dtype=torch.float32, device=device) for u, x in fixed.items()}
    extra = dict(use_causal_mask_bottom_right=True) if mask_kw["is_causal"] else {}
    offsets = {}
    if ragged:  # per-sequence lengths (a padding mask) and element offsets of each sequence's rows
        def ints(name, values, data_type):
            fixed[uid[name]] = torch.tensor(values, device=device).reshape(len(values), 1, 1, 1)
            return g.tensor(uid=uid[name], dim=(len(values), 1, 1, 1), stride=(1, 1, 1, 1), data_type=data_type)

        extra.update(use_padding_mask=True, seq_len_q=ints("q_len", np.diff(vl).astype(np.int32), dt.INT32),
                     seq_len_kv=ints("kv_len", np.diff(cro).astype(np.int32), dt.INT32))
        for name, starts, width in (("q_off", vl, DQK), ("k_off", cro, DQK), ("v_off", cro, DV), ("o_off", vl, DV)):
            offsets[name] = ints(name, starts.astype(np.int64) * h * width, dt.INT64)
        for t, name in ((q, "q_off"), (k, "k_off"), (v, "v_off")):
            t.set_ragged_offset(offsets[name])
    o, _, _, amax_o = g.sdpa_fp8(q=q, k=k, v=v, descale_q=sc["q_descale"], descale_k=sc["k_descale"],
                                 descale_v=sc["v_descale"], descale_s=sc["s_descale"], scale_s=sc["s_scale"],
                                 scale_o=sc["o_scale"], generate_stats=False, attn_scale=mask_kw["scale"], **extra)
    o.set_uid(uid["o"]).set_output(True).set_dim((b, h, s_q, DV)).set_stride((s_q * h * DV, DV, h * DV, 1))
    o.set_data_type(dt.BFLOAT16)
    if ragged:
        o.set_ragged_offset(offsets["o_off"])
    amax_o.set_uid(uid["o_amax"]).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1))
    amax_o.set_data_type(dt.FLOAT)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    handle = cudnn.create_handle()
    workspace = torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device=device)
    fixed[uid["o_amax"]] = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=device)

    def attn(q8, k8, v8, q_descale, k_descale, v_descale, out):
        cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)  # a no-op once it is set
        pack = {uid["q"]: q8, uid["k"]: k8, uid["v"]: v8, uid["q_descale"]: q_descale, uid["k_descale"]: k_descale,
                uid["v_descale"]: v_descale, uid["o"]: out, **fixed}
        g.execute(pack, workspace, handle=handle)
        return out

    return attn


def cudnn_fp8_call(case: BenchCase, attn, q8, k8, v8):
    """``call(i)``: cuDNN's fp8 graph ``attn`` (:func:`cudnn_fp8_fn`) on set i's e4m3 inputs
    (:func:`quantize_inputs` with ``per_tensor``), into a bf16 output of that set's own."""
    import torch

    outs = [torch.empty((sum(case.sq), case.heads, DV), dtype=torch.bfloat16, device=q[0].device) for q in q8]

    def call(i):
        return attn(q8[i][0], k8[i][0], v8[i][0], q8[i][1], k8[i][1], v8[i][1], outs[i])

    return call


def bench_cudnn_fp8(run: CaseRun) -> List[Row]:
    """cuDNN's fp8 SDPA (a frontend graph, :func:`cudnn_fp8_fn`): q, K built at 192 and v in e4m3
    with one descale per tensor (not timed), bf16 output, one execution for the whole batch; left
    out, with one line on stderr, when the frontend does not import."""
    if cudnn_sdpa_function() is None:
        _say_once(f"cudnn-fp8 rows left out: the cuDNN frontend (module cudnn) does not import; {CUDNN_FRONTEND_HINT}")
        return []
    try:
        tx, (kfull, _) = run.torch_sets(), run.k192()
        attn = cudnn_fp8_fn(run.case, tx[0]["q"].device)
    except ValueError as exc:
        return [Row(run.case.name, "cudnn-fp8", float("nan"), float("nan"), note=f"skipped: {exc}", group="fp8")]
    except Exception as exc:  # this cuDNN does not take the graph
        return [_failed(run, "cudnn-fp8", exc, "fp8")]
    try:
        q8, k8, v8 = quantize_inputs(run.case, [t["q"] for t in tx], kfull, [t["v"] for t in tx], per_tensor=True)
        call = cudnn_fp8_call(run.case, attn, q8, k8, v8)
        out = call(0)
        ms = time_ms(call, len(run.sets), reps=run.reps)
    except Exception as exc:
        return [_failed(run, "cudnn-fp8", exc, "fp8")]

    def deq(x8, descale):
        return e4m3_to_f64(x8) * float(descale.reshape(()))

    k_deq = deq(*k8[0])
    ref8 = run.reference(deq(*q8[0]), k_deq[:, :, :DV], deq(*v8[0]), k_deq[:, :, DV:])
    return [Row(run.case.name, "cudnn-fp8", ms, run.case.flops() / ms / 1e9, run.error(out, ref8), None,
                note="cuDNN frontend sdpa_fp8 graph, e4m3 per-tensor descales; K build and quantization not timed",
                err_vs_16bit=run.error(out), group="fp8")]


def bench_kbuild(run: CaseRun) -> List[Row]:
    """The K build the 16-bit peers need, on its own (when a peer built it)."""
    if run._k192 is None:
        return []
    return [Row(run.case.name, "kbuild", run.k192()[1], float("nan"),
                note="torch.cat(k, k_rope broadcast) to [Tk, H, 192]")]


#: Row builders run with ``peers=True``, in order: each takes the :class:`CaseRun` and returns its rows.
PEER_ROWS: List[Callable[[CaseRun], List[Row]]] = [bench_sdpa, bench_cudnn_ragged, bench_flex, bench_fa3,
                                                   bench_kbuild]

#: Our fp8 row builders, run with ``fp8=True`` (group "fp8": the ratios on the first of these rows
#: are against every other fp8 row). Another fp8 mode of ours plugs in here: a function
#: ``(run: CaseRun) -> List[Row]`` that quantizes ``run.sets`` (not timed), times its calls with
#: :func:`_timed_ours` (impl ``"mla_cupy-fp8-<mode>"``, group ``"fp8"``), and sets ``rel_err``
#: against :meth:`CaseRun.reference` of its dequantized inputs and ``err_vs_16bit`` with
#: :meth:`CaseRun.error`, as :func:`bench_ours_fp8` does.
FP8_ROWS: List[Callable[[CaseRun], List[Row]]] = [bench_ours_fp8, bench_ours_e4m3]

#: The fp8 peers, run with ``fp8=True`` and ``peers=True``.
FP8_PEER_ROWS: List[Callable[[CaseRun], List[Row]]] = [bench_fa3_fp8, bench_cudnn_fp8]


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


def run(cases: Sequence[BenchCase], *, peers: bool = True, fp8: bool = False, reps: int = 20, progress: bool = True,
        checkpoint: Optional[str] = None) -> dict:
    """Run the matrix on the current GPU; returns {"device", "matmul_tflops", "rows", ...}.

    ``peers``: the 16-bit peers (:data:`PEER_ROWS`); ``fp8``: our fp8 rows (:data:`FP8_ROWS`) and,
    with ``peers``, the fp8 peers (:data:`FP8_PEER_ROWS`). With ``checkpoint``, the rows so far are written there (JSON) after
    every case."""
    import cupy as cp

    info = device_info()
    info["matmul_tflops"] = matmul_tflops()
    builders = (PEER_ROWS if peers else []) + ((FP8_ROWS + (FP8_PEER_ROWS if peers else [])) if fp8 else [])
    rows: List[Row] = []
    for case in _progress(list(cases), "bench", progress):
        n_sets = n_input_sets(case)
        cr = CaseRun(case, [_inputs(case, seed) for seed in range(n_sets)], reps)
        ours = bench_ours(cr)
        ours.note = f"{n_sets} input set(s)"
        case_rows = [ours]
        for build in builders:
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
    """No GPU: time the float64 reference on tiny cases (no peers), so the command still works.
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
    fig.savefig(path, dpi=120)


def write_csv(result: dict, path: str) -> None:
    import csv

    keys = ["case", "impl", "group", "ms", "tflops", "rel_err", "err_vs_16bit", "extra_mem_mb", "host_us", "note", "ratios"]
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=keys)
        wr.writeheader()
        for r in result["rows"]:
            wr.writerow({**r, "ratios": json.dumps(r["ratios"])})

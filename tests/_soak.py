"""Soak and concurrency of the launch paths (GPU): many calls of mixed layouts through
``plan.run``, the one-shot call and the torch op with device memory and the caches sampled; and
several host threads, each with its own stream and plans, against the serial results.

* :func:`soak`: ``calls`` calls going round :data:`LAYOUTS` (both 16-bit kernels, every mask,
  ragged with empty sequences, paged, float32 output, lse, fp8 per token on Hopper) and the paths
  (``plan.run`` / ``run_fp8``, ``mla_prefill`` / ``mla_prefill_fp8``, and the ``mla_cupy.torch_ops``
  functions when torch is importable), half of the rounds into given outputs and half allocating
  theirs. Every result is compared on the device, bit for bit, with the first result of its
  layout, which is checked against the float64 reference. Sampled every ``calls / 50`` calls:
  CuPy's pool (used bytes), torch's allocated bytes, the device's free memory
  (``cudaMemGetInfo``), the kernel modules compiled (``mla_cupy.jit.compile_count``), the
  packed launch records the soak's plans keep (one per array layout, at most 256) and the entries
  of the one-shot calls' plan cache (one per call key, bounded; no device memory). After the
  warm-up every sample must stay within :data:`TOLERANCES` of the others.
* :func:`concurrency`: ``threads`` threads, each with its own non-blocking stream, its own plans and
  its own outputs, run every layout ``iters`` times (plans and one-shot calls alternating) at once;
  every result must equal the serial one bit for bit.
* :func:`backward_repeatability`: the backward of one problem (:data:`BACKWARD_LAYOUT`) on each
  kernel, checked against the float64 reference; in deterministic mode ``runs`` runs one after
  another and ``runs`` in each of ``threads`` threads with their own streams at once, every result
  bitwise equal to the first; in the default mode runs from the threads within the reference's
  bound of the serial result (its dq sums follow the order the key blocks finish in: not bitwise).

``python benchmarks/verify.py soak --out DIR`` runs the three and writes ``soak.json``
(:mod:`_verify`); ``tests/test_gpu_reliability.py`` runs them (the first two shorter) in the GPU
suite.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from mla_cupy import CausalMask, ChunkedCausalMask, ChunkedMask, NullMask, PagedKVCache, SlidingWindowCausalMask
from mla_cupy.masks import Mask

from _cases import BF16, FP16, build_paged, make_case
from _threads import in_threads

MIB = 2**20
#: The most a sampled quantity may move after the warm-up.
TOLERANCES = dict(pool_used=1 * MIB, torch_allocated=1 * MIB, device_free=32 * MIB, compiled_modules=0, plan_records=0,
                  plan_cache=0)
FP8_TOL = 5e-2  # the fp8 per-token kernel against the reference of its dequantized inputs (_fuzz.FP8_TOL)


@dataclass(frozen=True)
class Layout:
    """One batch layout of the soak."""

    sq: Tuple[int, ...]
    sk: Tuple[int, ...]
    heads: int
    mask: Mask
    kernel: str = "auto"
    fp16: bool = False
    page_size: int = 0
    cache_offsets: Optional[Tuple[int, ...]] = None
    out_f32: bool = False
    lse: bool = False
    fp8: bool = False

    @property
    def label(self) -> str:
        extra = [f"pages {self.page_size}"] * bool(self.page_size) + ["fp16"] * self.fp16 + ["f32 out"] * self.out_f32 \
            + ["lse"] * self.lse + ["fp8"] * self.fp8
        return f"{self.kernel} sq={list(self.sq)} sk={list(self.sk)} H={self.heads} {self.mask!r} {' '.join(extra)}".strip()


LAYOUTS = (
    Layout((64,), (64,), 16, CausalMask()),
    Layout((100, 0, 37), (300, 5, 37), 16, SlidingWindowCausalMask(64), lse=True),
    Layout((129, 1), (129, 200), 16, ChunkedCausalMask(50), out_f32=True, lse=True),
    Layout((200,), (456,), 16, NullMask(), page_size=64, cache_offsets=(5,)),
    Layout((17,) * 8, (40,) * 8, 1, ChunkedMask(16), kernel="sm80", lse=True),
    Layout((256,), (300,), 128, CausalMask(), kernel="sm80", fp16=True),
    Layout((130, 7), (300, 7), 16, CausalMask(), kernel="sm90", fp8=True, lse=True),
)


def _torch():
    """torch with a CUDA device and mla_cupy.torch_ops, or None."""
    try:
        import torch

        import mla_cupy.torch_ops as ops

        return (torch, ops) if torch.cuda.is_available() else None
    except ImportError:
        return None


def _bits(x):
    """A CuPy integer view of the bits of a CuPy array or torch tensor (for exact comparison)."""
    import cupy as cp

    if not isinstance(x, cp.ndarray):  # torch: its 16- / 32-bit integer view, through DLPack
        import torch

        x = cp.from_dlpack(x.view(torch.int16 if x.element_size() == 2 else torch.int32))
    return x.view(cp.uint16 if x.dtype.itemsize == 2 else cp.uint32)


class Prepared:
    """A layout's device inputs, its plan, its given outputs, torch views of them, and its
    expected result (the first one-shot call, checked against the float64 reference)."""

    def __init__(self, layout: Layout, seed: int, th=None):
        import cupy as cp

        from gpu_util import check_result, reference_result, upload
        from mla_cupy import quant, reference

        self.layout = L = layout
        dtype = FP16 if L.fp16 else BF16
        self.case = c = make_case(L.sq, L.sk, L.heads, dtype, seed=seed, cache_offsets=L.cache_offsets)
        self.d = upload(c)
        self.out_dtype = np.dtype(np.float32) if L.out_f32 else dtype
        self.rope, ref_rope, self.lut = self.d["k_rope"], None, None
        if L.page_size:
            blocks, lut = build_paged(c, L.page_size, seed=seed)
            self.rope = PagedKVCache(cp.asarray(blocks), cp.asarray(lut), L.page_size)
            ref_rope, self.lut = PagedKVCache(blocks, lut, L.page_size), self.rope.lookup_table
        self.fq = None
        if L.fp8:
            host = quant.quantize_per_token(c.q, c.k, c.v, c.k_rope)
            self.fq = {n: a.view(np.uint8) if a.dtype.itemsize == 1 else a for n, a in host.items()}
        self.fp8_args = None if self.fq is None else [cp.asarray(self.fq[n]) for n in
                                                      ("q_nope", "q_rope", "q_scale", "k", "k_scales", "v", "k_rope")]
        self.plan = self.make_plan()
        self.out, self.lse = self.buffers()
        self.expected = self.one_shot()
        got, lse = self.expected
        if L.fp8:
            f = self.fq
            ref, ref_lse = reference.mla_prefill_fp8(f["q_nope"], f["q_rope"], f["q_scale"], f["k"], f["k_scales"], f["v"],
                                                     f["k_rope"], c.valid_length, c.cache_row_offsets, mask=L.mask,
                                                     cache_offsets=c.cache_offsets, return_lse=True)
        else:
            ref, ref_lse = reference_result(c, mask=L.mask, k_rope=ref_rope)
        self.ref_error, self.ref_failure = None, None
        try:
            self.ref_error = check_result(c, got, lse, ref, ref_lse, tol=FP8_TOL if L.fp8 else 1e-2)
        except AssertionError as exc:
            self.ref_failure = f"{L.label}: the first result against the reference: {exc}"
        self.t = None
        if th is not None:
            self.t = self._torch_inputs(th[0])

    def make_plan(self):
        import mla_cupy

        L, d = self.layout, self.d
        return mla_cupy.plan(d["valid_length"], d["cache_row_offsets"], num_heads=L.heads, dtype=self.case.q.dtype,
                             mask=L.mask, kernel=L.kernel, cache_offsets=d["cache_offsets"], page_table=self.lut,
                             page_size=L.page_size or None, fp8=L.fp8, out_dtype=self.out_dtype, return_lse=L.lse)

    def buffers(self):
        """NaN-filled ``(out, lse or None)`` of the layout."""
        import cupy as cp

        tq, h = self.case.q.shape[:2]
        lse = cp.full((tq, h), np.nan, cp.float32) if self.layout.lse else None
        return cp.full((tq, h, 128), np.nan, self.out_dtype), lse

    def _torch_inputs(self, torch) -> dict:
        """torch views of the device inputs (zero copy) and torch output buffers."""
        import cupy as cp

        def view(x):
            if x is None:
                return None
            if x.dtype == BF16:  # through the bits: DLPack export of bfloat16 is not everywhere
                return torch.from_dlpack(x.view(cp.int16)).view(torch.bfloat16)
            return torch.from_dlpack(x)

        d = self.d
        t = {n: view(d[n]) for n in ("q", "k", "v", "k_rope")}
        t["valid_length"], t["cache_row_offsets"] = (view(d[n].astype(cp.int32)) for n in ("valid_length", "cache_row_offsets"))
        t["cache_offsets"] = None if d["cache_offsets"] is None else view(d["cache_offsets"].astype(cp.int32))
        if self.layout.page_size:
            t["k_rope"] = PagedKVCache(view(self.rope.blocks), view(self.rope.lookup_table), self.layout.page_size)
        if self.fp8_args is not None:
            t["fp8"] = [view(x) for x in self.fp8_args]
        out, lse = self.buffers()
        t["out"], t["lse"] = view(out), view(lse)
        t["keep"] = (out, lse)  # the CuPy owners of the torch views
        return t

    def _kw(self):
        L = self.layout
        return dict(mask=L.mask, kernel=L.kernel, return_lse=L.lse)

    def run_plan(self, plan, out=None, lse=None, stream=None):
        """``plan.run`` (``run_fp8``) of the layout's inputs; ``(out, lse or None)``."""
        if self.layout.fp8:
            res = plan.run_fp8(*self.fp8_args, out=out, lse=lse, stream=stream)
        else:
            res = plan.run(self.d["q"], self.d["k"], self.d["v"], self.rope, out=out, lse=lse, stream=stream)
        return res if self.layout.lse else (res, None)

    def one_shot(self, out=None, lse=None, stream=None):
        """``mla_prefill`` (``mla_prefill_fp8``) of the layout's inputs; ``(out, lse or None)``."""
        import mla_cupy

        d = self.d
        kw = dict(self._kw(), cache_offsets=d["cache_offsets"], out=out, lse=lse, stream=stream,
                  out_dtype=np.float32 if self.layout.out_f32 else None)
        if self.layout.fp8:
            res = mla_cupy.mla_prefill_fp8(*self.fp8_args, d["valid_length"], d["cache_row_offsets"], **kw)
        else:
            res = mla_cupy.mla_prefill(d["q"], d["k"], d["v"], self.rope, d["valid_length"], d["cache_row_offsets"], **kw)
        return res if self.layout.lse else (res, None)

    def torch_op(self, ops, given: bool):
        """The ``mla_cupy.torch_ops`` call of the layout's inputs (into its torch buffers when
        ``given``); ``(out, lse or None)`` as torch tensors."""
        import torch

        t = self.t
        kw = dict(self._kw(), cache_offsets=t["cache_offsets"], out=t["out"] if given else None,
                  lse=t["lse"] if given else None, out_dtype=torch.float32 if self.layout.out_f32 else None)
        if self.layout.fp8:
            res = ops.mla_prefill_fp8(*t["fp8"], t["valid_length"], t["cache_row_offsets"], **kw)
        else:
            res = ops.mla_prefill(t["q"], t["k"], t["v"], t["k_rope"], t["valid_length"], t["cache_row_offsets"], **kw)
        return res if self.layout.lse else (res, None)

    def differs(self, res):
        """A device count of the elements of ``res`` (out, lse) whose bits differ from the expected."""
        import cupy as cp

        n = cp.count_nonzero(_bits(res[0]) != _bits(self.expected[0]))
        if res[1] is not None:
            n = n + cp.count_nonzero(_bits(res[1]) != _bits(self.expected[1]))
        return n


def layouts_here(layouts=LAYOUTS) -> List[Layout]:
    """The layouts this GPU runs (the fp8 one and sm90 ones on compute capability 9.0 only)."""
    from gpu_util import KERNELS

    return [L for L in layouts if L.kernel == "auto" or L.kernel in KERNELS]


def prepare(layouts=None, with_torch: bool = True) -> List[Prepared]:
    th = _torch() if with_torch else None
    return [Prepared(L, seed=i, th=th) for i, L in enumerate(layouts_here() if layouts is None else layouts)]


def _sample(call: int, plans, th) -> dict:
    import cupy as cp

    from mla_cupy import jit, plan_cache_info

    cp.cuda.Device().synchronize()
    if th is not None:
        th[0].cuda.synchronize()
    free, _ = cp.cuda.runtime.memGetInfo()
    return dict(call=call, pool_used=cp.get_default_memory_pool().used_bytes(),
                pool_total=cp.get_default_memory_pool().total_bytes(),
                torch_allocated=None if th is None else int(th[0].cuda.memory_allocated()), device_free=int(free),
                compiled_modules=jit.compile_count(), plan_records=sum(len(getattr(p, "_records", ())) for p in plans),
                plan_cache=plan_cache_info().currsize)


def drift(samples: List[dict], warmup: int) -> Tuple[dict, dict]:
    """``(drift, span)`` of each sampled quantity over the samples taken at or after call
    ``warmup``: the last minus the first, and the largest minus the smallest (None where a
    quantity was not sampled)."""
    later = [s for s in samples if s["call"] >= warmup]
    dr, sp = {}, {}
    for key in TOLERANCES:
        vals = [s.get(key) for s in later]
        if not vals or any(v is None for v in vals):
            dr[key] = sp[key] = None
        else:
            dr[key], sp[key] = vals[-1] - vals[0], max(vals) - min(vals)
    return dr, sp


def judge(record: dict) -> List[str]:
    """What is wrong with a soak record (empty: nothing)."""
    bad = [f"{key} moved by {record['span'][key]:,} after the warm-up (tolerance {tol:,})"
           for key, tol in TOLERANCES.items() if record["span"].get(key) is not None and record["span"][key] > tol]
    if record["mismatched_elements"]:
        bad.append(f"{record['mismatched_elements']} result elements differ from the first result of their layout")
    bad += record.get("errors", [])
    return bad


def soak(calls: int = 10_000, *, with_torch: bool = True, prepared=None, log=print) -> dict:
    """``calls`` calls of mixed layouts and paths with memory and caches sampled (module doc).
    Returns the record (``failures`` empty when everything held)."""
    import cupy as cp

    th = _torch() if with_torch else None
    prepared = prepare(with_torch=with_torch) if prepared is None else prepared
    paths = ["plan", "one-shot"] + (["torch"] if th is not None else [])
    n, m = len(prepared), len(paths)
    combos = n * m * 2
    warmup = max(calls // 10, 2 * combos)
    every = max(1, calls // 50)
    plans = [p.plan for p in prepared]
    bad = cp.zeros((), cp.int64)
    counts: Dict[str, int] = {p: 0 for p in paths}
    samples, errors = [], [p.ref_failure for p in prepared if p.ref_failure]
    t0 = time.perf_counter()
    log(f"soak: {calls:,} calls over {n} layouts x {', '.join(paths)}; warm-up {warmup} calls, a sample every {every}")
    for i in range(calls):
        prep, path = prepared[i % n], paths[(i // n) % m]
        given = (i // (n * m)) % 2 == 1
        try:
            out, lse = (prep.out, prep.lse) if given else (None, None)
            if path == "plan":
                res = prep.run_plan(prep.plan, out, lse)
            elif path == "one-shot":
                res = prep.one_shot(out, lse)
            else:
                res = prep.torch_op(th[1], given)
            bad += prep.differs(res)
            del res
        except Exception as exc:  # keep going: the record says what failed
            errors.append(f"call {i} ({path}, {prep.layout.label}): {type(exc).__name__}: {exc}")
            if len(errors) >= 10:
                break
        counts[path] += 1
        if (i + 1) % every == 0:
            samples.append(_sample(i + 1, plans, th))
    elapsed = time.perf_counter() - t0
    dr, sp = drift(samples, warmup)
    rec = dict(kind="soak", calls=calls, paths=counts, layouts=[p.layout.label for p in prepared], torch=th is not None,
               warmup=warmup, samples=samples, drift=dr, span=sp, tolerances=TOLERANCES, elapsed_s=round(elapsed, 2),
               mismatched_elements=int(bad), reference_errors={p.layout.label: p.ref_error for p in prepared},
               errors=errors)
    rec["failures"] = judge(rec)
    rec["ok"] = not rec["failures"]
    log(f"soak: {sum(counts.values()):,} calls in {elapsed:.1f} s ({counts}); after the warm-up: "
        + ", ".join(f"{k} {'n/a' if v is None else f'{v:+,}'}" for k, v in dr.items())
        + f"; {int(bad)} differing elements; " + ("ok" if rec["ok"] else "FAILED: " + "; ".join(rec["failures"])))
    return rec


def concurrency(threads: int = 8, iters: int = 10, prepared=None, log=print) -> dict:
    """``threads`` threads with their own streams and plans against the serial results (module doc)."""
    import cupy as cp

    prepared = prepare(with_torch=False) if prepared is None else prepared
    n = len(prepared)
    barrier = threading.Barrier(threads, timeout=300)
    mismatches = [0] * threads
    errors: List[str] = []

    def worker(t: int) -> None:
        try:
            stream = cp.cuda.Stream(non_blocking=True)
            with stream:
                plans = [p.make_plan() for p in prepared]
                bufs = [p.buffers() for p in prepared]
                bad = cp.zeros((), cp.int64)
                barrier.wait()
                for it in range(iters):
                    for jj in range(n):
                        j = (jj + t) % n  # each thread in its own order
                        p = prepared[j]
                        out, lse = bufs[j]
                        if (it + t) % 2 == 0:
                            res = p.run_plan(plans[j], out, lse, stream=stream)
                        else:
                            res = p.one_shot(out, lse, stream=stream)
                        bad += p.differs(res)
                stream.synchronize()
                mismatches[t] = int(bad)
        except Exception as exc:
            errors.append(f"thread {t}: {type(exc).__name__}: {exc}")
            barrier.abort()

    t0 = time.perf_counter()
    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    rec = dict(threads=threads, runs_per_thread=iters * n, mismatches=sum(mismatches), errors=errors,
               elapsed_s=round(time.perf_counter() - t0, 2))
    rec["ok"] = not errors and rec["mismatches"] == 0
    log(f"concurrency: {threads} threads x {iters * n} runs in {rec['elapsed_s']} s: "
        + ("bitwise equal to the serial results" if rec["ok"] else f"{rec['mismatches']} differing elements, {errors}"))
    return rec


#: The problem of :func:`backward_repeatability` (bf16, with a gradient of lse): a ragged causal
#: batch with an empty sequence and a sequence whose query blocks each sum the dq of up to 11 key
#: blocks (the Hopper kernel's 96 keys; 16 of the portable kernel's 64).
BACKWARD_LAYOUT = Layout((700, 129, 0, 65), (1000, 129, 7, 300), 16, CausalMask())


def _same_bits(grads, first):
    """A device count of the elements of ``grads`` whose bits differ from ``first``'s."""
    import cupy as cp

    n = cp.zeros((), cp.int64)
    for g, f in zip(grads, first):
        n += cp.count_nonzero(_bits(g) != _bits(f))
    return n


def _repoisoned(grads):
    for g in grads:
        g.fill(np.nan)
    return grads


def _backward_kernel(out: dict, L: Layout, runs: int, threads: int, free_runs: int) -> None:
    """:func:`backward_repeatability` on the kernel ``out["kernel"]``: fills its part of the record."""
    import cupy as cp

    from gpu_util import BackwardProblem, check_gradients, gradient_errors

    bp = BackwardProblem(make_case(L.sq, L.sk, L.heads, BF16, seed=20), L.mask, out["kernel"], dlse=True, seed=21)
    first = bp.run(deterministic=True)
    try:
        out["ref_error"] = bp.check(first)
    except AssertionError as exc:
        out["errors"].append(f"deterministic result against the reference: {exc}")
    grads, bad = bp.gradients(), cp.zeros((), cp.int64)
    for _ in range(runs):
        bad += _same_bits(bp.run(_repoisoned(grads), deterministic=True), first)
    out["serial_mismatches"] = int(bad)
    serial = bp.run(deterministic=False)
    try:
        check_gradients(serial, bp.reference(), BF16, L.heads)
    except AssertionError as exc:
        out["errors"].append(f"default-mode result against the reference: {exc}")
    serial_host = [cp.asnumpy(g).astype(np.float64) for g in serial]
    thread_bad, worst, differ = [0] * threads, [0.0] * threads, [0] * threads
    barrier = threading.Barrier(threads, timeout=300)

    def work(t: int) -> None:
        try:
            stream = cp.cuda.Stream(non_blocking=True)
            with stream:
                grads, n = bp.gradients(), cp.zeros((), cp.int64)
                barrier.wait()
                for _ in range(runs):
                    n += _same_bits(bp.run(_repoisoned(grads), deterministic=True, stream=stream), first)
                for _ in range(free_runs):
                    got = bp.run(_repoisoned(grads), deterministic=False, stream=stream)
                    differ[t] += int(_same_bits(got, serial)) > 0
                    worst[t] = max(worst[t], *gradient_errors(got, serial_host, L.heads))
                stream.synchronize()
                thread_bad[t] = int(n)
        except Exception:
            barrier.abort()
            raise

    errors = in_threads(work, threads)
    causes = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]  # the others follow from them
    out["errors"] += [f"a thread: {type(e).__name__}: {e}" for e in causes or errors]
    out.update(thread_mismatches=sum(thread_bad), free_worst=max(worst), free_differ_bits=sum(differ))


def backward_repeatability(runs: int = 100, threads: int = 8, free_runs: int = 10, kernels=None,
                           layout: Layout = BACKWARD_LAYOUT, log=print) -> dict:
    """The backward's repeatability on every kernel this GPU runs (module doc): deterministic mode
    ``runs`` times serially and ``runs`` times in each of ``threads`` threads (own streams and
    gradients, NaN-poisoned before each run), bitwise equal to the first result; the default mode
    ``free_runs`` times in each thread, within the reference's bound of the serial result. The
    problem: ``layout`` in bf16 with a dlse."""
    from gpu_util import KERNELS, backward_bound

    t0 = time.perf_counter()
    parts = []
    for kernel in KERNELS if kernels is None else kernels:
        p = dict(kernel=kernel, ref_error=None, serial_mismatches=None, thread_mismatches=None, free_worst=None,
                 free_differ_bits=None, errors=[])
        try:
            _backward_kernel(p, layout, runs, threads, free_runs)
        except Exception as exc:  # a refused or failed call: the record says so, the other kernels still run
            p["errors"].append(f"{type(exc).__name__}: {exc}")
        p["ok"] = (not p["errors"] and p["serial_mismatches"] == 0 and p["thread_mismatches"] == 0
                   and p["free_worst"] < backward_bound(BF16))
        parts.append(p)
    rec = dict(layout=layout.label + " bf16 dlse", runs=runs, threads=threads, free_runs=free_runs, kernels=parts,
               ok=all(p["ok"] for p in parts), elapsed_s=round(time.perf_counter() - t0, 2))
    for p in parts:
        log(f"backward {p['kernel']}: deterministic {runs} serial + {threads} threads x {runs} runs: "
            f"{p['serial_mismatches']} + {p['thread_mismatches']} elements differ from the first result; default mode "
            f"{threads} threads x {free_runs} runs: worst {p['free_worst']} against the serial result "
            f"({p['free_differ_bits']} differ in bits); reference error {p['ref_error']}"
            + ("" if p["ok"] else f"; FAILED {p['errors']}"))
    return rec


def main(argv=None) -> int:
    """``python benchmarks/verify.py soak [--calls N] [--threads T] [--iters I] [--bwd-runs R] [--no-torch]
    [--out DIR]``: the soak, the concurrency check, then the backward's repeatability; the record
    goes to ``DIR/soak.json``. Exit status 1 when any failed."""
    ap = argparse.ArgumentParser(prog="verify.py soak", description=main.__doc__)
    ap.add_argument("--calls", type=int, default=10_000)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20, help="runs of every layout per thread")
    ap.add_argument("--bwd-runs", type=int, default=100, help="deterministic backward runs, serial and per thread")
    ap.add_argument("--no-torch", action="store_true", help="leave out the torch op")
    ap.add_argument("--out", help="folder of the record")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    from _verify import write_record

    prepared = prepare(with_torch=not a.no_torch)
    print("layouts (first result vs the float64 reference, worst per-slice error):")
    for p in prepared:
        print(f"  {p.layout.label}: {p.ref_failure or f'{p.ref_error:.2e}'}")
    rec = soak(a.calls, with_torch=not a.no_torch, prepared=prepared)
    rec["concurrency"] = concurrency(a.threads, a.iters, prepared=prepared)
    if not rec["concurrency"]["ok"]:
        rec["failures"].append("concurrency: results differ from the serial ones or a thread failed")
        rec["ok"] = False
    if a.out:  # kept if the backward's runs never return (a hang ends the step at its time limit)
        write_record(a.out, "soak.json", dict(rec, backward=dict(ok=False, unfinished=True, kernels=[])))
    rec["backward"] = backward_repeatability(a.bwd_runs, a.threads)
    if not rec["backward"]["ok"]:
        rec["failures"].append("backward: deterministic results differ, or a result is off the reference or the "
                               "serial one, or a thread failed")
        rec["ok"] = False
    if a.out:
        print(f"record: {write_record(a.out, 'soak.json', rec)}")
    return 0 if rec["ok"] else 1

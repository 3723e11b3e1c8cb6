"""A/B timing of attention implementations in one process: the tool behind every speed claim.

Two or more implementations run on the same inputs, in interleaved rounds whose order alternates
(forward on even rounds, reversed on odd ones), so that clock drift under the card's power cap
hits all of them alike. Each round times every implementation (median of ``--reps`` calls, GPU
time behind a spin kernel, as ``mla-cupy bench``); the result per implementation is the median
over rounds of its time divided by the BASE implementation's time in the same round, with the
spread (min, max) over rounds. An NVML thread samples the SM clock and the board power at
``--nvml-hz`` (20 by default) during the run; the table reports the clock and power per case.

With ``--energy S``, each round also runs every implementation back to back for about S seconds
and reads the board's energy counter around that window: energy per call (J), mean power, the SM
clock in the window and the wall time per call, hence thousands of SM cycles per call (ms x MHz).
Under the power cap the card runs at the clock its power limit allows, so on long cases the time of
two kernels doing the same work stands in the ratio of their energies per call; cycles per call
take the clock out of a comparison that the cap's drift would otherwise blur. The second table
gives, per implementation, the medians over rounds and the medians of per-round ratios to the
base's J and cycles.

With ``--launches N`` nothing is timed in rounds: each implementation runs N calls per case under
torch's profiler, and a table gives per kernel its launches and microseconds per call and its share
of the kernels' time, and the span per call (first kernel start to last kernel end: the gaps between
launches included), to see whether a difference lies in a main kernel or in its passes.

Implementations (``--impls``, comma separated; the first is the base):

  ours              16-bit Hopper kernel (``mla_prefill``, out= given, validate=False)
  ours:paged=P      the same with the rope in a PagedKVCache of P-row pages (shuffled), key tiles on page
                    boundaries; ours:paged=P;shift=S puts the keys S rows into their first page
                    (cache_offsets = S); one-sequence cases
  ours:hps=N        the same with N heads per L2 section (scheduler experiment; overrides the host heuristic)
  ours:tail=N       the same with N query blocks ending the launch outside the sections (0: the sections'
                    order alone; overrides the host's rule)
  ours:sched=static the same with the round-robin tile order instead of the dynamic hand-out
  ours:src=DIR      the same with the kernels under DIR (``git archive REV kernels | tar -x -C DIR``; they must
                    take the parameters the current launch code packs)
  ours:def=A:0+B:1  the same with compile-time switches of the Hopper kernel set (kernels/sm90/config.cuh)
  ours:pkg=DIR      an older version of the whole package: DIR holds a copy of its mla_cupy/ renamed (e.g.
                    mla_cupy_prev/) and its kernels/ beside it (``git archive REV mla_cupy kernels``)
  ours:...;check=0  a timing-only build (a probe that skips work, wrong results): its error is reported,
                    not checked against ``--max-err`` (any implementation, forward or backward)
  ours-fp8          fp8 per-token kernel (``mla_prefill_fp8``; inputs quantized by ``quant.quantize_per_token``)
  ours-e4m3         the same in the all-e4m3 mode (rope parts e4m3 under the per-token scales,
                    ``quantize_per_token(..., e4m3_rope=True)``): Q K^T one 192-deep e4m3 GEMM, as fa3-fp8's
  ours-fp8:vt=quant, ours-e4m3:vt=quant
                    the same given the quantizer's V^T (``quantize_per_token(..., cache_row_offsets=)``'s
                    ``TransposedV`` as v): each call launches the attention kernel alone, no V^T pre-pass
  ours-fp8:pairs=0, ours-e4m3:pairs=0
                    the same with the kernels that read the key scales one at a time where the batch's first
                    key rows are all even (which take the kernels reading them in pairs)
  ours-fp8:paged=P  the per-token kernel with its (bf16, scaled) rope in a PagedKVCache, as ours:paged=P
  fa3, fa3+kbuild   FlashAttention-3 (``fa3_fwd_interface`` or ``flash_attn_interface``), kernel only / with
                    the K build at 192 width that it needs
  fa3-fp8           FlashAttention-3 e4m3 (per (batch, head) descales)
  fa4, fa4+kbuild   FlashAttention-4's varlen call (``flash_attn.cute``, its SM90 path), kernel only / with the K
                    build at 192 width; left out, with one line saying how to get it, when it does not import
  cudnn, cudnn+kbuild   torch SDPA on the cuDNN backend (one call per sequence)
  cudnn-ragged, cudnn-ragged+kbuild
                    cuDNN's ragged SDPA (``cudnn.sdpa_torch`` with ``cu_seqlens``, the nvidia-cudnn-frontend
                    wheel): one call per batch; left out of the run, with one line saying how to get it,
                    when the module does not import, and of a case whose mask it cannot express
  cudnn-fp8         cuDNN's fp8 SDPA (a frontend graph, ``pygraph.sdpa_fp8``): e4m3 q, K at 192 and v with one
                    descale per tensor, bf16 out, one execution per batch (ragged layout for unequal lengths);
                    left out as cudnn-ragged is
  kbuild            the K build alone (``torch.cat``)

With ``--backward`` the implementations are backward passes, given our forward's out and lse and a random
dout: ``ours`` (``ours:det=1`` deterministic, ``ours:kernel=sm80`` the portable kernel, ``ours:hpg=N`` N
heads per work tile instead of the host's rule, ``ours:src=DIR``, ``ours:def=...`` and ``ours:pkg=DIR`` as
above), ``cudnn`` and ``fa4`` (their backward kernels through torch autograd, K at 192 given), ``cudnn+kbuild`` and
``fa4+kbuild`` (the whole step a trainer pays: K built in the forward graph, whose backward also
splits dK and sums its rope part over the heads); the check is dq, dk and dv against the float64
reference backward on two heads.

Every implementation's output is checked against the float64 reference (two heads) once per case;
a relative error above ``--max-err`` fails the run. Usage on a GPU machine::

    PYTHONPATH=.:/path/to/fa3/site python3 benchmarks/ab.py --impls ours,fa3,fa3+kbuild \\
        --cases 1x4096,1x8192,ragged --rounds 7 --out gpu-logs/ab.json

Case names are those of ``mla-cupy bench --list`` (``mla_cupy.bench.DEFAULT_CASES``) plus ``1xN`` and
``H16-1xN`` for any N.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import statistics
import sys
import threading
import time
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

import peers
from mla_cupy import bench
from mla_cupy.bench import BenchCase, DEFAULT_CASES
from mla_cupy.dims import DV


# ---------------------------------------------------------------------------------------------
# NVML sampling
# ---------------------------------------------------------------------------------------------
class NvmlSampler:
    """SM clock (MHz) and board power (W) of GPU ``index``, sampled at ``hz`` in a thread.
    ``mark()`` returns the sample count, so a window of the run can be summarised later."""

    def __init__(self, index: int = 0, hz: float = 20.0):
        self.samples: List[Tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._period = 1.0 / hz
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nv, self._h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:  # no NVML: timings still run, the clock columns stay empty
            print(f"NVML unavailable ({type(exc).__name__}: {exc}); no clock/power samples", file=sys.stderr)
            self._nv = None
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        nv = self._nv
        while not self._stop.is_set():
            try:
                clk = nv.nvmlDeviceGetClockInfo(self._h, nv.NVML_CLOCK_SM)
                pw = nv.nvmlDeviceGetPowerUsage(self._h) / 1000.0
                self.samples.append((time.perf_counter(), float(clk), pw))
            except Exception:
                pass
            self._stop.wait(self._period)

    def __enter__(self):
        if self._nv is not None:
            self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._nv is not None:
            self._t.join()

    def mark(self) -> int:
        return len(self.samples)

    def energy_mj(self):
        """The board's energy counter (mJ since the driver loaded), or None without NVML or where
        the card does not count it."""
        if self._nv is None:
            return None
        try:
            return float(self._nv.nvmlDeviceGetTotalEnergyConsumption(self._h))
        except Exception:
            return None

    def summary(self, since: int = 0, until=None) -> dict:
        s = self.samples[since:until]
        if not s:
            return {"n": 0}
        clk = [x[1] for x in s]
        pw = [x[2] for x in s]
        dur = s[-1][0] - s[0][0]
        return {"n": len(s), "hz": (len(s) - 1) / dur if dur > 0 else float("nan"),
                "sm_mhz_median": statistics.median(clk), "sm_mhz_min": min(clk), "sm_mhz_max": max(clk),
                "power_w_median": statistics.median(pw), "power_w_max": max(pw)}


# ---------------------------------------------------------------------------------------------
# cases and inputs
# ---------------------------------------------------------------------------------------------
def parse_case(name: str) -> BenchCase:
    """A case of ``mla-cupy bench --list``, or ``BxN`` (B causal sequences of N), ``1xN``,
    ``H16-1xN`` (16 heads) or ``ragged-A+B+C`` (causal sequences of those lengths)."""
    if name in DEFAULT_CASES:
        return DEFAULT_CASES[name]
    heads = 128
    body = name
    if name.startswith("H") and "-" in name:
        head, body = name.split("-", 1)
        heads = int(head[1:])
    if body.startswith("ragged-"):
        lens = tuple(int(x) for x in body[len("ragged-"):].split("+"))
        return BenchCase(name, lens, lens, heads, True)
    b, _, n = body.partition("x")
    if b.isdigit() and n.isdigit():
        lens = (int(n),) * int(b)
        return BenchCase(name, lens, lens, heads, True)
    raise SystemExit(f"unknown case {name!r}: one of {sorted(DEFAULT_CASES)}, BxN, H16-1xN or ragged-A+B+C")


# ---------------------------------------------------------------------------------------------
# implementations: each factory returns (call(i), output(i) -> device array [Tq, H, 128] for the check)
# ---------------------------------------------------------------------------------------------
Impl = Tuple[Callable[[int], object], Callable[[int], object]]


def _paged(k_rope, page: int, shift: int, package, seed: int = 1, table=None):
    """k_rope [Tk, 1, 64] as a PagedKVCache (of ``package``: the package timed) of ``page``-row
    pages in shuffled order, keys starting ``shift`` rows into their first page (``cache_offsets``:
    0 keeps key tiles on page boundaries). ``table``: another such cache's lookup table to share
    (a plan reads the one table it was built with)."""
    import cupy as cp

    PagedKVCache = package.PagedKVCache

    tk = int(k_rope.shape[0])
    n_pages = -(-(tk + shift) // page)
    if table is None:
        table = cp.asarray(np.random.default_rng(seed).permutation(n_pages).astype(np.uint32)).reshape(1, -1)
    order = table.reshape(-1)
    bits = cp.zeros((n_pages * page, 576), cp.uint16)  # 16-bit rows, filled through their bits
    pos = cp.arange(shift, shift + tk)
    bits[order[pos // page].astype(cp.int64) * page + pos % page, 512:] = k_rope[:, 0, :].view(cp.uint16)
    blocks = bits.view(k_rope.dtype).reshape(n_pages, page, 1, 576)
    return PagedKVCache(blocks, table, page, rope_offset=512), shift


def _paged_ropes(ropes, opts: Dict[str, str], package):
    """With ``paged=P`` in ``opts``: each rope of ``ropes`` as a PagedKVCache (``_paged``, ``shift=S``
    keys into the first page) and the plan's arguments for them (page table, page size, cache
    offsets); without it the ropes as given and no arguments."""
    import cupy as cp

    if "paged" not in opts:
        return ropes, {}
    page, shift = int(opts["paged"]), int(opts.get("shift", 0))
    first = _paged(ropes[0], page, shift, package)[0]
    caches = [first] + [_paged(r, page, shift, package, table=first.lookup_table)[0] for r in ropes[1:]]
    return caches, dict(page_table=first.lookup_table, page_size=page,
                        cache_offsets=cp.asarray(np.array([shift], np.uint32)))


def _ours(case: BenchCase, sets, opts: Dict[str, str]) -> Impl:
    """Our 16-bit Hopper kernel through a plan (``mla_cupy.plan``: packed once, then each run
    rewrites pointers and launches). Variants pack their plan's launch record under the variant."""
    import cupy as cp

    import mla_cupy
    from mla_cupy import _packing, workspace
    from mla_cupy._arrays import BF16

    if len(case.sq) > 1 and "paged" in opts:
        raise SystemExit("ours:paged=P takes one-sequence cases")
    mask = case.mask
    if "pkg" in opts:
        mla_cupy = _package(opts["pkg"])
        workspace = importlib.import_module(mla_cupy.__name__ + ".workspace")
        mask = _mask_of(mla_cupy, mask)
    n = len(sets)
    outs = [cp.empty((sum(case.sq), case.heads, DV), BF16) for _ in range(n)]
    vl, cro = case.offsets()
    ropes, kw = _paged_ropes([x["k_rope"] for x in sets], opts, mla_cupy)
    pl = mla_cupy.plan(vl, cro, num_heads=case.heads, dtype=BF16, mask=mask, q_max_seq_len=max(case.sq), **kw)
    dynamic = opts.get("sched", "dynamic") == "dynamic"

    def call(i):
        x = sets[i]
        workspace.DYNAMIC_SCHEDULE = dynamic
        try:
            pl.run(x["q"], x["k"], x["v"], ropes[i], out=outs[i])
        finally:
            workspace.DYNAMIC_SCHEDULE = True
        return outs[i]

    return _first_call_under_variant(call, opts), lambda i: outs[i]


def _first_call_under_variant(call, opts: Dict[str, str]):
    """Runs ``call(0)`` once under the variant that ``opts`` names (``src``, ``def``, ``hps``, ``tail``): the
    plan's first run packs its launch record (kernel function, arguments) under the variant; later
    runs reuse that record, so nothing recompiles inside the timed region. Returns ``call``."""
    from mla_cupy import _packing

    hps = int(opts["hps"]) if "hps" in opts else None
    tail = int(opts["tail"]) if "tail" in opts else None
    src, defs = opts.get("src"), opts.get("def")
    if hps is None and tail is None and src is None and defs is None:
        return call
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from _variant import restore, use_defines, use_sources

    saved = None
    if src is not None:
        saved = use_sources(src)
    elif defs is not None:
        saved = use_defines(dict(d.split(":", 1) for d in defs.split("+")))
    orig = _packing.heads_per_section, _packing.tail_blocks
    if hps is not None:
        _packing.heads_per_section = lambda p, d: hps
    if tail is not None:
        _packing.tail_blocks = lambda p, hs, nmb, ctas: tail if tail < nmb else 0
    try:
        call(0)
    finally:
        _packing.heads_per_section, _packing.tail_blocks = orig
        if saved is not None:
            restore(saved)
    return call


def _mask_of(package, mask):
    """``mask`` as the mask class of the same name of another copy of the package."""
    import dataclasses

    return getattr(package, type(mask).__name__)(**{f.name: getattr(mask, f.name) for f in dataclasses.fields(mask)})


def _package(directory: str):
    """The package copy in ``directory`` (a folder holding one renamed copy of mla_cupy/ and the
    kernels/ it compiles), imported under its own name beside the current one."""
    from pathlib import Path

    (pkg,) = [p for p in Path(directory).iterdir() if (p / "__init__.py").is_file()]
    if directory not in sys.path:
        sys.path.insert(0, directory)
    return importlib.import_module(pkg.name)


def _ours_fp8(case: BenchCase, sets, opts, e4m3_rope: bool = False) -> Impl:
    """Our fp8 per-token kernel through a plan (inputs quantized by ``quant.quantize_per_token``);
    the V^T pre-pass runs in every call (the plan owns its workspace), or with ``vt=quant`` none:
    each call is given the quantizer's V^T (made with the inputs, outside the timed calls). Other
    options as ``ours`` (``paged=P`` and ``shift=S``: the quantizer's bf16 rope in a PagedKVCache; per
    token only). ``e4m3_rope``: the all-e4m3 mode (an fp8 plan with ``fp8_rope=True``)."""
    if "paged" in opts and (e4m3_rope or len(case.sq) > 1):
        raise SystemExit("ours-fp8:paged=P takes one-sequence cases, per token (an e4m3 rope is plain only)")
    import cupy as cp

    import mla_cupy
    from mla_cupy import quant
    from mla_cupy._arrays import BF16

    mask = case.mask
    if "pkg" in opts:
        mla_cupy = _package(opts["pkg"])
        mask = _mask_of(mla_cupy, mask)
        quant = importlib.import_module(mla_cupy.__name__ + ".quant")  # its own TransposedV
    vt = opts.get("vt", "pass")
    if vt not in ("pass", "quant"):
        raise SystemExit(f"{case.name}: vt={vt}: expected vt=quant (the quantizer's V^T) or vt=pass (the pre-pass)")
    n = len(sets)
    vl, cro = (cp.asarray(x) for x in case.offsets())  # one device array for the plan and the quantizer's V^T
    given = dict(cache_row_offsets=cro) if vt == "quant" else {}
    fs = [quant.quantize_per_token(x["q"], x["k"], x["v"], x["k_rope"], e4m3_rope=e4m3_rope, **given) for x in sets]
    outs = [cp.empty((sum(case.sq), case.heads, DV), BF16) for _ in range(n)]
    ropes, kw = _paged_ropes([f["k_rope"] for f in fs], opts, mla_cupy)
    if e4m3_rope:
        kw["fp8_rope"] = True
    fp8_mod = importlib.import_module(mla_cupy.__name__ + ".fp8")
    chooser = fp8_mod.scale_pairs if hasattr(fp8_mod, "scale_pairs") else None
    if opts.get("pairs") == "0" and chooser is not None:  # the kernel that reads the scales one at a time
        fp8_mod.scale_pairs = lambda *a: False
    try:
        pl = mla_cupy.plan(vl, cro, num_heads=case.heads, dtype=BF16, mask=mask, q_max_seq_len=max(case.sq), fp8=True,
                           **kw)
    finally:
        if chooser is not None:
            fp8_mod.scale_pairs = chooser
    v_of = "v_t" if vt == "quant" else "v"

    def call(i):
        f = fs[i]
        return pl.run_fp8(f["q_nope"], f["q_rope"], f["q_scale"], f["k"], f["k_scales"], f[v_of], ropes[i],
                          out=outs[i])

    return _first_call_under_variant(call, opts), lambda i: outs[i]


def _torch_sets(sets):
    import torch

    return [{k: torch.from_dlpack(v) for k, v in x.items()} for x in sets]


class _KBuiltEachCall:
    """``ks[i]``: K of set i built at 192 width when indexed, inside the timed call (``+kbuild``)."""

    def __init__(self, tx, heads: int):
        self.tx, self.heads = tx, heads

    def __getitem__(self, i):
        return peers.k192_of(self.tx[i], self.heads)


def _from_torch(outs: List[object]) -> Callable[[int], object]:
    """``output(i)`` of an implementation whose ``call(i)`` leaves a torch tensor ``[Tq, H, 128]``
    in ``outs[i]``: a zero-copy CuPy view of it."""
    def output(i):
        import cupy as cp

        return cp.from_dlpack(outs[i])

    return output


def _fa3(case: BenchCase, sets, opts, *, kbuild: bool, fp8: bool = False) -> Impl:
    """FlashAttention-3's varlen call (``peers.fa3_varlen_call``) on K at 192 width, built before
    the timed calls or (``kbuild``) inside each; ``fp8``: q, K and v in e4m3 with descales per
    (sequence, head) (``peers.quantize_per_batch_head``, not timed)."""
    found = peers.fa3_function()
    if found is None:
        raise LeftOut(f"FlashAttention-3 does not import (one of {peers.FA3_MODULES})")
    fn = found[0]
    tx = _torch_sets(sets)
    k192 = [peers.k192_of(t, case.heads) for t in tx]
    qs, ks, vs = [t["q"] for t in tx], (_KBuiltEachCall(tx, case.heads) if kbuild else k192), [t["v"] for t in tx]
    kw_of = lambda i: {}  # noqa: E731
    if fp8:
        q8, k8, v8 = peers.quantize_inputs(case, qs, k192, vs)
        qs, ks, vs = [q for q, _ in q8], [k for k, _ in k8], [v for v, _ in v8]
        kw_of = lambda i: dict(q_descale=q8[i][1], k_descale=k8[i][1], v_descale=v8[i][1])  # noqa: E731
    fa3 = peers.fa3_varlen_call(case, fn, qs, ks, vs, kw_of)
    outs: List[object] = [None] * len(sets)

    def call(i):
        outs[i] = fa3(i)
        return outs[i]

    return call, _from_torch(outs)


def _fa4(case: BenchCase, sets, opts, *, kbuild: bool) -> Impl:
    """FlashAttention-4's varlen call (``peers.fa4_call``) on K at 192 width, built before the timed
    calls or (``kbuild``) inside each."""
    import torch

    fn = peers.fa4_function()
    if fn is None:
        raise LeftOut(f"{peers.FA4_MODULE} does not import: {peers.FA4_HINT}")
    tx = _torch_sets(sets)
    k192 = [peers.k192_of(t, case.heads) for t in tx]
    args = peers.varlen_args(case, tx[0]["q"].device)
    outs: List[object] = [None] * len(sets)

    def call(i):
        t = tx[i]
        with torch.no_grad():
            outs[i] = peers.fa4_call(fn, t["q"], peers.k192_of(t, case.heads) if kbuild else k192[i], t["v"], args)
        return outs[i]

    return call, _from_torch(outs)


def _cudnn(case: BenchCase, sets, opts, *, kbuild: bool) -> Impl:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tx = _torch_sets(sets)
    k192 = [peers.k192_of(t, case.heads) for t in tx]
    outs: List[object] = [None] * len(sets)

    def call(i):
        t = tx[i]
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), torch.no_grad():
            outs[i] = peers.sdpa_per_sequence(case, t, peers.k192_of(t, case.heads) if kbuild else k192[i])
        return outs[i]

    def output(i):
        import cupy as cp

        return cp.from_dlpack(torch.cat([r[0].transpose(0, 1) for r in outs[i]], dim=0).contiguous())

    return call, output


class LeftOut(Exception):
    """An implementation that cannot run a case (not installed, or a mask it cannot express): the
    case runs without it, and the message says why."""


def _cudnn_ragged(case: BenchCase, sets, opts, *, kbuild: bool) -> Impl:
    fn = peers.cudnn_sdpa_function()
    if fn is None:
        raise LeftOut(f"the cuDNN frontend (module cudnn) does not import; {peers.CUDNN_FRONTEND_HINT}")
    try:
        attn = peers.cudnn_ragged_fn(case, fn, "cuda")
    except ValueError as exc:
        raise LeftOut(str(exc)) from None
    import torch

    tx = _torch_sets(sets)
    k192 = [peers.k192_of(t, case.heads) for t in tx]
    outs: List[object] = [None] * len(sets)

    def call(i):
        t = tx[i]
        with torch.no_grad():
            outs[i] = attn(t["q"], peers.k192_of(t, case.heads) if kbuild else k192[i], t["v"])
        return outs[i]

    return call, _from_torch(outs)


def _cudnn_fp8(case: BenchCase, sets, opts) -> Impl:
    """cuDNN's fp8 SDPA graph (``peers.cudnn_fp8_fn``): q, K at 192 and v in e4m3 with one descale
    per tensor (``peers.quantize_per_tensor``, not timed), bf16 out, one execution per batch."""
    if peers.cudnn_sdpa_function() is None:
        raise LeftOut(f"the cuDNN frontend (module cudnn) does not import; {peers.CUDNN_FRONTEND_HINT}")
    try:
        attn = peers.cudnn_fp8_fn(case, "cuda")
    except ValueError as exc:
        raise LeftOut(str(exc)) from None
    tx = _torch_sets(sets)
    q8, k8, v8 = peers.quantize_inputs(case, [t["q"] for t in tx], [peers.k192_of(t, case.heads) for t in tx],
                                       [t["v"] for t in tx], per_tensor=True)
    cudnn = peers.cudnn_fp8_call(case, attn, q8, k8, v8)
    outs: List[object] = [None] * len(sets)

    def call(i):
        outs[i] = cudnn(i)
        return outs[i]

    return call, _from_torch(outs)


def _kbuild(case: BenchCase, sets, opts) -> Impl:
    tx = _torch_sets(sets)
    return (lambda i: peers.k192_of(tx[i], case.heads)), None


FACTORIES: Dict[str, Callable[..., Impl]] = {
    "ours": _ours,
    "ours-fp8": _ours_fp8,
    "ours-e4m3": lambda c, s, o: _ours_fp8(c, s, o, e4m3_rope=True),
    "fa3": lambda c, s, o: _fa3(c, s, o, kbuild=False),
    "fa3+kbuild": lambda c, s, o: _fa3(c, s, o, kbuild=True),
    "fa3-fp8": lambda c, s, o: _fa3(c, s, o, kbuild=False, fp8=True),
    "fa4": lambda c, s, o: _fa4(c, s, o, kbuild=False),
    "fa4+kbuild": lambda c, s, o: _fa4(c, s, o, kbuild=True),
    "cudnn": lambda c, s, o: _cudnn(c, s, o, kbuild=False),
    "cudnn+kbuild": lambda c, s, o: _cudnn(c, s, o, kbuild=True),
    "cudnn-ragged": lambda c, s, o: _cudnn_ragged(c, s, o, kbuild=False),
    "cudnn-ragged+kbuild": lambda c, s, o: _cudnn_ragged(c, s, o, kbuild=True),
    "cudnn-fp8": _cudnn_fp8,
    "kbuild": _kbuild,
}


# ---------------------------------------------------------------------------------------------
# the backward (--backward): each factory returns (call(i), grads(i) -> (dq, dk, dv, dk_rope) as
# CuPy arrays for the check); a peer's dk and dk_rope are the slices of its K-at-192 gradient, the
# rope's summed over heads outside the timed call unless the implementation is a "+kbuild" one
# (the whole step a trainer pays: K built in the forward graph, so its backward splits the gradient
# and sums the rope part over the heads)
# ---------------------------------------------------------------------------------------------
BwdImpl = Tuple[Callable[[int], object], Callable[[int], tuple]]


def backward_inputs(case: BenchCase, sets) -> None:
    """Adds to each input set a random ``dout`` and our forward's ``out`` and ``lse`` (not timed)."""
    import cupy as cp

    import mla_cupy
    from mla_cupy._arrays import BF16

    for seed, x in enumerate(sets):
        rng = cp.random.default_rng(1000 + seed)
        x["dout"] = rng.standard_normal((sum(case.sq), case.heads, DV), dtype=cp.float32).astype(BF16)
        x["out"], x["lse"] = mla_cupy.mla_prefill(x["q"], x["k"], x["v"], x["k_rope"], x["valid_length"],
                                                  x["cache_row_offsets"], mask=case.mask, return_lse=True)


def _bwd_ours(case: BenchCase, sets, opts) -> BwdImpl:
    """Our backward (kernels/mla_backward_*.cu) through a plan of each set's layout
    (:meth:`~mla_cupy.PrefillPlan.run_backward`: checked and packed at the first run, not timed),
    the gradients given (``det=1``: deterministic mode; ``kernel=sm80``: the portable kernel;
    ``hpg=N``: N heads per work tile, the packing's rule overridden while the plans pack;
    ``src=DIR``: the kernels under DIR, ``def=A:0+B:1``: compile-time switches, ``pkg=DIR``: an older
    version of the whole package, as for the forward)."""
    from mla_cupy import _backward

    saved = None
    rule = _backward.heads_per_group
    if "src" in opts or "def" in opts:  # the first runs below compile from the variant's sources
        sys.path.insert(0, __file__.rsplit("/", 1)[0])
        from _variant import restore, use_defines, use_sources

        saved = (use_sources(opts["src"]) if "src" in opts else
                 use_defines(dict(d.split(":", 1) for d in opts["def"].split("+")), "mla_backward_sm90.cu"))
    if "hpg" in opts:
        _backward.heads_per_group = lambda heads, *shape: min(int(opts["hpg"]), heads)
    try:
        runs = _bwd_runs(case, sets, opts)
        for run, _ in runs:
            run()  # the first run of each: checked, packed, compiled
    finally:
        _backward.heads_per_group = rule
        if saved is not None:
            restore(saved)
    return (lambda i: runs[i][0]()), (lambda i: runs[i][1])


def _bwd_runs(case: BenchCase, sets, opts) -> list:
    """For each input set, a call that runs our backward and the gradients it writes."""
    import cupy as cp

    import mla_cupy
    from mla_cupy._arrays import BF16

    det = opts.get("det") == "1"
    mask = case.mask
    if "pkg" in opts:
        mla_cupy = _package(opts["pkg"])
        mask = _mask_of(mla_cupy, mask)
    runs = []
    for x in sets:
        pl = mla_cupy.plan(x["valid_length"], x["cache_row_offsets"], num_heads=case.heads, dtype=BF16,
                           mask=mask, q_max_seq_len=max(case.sq), kernel=opts.get("kernel", "auto"))
        grads = dict(dq=cp.empty_like(x["q"]), dk=cp.empty_like(x["k"]), dv=cp.empty_like(x["v"]),
                     dk_rope=cp.empty(x["k_rope"].shape, x["q"].dtype))

        def run(pl=pl, x=x, grads=grads):
            pl.run_backward(x["dout"], x["q"], x["k"], x["v"], x["k_rope"], x["out"], x["lse"], deterministic=det,
                            **grads)

        runs.append((run, tuple(grads.values())))
    return runs


def _bwd_torch(case: BenchCase, sets, opts, *, peer: str, kbuild: bool) -> BwdImpl:
    """A peer's backward through torch autograd: its forward graph built once per set (not timed),
    each call ``torch.autograd.grad`` of it. ``peer``: "cudnn" (torch SDPA on the cuDNN backend, one
    call per sequence) or "fa4" (FlashAttention-4's varlen call)."""
    import cupy as cp
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fn = None
    if peer == "fa4":
        fn = peers.fa4_function()
        if fn is None:
            raise LeftOut(f"{peers.FA4_MODULE} does not import: {peers.FA4_HINT}")
    tx = _torch_sets(sets)
    h = case.heads
    graphs = []
    for x, t in zip(sets, tx):
        q, v = t["q"].detach().requires_grad_(), t["v"].detach().requires_grad_()
        if kbuild:
            k, rope = t["k"].detach().requires_grad_(), t["k_rope"].detach().requires_grad_()
            k192 = torch.cat([k, rope.expand(-1, h, -1)], dim=-1)
            leaves = (q, k, v, rope)
        else:
            k192 = peers.k192_of(t, h).detach().requires_grad_()
            leaves = (q, k192, v)
        dout = torch.from_dlpack(x["dout"])
        if peer == "fa4":
            outs = [peers.fa4_call(fn, q, k192, v, peers.varlen_args(case, q.device))]
            gouts = [dout]
        else:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                outs = peers.sdpa_per_sequence(case, {"q": q, "v": v}, k192)
            vl, _ = case.offsets()
            gouts = [dout[vl[b]:vl[b + 1]].transpose(0, 1).unsqueeze(0) for b in range(len(case.sq))]
        graphs.append((outs, leaves, gouts))
    grads: List[object] = [None] * len(sets)

    def call(i):
        outs, leaves, gouts = graphs[i]
        grads[i] = torch.autograd.grad(outs, leaves, gouts, retain_graph=True)
        return grads[i]

    def out(i):
        g = grads[i]
        if kbuild:
            dq, dk, dv, dkr = g
        else:
            dq, dk192, dv = g
            dk, dkr = dk192[..., :DV], dk192[..., DV:].sum(1, keepdim=True)
        return tuple(cp.from_dlpack(y.contiguous()) for y in (dq, dk, dv, dkr))

    return call, out


BWD_FACTORIES: Dict[str, Callable[..., BwdImpl]] = {
    "ours": _bwd_ours,
    "cudnn": lambda c, s, o: _bwd_torch(c, s, o, peer="cudnn", kbuild=False),
    "cudnn+kbuild": lambda c, s, o: _bwd_torch(c, s, o, peer="cudnn", kbuild=True),
    "fa4": lambda c, s, o: _bwd_torch(c, s, o, peer="fa4", kbuild=False),
    "fa4+kbuild": lambda c, s, o: _bwd_torch(c, s, o, peer="fa4", kbuild=True),
}
#: FLOPs of the backward per visible pair over the forward's: the five GEMMs (S, dP, dV, dK, dQ) at
#: K width 192, 2 (192 + 128 + 128 + 192 + 192), over the forward's 2 (192 + 128)
BWD_FLOP_FACTOR = (192 + 128 + 128 + 192 + 192) / (192 + 128)


def backward_reference_of(case: BenchCase, x, heads=(0, -1)):
    """The float64 reference gradients dq, dk, dv of inputs ``x`` on ``heads``, from our forward's
    out and lse (dk_rope, a sum over every head, is checked by the GPU tests)."""
    from mla_cupy import reference

    hs = sorted({h % case.heads for h in heads})
    g = reference.mla_prefill_backward(x["dout"][:, hs], x["q"][:, hs], x["k"][:, hs], x["v"][:, hs], x["k_rope"],
                                       x["out"][:, hs], x["lse"][:, hs], x["valid_length"], x["cache_row_offsets"],
                                       mask=case.mask)
    return hs, g[:3]


def backward_rel_err(ref, grads) -> float:
    """The largest of dq's, dk's and dv's relative errors on the reference's heads."""
    import cupy as cp

    hs, r = ref
    errs = []
    for want, got in zip(r, grads[:3]):
        got = cp.asnumpy(got[:, hs].astype(cp.float64))
        errs.append(float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)))
    return max(errs)


def parse_impl(spec: str, backward: bool = False) -> Tuple[str, Dict[str, str]]:
    base, _, rest = spec.partition(":")
    factories = BWD_FACTORIES if backward else FACTORIES
    if base not in factories:
        raise SystemExit(f"unknown {'backward ' if backward else ''}implementation {spec!r}: one of "
                         f"{sorted(factories)} (ours:hps=N, ours:src=DIR)")
    opts = dict(kv.split("=", 1) for kv in rest.split(";") if kv) if rest else {}
    return base, opts


# ---------------------------------------------------------------------------------------------
# the A/B loop
# ---------------------------------------------------------------------------------------------
def reference_of(case: BenchCase, x, heads=(0, -1)):
    """The float64 reference of inputs ``x`` on ``heads`` (computed once per case)."""
    from mla_cupy import reference

    hs = sorted({h % case.heads for h in heads})
    ref = reference.mla_prefill(x["q"][:, hs], x["k"][:, hs], x["v"][:, hs], x["k_rope"], x["valid_length"],
                                x["cache_row_offsets"], mask=case.mask)
    return hs, ref


def rel_err(ref, out) -> float:
    import cupy as cp

    hs, want = ref
    got = out[:, hs].astype(cp.float64)
    if not bool(cp.isfinite(got).all()):
        return float("inf")
    return float(cp.linalg.norm(got - want) / cp.linalg.norm(want))


def energy_window(call: Callable[[int], object], n_sets: int, calls: int, sampler, sync: Callable[[], object],
                  clock: Callable[[], float] = time.perf_counter) -> dict:
    """``calls`` calls ``call(i % n_sets)`` back to back from an idle device, with the energy
    counter read on both sides (the device synchronized before each read): joules per call, mean
    watts, the SM clock sampled in the window (median), wall ms per call and thousands of SM cycles
    per call (wall ms x MHz). Energy fields are None where the counter is not available."""
    sync()
    e0, m0, t0 = sampler.energy_mj(), sampler.mark(), clock()
    for i in range(calls):
        call(i % n_sets)
    sync()
    t1, m1, e1 = clock(), sampler.mark(), sampler.energy_mj()
    wall_s = t1 - t0
    ms = wall_s * 1e3 / calls
    clk = sampler.summary(m0, m1)
    mhz = clk.get("sm_mhz_median") if clk.get("n") else None
    joules = None if e0 is None or e1 is None else (e1 - e0) / 1e3
    return {"calls": calls, "wall_s": wall_s, "ms_per_call": ms,
            "j_per_call": None if joules is None else joules / calls,
            "watts": None if joules is None or wall_s <= 0 else joules / wall_s,
            "sm_mhz": mhz, "kcycles_per_call": None if mhz is None else ms * mhz}


def energy_calls(ms_per_call: float, seconds: float, most: int = 20000) -> int:
    """Calls that fill about ``seconds`` at ``ms_per_call`` (at least 3, at most ``most``)."""
    return int(min(most, max(3, math.ceil(seconds * 1e3 / max(ms_per_call, 1e-6)))))


def _ratios(vals: Dict[str, List], base: str) -> Dict[str, dict]:
    """Per implementation: the median of its values and of its per-round ratios to ``base``'s
    (rounds where either is missing are skipped)."""
    out = {}
    for s, v in vals.items():
        got = [x for x in v if x is not None]
        rr = [x / b for x, b in zip(v, vals[base]) if x is not None and b]
        out[s] = {"median": statistics.median(got) if got else None,
                  "ratio_median": statistics.median(rr) if rr else None,
                  "ratio_min": min(rr) if rr else None, "ratio_max": max(rr) if rr else None}
    return out


def run_case(case: BenchCase, specs: List[str], rounds: int, reps: int, sampler: NvmlSampler,
             max_err: float, energy_s: float = 0.0, backward: bool = False) -> dict:
    """Times ``specs`` on ``case`` in interleaved rounds. An implementation whose output misses the
    reference (or that raises) is reported and left out of the timing, not the whole run."""
    import cupy as cp

    n = bench.n_input_sets(case)
    sets = [bench.make_inputs(case, seed) for seed in range(n)]
    if backward:
        backward_inputs(case, sets)
    impls = {}
    errors = {}
    failed = {}
    ref = None
    for spec in specs:
        base, opts = parse_impl(spec, backward)
        try:
            if backward:
                call, grads = BWD_FACTORIES[base](case, sets, opts)
                if base == "ours":
                    for g in grads(0):
                        g.view(cp.uint16)[...] = 0x7FC0  # bf16 NaN
                call(0)
                cp.cuda.Device().synchronize()
                ref = ref if ref is not None else backward_reference_of(case, sets[0])
                errors[spec] = backward_rel_err(ref, grads(0))
                if opts.get("check") != "0" and not errors[spec] <= max_err:
                    raise RuntimeError(f"relative error {errors[spec]:.3e} > {max_err:.1e}")
                impls[spec] = call
                continue
            call, output = FACTORIES[base](case, sets, opts)
            # Poison, run once, check against the float64 reference.
            if output is not None and base in ("ours", "ours-fp8", "ours-e4m3"):
                output(0).view(cp.uint16)[...] = 0x7FC0  # bf16 NaN
            call(0)
            cp.cuda.Device().synchronize()
            if output is not None:
                ref = ref if ref is not None else reference_of(case, sets[0])
                errors[spec] = rel_err(ref, output(0))
                limit = max_err * (3 if "fp8" in base or "e4m3" in base else 1)
                if opts.get("check") != "0" and not errors[spec] <= limit:
                    raise RuntimeError(f"relative error {errors[spec]:.3e} > {limit:.1e}")
        except Exception as exc:
            failed[spec] = f"{type(exc).__name__}: {exc}"
            print(f"!! {case.name} / {spec}: {failed[spec]}", file=sys.stderr, flush=True)
            continue
        impls[spec] = call
    specs = [s for s in specs if s in impls]
    if not specs:
        return {"case": case.name, "failed": failed, "impls": {}, "clock": {"n": 0}}
    times: Dict[str, List[float]] = {s: [] for s in specs}
    windows: Dict[str, List[dict]] = {s: [] for s in specs}
    mark = sampler.mark()
    sync = cp.cuda.Device().synchronize
    for r in range(rounds):
        order = specs if r % 2 == 0 else specs[::-1]
        for s in order:
            times[s].append(bench.time_ms(impls[s], n, warmup=2, reps=reps))
            if energy_s > 0:
                windows[s].append(energy_window(impls[s], n, energy_calls(times[s][-1], energy_s), sampler, sync))
    clock = sampler.summary(mark)
    base = specs[0]
    ratios = {s: [t / b for t, b in zip(times[s], times[base])] for s in specs}
    flops = case.flops() * (BWD_FLOP_FACTOR if backward else 1.0)
    res = {"case": case.name, "flops": flops, "n_sets": n, "clock": clock, "impls": {}, "failed": failed}
    for s in specs:
        med = statistics.median(times[s])
        rr = ratios[s]
        res["impls"][s] = {"ms_rounds": times[s], "ms_median": med, "tflops": flops / med / 1e9,
                           "ratio_to_base_rounds": rr, "ratio_median": statistics.median(rr),
                           "ratio_min": min(rr), "ratio_max": max(rr), "rel_err": errors.get(s)}
    if energy_s > 0:
        for s, e in energy_summary(windows, base).items():
            res["impls"][s]["energy"] = e
    del sets, impls
    cp.get_default_memory_pool().free_all_blocks()
    try:
        import torch

        torch.cuda.empty_cache()
    except ImportError:
        pass
    return res


def _median_of(windows: List[dict], key: str):
    got = [w[key] for w in windows if w.get(key) is not None]
    return statistics.median(got) if got else None


def energy_summary(windows: Dict[str, List[dict]], base: str) -> Dict[str, dict]:
    """Per implementation, from its energy windows (one per round, in round order): J and
    kcycles per call (medians, and medians of per-round ratios to ``base``'s), the median watts,
    SM clock and wall ms per call."""
    joules = _ratios({s: [w["j_per_call"] for w in ws] for s, ws in windows.items()}, base)
    cycles = _ratios({s: [w["kcycles_per_call"] for w in ws] for s, ws in windows.items()}, base)
    return {s: {"windows": ws, "j_per_call": joules[s], "kcycles_per_call": cycles[s],
                "watts_median": _median_of(ws, "watts"), "sm_mhz_median": _median_of(ws, "sm_mhz"),
                "ms_per_call_median": _median_of(ws, "ms_per_call")} for s, ws in windows.items()}


def format_energy(res: dict) -> List[str]:
    """Rows of the energy table of one case (empty without ``--energy``)."""
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    def ratio(d):
        return "-" if d["ratio_median"] is None else (
            f"{d['ratio_median']:.3f} ({d['ratio_min']:.3f}-{d['ratio_max']:.3f})")

    lines = []
    for s, d in res["impls"].items():
        e = d.get("energy")
        if e is None:
            continue
        lines.append(f"| {res['case']} | {s} | {num(e['j_per_call']['median'], '.4f')} | {ratio(e['j_per_call'])} | "
                     f"{num(e['kcycles_per_call']['median'], '.0f')} | {ratio(e['kcycles_per_call'])} | "
                     f"{num(e['ms_per_call_median'], '.3f')} | {num(e['watts_median'], '.0f')} | "
                     f"{num(e['sm_mhz_median'], '.0f')} |")
    return lines


def format_case(res: dict, base: str) -> List[str]:
    c = res["clock"]
    clk = (f"SM {c['sm_mhz_median']:.0f} MHz ({c['sm_mhz_min']:.0f}-{c['sm_mhz_max']:.0f}), "
           f"{c['power_w_median']:.0f} W, {c['hz']:.0f} Hz") if c.get("n") else "no NVML"
    lines = []
    for s, d in res["impls"].items():
        err = "" if d["rel_err"] is None else f"{d['rel_err']:.1e}"
        lines.append(f"| {res['case']} | {s} | {d['ms_median']:.3f} | {d['tflops']:.0f} | "
                     f"{d['ratio_median']:.3f} ({d['ratio_min']:.3f}-{d['ratio_max']:.3f}) | {err} | {clk} |")
    for s, why in res.get("failed", {}).items():
        lines.append(f"| {res['case']} | {s} | FAILED: {why[:200]} | | | | |")
    return lines


def launch_table(kernels: Sequence[Tuple[str, float, float]], calls: int) -> Tuple[List[dict], float]:
    """Where a call's GPU time goes, from the kernels recorded over ``calls`` calls (``(name, start_us,
    end_us)`` each): one row per kernel name (``launches`` per call, ``us`` per call, ``share`` of the
    kernels' summed time), longest first, and the span per call (first start to last end over
    ``calls``: the kernels plus the gaps between them)."""
    if calls <= 0:
        raise ValueError(f"calls must be positive, got {calls}")
    rows: Dict[str, dict] = {}
    for name, start, end in kernels:
        if end < start:
            raise ValueError(f"kernel {name!r} ends ({end}) before it starts ({start})")
        r = rows.setdefault(name, {"kernel": name, "launches": 0, "us": 0.0})
        r["launches"] += 1
        r["us"] += end - start
    total = sum(r["us"] for r in rows.values())
    out = sorted(rows.values(), key=lambda r: -r["us"])
    for r in out:
        r["share"] = r["us"] / total if total > 0 else 0.0
        r["launches"] /= calls
        r["us"] /= calls
    span = (max(e for _, _, e in kernels) - min(s for _, s, _ in kernels)) / calls if kernels else 0.0
    return out, span


def format_launches(case: str, impl: str, rows: List[dict], span: float, width: int = 90) -> List[str]:
    """Markdown rows of :func:`launch_table`'s result, kernel names cut to ``width`` characters."""
    lines = [f"| {case} | {impl} | {r['kernel'][:width]} | {r['launches']:g} | {r['us']:.1f} | "
             f"{100 * r['share']:.1f}% |" for r in rows]
    busy = sum(r["us"] for r in rows)
    lines.append(f"| {case} | {impl} | (span per call: kernels and the gaps between them) | | {span:.1f} | "
                 f"{100 * busy / span if span > 0 else 0.0:.1f}% busy |")
    return lines


def profile_launches(call: Callable[[int], object], calls: int, sync: Callable[[], object]):
    """The CUDA kernels of ``calls`` calls of ``call(0)`` (input set 0, after three untimed calls),
    recorded by torch's profiler (CUPTI: every kernel of the process, CuPy's included): ``(name,
    start_us, end_us)`` each."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        call(0)
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call(0)
        sync()
    return [(e.name, float(e.time_range.start), float(e.time_range.end)) for e in prof.events()
            if e.device_type == DeviceType.CUDA]


def checkout_commit() -> str:
    """The commit of the checkout this script runs from (``git rev-parse --short HEAD``), with
    ``+modified`` when kernels/ or mla_cupy/ differ from it; ``"unknown"`` outside a git checkout.
    ``MLA_CUPY_COMMIT`` in the environment overrides it: a copy of a working tree on another machine
    can carry git metadata of another commit than its files'."""
    import os
    import subprocess
    from pathlib import Path

    if os.environ.get("MLA_CUPY_COMMIT"):
        return os.environ["MLA_CUPY_COMMIT"]

    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "kernels", "mla_cupy"], cwd=root,
                               timeout=10).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return rev + ("+modified" if dirty else "")


def _calls(cases: List[BenchCase], specs: List[str], backward: bool):
    """(case, implementation, its call) for every case and implementation, inputs made once per case;
    an implementation left out of a case is said on stderr and skipped."""
    for case in cases:
        sets = [bench.make_inputs(case, 0)]
        if backward:
            backward_inputs(case, sets)
        for spec in specs:
            base, opts = parse_impl(spec, backward)
            try:
                call, _ = (BWD_FACTORIES if backward else FACTORIES)[base](case, sets, opts)
            except LeftOut as exc:
                print(f"{case.name} / {spec}: left out ({exc})", file=sys.stderr, flush=True)
                continue
            yield case, spec, call


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--impls", default="ours,fa3", help="comma separated; the first is the base")
    ap.add_argument("--cases", default="1x4096,1x8192,1x16384", help="comma separated case names")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=10, help="timed calls per implementation per round (median)")
    ap.add_argument("--nvml-hz", type=float, default=20.0)
    ap.add_argument("--max-err", type=float, default=2e-2, help="bf16 bound; x3 for fp8 implementations")
    ap.add_argument("--energy", type=float, default=0.0, metavar="S",
                    help="also run each implementation back to back for about S seconds per round and read "
                         "the energy counter: J and SM cycles per call (0: off)")
    ap.add_argument("--out", default=None, help="write every round's numbers here (JSON)")
    ap.add_argument("--backward", action="store_true",
                    help="time the backward: implementations ours (ours:det=1 deterministic), cudnn, cudnn+kbuild, "
                         "fa4, fa4+kbuild; TFLOP/s count 2 (192 + 128 + 128 + 192 + 192) per visible pair")
    ap.add_argument("--profile", action="store_true",
                    help="no timing: run each implementation three times per case (for ncu: --launch-skip 2 "
                         "--launch-count 1 with a kernel-name filter)")
    ap.add_argument("--launches", type=int, default=0, metavar="N",
                    help="no interleaved timing: record N calls of each implementation per case with torch's "
                         "profiler and print, per kernel, launches and microseconds per call and its share, and "
                         "the span per call (0: off)")
    a = ap.parse_args(argv)
    specs = [s for s in a.impls.split(",") if s]
    cases = [parse_case(c) for c in a.cases.split(",") if c]
    if a.launches > 0 or a.profile:
        import cupy as cp

        sync = cp.cuda.Device().synchronize
        if a.launches > 0:
            print("| case | impl | kernel | launches per call | us per call | share |", flush=True)
            print("|---|---|---|---|---|---|", flush=True)
        for case, spec, call in _calls(cases, specs, a.backward):
            if a.launches > 0:
                rows, span = launch_table(profile_launches(call, a.launches, sync), a.launches)
                print("\n".join(format_launches(case.name, spec, rows, span)), flush=True)
            else:
                for _ in range(3):
                    call(0)
                sync()
        return 0
    results = []
    run_info = dict(bench.device_info(), commit=checkout_commit(), command=" ".join(["benchmarks/ab.py", *sys.argv[1:]]))
    with NvmlSampler(hz=a.nvml_hz) as sampler:
        print(f"| case | impl | ms | TFLOP/s | time / time of {specs[0]} (> 1: {specs[0]} faster; median of {a.rounds} rounds, min-max) "
              f"| rel err | clock during the case |", flush=True)
        print("|---|---|---|---|---|---|---|", flush=True)
        for case in cases:
            res = run_case(case, specs, a.rounds, a.reps, sampler, a.max_err, a.energy, a.backward)
            results.append(res)
            print("\n".join(format_case(res, specs[0])), flush=True)
            if a.out:
                with open(a.out, "w") as f:
                    json.dump({**run_info, "impls": specs, "rounds": a.rounds, "reps": a.reps, "results": results,
                               "clock_all": sampler.summary()}, f, indent=1)
        whole = sampler.summary()
    if a.energy > 0:
        print(f"\n| case | impl | J per call | J / J of {specs[0]} (median of {a.rounds} rounds, min-max) | "
              f"kcycles per call | cycles / cycles of {specs[0]} | wall ms per call | W | SM MHz |")
        print("|---|---|---|---|---|---|---|---|---|")
        for res in results:
            print("\n".join(format_energy(res)))
    if whole.get("n"):
        print(f"clock over the run: SM median {whole['sm_mhz_median']:.0f} MHz "
              f"({whole['sm_mhz_min']:.0f}-{whole['sm_mhz_max']:.0f}), power median {whole['power_w_median']:.0f} W, "
              f"{whole['n']} samples at {whole['hz']:.1f} Hz")
    return 0


if __name__ == "__main__":
    sys.exit(main())

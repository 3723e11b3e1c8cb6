"""``mla-cupy bench`` / ``python -m mla_cupy.bench``: mla_cupy against its peers on this GPU.

Every number in a table comes from one process on one warm GPU: our kernel, the peers that are
importable (torch's cuDNN SDPA and FlexAttention, which need K built at full 192 width: that
build is timed too), and the card's bf16 matmul rate as a roofline. Times are medians of many
repeats after warm-up, measured with CUDA events behind a GPU-busy spin kernel (so they are GPU
time, for every implementation alike; our host time per call is its own column), rotating
through enough input sets to defeat the L2 cache. FLOPs count visible (query, key) pairs only: ``H * 2 * (192 + 128) * pairs``.
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

from ._arrays import BF16
from .masks import CausalMask, Mask, NullMask
from .reference import visible_pairs
from .validation import DQK, DR, DV

__all__ = ["BenchCase", "DEFAULT_CASES", "CPU_CASES", "run", "format_table", "main"]

L2_DEFEAT_BYTES = 256 << 20  # rotate input sets until their total passes this (H100/H200 L2: 50-60 MB)


@dataclass(frozen=True)
class BenchCase:
    name: str
    sq: Sequence[int]
    sk: Sequence[int]
    heads: int = 128
    causal: bool = True

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


def _c(name, sq, sk=None, heads=128, causal=True):
    return BenchCase(name, tuple(sq), tuple(sk if sk is not None else sq), heads, causal)


DEFAULT_CASES: Dict[str, BenchCase] = {c.name: c for c in [
    _c("1x512", [512]), _c("1x1024", [1024]), _c("1x2048", [2048]), _c("1x4096", [4096]), _c("1x8192", [8192]),
    _c("1x16384", [16384]), _c("4x2048", [2048] * 4), _c("16x512", [512] * 16),
    _c("ragged", [512, 1024, 2048, 4096]), _c("1024+ctx8192", [1024], [9216]),
    _c("H16-1x8192", [8192], heads=16), _c("H16-1x16384", [16384], heads=16),
    _c("noncausal-1x4096", [4096], causal=False),
]}
CPU_CASES: Dict[str, BenchCase] = {c.name: c for c in [_c("tiny-2x48", [48, 20], [48, 33], heads=4)]}


@dataclass
class Row:
    case: str
    impl: str
    ms: float
    tflops: float
    rel_err: Optional[float] = None
    extra_mem_mb: Optional[float] = None
    note: str = ""
    host_us: Optional[float] = None  # host time per call (ours, validate=False, out= given)
    ratios: Dict[str, float] = field(default_factory=dict)


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


def host_us(fn: Callable[[int], object], n_sets: int, reps: int = 200) -> float:
    """Host time per call in microseconds: the wall time to enqueue ``reps`` calls, divided by
    ``reps`` (few enough that the launch queue never fills, so the host never waits for the GPU)."""
    import cupy as cp

    fn(0)
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for i in range(reps):
        fn(i % n_sets)
    dt = time.perf_counter() - t0
    cp.cuda.Device().synchronize()
    return dt / reps * 1e6


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


def _rel_err_sampled(case: BenchCase, x, out, heads_sample=(0,)) -> float:
    """Relative error of ``out`` against the float64 reference (run on the GPU) on a few heads."""
    import cupy as cp

    from . import reference

    hs = list(heads_sample)
    ref = reference.mla_prefill(x["q"][:, hs], x["k"][:, hs], x["v"][:, hs], x["k_rope"], x["valid_length"],
                                x["cache_row_offsets"], mask=case.mask)
    got = out[:, hs].astype(cp.float64)
    return float(cp.linalg.norm(got - ref) / cp.linalg.norm(ref))


def bench_ours(case: BenchCase, sets, reps: int) -> Row:
    import cupy as cp

    from .api import mla_prefill

    n = len(sets)
    outs = [cp.empty((sum(case.sq), case.heads, DV), BF16) for _ in range(n)]
    ms_max = max(case.sq)

    def call(i):
        x = sets[i]
        mla_prefill(x["q"], x["k"], x["v"], x["k_rope"], x["valid_length"], x["cache_row_offsets"], mask=case.mask,
                    q_max_seq_len=ms_max, validate=False, out=outs[i])

    ms = time_ms(call, n, reps=reps)
    launch_us = host_us(call, n, reps=max(20, min(200, int(200 / max(ms, 1e-3)))))
    pool = cp.get_default_memory_pool()
    before = pool.used_bytes()
    x = sets[0]
    res = mla_prefill(x["q"], x["k"], x["v"], x["k_rope"], x["valid_length"], x["cache_row_offsets"], mask=case.mask)
    extra = (pool.used_bytes() - before) / 2**20
    err = _rel_err_sampled(case, x, res, (0, case.heads - 1))
    return Row(case.name, "mla_cupy", ms, case.flops() / ms / 1e9, err, extra, host_us=launch_us)


def _torch_views(x):
    import torch

    return {k: torch.from_dlpack(v) for k, v in x.items()}


def bench_peers(case: BenchCase, sets, reps: int) -> List[Row]:
    """cuDNN SDPA (one call per sequence) and FlexAttention (one document mask), K built at 192."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa
    except ImportError:
        return []
    rows: List[Row] = []
    tx = [_torch_views(x) for x in sets]
    h, n = case.heads, len(sets)
    vl, cro = case.offsets()
    scale = 1.0 / math.sqrt(DQK)

    def build_k(t):
        tk = t["k"].shape[0]
        return torch.cat([t["k"], t["k_rope"].expand(tk, h, DR)], dim=-1)

    ms_build = time_ms(lambda i: build_k(tx[i]), n, reps=reps)
    kfull = [build_k(t) for t in tx]
    flops = case.flops()

    # --- SDPA: one call per sequence; bottom-right causal when Sq != Sk ---
    from torch.nn.attention.bias import causal_lower_right

    def sdpa_call(i):
        t, kf = tx[i], kfull[i]
        outs = []
        for b in range(len(case.sq)):
            qb = t["q"][vl[b]:vl[b + 1]].transpose(0, 1).unsqueeze(0)
            kb = kf[cro[b]:cro[b + 1]].transpose(0, 1).unsqueeze(0)
            vb = t["v"][cro[b]:cro[b + 1]].transpose(0, 1).unsqueeze(0)
            sq, sk = case.sq[b], case.sk[b]
            if not case.causal:
                outs.append(sdpa(qb, kb, vb, scale=scale))
            elif sq == sk:
                outs.append(sdpa(qb, kb, vb, is_causal=True, scale=scale))
            else:
                outs.append(sdpa(qb, kb, vb, attn_mask=causal_lower_right(sq, sk), scale=scale))
        return outs

    for label, backends in (("cudnn-sdpa", [SDPBackend.CUDNN_ATTENTION]),
                            ("sdpa-fallback", [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])):
        try:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            with sdpa_kernel(backends):
                ms = time_ms(sdpa_call, n, reps=reps)
            extra = (torch.cuda.max_memory_allocated() - base) / 2**20 + kfull[0].numel() * 2 / 2**20
            rows.append(Row(case.name, label, ms, flops / ms / 1e9, None, extra,
                            note=f"backend={backends[0].name}; K build {ms_build:.3f} ms not included"))
            rows.append(Row(case.name, label + "+kbuild", ms + ms_build, flops / (ms + ms_build) / 1e9, None, extra))
            break
        except Exception as exc:  # record why the backend did not run, try the next
            rows.append(Row(case.name, label, float("nan"), float("nan"), note=f"failed: {type(exc).__name__}: {str(exc)[:80]}"))

    # --- FlexAttention: one call for the whole batch with a document mask ---
    try:
        import torch._dynamo
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        # One compiled kernel per case shape: without a higher limit dynamo stops recompiling after
        # 8 shapes and silently runs the unfused (materializing) implementation.
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(64, getattr(torch._dynamo.config, knob)))
        flex = torch.compile(flex_attention, dynamic=False)
        dev = "cuda"
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

        def flex_call(i):
            t, kf = tx[i], kfull[i]
            return flex(t["q"].transpose(0, 1).unsqueeze(0), kf.transpose(0, 1).unsqueeze(0),
                        t["v"].transpose(0, 1).unsqueeze(0), block_mask=bm, scale=scale)

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = time_ms(flex_call, n, reps=reps)
        extra = (torch.cuda.max_memory_allocated() - base) / 2**20 + kfull[0].numel() * 2 / 2**20
        rows.append(Row(case.name, "flex", ms, flops / ms / 1e9, None, extra, note="torch.compile(flex_attention)"))
        rows.append(Row(case.name, "flex+kbuild", ms + ms_build, flops / (ms + ms_build) / 1e9, None, extra))
    except Exception as exc:
        rows.append(Row(case.name, "flex", float("nan"), float("nan"), note=f"failed: {type(exc).__name__}: {str(exc)[:80]}"))
    rows.append(Row(case.name, "kbuild", ms_build, float("nan"), note="torch.cat(k, k_rope broadcast) to [Tk, H, 192]"))
    return rows


def run(cases: Sequence[BenchCase], *, peers: bool = True, reps: int = 20, progress: bool = True,
        checkpoint: Optional[str] = None) -> dict:
    """Run the matrix on the current GPU; returns {"device", "matmul_tflops", "rows"}.
    With ``checkpoint``, the rows so far are written there (JSON) after every case."""
    import cupy as cp

    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    info = {"device": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
            "compute_capability": dev.compute_capability, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    info["matmul_tflops"] = matmul_tflops()
    rows: List[Row] = []
    for case in _progress(list(cases), "bench", progress):
        set_bytes = (sum(case.sq) * DQK + 2 * sum(case.sk) * DV) * case.heads * 2
        n_sets = int(min(8, max(1, math.ceil(L2_DEFEAT_BYTES / max(set_bytes, 1)))))
        sets = [_inputs(case, seed) for seed in range(n_sets)]
        ours = bench_ours(case, sets, reps)
        ours.note = f"{n_sets} input set(s)"
        if info["matmul_tflops"]:
            ours.ratios["roofline"] = ours.tflops / info["matmul_tflops"]
        case_rows = [ours]
        if peers:
            case_rows += bench_peers(case, sets, reps)
        for r in case_rows[1:]:
            if r.impl != "kbuild" and r.ms == r.ms:
                ours.ratios[r.impl] = r.ms / ours.ms  # > 1: we are faster
        rows += case_rows
        del sets
        cp.get_default_memory_pool().free_all_blocks()
        info["rows"] = [asdict(r) for r in rows]
        if checkpoint:
            with open(checkpoint, "w") as f:
                json.dump(info, f, indent=1, default=float)
    info["rows"] = [asdict(r) for r in rows]
    return info


def run_cpu(cases: Sequence[BenchCase]) -> dict:
    """No GPU: time the float64 reference on tiny cases (no peers), so the command still works."""
    from . import reference

    rows = []
    for case in cases:
        rng = np.random.default_rng(0)
        tq, tk, h = sum(case.sq), sum(case.sk), case.heads
        q, k, v = rng.standard_normal((tq, h, DQK)), rng.standard_normal((tk, h, DV)), rng.standard_normal((tk, h, DV))
        kr = rng.standard_normal((tk, 1, DR))
        vl, cro = case.offsets()
        t0 = time.perf_counter()
        reference.mla_prefill(q, k, v, kr, vl, cro, mask=case.mask)
        ms = (time.perf_counter() - t0) * 1e3
        rows.append(asdict(Row(case.name, "reference-cpu", ms, case.flops() / ms / 1e9, 0.0, None, note="float64 NumPy")))
    return {"device": "cpu (no GPU: reference only)", "compute_capability": None,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "matmul_tflops": None, "rows": rows}


def format_table(result: dict) -> str:
    peers = sorted({k for r in result["rows"] for k in r["ratios"]} - {"roofline"})
    head = ["case", "impl", "ms", "TFLOP/s", "rel_err", "extra MB", "host us"] + ["roof%"] + [f"x {p}" for p in peers]
    lines = [f"device: {result['device']}  bf16 matmul: "
             + (f"{result['matmul_tflops']:.0f} TFLOP/s" if result.get("matmul_tflops") else "n/a")]
    body = []
    for r in result["rows"]:
        cells = [r["case"], r["impl"], f"{r['ms']:.3f}", "" if r["tflops"] != r["tflops"] else f"{r['tflops']:.1f}",
                 "" if r["rel_err"] is None else f"{r['rel_err']:.2e}",
                 "" if r["extra_mem_mb"] is None else f"{r['extra_mem_mb']:.0f}",
                 "" if r.get("host_us") is None else f"{r['host_us']:.0f}",
                 f"{100 * r['ratios']['roofline']:.0f}" if "roofline" in r["ratios"] else ""]
        cells += [f"{r['ratios'][p]:.2f}" if p in r["ratios"] else "" for p in peers]
        body.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in body)) if body else len(h) for i, h in enumerate(head)]
    fmt = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
    lines += [fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(c) for c in body]
    notes = [f"{r['case']}/{r['impl']}: {r['note']}" for r in result["rows"] if r["note"].startswith("failed")]
    return "\n".join(lines + notes)


def plot(result: dict, path: str) -> None:
    import matplotlib

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
    ax.set_title(f"MLA prefill, bf16, {result['device']}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_csv(result: dict, path: str) -> None:
    import csv

    keys = ["case", "impl", "ms", "tflops", "rel_err", "extra_mem_mb", "host_us", "note", "ratios"]
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=keys)
        wr.writeheader()
        for r in result["rows"]:
            wr.writerow({**r, "ratios": json.dumps(r["ratios"])})


def main(argv=None):  # python -m mla_cupy.bench
    from cli import main as cli_main

    cli_main(["bench"] + list(argv if argv is not None else sys.argv[1:]))


if __name__ == "__main__":
    main()

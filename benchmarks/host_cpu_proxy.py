"""The host time of the call paths without a GPU, as a proxy of ``mla-cupy bench --host``.

    PYTHONPATH=. python3 benchmarks/host_cpu_proxy.py [--calls N] [--reps R] [--profile ROW] [--plan-cache-size N]

The problem is that of the host benchmark (one causal sequence of 64 queries and keys, 16 heads,
``out=`` given), on CuPy arrays over host memory, with the device stubbed (``tests/_fake_gpu.py``:
the kernels' parameter structs, the tensor-map encoder, the tile counters, the launch itself, and
offsets read from host memory). Every host step runs except the driver calls: the launch, the
tensor-map encoding (its Python side runs) and the device-to-host copies of the offsets (counted:
copies and synchronizations per call, the driver round trips a GPU would wait on). With torch
installed, torch CPU tensors pose as CUDA tensors (``torch_as_cuda``) for the torch rows, the
registered op among them (its CPU kernel routed to its CUDA implementation). The numbers say
where the Python time goes and how the paths compare; they are not GPU numbers.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the checkout's package and the tests' helpers

import numpy as np  # noqa: E402

import mla_cupy  # noqa: E402
from mla_cupy import CausalMask  # noqa: E402

from _cases import BF16, make_case  # noqa: E402
from _fake_gpu import fake_gpu, host_cupy, torch_as_cuda  # noqa: E402


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def calls():
    """(name, call) of each row, on one problem; the torch rows when torch imports."""
    c = make_case([64], [64], heads=16, dtype=BF16, seed=0)
    q, k, v, kr, vl, cro = (host_cupy(a) for a in (c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets))
    out = host_cupy(np.zeros((64, 16, 128), BF16))
    mask = CausalMask()
    pl = mla_cupy.plan(vl, cro, num_heads=16, dtype=BF16, mask=mask, q_max_seq_len=64)
    fast = dict(mask=mask, q_max_seq_len=64, validate=False)
    rows = [
        ("plan.run (CuPy)", lambda: pl.run(q, k, v, kr, out=out)),
        ("mla_prefill, q_max_seq_len= validate=False (CuPy)", lambda: mla_cupy.mla_prefill(q, k, v, kr, vl, cro, out=out,
                                                                                        **fast)),
        ("mla_prefill, default arguments (CuPy)", lambda: mla_cupy.mla_prefill(q, k, v, kr, vl, cro, mask=mask, out=out)),
    ]
    try:
        import torch
    except ImportError:
        return rows
    from mla_cupy import flash_attn, torch_ops

    t = {n: torch.from_numpy(np.ascontiguousarray(getattr(c, n)).view(np.int16)).view(torch.bfloat16)
         for n in ("q", "k", "v", "k_rope")}
    tq, tk, tv, tkr = t["q"], t["k"], t["v"], t["k_rope"]
    tvl, tcro = (torch.from_numpy(np.asarray(a, np.int32)) for a in (c.valid_length, c.cache_row_offsets))
    tout = torch.zeros((64, 16, 128), dtype=torch.bfloat16)
    return rows + [
        ("plan.run (torch)", lambda: pl.run(tq, tk, tv, tkr, out=tout)),
        ("mla_prefill, q_max_seq_len= validate=False (torch)",
         lambda: mla_cupy.mla_prefill(tq, tk, tv, tkr, tvl, tcro, out=tout, **fast)),
        ("mla_prefill, default arguments (torch)",
         lambda: mla_cupy.mla_prefill(tq, tk, tv, tkr, tvl, tcro, mask=mask, out=tout)),
        ("torch_ops.mla_prefill, q_max_seq_len= validate=False",
         lambda: torch_ops.mla_prefill(tq, tk, tv, tkr, tvl, tcro, out=tout, **fast)),
        ("torch.ops.mla_cupy.mla_prefill_out (the registered op), q_max_seq_len= validate=False",
         lambda: torch.ops.mla_cupy.mla_prefill_out(tq, tk, tv, tkr, tvl, tcro, tout, None, q_max_seq_len=64,
                                                    validate=False)),
        ("flash_attn.flash_attn_varlen_func, k_rope=",
         lambda: flash_attn.flash_attn_varlen_func(tq, tk, tv, tvl, tcro, 64, 64, causal=True, k_rope=tkr, out=tout)),
    ]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls back to back in one sample")
    ap.add_argument("--reps", type=int, default=7, help="interleaved rounds (samples per row)")
    ap.add_argument("--profile", type=int, default=None, help="cProfile row ROW (0-based) instead of timing")
    ap.add_argument("--plan-cache-size", type=int, default=None,
                    help="bound the one-shot calls' plan cache (0: off, every call checks and packs)")
    a = ap.parse_args(argv)
    if a.plan_cache_size is not None:
        mla_cupy.set_plan_cache_size(a.plan_cache_size)
    with fake_gpu(record=False) as gpu, (torch_as_cuda() if _has_torch() else contextlib.nullcontext()):
        rows = calls()
        for _, fn in rows:
            for _ in range(3):
                fn()
        if a.profile is not None:
            name, fn = rows[a.profile]
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(a.calls):
                fn()
            pr.disable()
            print(name)
            pstats.Stats(pr).sort_stats("tottime").print_stats(25)
            return
        samples = {name: [] for name, _ in rows}
        for r in range(a.reps):
            for name, fn in (rows if r % 2 == 0 else rows[::-1]):
                t0 = time.perf_counter()
                for _ in range(a.calls):
                    fn()
                samples[name].append((time.perf_counter() - t0) / a.calls * 1e6)
        reads = {}
        for name, fn in rows:  # device-to-host copies and synchronizations per call
            c, s = gpu.copies, gpu.syncs
            for _ in range(10):
                fn()
            reads[name] = ((gpu.copies - c) / 10, (gpu.syncs - s) / 10)
    print(f"host time per call without a GPU (device stubbed), {a.calls} calls back to back, median of {a.reps} rounds; "
          f"{gpu.count} launches reached the stub, {gpu.packs} argument packings, {gpu.encodes} tensor maps encoded")
    width = max(len(n) for n in samples)
    for name, xs in samples.items():
        copies, syncs = reads[name]
        print(f"  {name.ljust(width)}  {statistics.median(xs):7.1f} us  (min {min(xs):.1f}, max {max(xs):.1f})  "
              f"D2H copies {copies:g}, syncs {syncs:g} per call")
    info = getattr(mla_cupy, "plan_cache_info", None)
    if info is not None:
        print(f"  {info()}")


if __name__ == "__main__":
    main()

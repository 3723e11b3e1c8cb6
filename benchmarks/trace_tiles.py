"""Where the Hopper kernel's consumers spend their cycles around their key-tile loops: the kernel
built with ``MLA_SM90_TRACE`` 1 (``kernels/sm90/trace.cuh``) stamps each consumer's work tiles
(clock64 before it takes a tile, once it has it, after the mainloop, after the epilogue), and this
script runs one case, reads the stamps and splits each consumer's cycles into:

* ``wait``: taking the next work tile (the scheduler's hand-out);
* ``loop``: the mainloop, fitted over all busy tiles as ``a + b x key tiles`` (``b``: cycles per key
  tile in the kernel, to set beside ``pipe_probe.py``'s loop alone; ``a``: what each work tile adds:
  its Q wait, first S, last P V and the loop's entry and exit; where the tiles are all about as long,
  no fit: ``b`` is the mean and ``a`` 0);
* ``epilogue``: the normalization and stores;
* ``idle``: tiles where the consumer has no rows (``run_idle``);
* ``end``: from the consumer's last tile to its exit, and (by globaltimer, across SMs) from its
  CTA's exit to the launch's last.

Usage (GPU; the kernels are compiled with the switch, so the times are the traced build's)::

    PYTHONPATH=.:benchmarks python benchmarks/trace_tiles.py --impl ours-e4m3:vt=quant --case 1x8192

``--impl`` and ``--case`` take ``ab.py``'s names. ``summarize`` is plain NumPy (tested without a GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Tuple

import numpy as np

KERNEL_FILE = "mla_prefill_sm90.cu"
TA, TB, TC, TD, TILES, M0 = range(6)  # the words of a record (trace.cuh: TraceWord and after)


def summarize(trace: np.ndarray, end_ns: np.ndarray = None) -> Dict[str, float]:
    """Splits the consumers' cycles (``trace``: uint64 [CTAs, slots, 1 + tiles, words] as the kernel
    wrote it; a consumer that never exited has a zero header) into the shares of the module docstring,
    with the fit ``loop = a + b x key tiles`` over the busy tiles. ``end_ns``: optional, each
    recorded CTA's exit time (globaltimer); then ``end_launch`` is the mean share of the launch
    that CTAs spent after their exit, by nanoseconds."""
    t = trace.astype(np.int64)
    head = t[:, :, 0, :]
    used = head[:, :, 0] > 0
    if not used.any():
        raise ValueError("no consumer recorded anything: was the kernel built with MLA_SM90_TRACE=1?")
    tiles_kept = t.shape[2] - 1
    span = wait = epi = idle = loop = 0
    xs: List[int] = []
    ys: List[int] = []
    for c, s in zip(*np.nonzero(used)):
        h = head[c, s]
        if h[5]:
            raise ValueError(f"consumer ({c}, {s}) took more work tiles than the {tiles_kept} kept")
        n_rec = int((t[c, s, 1:, TD] > 0).sum())  # tiles with their epilogue (or run_idle) stamped
        r = t[c, s, 1:1 + n_rec, :]
        span += int(h[3] - h[1])
        wait += int((r[:, TB] - r[:, TA]).sum())
        last = t[c, s, 1 + n_rec, :] if n_rec < tiles_kept else None
        if last is not None:
            wait += int(last[TB] - last[TA])   # the final take, answered "no more work"
        is_idle = (r[:, TILES] >> 32) & 1
        busy = is_idle == 0
        idle += int((r[is_idle == 1, TD] - r[is_idle == 1, TB]).sum())
        loop += int((r[busy, TC] - r[busy, TB]).sum())
        epi += int((r[busy, TD] - r[busy, TC]).sum())
        xs += list((r[busy, TILES] & 0xFFFFFFFF).tolist())
        ys += list((r[busy, TC] - r[busy, TB]).tolist())
    x = np.asarray(xs, np.float64)
    y = np.asarray(ys, np.float64)
    # The fit needs work tiles of different lengths (a causal mask gives them); where they are all
    # about as long (cached context, no mask) a and b cannot be told apart: b is then the mean
    # cycles per key tile and a 0.
    fitted = len(x) >= 2 and np.ptp(x) >= 0.5 * x.mean()
    if fitted:
        b, a = np.polyfit(x, y, 1)
    else:
        a, b = 0.0, float(y.sum() / max(x.sum(), 1))
    other = span - wait - loop - epi - idle
    out = {"consumers": int(used.sum()), "busy_tiles": len(xs), "key_tiles": float(x.sum()), "fitted": bool(fitted),
           "cycles_per_key_tile": float(b), "cycles_per_work_tile": float(a),
           "share_wait": wait / span, "share_loop_per_key_tile": float(b * x.sum()) / span,
           "share_loop_per_work_tile": float(a * len(x)) / span,
           "share_loop_residual": float(loop - b * x.sum() - a * len(x)) / span,
           "share_epilogue": epi / span, "share_idle_tiles": idle / span, "share_other": other / span}
    if end_ns is not None and len(end_ns):
        e = np.asarray(end_ns, np.float64)
        start = t[:, :, 0, 2][used].astype(np.float64)
        out["end_launch"] = float(((e.max() - e) / (e.max() - start.min())).mean())
    return out


def _trace_memory(filename: str, names: Tuple[str, ...]):
    """(device pointer, [CTAs, slots, 1 + tiles, words]) of the module's stamps (trace.cuh)."""
    import cupy as cp
    from mla_cupy import jit

    shape = np.zeros(4, np.int32)
    sp = jit.device_symbol(filename, names, "mla_sm90_trace_shape")
    cp.cuda.runtime.memcpy(shape.ctypes.data, sp.ptr, shape.nbytes, cp.cuda.runtime.memcpyDeviceToHost)
    ctas, slots, tiles, words = (int(v) for v in shape)
    return jit.device_symbol(filename, names, "mla_sm90_trace"), (ctas, slots, 1 + tiles, words)


def _zero(filename: str, names: Tuple[str, ...]) -> None:
    import cupy as cp

    ptr, shape = _trace_memory(filename, names)
    cp.cuda.runtime.memset(ptr.ptr, 0, int(np.prod(shape)) * 8)


def _read(filename: str, names: Tuple[str, ...]) -> np.ndarray:
    import cupy as cp

    ptr, shape = _trace_memory(filename, names)
    got = np.zeros(shape, np.uint64)
    cp.cuda.runtime.memcpy(got.ctypes.data, ptr.ptr, got.nbytes, cp.cuda.runtime.memcpyDeviceToHost)
    return got


def _modules() -> List[Tuple[str, Tuple[str, ...]]]:
    from mla_cupy import jit

    return [(f, names) for f, _arch, names in jit.compiled_modules() if f == KERNEL_FILE]


def trace_case(case_name: str, spec: str) -> Dict[str, float]:
    """Runs ``spec`` (an ``ab.py`` implementation of ours) on ``case_name`` under the traced build
    and summarizes the launch it makes (the Hopper module whose stamps are not empty)."""
    import cupy as cp
    import ab
    from mla_cupy import bench, jit

    if jit.DEFINES.get("MLA_SM90_TRACE", "0") == "0":
        raise SystemExit("the kernels of this process are built without MLA_SM90_TRACE=1 "
                         "(set MLA_CUPY_DEFINES before mla_cupy is imported; main() does)")
    case = ab.parse_case(case_name)
    base, opts = ab.parse_impl(spec)
    if not base.startswith("ours"):
        raise SystemExit(f"--impl {spec!r}: only our kernels are traced (ours, ours-fp8, ours-e4m3)")
    call, _ = ab.FACTORIES[base](case, [bench.make_inputs(case, 0)], opts)
    call(0)
    call(0)  # compiled, warm
    cp.cuda.Device().synchronize()
    mods = _modules()
    for f, names in mods:
        _zero(f, names)
    call(0)
    cp.cuda.Device().synchronize()
    found = []
    for f, names in mods:
        t = _read(f, names)
        if (t[:, :, 0, 0] > 0).any():
            found.append(t)
    if len(found) != 1:
        raise RuntimeError(f"{len(found)} traced modules recorded this call (expected one)")
    t = found[0]
    used = t[:, :, 0, 0] > 0
    cta_end = np.where(used, t[:, :, 0, 4], 0).max(axis=1)
    res = summarize(t, cta_end[cta_end > 0])
    res.update(case=case_name, impl=spec)
    return res


def format_row(r: Dict[str, float]) -> str:
    keys = ("share_wait", "share_loop_per_key_tile", "share_loop_per_work_tile", "share_loop_residual",
            "share_epilogue", "share_idle_tiles", "share_other", "end_launch")
    shares = " | ".join(f"{100 * r.get(k, float('nan')):.1f}%" for k in keys)
    a = f"{r['cycles_per_work_tile']:.0f}" if r.get("fitted", True) else "- (tiles of one length)"
    return (f"| {r['case']} | {r['impl']} | {r['cycles_per_key_tile']:.0f} | {a} | "
            f"{shares} |")


HEADER = ("| case | impl | cycles / key tile (b) | cycles / work tile (a) | wait | loop b | loop a | loop residual | "
          "epilogue | idle tiles | other | end of launch |\n|" + "---|" * 12)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", default="ours-e4m3:vt=quant", help="ab.py's implementations of ours, comma separated")
    ap.add_argument("--case", default="1x8192", help="ab.py's cases, comma separated")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)
    if "MLA_SM90_TRACE" not in os.environ.get("MLA_CUPY_DEFINES", ""):  # read when mla_cupy is imported
        os.environ["MLA_CUPY_DEFINES"] = f"{os.environ.get('MLA_CUPY_DEFINES', '')} MLA_SM90_TRACE=1".strip()
    rows = []
    print(HEADER)
    for case in [c for c in a.case.split(",") if c]:
        for spec in [s for s in a.impl.split(",") if s]:
            rows.append(trace_case(case, spec))
            print(format_row(rows[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

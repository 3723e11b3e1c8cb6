"""Host time per call of two versions of the package in ONE process: this checkout's ``mla_cupy``
against another tree's (``--base DIR``: a checkout or ``git archive`` with ``mla_cupy/`` and
``kernels/``), imported beside it as ``mla_cupy_base``.

Separate processes of the same package land at host times up to 1.6x apart (on an H100 machine,
about 12 or about 18 us per ``plan.run`` call, the whole process at one level), so a comparison of
two versions from separate runs measures the processes.
Here every call of both versions is a row of one :func:`mla_cupy.bench_host.time_calls`: interleaved
rounds in alternating order, each version's row next to the other's, on the same arrays. Each pair's
ratio is the median over rounds of new / base, with the smallest and largest.

The rows are the CuPy calls (the torch routes register torch ops, which two copies of the package
cannot both do): ``plan.run`` with and without ``out=``, and the one-shot ``mla_prefill`` with
``q_max_seq_len=`` and ``validate=False`` and with the default arguments.

    python benchmarks/host_ab.py --base /tmp/base [--rounds 30] [--calls 300] [--json out.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Dict, List, Sequence, Tuple

BASE_NAME = "mla_cupy_base"


def load_base(tree: Path, into: Path) -> ModuleType:
    """The package of ``tree`` imported as :data:`BASE_NAME` from a copy under ``into`` (its kernel
    sources beside it, where the package looks for a checkout's)."""
    tree, into = Path(tree), Path(into)
    for need in ("mla_cupy", "kernels"):
        if not (tree / need).is_dir():
            raise SystemExit(f"--base: {tree} has no {need}/ (a checkout or git archive of the package)")
    shutil.copytree(tree / "mla_cupy", into / BASE_NAME, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(tree / "kernels", into / "kernels")
    sys.path.insert(0, str(into))
    try:
        return importlib.import_module(BASE_NAME)
    finally:
        sys.path.remove(str(into))


def mask_of(pkg: ModuleType, mask):
    """``mask`` as an instance of ``pkg``'s own class of that name (each version checks masks
    against its own classes)."""
    return getattr(pkg, type(mask).__name__)(**{f.name: getattr(mask, f.name) for f in dataclasses.fields(mask)})


def paired_calls(pkgs: Sequence[Tuple[str, ModuleType]], case, x) -> list:
    """The calls of each version on the arrays ``x`` of ``case`` (one ``out`` for all), each kind
    of call of the versions next to each other."""
    import cupy as cp

    from mla_cupy._arrays import BF16
    from mla_cupy.bench_host import HostCall
    from mla_cupy.dims import DV

    tq, heads, max_q = sum(case.sq), case.heads, max(case.sq)
    q, k, v, kr, vl, cro = (x[n] for n in ("q", "k", "v", "k_rope", "valid_length", "cache_row_offsets"))
    out = cp.empty((tq, heads, DV), BF16)
    kinds: Dict[str, list] = {}
    for tag, pkg in pkgs:
        mask = mask_of(pkg, case.mask)
        fast = dict(mask=mask, q_max_seq_len=max_q, validate=False)
        pl = pkg.plan(vl, cro, num_heads=heads, dtype=BF16, mask=mask, q_max_seq_len=max_q)
        for kind, fn in (
                ("plan.run", lambda i, pl=pl: pl.run(q, k, v, kr, out=out)),
                ("plan.run, no out=", lambda i, pl=pl: pl.run(q, k, v, kr)),
                ("mla_prefill, q_max_seq_len= validate=False",
                 lambda i, p=pkg, kw=fast: p.mla_prefill(q, k, v, kr, vl, cro, out=out, **kw)),
                ("mla_prefill, default arguments",
                 lambda i, p=pkg, m=mask: p.mla_prefill(q, k, v, kr, vl, cro, mask=m, out=out))):
            kinds.setdefault(kind, []).append(HostCall(f"{kind} [{tag}]", tag, fn))
    return [c for pair in kinds.values() for c in pair]


def compare(rows) -> List[dict]:
    """Per kind of call, the base and new medians (us) and new / base per round: median, min, max."""
    by = {r.impl: r for r in rows}
    out = []
    for r in rows:
        if r.group != "base":
            continue
        kind = r.impl[: -len(" [base]")]
        n = by[f"{kind} [new]"]
        ratios = [a / b for a, b in zip(n.samples, r.samples)]
        out.append(dict(call=kind, base_us=r.us, new_us=n.us, ratio=statistics.median(ratios) if ratios else float("nan"),
                        lo=min(ratios, default=float("nan")), hi=max(ratios, default=float("nan")),
                        note="; ".join(x for x in (r.note, n.note) if x)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, type=Path, help="the other tree (mla_cupy/ and kernels/)")
    ap.add_argument("--rounds", type=int, default=30, help="interleaved rounds (default 30)")
    ap.add_argument("--calls", type=int, default=300, help="calls back to back in one sample (default 300)")
    ap.add_argument("--json", type=Path, help="write the rows and the device here")
    args = ap.parse_args(argv)

    import cupy as cp

    import mla_cupy
    from mla_cupy.bench import device_info, make_inputs
    from mla_cupy.bench_host import HOST_CASE, time_calls

    with tempfile.TemporaryDirectory() as tmp:
        base = load_base(args.base, Path(tmp))
        x = make_inputs(HOST_CASE, 0)
        calls = paired_calls([("base", base), ("new", mla_cupy)], HOST_CASE, x)
        rows = time_calls(calls, reps=args.rounds, n=args.calls, sync=cp.cuda.Device().synchronize)
    table = compare(rows)
    info = device_info()
    print(f"{info.get('name', 'GPU')}: {args.rounds} rounds of {args.calls} calls, base {args.base}")
    print("| call | base us | new us | new / base per round (median, min-max) |")
    print("| --- | --- | --- | --- |")
    for t in table:
        print(f"| {t['call']} | {t['base_us']:.1f} | {t['new_us']:.1f} | {t['ratio']:.3f} ({t['lo']:.3f}-{t['hi']:.3f})"
              f"{' ' + t['note'] if t['note'] else ''} |")
    if args.json:
        args.json.write_text(json.dumps(dict(device=info, base=str(args.base), rows=table), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The bench matrix with the peers: ``mla_cupy.bench.run`` (our kernels, as ``mla-cupy bench``)
plus the rows of FlashAttention-3, cuDNN's ragged SDPA, torch SDPA on cuDNN and FlexAttention
(``peers.py``; with ``--fp8`` also FlashAttention-3's e4m3 and cuDNN's fp8 graph), each peer's time
over ours in the ``x <peer>`` columns; or, with ``--host``, the host time per call of our entry
points beside the peers' calls. GPU only.

Usage (from the repository root, on a GPU machine; peers that do not import are left out)::

    python benchmarks/matrix.py                                  # the default matrix
    python benchmarks/matrix.py --cases 1x8192,ragged --fp8 --json bench.json --plot bench.png
    python benchmarks/matrix.py --host --json host.json
    bash benchmarks/gpu.sh --wheels wheels bench                 # the same, with the peers' wheels

The README's performance table is not this matrix: it comes from ``ab.py`` (interleaved rounds)
through ``perf_plot.py``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peers.py beside this script

import peers  # noqa: E402
from mla_cupy import bench, bench_host  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: mla-cupy bench's matrix; "
                                                  "mla-cupy bench --list names them)")
    ap.add_argument("--fp8", action="store_true", help="add our fp8 rows and the fp8 peers")
    ap.add_argument("--reps", type=int, default=20, help="timed repeats per measurement (median)")
    ap.add_argument("--host", action="store_true", help="host time per call instead (takes --calls, --reps, --json)")
    ap.add_argument("--calls", type=int, default=300, help="with --host: calls back to back in one sample")
    ap.add_argument("--json", default=None, help="write the rows here (JSON)")
    ap.add_argument("--csv", default=None, help="write the rows here (CSV)")
    ap.add_argument("--plot", default=None, help="draw TFLOP/s per case and implementation here (PNG)")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    try:
        paths = {k: bench.check_writable(v) for k, v in (("json", a.json), ("csv", a.csv), ("plot", a.plot)) if v}
    except ValueError as exc:
        raise SystemExit(f"matrix.py: {exc}") from None
    if a.host:
        result = bench_host.run(calls=a.calls, reps=a.reps, peers=peers.host_peer_calls)
        print(bench_host.format_table(result))
    else:
        names = [c.strip() for c in a.cases.split(",") if c.strip()] if a.cases else None
        try:
            cases = bench.resolve_cases(names, gpu=True)
        except ValueError as exc:
            raise SystemExit(f"matrix.py: --cases: {exc}") from None
        builders = peers.PEER_ROWS + (peers.FP8_PEER_ROWS if a.fp8 else [])
        result = bench.run(cases, fp8=a.fp8, reps=a.reps, progress=not a.no_progress, checkpoint=paths.get("json"),
                           builders=builders)
        print(bench.format_table(result))
    if "json" in paths:
        bench.write_json(result, paths["json"])
    if "csv" in paths and not a.host:
        bench.write_csv(result, paths["csv"])
    if "plot" in paths and not a.host:
        bench.plot(result, paths["plot"])
    for name, path in paths.items():
        print(f"{name} written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The README's performance plot and table, both drawn from one machine-readable file that a
benchmark run wrote: the JSON of ``ab.py --out`` (``bash benchmarks/gpu.sh perf`` runs it over the
README's cases). Nothing here is typed in: a new run, then this script, replaces both.

Usage (from the repository root; no GPU needed)::

    python benchmarks/perf_plot.py gpu-logs/perf.json   # copies it to benchmarks/perf.json, then draws
    python benchmarks/perf_plot.py                      # draws again from benchmarks/perf.json

It writes ``docs/perf.png`` (titled with the card, the date and the commit of the run) and the
table between the README's ``<!-- perf-table -->`` markers. Every implementation the run timed
beside ours gets its columns (``x FA3``, ``x FA3 + K build``; a peer added to the run, such as
FlashAttention-4 as ``fa4``, adds its own): the median over rounds of its time over ours in the same
round, above 1 where this package is faster. ``tests/test_docs.py`` checks that the committed plot,
table and JSON agree.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "perf.json"
PLOT = ROOT / "docs" / "perf.png"
README = ROOT / "README.md"
BEGIN, END = "<!-- perf-table -->", "<!-- /perf-table -->"

#: How the table and the plot name ab.py's implementations (others keep their spec).
LABELS = {"ours": "mla_cupy", "fa3": "FA3", "fa3+kbuild": "FA3 + K build", "fa4": "FA4", "fa4+kbuild": "FA4 + K build",
          "cudnn": "cuDNN SDPA", "cudnn-ragged": "cuDNN ragged", "ours-fp8": "mla_cupy fp8 per token",
          "ours-e4m3": "mla_cupy all-e4m3", "fa3-fp8": "FA3 e4m3"}

#: The README's cases: (ab.py case name, how the table writes it).
CASES = [("1x512", "1 x 512"), ("1x1024", "1 x 1024"), ("1x2048", "1 x 2048"), ("1x4096", "1 x 4096"),
         ("1x8192", "1 x 8192"), ("1x16384", "1 x 16384"), ("1x32768", "1 x 32768"), ("4x2048", "4 x 2048"),
         ("16x512", "16 x 512"), ("64x128", "64 x 128"), ("ragged", "ragged 512+1024+2048+4096"),
         ("ragged-300+5000+77+1500", "ragged 300+5000+77+1500"), ("1024+ctx8192", "1024 queries, 9216 keys"),
         ("H16-1x8192", "H = 16, 1 x 8192"), ("H16-1x16384", "H = 16, 1 x 16384"),
         ("noncausal-1x4096", "not causal, 1 x 4096")]
#: The peers ``gpu.sh perf`` times beside ours (ab.py's --impls after "ours").
PEERS = ["fa4", "fa3", "fa4+kbuild", "fa3+kbuild"]


def label(spec: str) -> str:
    return LABELS.get(spec, spec)


def load(path: Path = DATA) -> dict:
    """The run's JSON (ab.py's ``--out``), checked for what the plot and the table need."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    missing = [k for k in ("device", "date", "commit", "impls", "results") if k not in data]
    if missing:
        raise SystemExit(f"{path}: not a JSON of benchmarks/ab.py --out from this version (no {', '.join(missing)})")
    return data


def title(data: dict) -> str:
    return (f"MLA prefill, bf16: {data['device']}, {data['date'][:10]}, commit {data['commit']} "
            f"({data['rounds']} interleaved rounds, median)")


def _case_name(case: str) -> str:
    return dict(CASES).get(case, case)


def _clock(res: dict) -> str:
    c = res.get("clock", {})
    if not c.get("n"):
        return "no NVML"
    mhz = f"{c['sm_mhz_median']:.0f} MHz"
    if c["sm_mhz_max"] - c["sm_mhz_min"] >= 30:
        mhz += f" ({c['sm_mhz_min']:.0f}-{c['sm_mhz_max']:.0f})"
    return f"{mhz}, {c['power_w_median']:.0f} W"


def peers_of(data: dict) -> List[str]:
    """The implementations timed beside the base (ours), in the run's order."""
    return [s for s in data["impls"][1:]]


def table(data: dict) -> str:
    """The README's table: per case our ms and TFLOP/s, each peer's time over ours (bold from 1.05:
    this package faster by 5% or more), the SM clock and board power during the case."""
    peers = peers_of(data)
    head = ["case", "ms", "TFLOP/s"] + [f"x {label(p)}" for p in peers] + ["SM clock, power"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for res in data["results"]:
        ours = res["impls"].get(data["impls"][0])
        if ours is None:
            continue
        cells = [_case_name(res["case"]), f"{ours['ms_median']:.3f}", f"{ours['tflops']:.0f}"]
        for p in peers:
            d = res["impls"].get(p)
            if d is None:
                cells.append("-")
                continue
            r = f"{d['ratio_median']:.2f}"
            cells.append(f"**{r}**" if d["ratio_median"] >= 1.05 else r)
        cells.append(_clock(res))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _seq_len(case: str) -> Optional[int]:
    m = re.fullmatch(r"1x(\d+)", case)
    return int(m.group(1)) if m else None


def series(data: dict) -> Dict[str, Dict[str, float]]:
    """TFLOP/s per implementation and case (the K-build rows count the build's time too)."""
    out: Dict[str, Dict[str, float]] = {}
    for res in data["results"]:
        for spec, d in res["impls"].items():
            out.setdefault(spec, {})[res["case"]] = d["tflops"]
    return out


def draw(data: dict, ax_scaling, ax_cases) -> None:
    """TFLOP/s against sequence length (the ``1xN`` cases) on ``ax_scaling``, the other cases as
    bars on ``ax_cases``; both with a legend."""
    s = series(data)
    cases = [r["case"] for r in data["results"]]
    lengths = sorted(n for n in (_seq_len(c) for c in cases) if n)
    others = [c for c in cases if not _seq_len(c)]
    impls = [i for i in data["impls"] if i in s]
    for spec in impls:
        ys = [s[spec].get(f"1x{n}", float("nan")) for n in lengths]
        ax_scaling.plot(lengths, ys, marker="o", label=label(spec))
    if lengths:
        ax_scaling.set_xscale("log", base=2)
        ax_scaling.set_xticks(lengths, [f"{n // 1024}k" if n >= 1024 else str(n) for n in lengths])
    ax_scaling.set_xlabel("sequence length (one causal sequence, H = 128)")
    ax_scaling.set_ylabel("TFLOP/s (visible pairs)")
    ax_scaling.set_ylim(bottom=0)
    ax_scaling.grid(alpha=0.3)
    ax_scaling.legend(fontsize=8, loc="lower right")
    width = 0.8 / max(1, len(impls))
    for j, spec in enumerate(impls):
        ax_cases.bar([i + j * width for i in range(len(others))], [s[spec].get(c, 0.0) for c in others], width,
                     label=label(spec))
    ax_cases.set_xticks([i + 0.4 - width / 2 for i in range(len(others))], [_case_name(c) for c in others],
                        rotation=25, ha="right", fontsize=7)
    ax_cases.set_ylabel("TFLOP/s (visible pairs)")
    ax_cases.grid(axis="y", alpha=0.3)
    ax_cases.legend(fontsize=7, loc="lower right")


def plot(data: dict, out: Path = PLOT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [3, 2]})
    draw(data, a, b)
    fig.suptitle(title(data), fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110, format="png", metadata={"Title": title(data)})
    plt.close(fig)


def with_table(readme: str, data: dict) -> str:
    """``readme`` with the text between its perf-table markers replaced by :func:`table`'s, under
    a line naming the run."""
    i, j = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    run = f"{data['device']}, {data['date'][:10]}, commit {data['commit']}: `{data.get('command', 'benchmarks/ab.py')}`"
    image = f"![{title(data)}](docs/perf.png)"
    return readme[:i] + f"\n{image}\n\n{run}\n\n{table(data)}\n" + readme[j:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("results", nargs="?", type=Path, default=None,
                    help="a run's JSON (ab.py --out): copied to benchmarks/perf.json first")
    ap.add_argument("--plot", type=Path, default=PLOT)
    ap.add_argument("--readme", type=Path, default=README)
    a = ap.parse_args(argv)
    if a.results is not None and a.results.resolve() != DATA.resolve():
        shutil.copyfile(a.results, DATA)
        print(f"copied {a.results} to {DATA}")
    if not DATA.exists():
        raise SystemExit(f"{DATA} does not exist: run `bash benchmarks/gpu.sh --wheels wheels perf` on a GPU "
                         "machine and pass its perf.json")
    data = load(DATA)
    plot(data, a.plot)
    print(f"wrote {a.plot}")
    a.readme.write_text(with_table(a.readme.read_text(encoding="utf-8"), data), encoding="utf-8")
    print(f"wrote the table into {a.readme}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Draw the README's performance plot (docs/perf.png) from the current numbers in
benchmarks/RESULTS.md: the table "v6 against FlashAttention-3 and cuDNN" (one process on an H200; the
rebuilt kernel was timed against FlashAttention-3 alone, on fewer cases).

Usage (from the repository root)::

    python benchmarks/perf_plot.py                 # writes docs/perf.png
    python benchmarks/perf_plot.py --out other.png

Run it again when that table changes (the plot is committed, not drawn per run). The notebook
``examples/quickstart.ipynb`` reads the same numbers through :func:`read_current` and draws them
with :func:`draw` when it has no GPU to measure on.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
OUT = ROOT / "docs" / "perf.png"
HEADING = "### v6 against FlashAttention-3 and cuDNN"

#: Implementations drawn, in order: (label, key of the row dict).
SERIES = [("mla_cupy", "ours"), ("FlashAttention-3 kernel", "fa3"), ("FlashAttention-3 + K build", "fa3_kbuild"),
          ("cuDNN SDPA kernel", "cudnn")]


def _first_number(cell: str) -> float:
    return float(cell.split()[0])


def read_current(path: Path = RESULTS) -> Dict[str, object]:
    """The table under :data:`HEADING`: ``{"title": heading text, "rows": [{case, ours, fa3,
    fa3_kbuild, cudnn}]}`` with TFLOP/s per implementation (a peer's is ours divided by its time
    ratio to ours, the table's own columns)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(HEADING))
    table = []
    for ln in lines[start + 1:]:
        if ln.startswith("|"):
            table.append([c.strip() for c in ln.strip().strip("|").split("|")])
        elif table:
            break
    head, body = table[0], table[2:]
    col = {name: i for i, name in enumerate(head)}
    rows = []
    for cells in body:
        ours = float(cells[col["ours TFLOP/s"]])
        rows.append({"case": cells[col["case"]], "ours": ours, "fa3": float(cells[col["FA3 TFLOP/s"]]),
                     "fa3_kbuild": ours / _first_number(cells[col["(FA3 + K build) / ours"]]),
                     "cudnn": ours / _first_number(cells[col["cuDNN / ours"]])})
    return {"title": lines[start][len("### "):], "rows": rows}


def _seq_len(case: str):
    """The sequence length of a ``1xN`` case (H = 128), else None."""
    m = re.fullmatch(r"1x(\d+)", case)
    return int(m.group(1)) if m else None


def draw(data: Dict[str, object], ax_scaling, ax_cases) -> None:
    """TFLOP/s against sequence length (the ``1xN`` cases) on ``ax_scaling``, the other cases as
    bars on ``ax_cases``."""
    rows: List[dict] = data["rows"]  # type: ignore[assignment]
    scaling = sorted((r for r in rows if _seq_len(r["case"])), key=lambda r: _seq_len(r["case"]))
    lengths = [_seq_len(r["case"]) for r in scaling]
    for label, key in SERIES:
        ax_scaling.plot(lengths, [r[key] for r in scaling], marker="o", label=label)
    ax_scaling.set_xscale("log", base=2)
    ax_scaling.set_xticks(lengths, [f"{n // 1024}k" for n in lengths])
    ax_scaling.set_xlabel("sequence length (one causal sequence, H = 128)")
    ax_scaling.set_ylabel("TFLOP/s (visible pairs)")
    ax_scaling.set_ylim(bottom=0)
    ax_scaling.grid(alpha=0.3)
    ax_scaling.legend(fontsize=8, loc="lower right")
    others = [r for r in rows if not _seq_len(r["case"])]
    width = 0.8 / len(SERIES)
    for j, (label, key) in enumerate(SERIES):
        ax_cases.bar([i + j * width for i in range(len(others))], [r[key] for r in others], width, label=label)
    ax_cases.set_xticks([i + 0.4 - width / 2 for i in range(len(others))], [r["case"] for r in others],
                        rotation=20, ha="right", fontsize=8)
    ax_cases.set_ylabel("TFLOP/s (visible pairs)")
    ax_cases.grid(axis="y", alpha=0.3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = read_current(args.results)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    draw(data, a, b)
    fig.suptitle(f"MLA prefill, bf16, causal: {data['title']} (benchmarks/RESULTS.md)", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

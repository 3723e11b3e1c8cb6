"""What the README shows works: its CPU example runs with the reference alone, and its
performance plot is the one benchmarks/perf_plot.py draws from benchmarks/RESULTS.md."""
import re
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _python_block_after(heading: str) -> str:
    i = README.index(heading)
    j = README.index("```python", i) + len("```python")
    return README[j:README.index("```", j)]


def test_readme_cpu_example_runs_without_cupy(monkeypatch, capsys):
    import mla_cupy._arrays

    monkeypatch.setitem(sys.modules, "cupy", None)           # as if CuPy were not installed
    monkeypatch.setattr(mla_cupy._arrays, "_CUPY", [None])
    exec(compile(_python_block_after("## On the CPU"), "README.md", "exec"), {"__name__": "__main__"})
    assert capsys.readouterr().out.strip() == "(317, 16, 128) float64 (317, 16)"


def test_readme_gpu_examples_say_they_need_a_gpu():
    gpu = README[README.index("## On the GPU"):README.index("## Plan once")]
    assert 'need a CUDA GPU and a GPU extra (`pip install ".[cuda13]"`' in " ".join(gpu.split())
    assert re.search(r"^pip install \.\s+# from a checkout: the float64 reference", README, re.M)  # "Set up", no extra


def test_perf_plot_reads_the_current_results_table():
    perf = runpy.run_path(str(ROOT / "benchmarks" / "perf_plot.py"))
    data = perf["read_current"]()
    rows = {r["case"]: r for r in data["rows"]}
    assert "NVIDIA H200" in data["title"] and len(rows) == 9
    r = rows["1x8192"]
    assert (r["ours"], r["fa3"]) == (660.0, 746.0)
    assert r["cudnn"] == pytest.approx(660 / 1.067) and r["fa3_kbuild"] == pytest.approx(660 / 1.061)
    assert re.search(r"!\[[^\]]+\]\(docs/perf\.png\)", README) and (ROOT / "docs" / "perf.png").stat().st_size > 10_000

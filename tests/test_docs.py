"""What the documents show works: the README's CPU example runs with the reference alone, every
Python example of the README and docs/ compiles, every link between them points at a file, the
README's first screen holds the set-up and test commands, the API reference is what the docstrings
give, and the README's performance plot and table come from one run's JSON."""
import json
import re
import textwrap
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "CHANGELOG.md"]


def _python_block_after(heading: str, text: str = README) -> str:
    i = text.index(heading)
    j = text.index("```python", i) + len("```python")
    return text[j:text.index("```", j)]


def test_readme_cpu_example_runs_without_cupy(monkeypatch, capsys):
    import mla_cupy._arrays

    monkeypatch.setitem(sys.modules, "cupy", None)           # as if CuPy were not installed
    monkeypatch.setattr(mla_cupy._arrays, "_CUPY", [None])
    exec(compile(_python_block_after("## On the CPU"), "README.md", "exec"), {"__name__": "__main__"})
    assert capsys.readouterr().out.strip() == "(317, 16, 128) float64 (317, 16)"


def test_readme_is_short_and_its_first_screen_says_how_to_start():
    lines = README.splitlines()
    assert len(lines) <= 300
    first = "\n".join(lines[:45])
    assert 'pip install ".[cuda13]"' in first and "mla-cupy smoke" in first
    assert "mla_cupy.mla_prefill(" in first  # the main job
    assert 'python -m venv v && v/bin/pip install ".[test]" && v/bin/python -m pytest' in first
    assert "## Training (backward)" in README


def test_gpu_examples_say_they_need_a_gpu():
    gpu = README[README.index("## On the GPU"):README.index("## Training")]
    assert 'need a CUDA GPU and a GPU extra (`pip install ".[cuda13]"`' in " ".join(gpu.split())
    usage = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    assert 'need a CUDA GPU and a GPU extra (`pip install ".[cuda13]"`' in " ".join(usage.split())


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_python_example_compiles(page):
    text = page.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    for i, block in enumerate(blocks):
        compile(textwrap.dedent(block), f"{page.name} example {i}", "exec")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_points_at_a_file(page):
    text = page.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_install_hints_are_commands_of_the_checkout():
    """Every pip hint of the package and the notebook installs an extra this checkout defines, from
    the checkout, quoted for any shell; none names a published mla_cupy."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml")

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    files = [*(ROOT / "mla_cupy").rglob("*.py"), ROOT / "examples" / "quickstart.ipynb", *PAGES]
    seen = 0
    for f in files:
        text = f.read_text(encoding="utf-8")
        assert "mla_cupy[" not in text, f"{f}: names the unpublished package mla_cupy[...]"
        for extra in re.findall(r"""pip install[^\n]*?\\?["'](?:\.|\.\[)([\w,]*)\]?\\?["']""", text):
            for e in filter(None, extra.split(",")):
                seen += 1
                assert e in extras, f"{f}: pip install of the unknown extra {e!r}"
        assert not re.search(r"pip install \.\[", text), f"{f}: an unquoted extra (zsh expands the brackets)"
    assert seen > 5


def test_api_reference_is_generated_from_the_docstrings():
    gen = runpy.run_path(str(ROOT / "docs" / "gen_api.py"))
    committed = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert committed == gen["render"](), "docs/api.md is stale: run python docs/gen_api.py"


def _perf():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    return runpy.run_path(str(ROOT / "benchmarks" / "perf_plot.py"))


def _run_json(peers=("fa3", "fa3+kbuild", "fa4")) -> dict:
    """A run's JSON in the form ab.py --out writes it (two cases)."""
    def impl(ms, ratio):
        return {"ms_median": ms, "tflops": 100 / ms, "ratio_median": ratio, "ratio_min": ratio, "ratio_max": ratio,
                "rel_err": 2e-3}

    clock = {"n": 9, "hz": 20.0, "sm_mhz_median": 1980, "sm_mhz_min": 1980, "sm_mhz_max": 1980,
             "power_w_median": 300, "power_w_max": 320}
    results = [{"case": c, "clock": clock,
                "impls": {"ours": impl(1.0, 1.0), **{p: impl(1.0 * r, r) for p, r in zip(peers, (1.1, 1.5, 0.97))}}}
               for c in ("1x1024", "1x2048", "ragged")]
    return {"device": "NVIDIA H200", "compute_capability": "90", "date": "2026-12-07 10:00:00", "commit": "abc1234",
            "command": "benchmarks/ab.py --impls ours,fa3", "impls": ["ours", *peers], "rounds": 7, "reps": 10,
            "results": results}


def test_perf_table_and_plot_come_from_a_run(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    perf = _perf()
    data = _run_json()
    table = perf["table"](data).splitlines()
    assert table[0] == "| case | ms | TFLOP/s | x FA3 | x FA3 + K build | x FA4 | SM clock, power |"
    assert table[2] == "| 1 x 1024 | 1.000 | 100 | **1.10** | **1.50** | 0.97 | 1980 MHz, 300 W |"
    titles, legends = [], []
    import matplotlib.axes
    import matplotlib.figure

    real_legend, real_sup = matplotlib.axes.Axes.legend, matplotlib.figure.Figure.suptitle
    monkeypatch.setattr(matplotlib.axes.Axes, "legend", lambda ax, *a, **k: legends.append(ax) or real_legend(ax, *a, **k))
    monkeypatch.setattr(matplotlib.figure.Figure, "suptitle",
                        lambda fig, t, *a, **k: titles.append(t) or real_sup(fig, t, *a, **k))
    perf["plot"](data, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000
    assert len(legends) == 2, "both panels have a legend"
    assert titles == ["MLA prefill, bf16: NVIDIA H200, 2026-12-07, commit abc1234 (7 interleaved rounds, median)"]
    readme = "a\n<!-- perf-table -->\nold\n<!-- /perf-table -->\nb\n"
    new = perf["with_table"](readme, data)
    assert new.startswith("a\n<!-- perf-table -->\n![MLA prefill, bf16: NVIDIA H200") and "old" not in new
    assert "\n".join(table) in new and new.endswith("<!-- /perf-table -->\nb\n")


def test_readme_plot_and_table_are_those_of_the_stored_run():
    """With a stored run (benchmarks/perf.json), the README holds exactly its table and the plot it
    draws; without one, neither a plot nor a table of numbers: nothing stale."""
    perf = _perf()
    region = README[README.index(perf["BEGIN"]):README.index(perf["END"]) + len(perf["END"])]
    if perf["DATA"].exists():
        data = perf["load"](perf["DATA"])
        assert perf["with_table"](region, data) == region, "README's table is not benchmarks/perf.json's"
        assert (ROOT / "docs" / "perf.png").stat().st_size > 10_000
    else:
        assert "docs/perf.png" not in README and not (ROOT / "docs" / "perf.png").exists()
        assert "|" not in region


def test_gpu_sh_perf_times_the_readme_cases():
    perf = _perf()
    text = (ROOT / "benchmarks" / "gpu.sh").read_text()
    cases = re.search(r"PERF_CASES=(\S+)", text).group(1).split(",")
    assert cases == [c for c, _ in perf["CASES"]]
    assert "--impls ours," + ",".join(perf["PEERS"]) in text


def test_ab_json_names_card_date_and_commit():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    text = (ROOT / "benchmarks" / "ab.py").read_text()
    assert "run_info = dict(bench.device_info(), commit=checkout_commit()" in text
    from _scripts import load_script

    ab = load_script("benchmarks/ab.py", "ab_docs")
    commit = ab.checkout_commit()
    assert commit == "unknown" or re.fullmatch(r"[0-9a-f]{7,}(\+modified)?", commit)
    json.dumps({"commit": commit})

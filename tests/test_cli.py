"""The command line on the CPU path (CI): info, smoke, bench."""
import json

from click.testing import CliRunner

import cli


def test_info_runs():
    res = CliRunner().invoke(cli.cli, ["info"])
    assert res.exit_code == 0, res.output
    assert "mla_cupy" in res.output and "kernel families" in res.output


def test_smoke_cpu_says_so():
    res = CliRunner().invoke(cli.cli, ["smoke", "--cpu"])
    assert res.exit_code == 0, res.output
    assert "no GPU: ran the float64 reference only" in res.output and "finite: True" in res.output


def test_bench_cpu_json_fields(tmp_path):
    path = tmp_path / "b.json"
    csvp = tmp_path / "b.csv"
    res = CliRunner().invoke(cli.cli, ["bench", "--cpu", "--json", str(path), "--csv", str(csvp), "--no-progress"])
    assert res.exit_code == 0, res.output
    data = json.loads(path.read_text())
    assert {"device", "matmul_tflops", "rows", "date"} <= set(data)
    row = data["rows"][0]
    assert {"case", "impl", "ms", "tflops", "rel_err", "extra_mem_mb", "host_us", "note", "ratios"} <= set(row)
    assert row["impl"] == "reference-cpu" and row["ms"] > 0
    # the FLOP count behind TFLOP/s: H * 2 * (192 + 128) * visible pairs (checked by hand)
    from mla_cupy.bench import CPU_CASES

    c = CPU_CASES["tiny-2x48"]
    pairs = 48 * 49 // 2 + sum(min(33, 33 - 20 + i + 1) for i in range(20))
    assert c.flops() == 4 * 2 * 320 * pairs
    assert "tiny-2x48" in csvp.read_text()


def test_bench_rejects_unknown_case():
    res = CliRunner().invoke(cli.cli, ["bench", "--cpu", "--cases", "nope"])
    assert res.exit_code != 0 and "unknown case" in res.output


def test_bench_plot(tmp_path):
    import pytest

    pytest.importorskip("matplotlib")
    from mla_cupy import bench

    res = bench.run_cpu(list(bench.CPU_CASES.values()))
    p = tmp_path / "p.png"
    bench.plot(res, str(p))
    assert p.stat().st_size > 1000

"""The command line on the CPU path (CI): info, smoke, compile, bench, and ``python -m mla_cupy``."""
import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import mla_cupy
from mla_cupy import _registry as reg
from mla_cupy import bench, cli

ROOT = Path(__file__).resolve().parent.parent


def invoke(*args):
    return CliRunner().invoke(cli.cli, list(args))


def test_info_runs_with_readable_versions():
    res = invoke("info")
    assert res.exit_code == 0, res.output
    assert "mla_cupy" in res.output and "mla_prefill_sm90.cu" in res.output
    assert reg.SPIN[0] not in res.output  # the benchmark's helper is not one of the package's kernels
    if "CuPy " in res.output and "not importable" not in res.output:  # each CUDA version says what it is
        assert re.search(r"CuPy \S+ \(built with CUDA \d+\.\d+\), CUDA runtime library (\d+\.\d+|none found), "
                         r"NVRTC \d+\.\d+ \(compiles the kernels\), driver (\d+\.\d+|none)\n", res.output), res.output
        assert "the extra pins the NVRTC" in res.output


def test_cuda_version_reads_like_a_person_writes_it():
    assert cli.cuda_version(13020) == "13.2"
    assert cli.cuda_version(12090) == "12.9"
    assert cli.cuda_version(13000) == "13.0"


def test_smoke_cpu_says_so():
    res = invoke("smoke", "--cpu")
    assert res.exit_code == 0, res.output
    assert "no GPU: ran the float64 reference only" in res.output and "finite: True" in res.output


def test_compile_list_names_every_family_apart():
    res = invoke("compile", "--list")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert len(lines) == len(reg.all_families())
    labels = [line.split(" (")[0] for line in lines]
    assert len(set(labels)) == len(labels), "two families print the same name"
    for variant in ("16-bit", "fp8-per-token", "fp8-rope"):
        assert f"sm_90a mla_prefill_sm90<bf16, CausalMask, {variant}>" in labels


def test_family_label_of_a_family_with_one_kernel_per_type():
    assert cli.family_label(reg.quantize_family()) == "quantize"
    assert cli.family_label(reg.prefill_sm80(reg.FP16, reg.MASKS[0])).startswith("mla_prefill_sm80<fp16, ")


def test_compile_offline_shows_progress_in_spawned_workers():
    """Two families through two spawned workers (the path a GPU machine takes too)."""
    pytest.importorskip("cupy")
    res = invoke("compile", "--offline", "--only", "bench_spin", "-j", "2")
    assert res.exit_code == 0, res.output
    done = re.findall(r"^\[(\d)/2\] (sm_80|sm_90a) bench_spin \d+\.\d s$", res.output, re.MULTILINE)
    assert sorted(n for n, _ in done) == ["1", "2"] and {a for _, a in done} == {"sm_80", "sm_90a"}, res.output
    assert "2/2 families compiled" in res.output


def test_compile_rejects_a_filter_that_matches_nothing():
    pytest.importorskip("cupy")
    res = invoke("compile", "--offline", "--only", "no-such-family")
    assert res.exit_code == 1 and "no family matches" in res.output


def test_compile_without_cupy_says_so_once(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    res = invoke("compile", "--offline")
    assert res.exit_code == 1
    assert res.output.count("CuPy is not importable") == 1 and 'pip install ".[cuda13]"' in res.output
    assert "Traceback" not in res.output and isinstance(res.exception, SystemExit)


def test_compile_without_nvrtc_says_so_once(monkeypatch):
    cupy = pytest.importorskip("cupy")

    def missing():
        raise RuntimeError("libnvrtc.so: cannot open shared object file")

    monkeypatch.setattr(cupy.cuda.nvrtc, "getVersion", missing)
    res = invoke("compile", "--offline")
    assert res.exit_code == 1
    assert res.output.count("NVRTC (libnvrtc) is not found") == 1
    assert "Traceback" not in res.output and isinstance(res.exception, SystemExit)


def test_info_without_cupy_points_to_the_reference(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    res = invoke("info")
    assert res.exit_code == 0, res.output
    assert "CuPy is not importable" in res.output and "reference" in res.output


def test_bench_list_shows_every_case_and_marks_gpu_ones():
    res = invoke("bench", "--list", "--cpu")
    assert res.exit_code == 0, res.output
    lines = {line.split()[0]: line for line in res.output.splitlines()}
    assert set(lines) == set(bench.ALL_CASES)
    for name, case in bench.ALL_CASES.items():
        assert ("[needs a GPU" in lines[name]) == case.needs_gpu
    assert "default here" in lines["tiny-2x48"] and "default here" not in lines["1x8192"]


def test_bench_names_a_gpu_case_on_a_cpu_run():
    """A known GPU case is recognised (not "unknown") and refused with the reason."""
    res = invoke("bench", "--cpu", "--cases", "1x8192,ragged")
    assert res.exit_code != 0
    assert "need a GPU" in res.output and "unknown" not in res.output and "tiny-2x48" in res.output


def test_resolve_cases():
    assert bench.resolve_cases(None, gpu=True) == list(bench.DEFAULT_CASES.values())
    assert bench.resolve_cases(None, gpu=False) == list(bench.CPU_CASES.values())
    assert [c.name for c in bench.resolve_cases(["1x32768", "tiny-2x48"], gpu=True)] == ["1x32768", "tiny-2x48"]
    with pytest.raises(ValueError, match="unknown case"):
        bench.resolve_cases(["nope"], gpu=True)


def test_bench_cpu_json_fields(tmp_path):
    path = tmp_path / "b.json"
    csvp = tmp_path / "b.csv"
    res = invoke("bench", "--cpu", "--json", str(path), "--csv", str(csvp), "--no-progress")
    assert res.exit_code == 0, res.output
    data = json.loads(path.read_text())
    assert {"device", "matmul_tflops", "rows", "date"} <= set(data)
    row = data["rows"][0]
    assert {"case", "impl", "ms", "tflops", "rel_err", "err_vs_16bit", "extra_mem_mb", "host_us", "note", "ratios",
            "group"} <= set(row)
    assert row["impl"] == "reference-cpu" and row["ms"] > 0
    # the FLOP count behind TFLOP/s: H * 2 * (192 + 128) * visible pairs (checked by hand)
    c = bench.CPU_CASES["tiny-2x48"]
    pairs = 48 * 49 // 2 + sum(min(33, 33 - 20 + i + 1) for i in range(20))
    assert c.flops() == 4 * 2 * 320 * pairs
    assert "tiny-2x48" in csvp.read_text()


def test_bench_rejects_unknown_case():
    res = invoke("bench", "--cpu", "--cases", "nope")
    assert res.exit_code != 0 and "unknown case" in res.output


def test_bench_help_points_to_the_peer_scripts():
    """The package times its own kernels; the help says which scripts of the checkout time the peers."""
    res = invoke("bench", "--help")
    assert res.exit_code == 0
    for text in ("python benchmarks/matrix.py", "python benchmarks/ab.py --help", "--fp8", "--host"):
        assert text in res.output
    assert "--no-peers" not in res.output


def test_no_command_prints_the_help_and_succeeds():
    res = invoke()
    assert res.exit_code == 0 and res.output.startswith("Usage: ") and "Commands:" in res.output
    assert res.output == invoke("--help").output


@pytest.mark.parametrize("option", ["--json", "--csv", "--plot"])
def test_bench_refuses_an_output_it_cannot_write_before_timing(option, monkeypatch, tmp_path):
    """One line and exit 1, before any case runs (the run would be lost at the end)."""
    if option == "--plot":
        pytest.importorskip("matplotlib")
    ran = []
    monkeypatch.setattr(bench, "run_cpu", lambda *a, **k: ran.append(1))
    res = invoke("bench", "--cpu", "--reps", "1", option, "/no/such/dir/x.out")
    assert res.exit_code == 1 and not ran
    assert res.output == f"Error: {option}: cannot write /no/such/dir/x.out: the folder /no/such/dir does not exist\n"
    res = invoke("bench", "--cpu", "--reps", "1", option, str(tmp_path))
    assert res.exit_code == 1 and res.output == f"Error: {option}: {tmp_path} is a folder, not a file\n"


def test_bench_says_where_it_wrote(tmp_path):
    pytest.importorskip("matplotlib")
    paths = {o: tmp_path / f"r.{e}" for o, e in (("--json", "json"), ("--csv", "csv"), ("--plot", "png"))}
    res = invoke("bench", "--cpu", "--reps", "1", *[x for o, p in paths.items() for x in (o, str(p))])
    assert res.exit_code == 0, res.output
    assert res.stderr.splitlines()[-3:] == [f"the rows (JSON) written to {paths['--json']}",
                                           f"the rows (CSV) written to {paths['--csv']}",
                                           f"the plot (PNG) written to {paths['--plot']}"]
    assert all(p.stat().st_size > 0 for p in paths.values())


def test_a_failed_write_is_one_line(monkeypatch, tmp_path):
    def full(result, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bench, "write_json", full)
    res = invoke("bench", "--cpu", "--reps", "1", "--json", str(tmp_path / "r.json"))
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert res.output.splitlines()[-1] == f"Error: could not write the rows (JSON) to {tmp_path / 'r.json'}: No space left on device"


def test_bench_fp8_without_a_gpu_is_refused(monkeypatch):
    res = invoke("bench", "--cpu", "--fp8")
    assert res.exit_code == 1 and res.output == "Error: --fp8 times the fp8 kernels on a Hopper GPU (--cpu was given)\n"
    monkeypatch.setattr(cli, "_gpu_available", lambda: False)
    monkeypatch.setattr(cli, "gpu_missing", lambda: "CuPy sees no CUDA device")
    res = invoke("bench", "--fp8")
    assert res.exit_code == 1
    assert res.output == "Error: --fp8 times the fp8 kernels on a Hopper GPU (none found: CuPy sees no CUDA device)\n"


def test_format_table_shows_the_fp8_error_columns():
    rows = [bench.Row("c", "mla_cupy-fp8", 2.0, 100.0, 0.02, None, err_vs_16bit=0.03, group="fp8",
                      ratios={"fa3-fp8": 0.9}),
            bench.Row("c", "fa3-fp8", 1.8, 111.0, 0.025, None, err_vs_16bit=0.031, group="fp8")]
    from dataclasses import asdict

    text = bench.format_table({"device": "d", "matmul_tflops": None, "rows": [asdict(r) for r in rows]})
    assert "err vs 16-bit" in text and "x fa3-fp8" in text
    line = next(ln for ln in text.splitlines() if "| mla_cupy-fp8" in ln)
    assert "2.00e-02" in line and "3.00e-02" in line and "0.90" in line


def test_bench_plot(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    res = bench.run_cpu(list(bench.CPU_CASES.values()), reps=2)
    p = tmp_path / "p.png"
    titles = []
    import matplotlib.axes

    real = matplotlib.axes.Axes.set_title
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", lambda ax, t, *a, **k: titles.append(t) or real(ax, t, *a, **k))
    bench.plot(res, str(p))
    assert p.stat().st_size > 1000
    assert titles == ["MLA prefill, float64 reference, cpu (no GPU: reference only)"]


def test_bench_cpu_is_warmed_and_takes_the_median_of_reps():
    res = invoke("bench", "--cpu", "--reps", "3", "--no-progress")
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if "reference-cpu" in ln)
    rate = float(line.split("|")[4])
    assert 0 < rate < 1  # TFLOP/s of float64 NumPy, printed with its digits
    data = bench.run_cpu(list(bench.CPU_CASES.values()), reps=3)
    assert data["rows"][0]["note"] == "float64 NumPy, median of 3 after a warm-up call"
    assert data["rows"][0]["tflops"] > 0


def test_a_missing_optional_package_is_named_with_its_install_command(tmp_path, monkeypatch):
    """As if matplotlib, torch and transformers were not installed (None in sys.modules stops
    their import): each feature names the extra to install; the command line says it without a
    traceback."""
    import importlib

    for name in ("matplotlib", "matplotlib.pyplot", "torch", "transformers"):
        monkeypatch.setitem(sys.modules, name, None)
    res = invoke("bench", "--cpu", "--reps", "1", "--plot", str(tmp_path / "p.png"))
    assert res.exit_code == 1 and res.output.endswith(
        'Error: mla-cupy bench --plot needs matplotlib, which is not installed: pip install ".[bench]" in the mla_cupy '
        'checkout\n')
    res = invoke("bench", "--cp", "1", "--cpu")
    assert res.exit_code == 1 and res.output.endswith(
        'Error: mla-cupy bench --cp needs torch, which is not installed: pip install ".[distributed]" in the mla_cupy '
        'checkout\n')
    monkeypatch.delitem(sys.modules, "mla_cupy.torch_ops", raising=False)
    with pytest.raises(ModuleNotFoundError, match=r"^mla_cupy.torch_ops needs torch, which is not installed: "
                                                  r'pip install "\.\[torch\]" in the mla_cupy checkout$'):
        importlib.import_module("mla_cupy.torch_ops")
    monkeypatch.delitem(sys.modules, "mla_cupy.integrations.transformers", raising=False)
    with pytest.raises(ModuleNotFoundError,
                       match=r'transformers needs torch, .*pip install "\.\[transformers\]" in the mla_cupy checkout$'):
        importlib.import_module("mla_cupy.integrations.transformers")
    from mla_cupy._optional import require

    with pytest.raises(ModuleNotFoundError, match=r"^register needs transformers, which is not installed: "
                                                  r'pip install "\.\[transformers\]" in the mla_cupy checkout$'):
        require("transformers", "register")


def test_python_m_mla_cupy():
    res = subprocess.run([sys.executable, "-m", "mla_cupy", "bench", "--list", "--cpu"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "1x8192" in res.stdout and "tiny-2x48" in res.stdout


def test_root_cli_runs_the_command_line_from_the_checkout(tmp_path):
    """``python cli.py ...`` from anywhere runs this checkout's command line (its kernel sources),
    with nothing installed as a top-level ``cli`` module (the wheel leaves cli.py out:
    tests/test_packaging.py)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, str(ROOT / "cli.py"), "info"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"mla_cupy {mla_cupy.__version__}, kernel sources in {ROOT / 'kernels'}\n")


def test_root_cli_smoke(monkeypatch, capsys):
    """``python cli.py smoke`` (here: ``smoke --cpu``, run as __main__ in this process)."""
    monkeypatch.setattr(sys, "argv", ["cli.py", "smoke", "--cpu"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # cli.py puts the checkout first
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(ROOT / "cli.py"), run_name="__main__")
    assert exc.value.code == 0
    assert "no GPU: ran the float64 reference only" in capsys.readouterr().out


def test_package_never_imports_the_command_line():
    """The package's modules import nothing from the command line (it imports them, not the reverse)."""
    for path in (ROOT / "mla_cupy").glob("*.py"):
        if path.name in ("cli.py", "__main__.py"):
            continue
        text = path.read_text()
        assert not re.search(r"^\s*(from\s+(\.|mla_cupy\.)?cli\s+import|import\s+cli\b|from\s+\.\s+import\s+cli\b)",
                             text, re.MULTILINE), path.name


def _nvls_env_restored(monkeypatch):
    """The runner sets NVLink multicast variables in os.environ; monkeypatch puts them back."""
    from mla_cupy.distributed.bench import NVLS_OFF

    for key in NVLS_OFF:
        monkeypatch.setenv(key, "unset-by-test")
    return NVLS_OFF


def test_bench_cp_one_rank_runs_in_process(monkeypatch):
    """``--cp 1 --cpu``: the context-parallel runner on gloo with the float64 reference, tiny sizes."""
    pytest.importorskip("torch")
    nvls = _nvls_env_restored(monkeypatch)
    monkeypatch.delenv("RANK", raising=False)
    res = invoke("bench", "--cp", "1", "--cpu", "--seq", "32", "--heads", "2", "--check-seq", "24", "--iters", "1",
                 "--warmup", "0", "--page-size", "16")
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.output.splitlines() if line.startswith("{")]
    env, results = rows[0], rows[1:]
    assert env["world_size"] == 1 and env["device"] == "cpu" and all(env[k] == v for k, v in nvls.items())
    equality = [r for r in results if r["check"] == "equality"]
    assert len(equality) == 12 and all(r["ok"] for r in equality)  # 5 masks + paged, ring and all-gather
    (scaling,) = [r for r in results if r["check"] == "scaling"]
    assert scaling["seq"] == 32 and scaling["heads"] == 2 and scaling["t_ring_s"] > 0


def test_bench_cp_several_ranks_execs_torchrun(monkeypatch):
    """``--cp 4``: this process becomes ``torch.distributed.run`` over the runner, with the runner's
    arguments (--json and --cpu passed on) and NVLink multicast off in the environment."""
    import os

    nvls = _nvls_env_restored(monkeypatch)
    seen = {}

    def fake_execvp(file, argv):
        seen.update(file=file, argv=list(argv), env={k: os.environ[k] for k in nvls})
        raise SystemExit(7)

    monkeypatch.setattr(cli.os, "execvp", fake_execvp)
    monkeypatch.setattr(cli, "require", lambda *a, **k: None)  # as if torch were installed
    res = invoke("bench", "--cp", "4", "--seq", "131072", "--heads", "128", "--json", "cp4.json", "--cpu")
    assert res.exit_code == 7, res.output
    assert seen["file"] == sys.executable
    assert seen["argv"] == [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "-m",
                            "mla_cupy.distributed.bench", "--seq", "131072", "--heads", "128", "--json", "cp4.json",
                            "--device", "cpu"]
    assert seen["env"] == nvls


def test_bench_cp_refuses_the_matrix_options_and_stray_arguments():
    res = invoke("bench", "--cp", "2", "--fp8", "--cases", "1x8192")
    assert res.exit_code != 0 and "--cp runs the context-parallel runner" in res.output
    assert "--fp8" in res.output and "--cases" in res.output
    res = invoke("bench", "--cpu", "--seq", "64")
    assert res.exit_code != 0 and "unexpected arguments --seq 64" in res.output
    res = invoke("bench", "--cp", "0")
    assert res.exit_code != 0

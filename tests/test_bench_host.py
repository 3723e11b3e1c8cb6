"""``mla-cupy bench --host`` without a GPU: the interleaved timing with a fake clock, the table and
the JSON, the command line's options, and its mode of benchmarks/gpu.sh (the GPU run itself:
tests/test_gpu_bench.py)."""
import itertools
import json
import math
import subprocess
from pathlib import Path

from click.testing import CliRunner

from _scripts import load_script

from mla_cupy import bench_host, cli

import peers  # noqa: E402  (benchmarks/, put on sys.path by _scripts)


class FakeDevice:
    """A clock that advances only when a call runs, by the call's cost; a log of calls and syncs."""

    def __init__(self):
        self.now, self.log = 0.0, []

    def clock(self):
        return self.now

    def sync(self):
        self.log.append("sync")

    def call(self, name, us, fail_at=None):
        def fn(i):
            self.log.append(name)
            if fail_at is not None and self.log.count(name) >= fail_at:
                raise RuntimeError(f"{name} broke")
            self.now += us * 1e-6
        return bench_host.HostCall(name, "ours", fn, note=f"note {name}")


def test_time_calls_interleaves_rounds_and_takes_the_median():
    dev = FakeDevice()
    calls = [dev.call("a", 2.0), dev.call("b", 5.0), dev.call("c", 1.0, fail_at=2 + 4 + 1)]
    rows = bench_host.time_calls(calls, reps=3, n=4, sync=dev.sync, clock=dev.clock, warmup=2)
    a, b, c = rows
    assert [r.impl for r in rows] == ["a", "b", "c"]
    assert math.isclose(a.us, 2.0) and math.isclose(b.us, 5.0) and len(a.samples) == len(b.samples) == 3
    assert a.note == "note a" and a.us_min <= a.us <= a.us_max
    # c: 2 warm-up calls, 4 timed calls in round 0, then it raises in round 1 and is timed no further
    assert c.note == "failed: RuntimeError: c broke" and c.us != c.us and c.samples == []
    runs = [x for x in dev.log if x != "sync"]
    assert runs[:6] == ["a", "a", "b", "b", "c", "c"]  # warm-up
    # rounds of 4 calls each, in alternating order: a b c | c (raises at once) b a | a b
    assert [(x, len(list(g))) for x, g in itertools.groupby(runs[6:])] == [
        ("a", 4), ("b", 4), ("c", 4 + 1), ("b", 4), ("a", 4 + 4), ("b", 4)]
    assert dev.log[-1] == "sync"


def test_takes_out_reads_the_signature():
    def with_out(q, k, v, *, out=None):
        pass

    def with_kwargs(q, **kw):
        pass

    assert peers._takes_out(with_out) and not peers._takes_out(with_kwargs)
    assert not peers._takes_out(len)


RESULT = {
    "device": "NVIDIA H200", "compute_capability": "90", "date": "2026-12-05 10:00:00", "case": "host-1x64-H16",
    "problem": "Sq=1x64 Sk=1x64 H=16 causal", "calls": 300, "reps": 7,
    "rows": [
        {"impl": "plan.run (CuPy)", "group": "ours", "us": 11.04, "us_min": 10.9, "us_max": 12.5,
         "samples": [11.04], "note": ""},
        {"impl": "FA3 flash_attn_varlen_func (K at 192)", "group": "peer", "us": float("nan"), "us_min": float("nan"),
         "us_max": float("nan"), "samples": [], "note": "failed: RuntimeError: no"},
    ],
    "left_out": ["cuDNN row left out: the cuDNN frontend (module cudnn) does not import"],
}


def test_format_table():
    lines = bench_host.format_table(RESULT).splitlines()
    assert lines[0] == ("device: NVIDIA H200  host time per call: Sq=1x64 Sk=1x64 H=16 causal, 300 calls back to "
                        "back, median of 7 interleaved rounds")
    assert lines[1].split("|")[1:-1] == [" call                                  ", " group ", " us/call (median) ",
                                         " min  ", " max  ", " note                     "]
    assert [c.strip() for c in lines[3].split("|")[1:-1]] == ["plan.run (CuPy)", "ours", "11.0", "10.9", "12.5", ""]
    assert [c.strip() for c in lines[4].split("|")[1:-1]] == ["FA3 flash_attn_varlen_func (K at 192)", "peer", "", "",
                                                              "", "failed: RuntimeError: no"]
    assert lines[5] == RESULT["left_out"][0] and len(lines) == 6
    assert len({len(line) for line in lines[1:5]}) == 1


def test_bench_host_passes_its_options_and_writes_json(monkeypatch, tmp_path):
    seen = {}

    def fake_run(**kw):
        seen.update(kw)
        return RESULT

    monkeypatch.setattr(cli, "_gpu_available", lambda: True)
    monkeypatch.setattr(bench_host, "run", fake_run)
    path = tmp_path / "host.json"
    res = CliRunner().invoke(cli.cli, ["bench", "--host", "--calls", "50", "--reps", "3", "--json", str(path)])
    assert res.exit_code == 0, res.output
    assert seen == {"calls": 50, "reps": 3}
    assert res.stdout == bench_host.format_table(RESULT) + "\n"
    assert res.stderr == f"the rows (JSON) written to {path}\n"
    assert json.loads(path.read_text())["rows"][0]["impl"] == "plan.run (CuPy)"
    seen.clear()
    assert CliRunner().invoke(cli.cli, ["bench", "--host"]).exit_code == 0
    assert seen == {"calls": 300, "reps": 20}


def test_bench_host_refusals(monkeypatch):
    def invoke(*args):
        return CliRunner().invoke(cli.cli, ["bench", *args])

    monkeypatch.setattr(cli, "_gpu_available", lambda: True)
    res = invoke("--host", "--cases", "1x8192", "--fp8")
    assert res.exit_code == 2
    assert "--host times calls on one small problem; it does not take --cases, --fp8" in res.output
    res = invoke("--calls", "10", "--cpu")
    assert res.exit_code == 2 and "--calls: only with --host" in res.output
    res = invoke("--cp", "1", "--host")
    assert res.exit_code == 2 and "--cp runs the context-parallel runner; it does not take --host" in res.output
    monkeypatch.setattr(cli, "_gpu_available", lambda: False)
    monkeypatch.setattr(cli, "gpu_missing", lambda: "CuPy sees no CUDA device")
    res = invoke("--host")
    assert res.exit_code == 1 and res.output == "Error: --host times calls on a GPU: none found (CuPy sees no CUDA device)\n"


def test_gpu_sh_runs_the_host_and_e2e_benchmarks():
    """``bash benchmarks/gpu.sh host`` and ``e2e`` are modes of the GPU runner, documented in its help;
    the host mode times the peers' calls too (``matrix.py --host``)."""
    gpu_sh = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu.sh"
    res = subprocess.run(["bash", str(gpu_sh), "--help"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0
    modes = {line.split()[0] for line in res.stdout.splitlines() if line.startswith("  ") and line.split()}
    assert {"host", "e2e", "bench", "suite"} <= modes
    text = gpu_sh.read_text()
    assert 'benchmarks/matrix.py --host --json "$OUT_DIR/host.json"' in text
    assert 'transformers_e2e.py --json "$OUT_DIR/e2e.json"' in text

"""benchmarks/train_e2e.py without a GPU: its options, the copy task's data, and (with torch and
transformers) the whole run on a tiny model on the CPU: both backends start from the same loss and
stay together, and the JSON and plot are written."""
import json

import pytest
from _scripts import load_script


@pytest.fixture(scope="module")
def train():
    return load_script("benchmarks/train_e2e.py", "train_e2e")


def test_options(train):
    args = train.parse_args([])
    assert (args.tokens, args.steps, args.heads, args.impls) == (4096, 200, 128, ["mla_cupy", "sdpa"])
    for bad in (["--impls", "eager"], ["--tokens", "7"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            train.parse_args(bad)


def test_the_copy_task(train):
    torch = pytest.importorskip("torch")
    args = train.parse_args(["--tokens", "10", "--device", "cpu", "--vocab", "16"])
    a, b = train.batch(args, 3, torch), train.batch(args, 3, torch)
    assert torch.equal(a, b) and torch.equal(a[:, :5], a[:, 5:]) and int(a.min()) >= 1 and int(a.max()) < 16
    assert not torch.equal(a, train.batch(args, 4, torch))


def test_a_tiny_run_on_the_cpu(train, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    out = tmp_path / "train.json"
    assert train.main(["--device", "cpu", "--tokens", "16", "--steps", "4", "--warmup", "1", "--layers", "1",
                       "--hidden", "64", "--heads", "2", "--intermediate", "64", "--vocab", "32", "--json", str(out),
                       "--plot", str(tmp_path / "train.png")]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["impl"] for r in runs] == ["mla_cupy", "sdpa"] and all(len(r["losses"]) == 4 for r in runs)
    assert abs(runs[0]["losses"][0] - runs[1]["losses"][0]) < 1e-4  # the same weights and data
    assert runs[1]["max_window_diff"] < 1e-3
    assert (tmp_path / "train.png").stat().st_size > 0

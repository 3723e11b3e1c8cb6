"""benchmarks/train_e2e.py without a GPU: its options, the repeated-pattern task's data and labels,
and (with torch and transformers) the whole run on a tiny model on the CPU: the backends start
from the same loss and stay together, the JSON and plot are written, and a small model learns the
task (its loss falls well below chance)."""
import json
import math

import pytest
from _scripts import load_script


@pytest.fixture(scope="module")
def train():
    return load_script("benchmarks/train_e2e.py", "train_e2e")


def test_options(train):
    args = train.parse_args([])
    assert (args.tokens, args.steps, args.heads, args.impls) == (4096, 200, 128, ["mla_cupy", "sdpa"])
    assert (args.period, args.segment, args.lr_warmup, args.warmup) == (8, 32, 10, 5)
    assert 0 < args.lr and 0 <= args.beta2 < 1
    assert train.parse_args(["--impls", "mla_cupy,sdpa,eager"]).impls == ["mla_cupy", "sdpa", "eager"]
    for bad in (["--impls", "flash"], ["--impls", ","], ["--steps", "0"],
                ["--tokens", "7"],  # 7 tokens: shorter than a segment
                ["--period", "0"], ["--period", "32"], ["--segment", "8", "--period", "9"],
                ["--tokens", "64", "--segment", "65"], ["--lr-warmup", "-1"], ["--vocab", "1"], ["--beta2", "1"]):
        with pytest.raises(SystemExit):
            train.parse_args(bad)


def test_the_repeated_pattern_task(train):
    torch = pytest.importorskip("torch")
    period, segment, tokens, vocab = 4, 12, 58, 16  # the last segment cut short (58 = 4 x 12 + 10)
    args = train.parse_args(["--tokens", str(tokens), "--period", str(period), "--segment", str(segment),
                             "--vocab", str(vocab), "--device", "cpu"])
    a, b = train.batch(args, 3, torch), train.batch(args, 3, torch)
    assert a.shape == (1, tokens) and a.dtype == torch.int64
    assert torch.equal(a, b)  # one seed per step
    assert not torch.equal(a, train.batch(args, 4, torch))  # a new sequence each step
    other_seed = train.parse_args(["--seed", "1", "--tokens", str(tokens), "--period", str(period),
                                   "--segment", str(segment), "--vocab", str(vocab), "--device", "cpu"])
    assert not torch.equal(a, train.batch(other_seed, 3, torch))
    assert int(a.min()) >= 1 and int(a.max()) < vocab
    x = a[0].tolist()
    for j in range(tokens):  # within a segment, every token after the first period is the one `period` back
        if j % segment >= period:
            assert x[j] == x[j - period], j
    patterns = [tuple(x[s:s + period]) for s in range(0, tokens, segment)]
    assert len(set(patterns)) > 1  # a new pattern per segment
    # The labels: the tokens, with no loss on each segment's first period (no model can predict it).
    labels = train.targets(args, a, torch)[0].tolist()
    for j in range(tokens):
        assert labels[j] == (-100 if j % segment < period else x[j]), j


def test_the_tokens_are_about_equally_frequent(train):
    torch = pytest.importorskip("torch")
    args = train.parse_args(["--device", "cpu"])  # 4096 tokens, vocabulary 256
    for step in (0, 1):
        counts = torch.bincount(train.batch(args, step, torch)[0], minlength=args.vocab)
        assert int(counts[0]) == 0  # token 0 is never drawn
        # 128 patterns of 8: each token in 4 or 5 of them, 4 repeats each
        assert int(counts[1:].min()) >= 16 and int(counts[1:].max()) <= 20


def test_a_tiny_run_on_the_cpu(train, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    out = tmp_path / "train.json"
    assert train.main(["--device", "cpu", "--tokens", "16", "--period", "2", "--segment", "8", "--steps", "4",
                       "--warmup", "1", "--layers", "1", "--hidden", "64", "--heads", "2", "--intermediate", "64",
                       "--vocab", "32", "--impls", "mla_cupy,sdpa,eager", "--json", str(out),
                       "--plot", str(tmp_path / "train.png")]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["impl"] for r in runs] == ["mla_cupy", "sdpa", "eager"] and all(len(r["losses"]) == 4 for r in runs)
    for r in runs[1:]:
        assert abs(runs[0]["losses"][0] - r["losses"][0]) < 1e-4  # the same weights and data
        assert r["max_window_diff"] < 1e-3
    assert (tmp_path / "train.png").stat().st_size > 0


def test_a_small_model_learns_the_task(train, tmp_path):
    """80 steps of a 2-layer model on 256-token sequences (a few seconds on 2 cores): the loss
    starts at chance, ln(31), and its last 10-step mean ends well below it. A task the model cannot
    learn in that time (or a broken one, say patterns that do not repeat) stays at chance."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "train.json"
    assert train.main(["--device", "cpu", "--impls", "sdpa", "--tokens", "256", "--period", "4", "--segment", "16",
                       "--steps", "80", "--warmup", "1", "--layers", "2", "--hidden", "128", "--heads", "2",
                       "--intermediate", "128", "--vocab", "32", "--lr", "5e-4", "--json", str(out)]) == 0
    losses = json.loads(out.read_text())["runs"][0]["losses"]
    chance = math.log(31)
    assert abs(losses[0] - chance) < 0.3
    last = sum(losses[-10:]) / 10
    assert last < 0.7 * chance, (losses[0], last)

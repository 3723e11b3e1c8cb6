"""cuDNN's ragged SDPA as a bench peer, on the CPU: the keywords it is called with, the masks it
cannot express, and what happens when its module is not installed (``mla-cupy bench`` and
``benchmarks/ab.py``). Its GPU rows: ``tests/test_gpu_bench.py`` and ``gpu.sh --wheels DIR bench``."""
import math
import sys
from dataclasses import dataclass

import pytest
from _scripts import load_script

from mla_cupy import bench
from mla_cupy.masks import ChunkedMask

def _ab():
    return load_script("benchmarks/ab.py", "ab_tool")


def test_causal_keywords_are_bottom_right_with_the_longest_sequences():
    kw = bench.cudnn_ragged_args(bench.DEFAULT_CASES["1024+ctx8192"])
    assert kw == dict(is_causal=True, causal_bottom_right=True, scale=1 / math.sqrt(192), max_seqlen_q=1024,
                      max_seqlen_kv=9216)
    kw = bench.cudnn_ragged_args(bench.DEFAULT_CASES["ragged"])
    assert kw["max_seqlen_q"] == kw["max_seqlen_kv"] == 4096 and kw["is_causal"]


def test_non_causal_keywords():
    kw = bench.cudnn_ragged_args(bench.DEFAULT_CASES["noncausal-1x4096"])
    assert kw["is_causal"] is False and "causal_bottom_right" not in kw


@dataclass(frozen=True)
class _ChunkedCase(bench.BenchCase):
    @property
    def mask(self):
        return ChunkedMask(64)


@pytest.mark.parametrize("case, reason", [
    (bench.BenchCase("more-q", (300, 100), (200, 100)), "more queries than keys"),
    (_ChunkedCase("chunked", (128,), (128,)), "no ChunkedMask"),
])
def test_masks_it_cannot_express_are_refused(case, reason):
    with pytest.raises(ValueError, match=reason):
        bench.cudnn_ragged_args(case)
    with pytest.raises(ValueError, match=reason):  # before any tensor is built
        bench.cudnn_ragged_fn(case, lambda *a, **k: None, "cpu")


def test_missing_frontend_leaves_the_rows_out_with_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn fails
    assert bench.cudnn_sdpa_function() is None
    monkeypatch.setattr(bench, "_said", set())
    run = bench.CaseRun(bench.DEFAULT_CASES["ragged"], [], reps=1)
    assert bench.bench_cudnn_ragged(run) == [] and bench.bench_cudnn_ragged(run) == []
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "cudnn-ragged" in err[0] and "nvidia-cudnn-frontend" in err[0] and "--wheels" in err[0]


def test_a_skipped_row_says_why_in_the_table():
    row = bench.Row("c", "cudnn-ragged", float("nan"), float("nan"), note="skipped: cuDNN's ragged SDPA has no X")
    from dataclasses import asdict

    text = bench.format_table({"device": "d", "matmul_tflops": None, "rows": [asdict(row)]})
    assert "c/cudnn-ragged: skipped: cuDNN's ragged SDPA has no X" in text


def test_ab_leaves_out_what_cannot_run(monkeypatch):
    ab = _ab()
    assert {"cudnn-ragged", "cudnn-ragged+kbuild", "cudnn", "cudnn+kbuild"} <= set(ab.FACTORIES)
    monkeypatch.setattr(bench, "cudnn_sdpa_function", lambda: None)
    with pytest.raises(ab.LeftOut, match="nvidia-cudnn-frontend"):
        ab.FACTORIES["cudnn-ragged"](bench.DEFAULT_CASES["ragged"], [], {})
    monkeypatch.setattr(bench, "cudnn_sdpa_function", lambda: (lambda *a, **k: None))
    with pytest.raises(ab.LeftOut, match="no ChunkedMask"):
        ab.FACTORIES["cudnn-ragged+kbuild"](_ChunkedCase("chunked", (128,), (128,)), [], {})

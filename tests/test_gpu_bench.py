"""The benchmark on a real GPU: one small case, our kernel and at least one peer (pytest -m gpu)."""
import math

import pytest

pytestmark = pytest.mark.gpu


def test_bench_one_case_with_a_peer():
    pytest.importorskip("torch")
    from mla_cupy import bench

    case = bench.BenchCase("gpu-test", (256, 100), (256, 300), heads=16)
    res = bench.run([case], peers=True, reps=3, progress=False)
    rows = {r["impl"]: r for r in res["rows"]}
    ours = rows["mla_cupy"]
    assert ours["ms"] > 0 and ours["rel_err"] < 1e-2
    assert math.isclose(ours["tflops"], case.flops() / ours["ms"] / 1e9)
    peers = [r for r in res["rows"] if r["impl"] in ("cudnn-sdpa", "sdpa-fallback", "flex") and r["ms"] == r["ms"]]
    assert peers, [r["note"] for r in res["rows"]]
    assert res["matmul_tflops"] > 10
    assert any(k in ours["ratios"] for k in ("cudnn-sdpa", "flex", "sdpa-fallback"))
    text = bench.format_table(res)
    assert "gpu-test" in text and "mla_cupy" in text

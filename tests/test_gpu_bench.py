"""The benchmark on a real GPU: one small case, our kernel and the peers, fp8 rows, host time per call
(pytest -m gpu)."""
import importlib.util
import math

import pytest
from _scripts import load_script  # noqa: F401  (puts benchmarks/ on sys.path)

import peers

pytestmark = pytest.mark.gpu

CASE_ARGS = ("gpu-test", (256, 100), (256, 300))  # ragged, the second sequence after 200 keys of context


def _case(heads=16):
    from mla_cupy import bench

    return bench.BenchCase(*CASE_ARGS, heads=heads)


def _is_hopper():
    import cupy

    return cupy.cuda.Device().compute_capability == "90"


def test_bench_one_case_with_a_peer():
    pytest.importorskip("torch")
    from mla_cupy import bench

    case = _case()
    res = bench.run([case], builders=peers.PEER_ROWS, reps=3, progress=False)
    rows = {r["impl"]: r for r in res["rows"]}
    ours = rows["mla_cupy"]
    assert ours["ms"] > 0 and ours["rel_err"] < 1e-2
    assert math.isclose(ours["tflops"], case.flops() / ours["ms"] / 1e9)
    ran = [r for r in res["rows"] if r["impl"] in ("cudnn-sdpa", "sdpa-fallback", "flex") and r["ms"] == r["ms"]]
    assert ran, [r["note"] for r in res["rows"]]
    for r in ran:  # every peer that ran is checked against the same float64 reference
        assert r["rel_err"] is not None and r["rel_err"] < 2e-2, r
    assert res["matmul_tflops"] > 10
    assert any(k in ours["ratios"] for k in ("cudnn-sdpa", "flex", "sdpa-fallback"))
    text = bench.format_table(res)
    assert "gpu-test" in text and "mla_cupy" in text


def _check_peer_rows(rows, impl):
    """A 16-bit peer's two rows (kernel, and with the K build) of one case, by impl name: timed,
    within bf16 accuracy of the reference, and its ratio on our row."""
    assert impl in rows and impl + "+kbuild" in rows, [r["note"] for r in rows.values()]
    peer, full = rows[impl], rows[impl + "+kbuild"]
    assert peer["ms"] > 0 and peer["rel_err"] < 2e-2, peer
    assert full["ms"] > peer["ms"] and full["rel_err"] == peer["rel_err"]
    assert math.isclose(rows["mla_cupy"]["ratios"][impl], peer["ms"] / rows["mla_cupy"]["ms"])


def test_bench_fa3_rows_when_importable():
    pytest.importorskip("torch")
    from mla_cupy import bench

    if peers.fa3_function() is None:
        pytest.skip("FlashAttention-3 (fa3_fwd_interface or flash_attn_interface) is not importable")
    case = _case()
    res = bench.run([case], builders=peers.PEER_ROWS, reps=3, progress=False)
    _check_peer_rows({r["impl"]: r for r in res["rows"]}, "fa3")


def test_bench_cudnn_ragged_rows_when_importable():
    """cuDNN's ragged SDPA (nvidia-cudnn-frontend), one call per batch, causal (bottom-right: the
    second sequence comes after 200 keys of context) and not, checked against the same reference."""
    pytest.importorskip("torch")
    from mla_cupy import bench

    if peers.cudnn_sdpa_function() is None:
        pytest.skip("the cuDNN frontend (module cudnn) is not importable: " + peers.CUDNN_FRONTEND_HINT)
    cases = [_case(), bench.BenchCase("gpu-test-noncausal", *CASE_ARGS[1:], heads=16, causal=False)]
    res = bench.run(cases, builders=peers.PEER_ROWS, reps=3, progress=False)
    for case in cases:
        rows = {r["impl"]: r for r in res["rows"] if r["case"] == case.name}
        _check_peer_rows(rows, "cudnn-ragged")
        assert "cudnn-sdpa" in rows  # the per-sequence torch SDPA rows keep their name


def test_bench_fp8_rows():
    """Ours per token (Hopper), FA3 e4m3 and cuDNN's fp8 graph when importable, each with both error
    columns."""
    pytest.importorskip("torch")
    if not _is_hopper():
        pytest.skip("the fp8 kernel runs on Hopper")
    from mla_cupy import bench

    case = _case()
    res = bench.run([case], builders=peers.PEER_ROWS + peers.FP8_PEER_ROWS, fp8=True, reps=3, progress=False)
    rows = {r["impl"]: r for r in res["rows"]}
    ours = rows["mla_cupy-fp8"]
    assert ours["group"] == "fp8" and ours["ms"] > 0, ours
    assert ours["rel_err"] < 6e-2 and ours["err_vs_16bit"] < 1e-1, ours
    assert ours["err_vs_16bit"] != ours["rel_err"]  # two references: dequantized and unquantized inputs
    assert "fa3-fp8" not in rows["mla_cupy"]["ratios"]  # 16-bit rows are compared with 16-bit peers only
    e4m3 = rows["mla_cupy-fp8-e4m3"]  # the all-e4m3 mode, compared with the first fp8 row
    assert e4m3["ms"] > 0 and e4m3["rel_err"] < 6e-2 and e4m3["err_vs_16bit"] < 1e-1, e4m3
    assert math.isclose(ours["ratios"]["mla_cupy-fp8-e4m3"], e4m3["ms"] / ours["ms"])
    if peers.fa3_function() is not None:
        fa3 = rows["fa3-fp8"]
        assert fa3["ms"] > 0 and fa3["rel_err"] < 6e-2 and fa3["err_vs_16bit"] < 1e-1, fa3
        assert math.isclose(ours["ratios"]["fa3-fp8"], fa3["ms"] / ours["ms"])
    if peers.cudnn_sdpa_function() is not None:  # cuDNN's fp8 graph: checked where this cuDNN runs it
        cud = rows["cudnn-fp8"]
        if cud["ms"] == cud["ms"]:
            assert cud["rel_err"] < 6e-2 and cud["err_vs_16bit"] < 1e-1, cud
            assert math.isclose(ours["ratios"]["cudnn-fp8"], cud["ms"] / ours["ms"])
        else:
            assert cud["note"].startswith("failed: "), cud  # the frontend's reason, in the table
    text = bench.format_table(res)
    assert "err vs 16-bit" in text and "mla_cupy-fp8" in text


def test_fp8_error_sees_a_wrong_output():
    """The accuracy column can fail: a perturbed output of one slice raises the worst error."""
    import cupy as cp

    from mla_cupy import bench, mla_prefill

    case = _case(heads=4)
    run = bench.CaseRun(case, [bench.make_inputs(case, 0)], reps=1)
    x = run.sets[0]
    out = mla_prefill(x["q"], x["k"], x["v"], x["k_rope"], x["valid_length"], x["cache_row_offsets"], mask=case.mask)
    good = run.error(out)
    assert good < 1e-2
    bad = out.copy()
    bad[256:, case.heads - 1] = bad[256:, case.heads - 1] * 1.1  # the last head of the second sequence, 10% off
    assert 0.05 < run.error(bad) < 0.2
    bad[0, 0, 0] = cp.nan
    assert math.isnan(run.error(bad))


def test_e4m3_decode_matches_ml_dtypes():
    import cupy as cp
    import numpy as np

    from mla_cupy import bench
    from mla_cupy._arrays import FP8_E4M3

    vals = np.array([0.0, 1.0, -2.5, 448.0, 0.015625, -0.001953125], np.float32).astype(FP8_E4M3)
    got = cp.asnumpy(bench.e4m3_to_f64(cp.asarray(vals.view(np.uint8))))
    np.testing.assert_array_equal(got, vals.astype(np.float64))


def test_bench_host_rows():
    """``mla-cupy bench --host`` on this GPU: every call of ours is timed (the torch rows when torch
    imports), each peer is timed or said to be left out, and a plan's run costs the host less than
    a one-shot call that reads the offsets back."""
    from mla_cupy import bench_host

    res = bench_host.run(calls=20, reps=3, peers=peers.host_peer_calls)
    rows = {r["impl"]: r for r in res["rows"]}
    ours = ["plan.run (CuPy)", "mla_prefill, q_max_seq_len= validate=False (CuPy)",
            "mla_prefill, default arguments (CuPy)"]
    has_torch = importlib.util.find_spec("torch") is not None
    if has_torch:
        ours += ["plan.run (torch)", "mla_prefill, q_max_seq_len= validate=False (torch)",
                 "mla_prefill, default arguments (torch)", "torch_ops.mla_prefill, q_max_seq_len= validate=False",
                 "flash_attn.flash_attn_varlen_func, k_rope="]
    else:
        assert any(line.startswith("torch rows left out") for line in res["left_out"])
    for name in ours:
        r = rows[name]
        assert r["group"] == "ours" and len(r["samples"]) == 3 and 0 < r["us_min"] <= r["us"] <= r["us_max"], r
    for r in rows.values():
        assert r["us"] > 0 or r["note"].startswith("failed"), r
    peer_rows = [r for r in rows.values() if r["group"] == "peer"]
    said = sum(line.startswith(("FA3", "cuDNN")) for line in res["left_out"])
    assert len(peer_rows) + said == (2 if has_torch else 0), res["left_out"]  # each peer: a row or a line
    assert rows["plan.run (CuPy)"]["us"] < rows["mla_prefill, default arguments (CuPy)"]["us"]
    text = bench_host.format_table(res)
    assert text.splitlines()[0].startswith(f"device: {res['device']}  host time per call: Sq=1x64 Sk=1x64 H=16")

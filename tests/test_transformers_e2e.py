"""benchmarks/transformers_e2e.py without a GPU: its options and model configuration, ``--help``
without torch or CuPy, and (with torch and transformers) the whole run on a tiny configuration on
the CPU: the agreement check, a backend out of memory, a disagreement that stops it before timing."""
import json
import subprocess
import sys

import pytest
from _scripts import ROOT, load_script

SCRIPT = ROOT / "benchmarks" / "transformers_e2e.py"


@pytest.fixture(scope="module")
def e2e():
    return load_script("benchmarks/transformers_e2e.py", "transformers_e2e")


def test_defaults_are_deepseek_v3_attention_at_1k_4k_16k(e2e):
    args = e2e.parse_args([])
    assert args.tokens == [1024, 4096, 16384] and args.impls == ["mla_cupy", "sdpa", "eager"]
    assert args.reference == "sdpa" and args.device == "cuda" and args.dtype == "bfloat16"
    cfg = e2e.model_config(args)
    assert {k: cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "q_lora_rank",
                                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")} == dict(
        hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    assert cfg["num_hidden_layers"] == cfg["first_k_dense_replace"] == 4  # dense layers only: no experts
    assert cfg["intermediate_size"] == 2048 and cfg["max_position_embeddings"] == 16384


def test_options(e2e):
    args = e2e.parse_args(["--tokens", "64, 128", "--impls", "mla_cupy,eager", "--reference", "eager", "--layers", "2",
                           "--heads", "16", "--rounds", "3", "--json", "x.json"])
    assert (args.tokens, args.impls, args.rounds, args.json_path) == ([64, 128], ["mla_cupy", "eager"], 3, "x.json")
    cfg = e2e.model_config(args)
    assert cfg["num_attention_heads"] == 16 and cfg["num_hidden_layers"] == 2 and cfg["max_position_embeddings"] == 128
    for bad in (["--impls", "flash_attention_2"], ["--impls", "mla_cupy,eager"], ["--tokens", "0"], ["--layers", "0"]):
        with pytest.raises(SystemExit) as exc:
            e2e.parse_args(bad)
        assert exc.value.code == 2, bad


def test_help_needs_neither_torch_nor_cupy():
    code = ("import runpy, sys\n"
            f"sys.argv = ['transformers_e2e.py', '--help']\n"
            "try:\n"
            f"    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
            "except SystemExit as exc:\n"
            "    assert exc.code == 0, exc.code\n"
            "assert 'torch' not in sys.modules and 'cupy' not in sys.modules and 'transformers' not in sys.modules\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "DeepSeek-V3-shaped model" in res.stdout and "--tokens" in res.stdout


TINY = ["--device", "cpu", "--dtype", "float32", "--tokens", "12", "--layers", "1", "--heads", "2", "--hidden", "64",
        "--intermediate", "64", "--vocab", "64", "--rounds", "1"]


def _with_transformers():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")


def test_runs_end_to_end_on_the_cpu(e2e, tmp_path, capsys):
    _with_transformers()
    path = tmp_path / "e2e.json"
    assert e2e.main(TINY + ["--json", str(path)]) == 0
    res = json.loads(path.read_text())
    assert [(r["tokens"], r["impl"], r["status"]) for r in res["results"]] == [
        (12, "mla_cupy", "ok"), (12, "sdpa", "ok"), (12, "eager", "ok")]
    for r in res["results"]:
        assert r["ms"] > 0 and len(r["ms_all"]) == 1 and r["err_vs_reference"] <= r["bound"] and r["bound"] >= 2e-2
    assert res["results"][1]["err_vs_reference"] == 0  # sdpa is the reference
    assert res["config"]["qk_rope_head_dim"] == 64 and res["device"] == "cpu"
    assert capsys.readouterr().out.splitlines()[0].startswith("cpu, float32: 1 layers, hidden 64, H = 2")


@pytest.mark.parametrize("short", ["eager", "sdpa"])
def test_a_backend_out_of_memory_is_recorded_and_not_timed(e2e, monkeypatch, short):
    """Eager out of memory (as at 16k tokens): recorded, not timed. The reference (sdpa) out of
    memory: the first backend that ran (mla_cupy) is that length's reference."""
    _with_transformers()
    import torch
    from transformers import AttentionInterface
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    if short == "eager":
        monkeypatch.setattr(ds, "eager_attention_forward", out_of_memory)
    else:
        monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", out_of_memory)
    res = e2e.run(e2e.parse_args(TINY))
    rows = {r["impl"]: r for r in res["results"]}
    assert rows[short]["status"] == "out of memory" and rows[short]["ms"] is None and rows[short]["ms_all"] == []
    assert rows[short]["err_vs_reference"] is None
    ran = [r for r in rows.values() if r["impl"] != short]
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in ran)
    assert {r["reference"] for r in rows.values()} == {"sdpa" if short == "eager" else "mla_cupy"}
    assert "out of memory" in e2e.format_table(res)


def test_a_disagreement_stops_before_timing(e2e, tmp_path):
    _with_transformers()
    path = tmp_path / "e2e.json"
    with pytest.raises(SystemExit, match=r"at 12 tokens \{'mla_cupy': .*\} differ from sdpa by more than 1e-12"):
        e2e.main(TINY + ["--impls", "mla_cupy,sdpa", "--tol", "1e-12", "--json", str(path)])
    assert not path.exists()


def test_without_a_gpu_says_how_to_check_the_script(e2e):
    _with_transformers()
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    with pytest.raises(SystemExit, match=r"no CUDA device .*--device cpu with a small --hidden / --heads"):
        e2e.run(e2e.parse_args(["--tokens", "16"]))

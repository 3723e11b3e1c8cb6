"""cuDNN's ragged SDPA and its fp8 graph as bench peers (``benchmarks/peers.py``), on the CPU: the
keywords and graph they are called with (the fp8 graph against a recording stand-in of the
frontend), the masks they cannot express, and what happens when the module is not installed
(``benchmarks/matrix.py`` and ``benchmarks/ab.py``). Its GPU rows: ``tests/test_gpu_bench.py`` and
``gpu.sh --wheels DIR bench``."""
import math
import sys
from dataclasses import dataclass

import pytest
from _scripts import load_script

from mla_cupy import bench
from mla_cupy.masks import ChunkedMask

import peers  # noqa: E402  (benchmarks/, put on sys.path by _scripts)

def _ab():
    return load_script("benchmarks/ab.py", "ab_tool")


def test_causal_keywords_are_bottom_right_with_the_longest_sequences():
    kw = peers.cudnn_ragged_args(bench.DEFAULT_CASES["1024+ctx8192"])
    assert kw == dict(is_causal=True, causal_bottom_right=True, scale=1 / math.sqrt(192), max_seqlen_q=1024,
                      max_seqlen_kv=9216)
    kw = peers.cudnn_ragged_args(bench.DEFAULT_CASES["ragged"])
    assert kw["max_seqlen_q"] == kw["max_seqlen_kv"] == 4096 and kw["is_causal"]


def test_non_causal_keywords():
    kw = peers.cudnn_ragged_args(bench.DEFAULT_CASES["noncausal-1x4096"])
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
        peers.cudnn_ragged_args(case)
    with pytest.raises(ValueError, match=reason):  # before any tensor is built
        peers.cudnn_ragged_fn(case, lambda *a, **k: None, "cpu")


def test_missing_frontend_leaves_the_rows_out_with_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn fails
    assert peers.cudnn_sdpa_function() is None
    monkeypatch.setattr(peers, "_said", set())
    run = bench.CaseRun(bench.DEFAULT_CASES["ragged"], [], reps=1)
    assert peers.bench_cudnn_ragged(run) == [] and peers.bench_cudnn_ragged(run) == []
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
    monkeypatch.setattr(peers, "cudnn_sdpa_function", lambda: None)
    with pytest.raises(ab.LeftOut, match="nvidia-cudnn-frontend"):
        ab.FACTORIES["cudnn-ragged"](bench.DEFAULT_CASES["ragged"], [], {})
    monkeypatch.setattr(peers, "cudnn_sdpa_function", lambda: (lambda *a, **k: None))
    with pytest.raises(ab.LeftOut, match="no ChunkedMask"):
        ab.FACTORIES["cudnn-ragged+kbuild"](_ChunkedCase("chunked", (128,), (128,)), [], {})


class _FakeTensor:
    """A graph tensor of the fake frontend: what the graph set on it."""

    def __init__(self, **attrs):
        self.attrs = dict(attrs)

    def __getattr__(self, name):
        if not name.startswith("set_"):
            raise AttributeError(name)

        def setter(value):
            self.attrs[name[4:]] = value
            return self

        return setter


class _FakeFrontend:
    """Enough of the cuDNN frontend's graph API to record what cudnn_fp8_fn builds and executes."""

    class data_type:  # noqa: N801 (the frontend's spelling)
        FP8_E4M3, FLOAT, BFLOAT16, INT32, INT64 = "e4m3", "float", "bf16", "int32", "int64"

    class heur_mode:  # noqa: N801
        A, FALLBACK = "A", "FALLBACK"

    def __init__(self):
        self.graphs, self.executed, self.streams = [], [], []
        frontend = self

        class Graph:
            def __init__(self, **kw):
                self.kw, self.tensors, self.steps, self.sdpa = kw, {}, [], None
                frontend.graphs.append(self)

            def tensor(self, uid, **kw):
                self.tensors[uid] = _FakeTensor(uid=uid, **kw)
                return self.tensors[uid]

            def sdpa_fp8(self, **kw):
                self.sdpa = kw
                self.o, self.amax_o = _FakeTensor(), _FakeTensor()
                return self.o, None, _FakeTensor(), self.amax_o

            def __getattr__(self, step):  # validate, build_operation_graph, ...
                return lambda *a: self.steps.append(step)

            def get_workspace_size(self):
                return 64

            def execute(self, pack, workspace, handle):
                frontend.executed.append(pack)

        self.pygraph = Graph

    def create_handle(self):
        return "handle"

    def set_stream(self, handle, stream):
        self.streams.append(stream)


@pytest.fixture
def fake_cudnn(monkeypatch):
    torch = pytest.importorskip("torch")
    fe = _FakeFrontend()
    monkeypatch.setitem(sys.modules, "cudnn", fe)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: type("S", (), {"cuda_stream": 7})())
    return fe


def test_cudnn_fp8_graph_of_a_ragged_causal_batch(fake_cudnn):
    import torch

    case = bench.BenchCase("r", (3, 5), (4, 6), heads=2, causal=True)
    attn = peers.cudnn_fp8_fn(case, "cpu")
    (g,) = fake_cudnn.graphs
    assert g.kw == dict(io_data_type="e4m3", intermediate_data_type="float", compute_data_type="float")
    t = {u: x.attrs for u, x in g.tensors.items()}
    uid = peers._CUDNN_FP8_UIDS
    # rows [T, H, D] as (b, h, s_max, d), every sequence's rows located by its ragged offset
    assert t[uid["q"]]["dim"] == (2, 2, 5, 192) and t[uid["q"]]["stride"] == (5 * 2 * 192, 192, 2 * 192, 1)
    assert t[uid["k"]]["dim"] == (2, 2, 6, 192) and t[uid["v"]]["dim"] == (2, 2, 6, 128)
    assert t[uid["q"]]["ragged_offset"] is g.tensors[uid["q_off"]]
    assert t[uid["v"]]["ragged_offset"] is g.tensors[uid["v_off"]]
    assert g.o.attrs["ragged_offset"] is g.tensors[uid["o_off"]]
    assert g.o.attrs["data_type"] == "bf16" and g.o.attrs["dim"] == (2, 2, 5, 128) and g.o.attrs["output"]
    kw = g.sdpa
    assert kw["use_causal_mask_bottom_right"] is True and kw["use_padding_mask"] is True
    assert kw["generate_stats"] is False and kw["attn_scale"] == pytest.approx(192 ** -0.5)
    assert kw["seq_len_q"] is g.tensors[uid["q_len"]] and kw["seq_len_kv"] is g.tensors[uid["kv_len"]]
    assert g.steps == ["validate", "build_operation_graph", "create_execution_plans", "check_support", "build_plans"]

    q8, k8, v8, out = (torch.zeros(n, 2, d) for n, d in ((8, 192), (10, 192), (10, 128), (8, 128)))
    ds = [torch.full((1, 1, 1, 1), x) for x in (0.5, 0.25, 2.0)]
    assert attn(q8, k8, v8, *ds, out) is out
    (pack,) = fake_cudnn.executed
    assert fake_cudnn.streams == [7]
    assert pack[uid["q"]] is q8 and pack[uid["o"]] is out and pack[uid["k_descale"]] is ds[1]
    assert pack[uid["q_len"]].flatten().tolist() == [3, 5] and pack[uid["kv_len"]].flatten().tolist() == [4, 6]
    assert pack[uid["q_off"]].flatten().tolist() == [0, 3 * 2 * 192, 8 * 2 * 192]
    assert pack[uid["k_off"]].flatten().tolist() == [0, 4 * 2 * 192, 10 * 2 * 192]
    assert pack[uid["v_off"]].flatten().tolist() == [0, 4 * 2 * 128, 10 * 2 * 128]
    assert pack[uid["o_off"]].flatten().tolist() == [0, 3 * 2 * 128, 8 * 2 * 128]
    assert float(pack[uid["s_scale"]]) == 448.0 and float(pack[uid["s_descale"]]) == pytest.approx(1 / 448)
    assert float(pack[uid["o_scale"]]) == 1.0
    assert set(pack) == set(t) | {uid["o"], uid["o_amax"]}, "every graph tensor is given"


def test_cudnn_fp8_graph_of_equal_lengths_has_no_ragged_layout(fake_cudnn):
    case = bench.BenchCase("4x8", (8,) * 4, (8,) * 4, heads=2, causal=False)
    peers.cudnn_fp8_fn(case, "cpu")
    (g,) = fake_cudnn.graphs
    assert "ragged_offset" not in g.tensors[peers._CUDNN_FP8_UIDS["q"]].attrs
    assert "use_padding_mask" not in g.sdpa and "use_causal_mask_bottom_right" not in g.sdpa
    assert g.tensors[peers._CUDNN_FP8_UIDS["q"]].attrs["dim"] == (4, 2, 8, 192)


def test_cudnn_fp8_refuses_masks_before_the_frontend(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", None)
    with pytest.raises(ValueError, match="no ChunkedMask"):
        peers.cudnn_fp8_fn(_ChunkedCase("chunked", (128,), (128,)), "cpu")


def test_per_tensor_quantization_maps_the_largest_value_to_448():
    torch = pytest.importorskip("torch")
    x = torch.randn(6, 2, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x8, d = peers.quantize_per_tensor(x)
    assert x8.dtype == torch.float8_e4m3fn and tuple(d.shape) == (1, 1, 1, 1)
    assert float(x8.float().abs().max()) == 448.0
    assert float(d) == pytest.approx(float(x.float().abs().max()) / 448)
    assert float((x8.float() * d - x.float()).abs().max() / x.float().abs().max()) < 2 ** -3
    z8, zd = peers.quantize_per_tensor(torch.zeros(3, 1, 4))
    assert float(zd) == 1.0 and not z8.float().any()


def test_cudnn_fp8_call_gives_the_graph_each_sets_inputs_and_descales():
    torch = pytest.importorskip("torch")
    case = bench.BenchCase("r", (3, 5), (4, 6), heads=2, causal=True)
    g = torch.Generator().manual_seed(2)
    sets = [[torch.randn(n, 2, d, generator=g) for n, d in ((8, 192), (10, 192), (10, 128))] for _ in range(2)]
    q8, k8, v8 = peers.quantize_inputs(case, *zip(*sets), per_tensor=True)
    assert all(tuple(d.shape) == (1, 1, 1, 1) for x in (q8, k8, v8) for _, d in x)
    seen = []
    call = peers.cudnn_fp8_call(case, lambda *a: seen.append(a) or a[-1], q8, k8, v8)
    out = call(1)
    (a,) = seen
    assert all(x is y for x, y in zip(a[:6], (q8[1][0], k8[1][0], v8[1][0], q8[1][1], k8[1][1], v8[1][1])))
    assert out is a[6] and tuple(out.shape) == (8, 2, 128) and out.dtype == torch.bfloat16
    assert call(0) is not out  # an output of each set's own

"""The torch entry points without a GPU (tests/_fake_gpu.py: the device stubbed, torch CPU tensors
posing as CUDA tensors): in eager execution ``mla_cupy.torch_ops``' functions run the ops' CUDA
implementation without the dispatcher, and launch what the registered op and the Python API
launch; under a dispatch mode, tracing or ``torch.compile`` they go through the registered op;
the eager call keeps what CUDA-graph capture needs (torch's stream, torch's allocator, no
device-to-host read)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mla_cupy  # noqa: E402
from mla_cupy import plan_cache_clear  # noqa: E402
from mla_cupy.masks import CausalMask  # noqa: E402

from _cases import BF16, make_case  # noqa: E402
from _fake_gpu import fake_gpu, torch_as_cuda  # noqa: E402

ops = pytest.importorskip("mla_cupy.torch_ops")
fa = pytest.importorskip("mla_cupy.flash_attn")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

FAST = dict(q_max_seq_len=5, validate=False)


@pytest.fixture
def gpu():
    plan_cache_clear()
    with fake_gpu("90") as g, torch_as_cuda():
        yield g
    plan_cache_clear()


def tensors(sq=(5, 3), sk=(6, 3), heads=4, seed=0):
    """A problem's tensors (bfloat16 data, int32 offsets) with an output buffer."""
    c = make_case(list(sq), list(sk), heads, BF16, seed=seed)
    t = {n: torch.from_numpy(np.ascontiguousarray(getattr(c, n)).view(np.int16)).view(torch.bfloat16)
         for n in ("q", "k", "v", "k_rope")}
    t.update({n: torch.from_numpy(np.asarray(getattr(c, n), np.int32)) for n in ("valid_length", "cache_row_offsets")})
    t["out"] = torch.zeros((sum(sq), heads, 128), dtype=torch.bfloat16)
    return t


def args(t):
    return tuple(t[n] for n in ("q", "k", "v", "k_rope", "valid_length", "cache_row_offsets"))


class Recorder(TorchDispatchMode):
    """Records the ops dispatched; runs them."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def direct(monkeypatch):
    """Counts the calls that run the ops' CUDA implementation without the dispatcher."""
    calls = []
    impl = ops._prefill_cuda
    monkeypatch.setattr(ops, "_prefill_cuda", lambda *a, **kw: calls.append(a[0]) or impl(*a, **kw))
    return calls


def last_launch(gpu):
    _, stream, raw = gpu.launches[-1]
    return stream, raw


def test_eager_calls_skip_the_dispatcher_and_launch_what_the_op_launches(gpu, direct):
    t = tensors()
    with Recorder() as rec:  # a dispatch mode: the registered op runs
        assert ops.mla_prefill(*args(t), out=t["out"], **FAST) is t["out"]
    assert "mla_cupy.mla_prefill_out.default" in rec.seen and direct == []
    via_op = last_launch(gpu)
    assert ops.mla_prefill(*args(t), out=t["out"], **FAST) is t["out"]
    assert direct == [False] and last_launch(gpu) == via_op
    mla_cupy.mla_prefill(*args(t), out=t["out"], mask=CausalMask(), **FAST)
    assert last_launch(gpu) == via_op
    assert mla_cupy.plan_cache_info().hits == 2


def test_eager_functional_call_allocates_through_torch(gpu, direct):
    t = tensors()
    o, lse = ops.mla_prefill(*args(t), return_lse=True, **FAST)
    assert direct == [False]
    assert type(o) is torch.Tensor and o.shape == (8, 4, 128) and o.dtype == torch.bfloat16
    assert type(lse) is torch.Tensor and lse.shape == (8, 4) and lse.dtype == torch.float32
    assert gpu.values()["out"] == o.data_ptr() and gpu.values()["lse"] == lse.data_ptr()
    o32 = ops.mla_prefill(*args(t), out_dtype=torch.float32, **FAST)
    assert o32.dtype == torch.float32 and gpu.values()["out"] == o32.data_ptr()


def test_eager_calls_keep_what_graph_capture_needs(gpu, monkeypatch):
    """torch's current stream, no device-to-host read with ``q_max_seq_len`` and ``validate=False``
    (a read makes exactly one synchronization otherwise)."""
    import mla_cupy._arrays as arrays

    monkeypatch.setattr(arrays, "_TORCH_STREAM", [lambda: 0x6000])
    t = tensors()
    for _ in range(2):
        n = gpu.syncs
        ops.mla_prefill(*args(t), out=t["out"], **FAST)
        assert gpu.syncs == n and last_launch(gpu)[0] == 0x6000
        fa.flash_attn_varlen_func(t["q"], t["k"], t["v"], t["valid_length"], t["cache_row_offsets"], 5, 6,
                                  causal=True, k_rope=t["k_rope"], out=t["out"])
        assert gpu.syncs == n and last_launch(gpu)[0] == 0x6000
        ops.mla_prefill(*args(t), out=t["out"])
        assert gpu.syncs == n + 1


def test_an_in_place_eager_call_bumps_the_versions_of_what_it_writes(gpu):
    t = tensors()
    lse = torch.zeros((8, 4), dtype=torch.float32)
    before = (t["out"]._version, lse._version)
    ops.mla_prefill(*args(t), out=t["out"], lse=lse, **FAST)
    assert (t["out"]._version, lse._version) == (before[0] + 1, before[1] + 1)


def test_bad_input_hears_the_same_error_on_both_routes(gpu, direct):
    t = tensors()
    bad = dict(t, q=t["q"][:, :, :128])
    msgs = []
    for route in (Recorder, None):
        with pytest.raises(ValueError) as e:
            if route is None:
                ops.mla_prefill(*args(bad), out=t["out"], **FAST)
            else:
                with route():
                    ops.mla_prefill(*args(bad), out=t["out"], **FAST)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and msgs[0].startswith("q: expected head size Dqk = 192") and direct == [False]


def test_the_op_route_is_taken_whenever_something_else_would_see_the_op(gpu, direct):
    t = tensors()
    plain = args(t) + (t["out"],)
    assert ops.eager_cuda(plain)
    assert not ops.eager_cuda(plain + (torch.nn.Parameter(torch.zeros(2)),))  # a tensor subclass
    grad = torch.zeros((8, 4, 128), requires_grad=True)
    assert not ops.eager_cuda(plain + (grad,))
    with torch.no_grad():
        assert ops.eager_cuda(plain + (grad,))
    with Recorder():
        assert not ops.eager_cuda(plain)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert not ops.eager_cuda(plain)
    seen = []
    torch.vmap(lambda x: seen.append(ops.eager_cuda((x,))) or x)(torch.zeros(2, 3))
    assert seen == [False]

    def backend(gm, example_inputs):
        return gm.forward

    traced = torch.compile(lambda x: x + int(ops.eager_cuda((x,))), fullgraph=True, backend=backend)
    assert traced(torch.zeros(2)).tolist() == [0.0, 0.0]  # while compiling: the op route
    assert direct == []


def fp8_tensors(e4m3_rope=False):
    """The fp8 per-token inputs of tensors() (uint8 e4m3 bytes, bfloat16 or e4m3 rope parts), and
    the quantizer's V^T for its offsets (a TransposedV over tensors, naming its offsets tensor)."""
    from mla_cupy import quant
    from mla_cupy.fp8 import TransposedV

    t = tensors()
    c = make_case([5, 3], [6, 3], 4, BF16, seed=0)
    f = quant.quantize_per_token(c.q, c.k, c.v, c.k_rope, e4m3_rope=e4m3_rope,
                                 cache_row_offsets=t["cache_row_offsets"])

    def tensor(x):
        x = np.ascontiguousarray(x)
        return torch.from_numpy(x.view(np.uint8) if x.dtype.itemsize == 1 else
                                (x.view(np.int16) if x.dtype == BF16 else x)).view(
            torch.bfloat16 if x.dtype == BF16 else (torch.uint8 if x.dtype.itemsize == 1 else torch.float32))

    a = [tensor(f[n]) for n in ("q_nope", "q_rope", "q_scale", "k", "k_scales", "v", "k_rope")]
    tv = f["v_t"]
    assert tv.cache_row_offsets is t["cache_row_offsets"]
    return t, a, TransposedV(torch.from_numpy(tv.data), tv.cache_row_offsets, tv.num_keys)


@pytest.mark.parametrize("e4m3_rope", [False, True], ids=["bf16-rope", "e4m3-rope"])
def test_fp8_op_given_vt_launches_the_kernel_alone_on_both_routes(gpu, direct, e4m3_rope):
    """A TransposedV as v: the op gets its data and its offsets (vt_offsets), and launches the
    attention kernel alone, eagerly and through the dispatcher alike."""
    t, a, tv = fp8_tensors(e4m3_rope)
    offs = (t["valid_length"], t["cache_row_offsets"])
    for route in (Recorder, None):
        n = len(gpu.launches)
        if route is None:
            ops.mla_prefill_fp8(*a[:5], tv, a[6], *offs, out=t["out"], **FAST)
        else:
            with route() as rec:
                ops.mla_prefill_fp8(*a[:5], tv, a[6], *offs, out=t["out"], **FAST)
            assert "mla_cupy.mla_prefill_fp8_out.default" in rec.seen
        kinds = ["prefill" if "num_heads" in pl.pack.names else "vt" for pl, _, _ in gpu.launches[n:]]
        assert kinds == ["prefill"]
        assert int(np.frombuffer(gpu.values()["tm_v"].tobytes(), np.uint64)[0]) == tv.data.data_ptr()
    assert direct == [True]
    n = len(gpu.launches)
    ops.mla_prefill_fp8(*a, *offs, out=t["out"], **FAST)  # v itself: the pre-pass, then the kernel
    assert len(gpu.launches) == n + 2
    with pytest.raises(ValueError, match=r"v: a TransposedV of B = 2 sequences, the call has B = 1"):
        ops.mla_prefill_fp8(*a[:5], tv, a[6], t["valid_length"][:2], t["cache_row_offsets"][:2], out=t["out"], **FAST)

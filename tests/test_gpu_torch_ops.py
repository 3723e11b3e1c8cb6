"""GPU tests of the torch custom ops and of flash_attn_varlen_func (pytest -m gpu): the ops give
the Python API's results bit for bit, compile with torch.compile(fullgraph=True), and replay from
a CUDA graph with the eager result on fresh inputs, for every mask."""
import numpy as np
import pytest

import mla_cupy
from mla_cupy.masks import MASKS, NullMask, SlidingWindowCausalMask

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch without a CUDA device")]

ops = pytest.importorskip("mla_cupy.torch_ops")
fa = pytest.importorskip("mla_cupy.flash_attn")

H = 8
SQ, SK = (200, 1, 77), (300, 64, 77)


def _case(seed=0, sq=SQ, sk=SK, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    tq, tk = sum(sq), sum(sk)
    off = [torch.tensor(np.concatenate([[0], np.cumsum(s)]), dtype=torch.int32, device="cuda") for s in (sq, sk)]
    return [rnd(tq, H, 192), rnd(tk, H, 128), rnd(tk, H, 128), rnd(tk, 1, 64), *off]


def _refill(static, seed):
    """New values in the float inputs of a captured graph (offsets kept)."""
    for t, new in zip(static, _case(seed)):
        if t.is_floating_point():
            t.copy_(new)


class Attention(torch.nn.Module):
    """A prefill over all keys as two chunks merged in place, and the one-shot call: what a
    chunked-prefill layer does, with everything graph capturable."""

    def __init__(self, mask):
        super().__init__()
        self.mask = mask

    def forward(self, q, k, v, k_rope, vl, cro):
        kw = dict(mask=self.mask, q_max_seq_len=max(SQ), validate=False)
        o, lse = ops.mla_prefill(q, k, v, k_rope, vl, cro, return_lse=True, **kw)
        acc = torch.zeros(o.shape, dtype=torch.float32, device=o.device)
        acc_lse = torch.full_like(lse, -float("inf"))
        ops.mla_prefill(q, k, v, k_rope, vl, cro, out=acc, lse=acc_lse, accumulate=True, **kw)
        merged, merged_lse = ops.merge_states(acc, acc_lse, torch.zeros_like(acc), torch.full_like(lse, -float("inf")))
        return o, lse, merged, merged_lse


def _capture(call):
    """``call`` run once on a side stream (the warm-up compiles the kernels outside the capture),
    then captured: ``(graph, its results)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    return graph, captured


def _assert_same(got, want):
    for g, w in zip(got, want):
        assert torch.equal(g, w) or torch.equal(torch.nan_to_num(g), torch.nan_to_num(w))


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: type(m).__name__)
def test_ops_equal_the_python_api(mask):
    args = _case(1)
    o, lse = ops.mla_prefill(*args, mask=mask, return_lse=True)
    want, want_lse = mla_cupy.mla_prefill(*args, mask=mask, return_lse=True)
    assert torch.equal(o, want) and torch.equal(lse, want_lse)
    o32 = ops.mla_prefill(*args, mask=mask, out_dtype=torch.float32)
    assert o32.dtype == torch.float32
    assert torch.equal(o32, mla_cupy.mla_prefill(*args, mask=mask, out_dtype=np.float32))


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: type(m).__name__)
def test_compile_fullgraph_equals_eager(mask):
    args = _case(2)
    eager = Attention(mask)(*args)
    compiled = torch.compile(Attention(mask), fullgraph=True)(*args)
    _assert_same(compiled, eager)


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: type(m).__name__)
def test_cuda_graph_replay_equals_eager(mask):
    static = _case(3)
    model = Attention(mask)
    graph, captured = _capture(lambda: model(*static))
    for seed in (4, 5):
        _refill(static, seed)
        graph.replay()
        torch.cuda.synchronize()
        _assert_same(captured, model(*static))


def test_compiled_module_in_a_cuda_graph():
    """torch.compile output captured by torch's own CUDA-graph mode."""
    args = _case(6)
    model = Attention(SlidingWindowCausalMask(100))
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # reduce-overhead records the graph on a later call
        got = [t.clone() for t in compiled(*args)]
    _assert_same(got, model(*args))


def test_paged_cache_through_the_ops():
    q, k, v, k_rope, vl, cro = _case(7)
    blocks = torch.randn(64, 16, 1, 576, device="cuda").bfloat16()
    lut = torch.randperm(64, device="cuda", dtype=torch.int32)[:60].reshape(3, 20)  # 320 slots per sequence
    co = torch.tensor([0, 17, 3], dtype=torch.int32, device="cuda")
    cache = mla_cupy.PagedKVCache(blocks, lut, 16)
    o = ops.mla_prefill(q, k, v, cache, vl, cro, cache_offsets=co, q_max_seq_len=max(SQ), validate=False)
    assert torch.equal(o, mla_cupy.mla_prefill(q, k, v, cache, vl, cro, cache_offsets=co))


def _fp8_inputs(seed, e4m3_rope=False):
    from mla_cupy import quant

    q, k, v, k_rope, vl, cro = _case(seed, dtype=torch.float32)
    d = quant.quantize_per_token(*(t.cpu().numpy() for t in (q, k, v, k_rope)), e4m3_rope=e4m3_rope)

    def dev(name):
        x = np.asarray(d[name])
        if x.dtype.itemsize == 1:
            return torch.from_numpy(x.view(np.uint8)).cuda().view(torch.float8_e4m3fn)
        t = torch.from_numpy(x).cuda()
        return t.bfloat16() if name in ("q_rope", "k_rope") else t

    return [dev(n) for n in ("q_nope", "q_rope", "q_scale", "k", "k_scales", "v", "k_rope")] + [vl, cro]


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                    reason="the fp8 per-token kernel runs on compute capability 9.0")
def test_fp8_op_equals_the_api_and_replays_from_a_graph():
    """The V^T workspace comes from torch's allocator: the call captures and replays."""
    static = _fp8_inputs(8)
    kw = dict(q_max_seq_len=max(SQ), validate=False)
    eager = ops.mla_prefill_fp8(*static, return_lse=True, **kw)
    want = mla_cupy.mla_prefill_fp8(*static, return_lse=True)
    _assert_same(eager, want)
    graph, captured = _capture(lambda: ops.mla_prefill_fp8(*static, return_lse=True, **kw))
    fresh = _fp8_inputs(9)
    for t, new in zip(static, fresh):
        t.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    _assert_same(captured, ops.mla_prefill_fp8(*static, return_lse=True, **kw))


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                    reason="the fp8 per-token kernel runs on compute capability 9.0")
def test_e4m3_op_equals_the_api():
    """The all-e4m3 mode (float8_e4m3fn q_rope and k_rope) through the op: the API's bits, bfloat16
    results by default, and the in-place op into a float32 out."""
    args = _fp8_inputs(12, e4m3_rope=True)
    assert args[1].dtype == torch.float8_e4m3fn and args[6].dtype == torch.float8_e4m3fn
    got = ops.mla_prefill_fp8(*args, return_lse=True)
    assert got[0].dtype == torch.bfloat16
    _assert_same(got, mla_cupy.mla_prefill_fp8(*args, return_lse=True))
    out = torch.full(got[0].shape, float("nan"), dtype=torch.float32, device="cuda")
    lse = torch.empty_like(got[1])
    ops.mla_prefill_fp8(*args, out=out, lse=lse)
    _assert_same((out, lse), mla_cupy.mla_prefill_fp8(*args, out_dtype=np.float32, return_lse=True))


def test_merge_ops_equal_the_api():
    args = _case(10)
    a = ops.mla_prefill(*args, out_dtype=torch.float32, return_lse=True)
    b = ops.mla_prefill(*args, mask=NullMask(), out_dtype=torch.float32, return_lse=True)
    want = mla_cupy.merge_states(*a, *b)
    _assert_same(ops.merge_states(*a, *b), want)
    oa, la = a[0].clone(), a[1].clone()
    ops.merge_states_(oa, la, *b)
    _assert_same((oa, la), want)


@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_varlen_equals_mla_prefill(causal):
    q, k, v, k_rope, cu_q, cu_k = _case(11)
    k192 = torch.cat([k, k_rope.expand(-1, H, -1)], -1)
    want, want_lse = mla_cupy.mla_prefill(q, k, v, k_rope, cu_q, cu_k, scale=0.07,
                                          mask=mla_cupy.CausalMask() if causal else NullMask(), return_lse=True)
    out, lse = fa.flash_attn_varlen_func(q, k192, v, cu_q, cu_k, max(SQ), max(SK), softmax_scale=0.07, causal=causal,
                                         return_softmax_lse=True)
    assert torch.equal(out, want) and tuple(lse.shape) == (H, sum(SQ)) and torch.equal(lse, want_lse.t())
    latent = torch.randn(k.shape[0], 1, 576, device="cuda").bfloat16()
    latent[:, :, 512:] = k_rope
    out2 = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(SQ), max(SK), softmax_scale=0.07, causal=causal,
                                     k_rope=latent[:, 0, 512:])
    assert torch.equal(out2, want)


def test_flash_attn_varlen_replays_from_a_graph():
    static = _case(12)
    q, k, v, k_rope, cu_q, cu_k = static

    def call():
        return fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(SQ), max(SK), causal=True, return_softmax_lse=True,
                                         k_rope=k_rope)

    graph, captured = _capture(call)
    _refill(static, 13)
    graph.replay()
    torch.cuda.synchronize()
    _assert_same(captured, call())


def test_backward_op_replays_from_a_graph():
    """With q_max_seq_len and validate=False the backward op reads nothing back: it captures in a
    CUDA graph and replays with eager's bits on fresh inputs (deterministic mode), its gradients
    those of the call that reads the offsets back (which spans the longest sequence's key blocks)."""
    kw = dict(q_max_seq_len=max(SQ), validate=False)
    q, k, v, r, vl, cro = _case(20)
    out, lse = ops.mla_prefill(q, k, v, r, vl, cro, return_lse=True, **kw)
    static = [torch.randn_like(out), q, k, v, r, out, lse, vl, cro]

    def step():
        return ops.mla_prefill_backward(*static, deterministic=True, **kw)

    eager = step()
    for g, w in zip(eager, mla_cupy.mla_prefill_backward(*static, deterministic=True)):
        assert float((g.float() - w.float()).norm() / w.float().norm()) < 1e-2
    graph, captured = _capture(step)
    g = torch.Generator(device="cuda").manual_seed(21)
    for t in static[:5]:  # dout, q, k, v, k_rope; then their out and lse
        t.copy_(torch.randn(t.shape, generator=g, device="cuda").to(t.dtype))
    ops.mla_prefill(q, k, v, r, vl, cro, out=out, lse=lse, **kw)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, step()):
        assert torch.equal(got, want)


def test_ops_launch_from_the_plan_cache():
    """Calls seen before launch their cached record on the tensors themselves: they equal the first
    call bit for bit, count as hits, run on torch's current stream, and with validate=True read the
    offsets through torch; a 192-wide K's view and a new lse per call (flash_attn) hit as well."""
    from mla_cupy._arrays import stream_ptr

    mla_cupy.plan_cache_clear()
    q, k, v, k_rope, vl, cro = _case(13)
    kw = dict(mask=SlidingWindowCausalMask(50), q_max_seq_len=max(SQ), validate=False, return_lse=True)
    want = ops.mla_prefill(q, k, v, k_rope, vl, cro, **kw)  # the functional op: packed and kept
    hits = mla_cupy.plan_cache_info().hits
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        assert stream_ptr(None, True) == torch.cuda.current_stream().cuda_stream == side.cuda_stream
        got = ops.mla_prefill(q, k, v, k_rope, vl, cro, **kw)
    torch.cuda.current_stream().wait_stream(side)
    _assert_same(got, want)
    assert mla_cupy.plan_cache_info().hits == hits + 1
    out, lse = torch.full_like(want[0], float("nan")), torch.full_like(want[1], float("nan"))
    for _ in range(2):  # in place, validated: the second call is a hit that reads the offsets
        ops.mla_prefill(q, k, v, k_rope, vl, cro, out=out, lse=lse, **dict(kw, validate=True))
    _assert_same((out, lse), want)
    assert mla_cupy.plan_cache_info().hits == hits + 2
    cro2 = cro.clone()
    ops.mla_prefill(q, k, v, k_rope, vl, cro2, out=out, lse=lse, **dict(kw, validate=True))  # packed and kept
    cro2[1] = 10_000  # the same tensor, decreasing offsets: the call from the cache still checks them
    with pytest.raises(ValueError, match=r"^cache_row_offsets: offsets must be non-decreasing"):
        ops.mla_prefill(q, k, v, k_rope, vl, cro2, out=out, lse=lse, **dict(kw, validate=True))
    k192 = torch.cat([k, k_rope.expand(-1, H, -1)], -1)
    outs = [fa.flash_attn_varlen_func(q, k192, v, vl, cro, max(SQ), max(SK), causal=True) for _ in range(3)]
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])
    info = mla_cupy.plan_cache_info()
    assert info.hits >= hits + 4, info


def test_eager_calls_equal_the_registered_op():
    """The eager route (no dispatcher) and the op (taken under a dispatch mode) give the same
    results bit for bit, with default arguments too (offsets read on torch's stream)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Through(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    args = _case(21)
    for kw in (dict(q_max_seq_len=max(SQ), validate=False), {}):
        assert ops.eager_cuda(tuple(args))
        got = ops.mla_prefill(*args, return_lse=True, **kw)
        with Through():
            want = ops.mla_prefill(*args, return_lse=True, **kw)
        _assert_same(got, want)
        out = torch.full_like(got[0], float("nan"))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            vl = args[4].clone()  # written on the side stream just before the call reads it
            ops.mla_prefill(*args[:4], vl, args[5], out=out, **kw)
        torch.cuda.current_stream().wait_stream(side)
        _assert_same((out,), (got[0],))

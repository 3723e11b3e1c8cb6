"""The torch custom ops (mla_cupy.torch_ops) and the FlashAttention-style entry point
(mla_cupy.flash_attn) on CPU: registration, schemas, fake implementations, opcheck, torch.compile
tracing, and results against the float64 reference (the ops' CPU kernel) and plain torch math."""
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mla_cupy import reference  # noqa: E402
from mla_cupy.masks import MASKS, ChunkedMask, NullMask, SlidingWindowCausalMask  # noqa: E402
from mla_cupy.paged import PagedKVCache  # noqa: E402

ops = pytest.importorskip("mla_cupy.torch_ops")
fa = pytest.importorskip("mla_cupy.flash_attn")

H = 2


def _case(seed=0, sq=(4, 5), sk=(5, 6)):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(sq), sum(sk)
    return dict(q=torch.randn(tq, H, 192, generator=g), k=torch.randn(tk, H, 128, generator=g),
                v=torch.randn(tk, H, 128, generator=g), k_rope=torch.randn(tk, 1, 64, generator=g),
                valid_length=torch.tensor(np.concatenate([[0], np.cumsum(sq)]), dtype=torch.int32),
                cache_row_offsets=torch.tensor(np.concatenate([[0], np.cumsum(sk)]), dtype=torch.int32))


def _ref(c, **kw):
    n = {name: c[name].double().numpy() if c[name].is_floating_point() else c[name].numpy() for name in c}
    return reference.mla_prefill(n["q"], n["k"], n["v"], n["k_rope"], n["valid_length"], n["cache_row_offsets"],
                                 return_lse=True, **kw)


def _args(c):
    return tuple(c[n] for n in ("q", "k", "v", "k_rope", "valid_length", "cache_row_offsets"))


def test_import_of_the_package_does_not_import_torch():
    code = ("import sys, mla_cupy, mla_cupy.integrations; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parent.parent))


def test_ops_are_registered_with_their_schemas():
    ns = torch.ops.mla_cupy
    s = str(ns.mla_prefill.default._schema)
    for arg in ("Tensor? cache_offsets", "Tensor? q_start_pos", "Tensor? lookup_table", "Tensor? k_rope_scales",
                "ScalarType? out_dtype", "float? scale", "int mask_kind", "int mask_arg", "SymInt? q_max_seq_len",
                "int page_size", "int rope_offset", "bool validate", "str kernel"):
        assert arg in s, arg
    assert s.endswith("-> (Tensor, Tensor)")
    s_out = str(ns.mla_prefill_out.default._schema)
    assert "Tensor(a!) out, Tensor(b!)? lse" in s_out and "bool accumulate=False" in s_out and s_out.endswith("-> ()")
    assert "Tensor q_nope, Tensor q_rope, Tensor q_scale" in str(ns.mla_prefill_fp8.default._schema)
    assert "k_rope_scales" not in str(ns.mla_prefill_fp8_out.default._schema)
    assert "Tensor(a!) out_a, Tensor(b!) lse_a" in str(ns.merge_states_.default._schema)
    assert str(ns.merge_states.default._schema).endswith("-> (Tensor, Tensor)")


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: type(m).__name__)
def test_mask_arguments_round_trip(mask):
    assert ops.mask_from_args(*ops.mask_args(mask)) == mask


def test_mask_arguments_errors():
    with pytest.raises(TypeError, match="mask"):
        ops.mask_args("causal")
    with pytest.raises(ValueError, match="mask_kind"):
        ops.mask_from_args(len(ops.MASK_KINDS), 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fake_implementations_give_shapes_and_dtypes(dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    ns = torch.ops.mla_cupy
    with FakeTensorMode():
        q, k, v = torch.empty(37, 3, 192, dtype=dtype), torch.empty(50, 3, 128, dtype=dtype), torch.empty(50, 3, 128, dtype=dtype)
        rope, off = torch.empty(50, 1, 64, dtype=dtype), torch.empty(3, dtype=torch.int32)
        out, lse = ns.mla_prefill(q, k, v, rope, off, off)
        assert (tuple(out.shape), out.dtype, tuple(lse.shape), lse.dtype) == ((37, 3, 128), dtype, (37, 3), torch.float32)
        out32, _ = ns.mla_prefill(q, k, v, rope, off, off, out_dtype=torch.float32, mask_kind=2, mask_arg=8)
        assert out32.dtype == torch.float32
        q8, k8 = torch.empty(37, 3, 128, dtype=torch.float8_e4m3fn), torch.empty(50, 3, 128, dtype=torch.float8_e4m3fn)
        o8, l8 = ns.mla_prefill_fp8(q8, torch.empty(37, 3, 64, dtype=torch.bfloat16), torch.empty(37, 1), k8,
                                    torch.empty(50, 1), k8, rope.bfloat16(), off, off)
        assert (tuple(o8.shape), o8.dtype, tuple(l8.shape)) == ((37, 3, 128), torch.bfloat16, (37, 3))
        m, ml = ns.merge_states(out32, lse, out32, lse, out_dtype=torch.bfloat16)
        assert (tuple(m.shape), m.dtype, ml.dtype) == ((37, 3, 128), torch.bfloat16, torch.float32)
        assert ns.mla_prefill_out(q, k, v, rope, off, off, out32, lse, accumulate=True) is None
    # meta tensors dispatch to the same fake implementation
    o, l = ns.mla_prefill(*(t.to("meta") for t in (q, k, v, rope, off, off)))
    assert o.device.type == "meta" and tuple(o.shape) == (37, 3, 128) and tuple(l.shape) == (37, 3)


@pytest.mark.parametrize("mask", [MASKS[1], SlidingWindowCausalMask(3), NullMask()], ids=lambda m: type(m).__name__)
def test_opcheck_functional(mask):
    c = _case()
    kind, arg = ops.mask_args(mask)
    torch.library.opcheck(torch.ops.mla_cupy.mla_prefill, _args(c), {"mask_kind": kind, "mask_arg": arg})


def test_opcheck_in_place_and_merge():
    c = _case(1)
    out, lse = torch.zeros(9, H, 128), torch.full((9, H), -float("inf"))
    torch.library.opcheck(torch.ops.mla_cupy.mla_prefill_out, _args(c) + (out, lse), {"accumulate": True})
    torch.library.opcheck(torch.ops.mla_cupy.mla_prefill_out, _args(c) + (out.clone(), None))
    o, l = ops.mla_prefill(*_args(c), return_lse=True)
    torch.library.opcheck(torch.ops.mla_cupy.merge_states, (o, l, o.flip(0), l.flip(0)))
    torch.library.opcheck(torch.ops.mla_cupy.merge_states_, (o.clone(), l.clone(), o.flip(0), l.flip(0)))


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: type(m).__name__)
def test_cpu_kernel_is_the_reference(mask):
    c = _case(2, sq=(3, 7), sk=(9, 4))
    q_start = torch.tensor([2, 5], dtype=torch.int64)
    o, l = ops.mla_prefill(*_args(c), mask=mask, scale=0.1, q_start_pos=q_start, return_lse=True)
    ro, rl = _ref(c, mask=mask, scale=0.1, q_start_pos=q_start.numpy())
    np.testing.assert_allclose(o.numpy(), ro, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(l.numpy(), rl, rtol=1e-5, atol=1e-6)


def test_paged_cache_through_the_ops():
    c = _case(3)
    g = torch.Generator().manual_seed(3)
    blocks = torch.randn(4, 16, 1, 576, generator=g)
    lut = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    co = torch.tensor([3, 12], dtype=torch.int32)
    o = ops.mla_prefill(*_args(c)[:3], PagedKVCache(blocks, lut, 16), *_args(c)[4:], cache_offsets=co)
    ro, _ = reference.mla_prefill(*(c[n].double().numpy() for n in ("q", "k", "v")),
                                  PagedKVCache(blocks.double().numpy(), lut.numpy(), 16), c["valid_length"].numpy(),
                                  c["cache_row_offsets"].numpy(), cache_offsets=co.numpy(), return_lse=True)
    np.testing.assert_allclose(o.numpy(), ro, rtol=1e-5, atol=1e-6)


def test_accumulate_over_two_key_chunks_equals_one_call():
    c = _case(4, sq=(6,), sk=(10,))
    full, full_lse = ops.mla_prefill(*_args(c), return_lse=True)
    q_start = torch.tensor([4], dtype=torch.int64)  # the one-shot call's query positions: 10 - 6
    out, lse = torch.zeros(6, H, 128), torch.full((6, H), -float("inf"))
    for lo, hi in ((0, 5), (5, 10)):
        part = dict(c, k=c["k"][lo:hi], v=c["v"][lo:hi], k_rope=c["k_rope"][lo:hi],
                    cache_row_offsets=torch.tensor([0, hi - lo], dtype=torch.int32))
        ops.mla_prefill(*_args(part), cache_offsets=torch.tensor([lo], dtype=torch.int32), q_start_pos=q_start,
                        out=out, lse=lse, accumulate=True)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, full_lse, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="accumulate"):
        ops.mla_prefill(*_args(c), accumulate=True)


def test_merge_states_functional_and_in_place():
    c = _case(5)
    a = ops.mla_prefill(*_args(c), mask=ChunkedMask(2), return_lse=True)
    b = ops.mla_prefill(*_args(c), mask=NullMask(), return_lse=True)
    b[1][0] = -float("inf")  # an empty side contributes nothing, whatever its output holds
    b[0][0] = float("nan")
    m, ml = ops.merge_states(*a, *b)
    w_a, w_b = torch.exp(a[1] - ml), torch.exp(b[1] - ml)
    expect = w_a[..., None] * a[0] + torch.nan_to_num(w_b[..., None] * b[0])
    torch.testing.assert_close(m, expect, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m[0], a[0][0])
    oa, la = a[0].clone(), a[1].clone()
    assert ops.merge_states_(oa, la, *b)[0] is oa
    torch.testing.assert_close(oa, m)
    torch.testing.assert_close(la, ml)


@pytest.mark.parametrize("e4m3_rope", [False, True], ids=["bf16-rope", "e4m3-rope"])
def test_fp8_op_on_cpu_matches_the_reference(e4m3_rope):
    from mla_cupy import quant

    c = _case(6)
    d = quant.quantize_per_token(*(c[n].numpy().astype(ml_dtypes.bfloat16) for n in ("q", "k", "v", "k_rope")),
                                 e4m3_rope=e4m3_rope)

    def tensor(n, x):  # e4m3 data as float8_e4m3fn, the rope parts as bfloat16 (as the GPU op takes them)
        x = np.asarray(x)
        if x.dtype.itemsize == 1:
            return torch.from_numpy(x.view(np.uint8)).view(torch.float8_e4m3fn)
        t = torch.from_numpy(x.astype(np.float32))
        return t.to(torch.bfloat16) if n in ("q_rope", "k_rope") else t

    t = {n: tensor(n, x) for n, x in d.items()}
    o = ops.mla_prefill_fp8(t["q_nope"], t["q_rope"], t["q_scale"], t["k"], t["k_scales"], t["v"], t["k_rope"],
                            c["valid_length"], c["cache_row_offsets"])
    ro = reference.mla_prefill_fp8(d["q_nope"], d["q_rope"], d["q_scale"], d["k"], d["k_scales"], d["v"], d["k_rope"],
                                   c["valid_length"].numpy(), c["cache_row_offsets"].numpy())
    assert o.dtype == torch.bfloat16  # also with e4m3 rope parts
    np.testing.assert_allclose(o.float().numpy(), ro, rtol=1e-2, atol=1e-2)  # a bfloat16 result
    o32 = ops.mla_prefill_fp8(t["q_nope"], t["q_rope"], t["q_scale"], t["k"], t["k_scales"], t["v"], t["k_rope"],
                              c["valid_length"], c["cache_row_offsets"], out_dtype=torch.float32)
    np.testing.assert_allclose(o32.numpy(), ro, rtol=1e-5, atol=1e-5)


def test_compile_fullgraph_traces_the_ops():
    """torch.compile(fullgraph=True) puts the ops in the graph (no break) and gives eager's result."""
    c = _case(7)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    class Attn(torch.nn.Module):
        def forward(self, q, k, v, k_rope, vl, cro):
            o, lse = ops.mla_prefill(q, k, v, k_rope, vl, cro, mask=SlidingWindowCausalMask(4), q_max_seq_len=5,
                                     validate=False, return_lse=True)
            acc = torch.zeros_like(o)
            acc_lse = torch.full_like(lse, -float("inf"))
            ops.mla_prefill(q, k, v, k_rope, vl, cro, q_max_seq_len=5, validate=False, out=acc, lse=acc_lse,
                            accumulate=True)
            return ops.merge_states(o * 1, lse, acc, acc_lse)

    want = Attn()(*_args(c))
    got = torch.compile(Attn(), fullgraph=True, backend=backend)(*_args(c))
    names = {str(t).removesuffix(".default") for t in seen}
    assert {"mla_cupy.mla_prefill", "mla_cupy.mla_prefill_out", "mla_cupy.merge_states"} <= names, names
    # through AOTAutograd too: the in-place op is functionalized from its declared mutations
    functionalized = torch.compile(Attn(), fullgraph=True, backend="aot_eager")(*_args(c))
    for g, f, w in zip(got, functionalized, want):
        torch.testing.assert_close(g, w)
        torch.testing.assert_close(f, w)


# ---------------------------------------------------------------------------------------------
# flash_attn_varlen_func


def _naive_attention(q, k, v, sq, sk, scale, causal):
    """Plain torch attention per sequence over a materialized 192-wide K (bottom-right causal)."""
    outs, lses = [], []
    q0 = k0 = 0
    for a, b in zip(sq, sk):
        s = torch.einsum("qhd,khd->hqk", q[q0:q0 + a].double(), k[k0:k0 + b].double()) * scale
        if causal:
            vis = torch.arange(b)[None, :] <= torch.arange(a)[:, None] + (b - a)
            s = s.masked_fill(~vis, -float("inf"))
        lses.append(torch.logsumexp(s, -1))
        p = torch.nan_to_num(torch.softmax(s, -1))
        outs.append(torch.einsum("hqk,khd->qhd", p, v[k0:k0 + b].double()))
        q0, k0 = q0 + a, k0 + b
    return torch.cat(outs), torch.cat(lses, 1)


@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_varlen_matches_plain_attention(causal):
    sq, sk = (3, 6), (5, 6)
    c = _case(8, sq, sk)
    k192 = torch.cat([c["k"], c["k_rope"].expand(-1, H, -1)], -1)
    cu_q, cu_k = c["valid_length"], c["cache_row_offsets"]
    out, lse = fa.flash_attn_varlen_func(c["q"], k192, c["v"], cu_q, cu_k, 6, 6, softmax_scale=0.125, causal=causal,
                                         return_softmax_lse=True)
    want, want_lse = _naive_attention(c["q"], k192, c["v"], sq, sk, 0.125, causal)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert tuple(lse.shape) == (H, sum(sq))  # FlashAttention's [H, Tq] layout, natural log
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    out2, lse2, probs = fa.flash_attn_varlen_func(c["q"], c["k"], c["v"], cu_q, cu_k, 6, 6, 0.0, 0.125, causal,
                                                  return_attn_probs=True, k_rope=c["k_rope"][:, 0])
    torch.testing.assert_close(out2, out)
    torch.testing.assert_close(lse2, lse)
    assert probs is None


def test_flash_attn_window_and_default_scale():
    c = _case(9, (5,), (7,))
    k192 = torch.cat([c["k"], c["k_rope"].expand(-1, H, -1)], -1)
    got = fa.flash_attn_varlen_func(c["q"], k192, c["v"], c["valid_length"], c["cache_row_offsets"], 5, 7,
                                    window_size=(2, 0))
    ro, _ = _ref(c, mask=SlidingWindowCausalMask(3))
    np.testing.assert_allclose(got.numpy(), ro, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw, match", [({"dropout_p": 0.1}, "dropout_p"), ({"softcap": 5.0}, "softcap"),
                                       ({"alibi_slopes": 1}, "alibi"), ({"block_table": 1}, "block_table"),
                                       ({"window_size": (2, 3)}, "window_size")])
def test_flash_attn_refuses_what_it_cannot_do(kw, match):
    c = _case()
    k192 = torch.cat([c["k"], c["k_rope"].expand(-1, H, -1)], -1)
    with pytest.raises(ValueError, match=match):
        fa.flash_attn_varlen_func(c["q"], k192, c["v"], c["valid_length"], c["cache_row_offsets"], 5, 6, **kw)


def test_flash_attn_shape_errors():
    c = _case()
    args = (c["valid_length"], c["cache_row_offsets"], 5, 6)
    with pytest.raises(ValueError, match="k_rope"):
        fa.flash_attn_varlen_func(c["q"], c["k"], c["v"], *args)
    with pytest.raises(ValueError, match="v:"):
        fa.flash_attn_varlen_func(c["q"], c["k"], torch.nn.functional.pad(c["v"], (0, 64)), *args, k_rope=c["k_rope"])
    with pytest.raises(ValueError, match="q:"):
        fa.flash_attn_varlen_func(c["q"][..., :128], c["k"], c["v"], *args, k_rope=c["k_rope"])


def test_fp8_op_on_cpu_takes_the_quantizers_vt():
    """On CPU tensors a TransposedV as v gives the result of v itself (the reference reads the keys
    given back by untranspose_v_host); one laid out for other offsets is refused."""
    from mla_cupy import quant
    from mla_cupy.fp8 import TransposedV

    c = _case(6)
    cro = c["cache_row_offsets"]
    d = quant.quantize_per_token(*(c[n].numpy().astype(ml_dtypes.bfloat16) for n in ("q", "k", "v", "k_rope")),
                                 cache_row_offsets=cro)
    assert d["v_t"].cache_row_offsets is cro

    def tensor(n, x):
        x = np.asarray(x)
        if x.dtype.itemsize == 1:
            return torch.from_numpy(x.view(np.uint8)).view(torch.float8_e4m3fn)
        t = torch.from_numpy(x.astype(np.float32))
        return t.to(torch.bfloat16) if n in ("q_rope", "k_rope") else t

    t = {n: tensor(n, x) for n, x in d.items() if n != "v_t"}
    head = [t[n] for n in ("q_nope", "q_rope", "q_scale", "k", "k_scales")]
    want = ops.mla_prefill_fp8(*head, t["v"], t["k_rope"], c["valid_length"], cro)
    got = ops.mla_prefill_fp8(*head, d["v_t"], t["k_rope"], c["valid_length"], cro)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    other = cro.clone()
    other[1] += 1
    with pytest.raises(ValueError, match="v: the TransposedV was laid out for other cache_row_offsets"):
        ops.mla_prefill_fp8(*head, TransposedV(d["v_t"].data, other, d["v_t"].num_keys), t["k_rope"],
                            c["valid_length"], cro)


# ---------------------------------------------------------------------------------------------
# the backward: autograd through the functional op, the backward op


def _dense_grads(c, mask, dout, dlse):
    """float64 gradients of sum(dout * out) + sum(dlse * lse) by autograd of a dense attention over
    the 192-wide keys built from k and the shared rope (the rope's gradient summed over heads)."""
    q, k, v, r = (c[n].double().detach().requires_grad_() for n in ("q", "k", "v", "k_rope"))
    vl, cro = c["valid_length"].tolist(), c["cache_row_offsets"].tolist()
    total = 0.0
    for b in range(len(vl) - 1):
        a0, a1, k0, k1 = vl[b], vl[b + 1], cro[b], cro[b + 1]
        keys = torch.cat([k[k0:k1], r[k0:k1].expand(k1 - k0, H, 64)], -1)
        s = torch.einsum("qhd,khd->hqk", q[a0:a1], keys) / np.sqrt(192)
        qp = torch.arange(a1 - a0)[:, None] + (k1 - k0) - (a1 - a0)
        kp = torch.arange(k1 - k0)[None, :]
        vis = torch.as_tensor(mask.visible(qp.numpy(), kp.numpy()))
        s = s.masked_fill(~vis, -float("inf"))
        lse = torch.logsumexp(s, -1)
        o = torch.einsum("hqk,khd->qhd", torch.nan_to_num(torch.softmax(s, -1)), v[k0:k1])
        total = total + (o * dout[a0:a1].double()).sum() + (torch.nan_to_num(lse, neginf=0.0).T * dlse[a0:a1].double()).sum()
    total.backward()
    return q.grad, k.grad, v.grad, r.grad


@pytest.mark.parametrize("mask", [MASKS[1], SlidingWindowCausalMask(3), NullMask()], ids=lambda m: type(m).__name__)
def test_autograd_through_the_prefill_matches_a_dense_attention(mask):
    """loss.backward() through ops.mla_prefill (out and lse both in the loss; the rope a view of
    576-wide latent rows) against autograd of plain torch math in float64."""
    c = _case(11, sq=(4, 0, 6), sk=(5, 2, 6))
    latent = torch.randn(c["k"].shape[0], 1, 576, generator=torch.Generator().manual_seed(3))
    latent[:, :, 512:] = c["k_rope"]
    latent.requires_grad_()
    q, k, v = (c[n].clone().requires_grad_() for n in ("q", "k", "v"))
    out, lse = ops.mla_prefill(q, k, v, latent[:, :, 512:576], c["valid_length"], c["cache_row_offsets"], mask=mask,
                               return_lse=True)
    g = torch.Generator().manual_seed(4)
    dout, dlse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    ((out * dout).sum() + (torch.nan_to_num(lse, neginf=0.0) * dlse).sum()).backward()
    want = _dense_grads(c, mask, dout, dlse)
    for got, w in zip((q.grad, k.grad, v.grad, latent.grad[:, :, 512:]), want):
        torch.testing.assert_close(got.double(), w, rtol=1e-4, atol=1e-5)
    assert not latent.grad[:, :, :512].any()


def test_opcheck_backward_op():
    c = _case(12)
    o, l = ops.mla_prefill(*_args(c), return_lse=True)
    dout = torch.randn(o.shape, generator=torch.Generator().manual_seed(5))
    q, k, v, r, vl, cro = _args(c)
    torch.library.opcheck(torch.ops.mla_cupy.mla_prefill_backward, (dout, q, k, v, r, o, l, vl, cro))
    dq, dk, dv, dkr = ops.mla_prefill_backward(dout, q, k, v, r, o, l, vl, cro)
    assert dkr.shape == (r.shape[0], 1, 64)


def test_backward_writes_into_given_strided_tensors():
    """dq=, dk=, dv=, dk_rope= views of wider tensors (head-major, as the transformers backend
    passes its inputs' gradients) get the functional op's gradients; the rest stays untouched."""
    c = _case(15)
    o, l = ops.mla_prefill(*_args(c), return_lse=True)
    dout = torch.randn(o.shape, generator=torch.Generator().manual_seed(6))
    q, k, v, r, vl, cro = _args(c)
    want = ops.mla_prefill_backward(dout, q, k, v, r, o, l, vl, cro)
    tq, tk = q.shape[0], k.shape[0]
    gq, gk, gv = torch.full((H, tq, 192), 7.0), torch.full((H, tk, 192), 7.0), torch.full((H, tk, 130), 7.0)
    given = (gq.transpose(0, 1), gk[..., :128].transpose(0, 1), gv[..., :128].transpose(0, 1), gk[0, :, None, 128:])
    got = ops.mla_prefill_backward(dout, q, k, v, r, o, l, vl, cro, dq=given[0], dk=given[1], dv=given[2],
                                   dk_rope=given[3])
    assert all(a is b for a, b in zip(got, given))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert (gk[1:, :, 128:] == 7).all() and (gv[..., 128:] == 7).all()
    part = ops.mla_prefill_backward(dout, q, k, v, r, o, l, vl, cro, dv=torch.empty_like(v))
    for g, w in zip(part, want):
        torch.testing.assert_close(g, w)


def test_backward_refuses_a_paged_rope():
    c = _case(13, sq=(4,), sk=(5,))
    blocks = torch.randn(2, 16, 1, 576)
    blocks[0, :5, 0, 512:] = c["k_rope"][:, 0]
    cache = PagedKVCache(blocks, torch.tensor([[0]], dtype=torch.int32), 16, 512)
    q = c["q"].clone().requires_grad_()
    out = ops.mla_prefill(q, c["k"], c["v"], cache, c["valid_length"], c["cache_row_offsets"])
    with pytest.raises(ValueError, match="k_rope: the backward takes a plain 16-bit rope"):
        out.sum().backward()


def test_compile_fullgraph_backward():
    """torch.compile(fullgraph=True) of a step with the backward: the backward op is in the
    compiled graph and the gradients are eager's."""
    c = _case(14)

    def step(q, k, v, r, vl, cro):
        o = ops.mla_prefill(q, k, v, r, vl, cro, q_max_seq_len=5, validate=False)
        return (o * o).sum()

    grads = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        q, k, v, r = (c[n].clone().requires_grad_() for n in ("q", "k", "v", "k_rope"))
        fn(q, k, v, r, c["valid_length"], c["cache_row_offsets"]).backward()
        grads.append((q.grad, k.grad, v.grad, r.grad))
    for g, w in zip(*grads):
        torch.testing.assert_close(g, w)


def test_flash_attn_varlen_trains():
    """Gradients through flash_attn_varlen_func with a 192-wide K built from a shared rope (as a
    trainer builds it) equal plain attention's: the rope's gradient is summed over the heads."""
    g = torch.Generator().manual_seed(21)
    sq = sk = (5, 7)
    q = torch.randn(12, H, 192, generator=g, dtype=torch.float64).requires_grad_()
    kn = torch.randn(12, H, 128, generator=g, dtype=torch.float64).requires_grad_()
    rope = torch.randn(12, 1, 64, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(12, H, 128, generator=g, dtype=torch.float64).requires_grad_()
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    dout = torch.randn(12, H, 128, generator=g, dtype=torch.float64)
    grads = []
    for impl in ("ours", "naive"):
        for t in (q, kn, rope, v):
            t.grad = None
        k192 = torch.cat([kn, rope.expand(-1, H, -1)], -1)
        if impl == "ours":
            o = fa.flash_attn_varlen_func(q, k192, v, cu, cu, 7, 7, causal=True)
        else:
            o = _naive_attention(q, k192, v, sq, sk, 1 / np.sqrt(192), True)[0]
        (o * dout).sum().backward()
        grads.append([t.grad.clone() for t in (q, kn, rope, v)])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)  # the lse the op keeps is float32

"""The float64 backward reference, ``mla_cupy.reference.mla_prefill_backward``: against central
finite differences of the float64 forward reference, against ``torch.autograd`` of a dense float64
attention written here, its NaN and Inf rules (docs/contract.md, "The backward") and its checks
(``mla_cupy.validation.check_backward_inputs``, also run here as the GPU function will run them)."""
import functools

import ml_dtypes
import numpy as np
import pytest

from mla_cupy import reference
from mla_cupy.masks import CausalMask, ChunkedCausalMask, ChunkedMask, NullMask, SlidingWindowCausalMask
from mla_cupy.paged import PagedKVCache
from mla_cupy.validation import check_backward_inputs

from _cases import BF16, FP16, make_case
from _fake import dev
from test_reference import _visible_np, seq_visible

MASKS = [NullMask(), CausalMask(), SlidingWindowCausalMask(3), ChunkedMask(3), ChunkedCausalMask(2)]
MASK_IDS = [type(m).__name__ for m in MASKS]


def forward(c, mask=None, scale=None):
    """The float64 forward reference: ``(out, lse)``."""
    return reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets, mask=mask, scale=scale,
                                 cache_offsets=c.cache_offsets, q_start_pos=c.q_start_pos, return_lse=True)


def backward(c, dout, out, lse, mask=None, scale=None, **kw):
    return reference.mla_prefill_backward(dout, c.q, c.k, c.v, c.k_rope, out, lse, c.valid_length, c.cache_row_offsets,
                                          mask=mask, scale=scale, cache_offsets=c.cache_offsets,
                                          q_start_pos=c.q_start_pos, **kw)


# ------------------------------------------------------------------------------------------------
# central finite differences of the float64 forward

FD_LAYOUTS = {
    # an empty sequence, one whose queries see no key (no keys), prefix context (more keys than
    # queries), key rows after the last sequence
    "ragged": dict(sq=[3, 0, 4, 2], sk=[5, 2, 4, 0], extra_keys=2),
    # cache offsets and query positions: rows 0 and 1 of sequence 0 sit before its keys
    "positions": dict(sq=[4, 3], sk=[6, 5], cache_offsets=[3, 0], q_start_pos=[1, 7]),
    # B = 0: no query, three key rows outside every sequence
    "no sequence": dict(sq=[], sk=[], extra_keys=3),
}


@pytest.mark.parametrize("layout", list(FD_LAYOUTS))
@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
def test_gradients_are_central_differences_of_the_forward(layout, mask):
    """<grad, u> against (L(x + eps u) - L(x - eps u)) / 2 eps for L = sum(dout * out): two random
    directions over all of each input, and single coordinates (among them a key row after the last
    sequence, whose gradient is 0, and three rope values of key 1, whose gradient sums both heads)."""
    spec = dict(FD_LAYOUTS[layout])
    seed = 100 + MASKS.index(mask) + 10 * list(FD_LAYOUTS).index(layout)
    c = make_case(spec.pop("sq"), spec.pop("sk"), heads=2, dtype=np.float64, seed=seed, **spec)
    rng = np.random.default_rng(seed)
    scale = 0.13
    out, lse = forward(c, mask, scale)
    dout = rng.standard_normal(out.shape)
    grads = dict(zip(("q", "k", "v", "k_rope"), backward(c, dout, out, lse, mask, scale)))
    assert grads["q"].dtype == np.float64 and grads["k_rope"].shape == (c.k.shape[0], 1, 64)

    def loss(name, delta):
        x = getattr(c, name)
        setattr(c, name, x + delta)
        try:
            return float((dout * forward(c, mask, scale)[0]).sum())
        finally:
            setattr(c, name, x)

    eps = 1e-5
    for name, g in grads.items():
        shape = getattr(c, name).shape
        directions = [rng.standard_normal(shape) for _ in range(2)]
        flat = [tuple(rng.integers(0, n) for n in shape) for _ in range(4)] if g.size else []
        if name == "k_rope":
            flat += [(1, 0, d) for d in (0, 31, 63)]
        if name in ("k", "v", "k_rope") and "extra_keys" in FD_LAYOUTS[layout]:
            flat.append((shape[0] - 1,) + (0,) * (len(shape) - 1))  # a key row after the last sequence
            assert not g[-1].any()
        for idx in flat:
            u = np.zeros(shape)
            u[idx] = 1.0
            directions.append(u)
        for u in directions:
            want = (loss(name, eps * u) - loss(name, -eps * u)) / (2 * eps)
            got = float((g * u).sum())
            assert abs(got - want) <= 1e-7 + 1e-6 * abs(want), (name, got, want)


def test_no_sequence_gives_zeros_and_fills_given_results():
    """B = 0 (and Tq = 0): every gradient is 0, given results are zero-filled."""
    c = make_case([], [], heads=2, dtype=np.float64, seed=1, extra_keys=3)
    out, lse = np.zeros((0, 2, 128)), np.zeros((0, 2))
    dk = np.full((3, 2, 128), np.nan)
    dq, dk2, dv, dkr = backward(c, np.zeros((0, 2, 128)), out, lse, dk=dk)
    assert dq.shape == (0, 2, 192) and dk2 is dk and dv.shape == (3, 2, 128) and dkr.shape == (3, 1, 64)
    assert not (dk.any() or dv.any() or dkr.any())


# ------------------------------------------------------------------------------------------------
# torch.autograd of a dense float64 attention written here


def dense_grads(c, mask, scale, dout):
    """Dense float64 attention in torch, one sequence at a time, and torch.autograd's gradients of
    ``sum(dout * out)``: ``(out, lse, (dq, dk, dv, dk_rope))``. A row that sees no key gives 0 and
    lse -inf; the rope is broadcast over the heads, so its gradient is the head sum."""
    torch = pytest.importorskip("torch")
    ins = [torch.tensor(np.asarray(x, np.float64), requires_grad=True) for x in (c.q, c.k, c.v, c.k_rope)]
    q, k, v, rope = ins
    vl, cro = c.valid_length.astype(int), c.cache_row_offsets.astype(int)
    heads = q.shape[1]
    outs, lses = [], []
    for b in range(len(vl) - 1):
        sq, sk = vl[b + 1] - vl[b], cro[b + 1] - cro[b]
        k0 = 0 if c.cache_offsets is None else int(c.cache_offsets[b])
        q0 = k0 + sk - sq if c.q_start_pos is None else int(c.q_start_pos[b])
        vis = torch.tensor(_visible_np(mask, (q0 + np.arange(sq))[:, None], (k0 + np.arange(sk))[None, :]))
        keys = torch.cat([k[cro[b]:cro[b + 1]], rope[cro[b]:cro[b + 1]].expand(-1, heads, -1)], dim=-1)
        s = scale * torch.einsum("ihd,jhd->hij", q[vl[b]:vl[b + 1]], keys)
        s = torch.where(vis, s, -torch.inf)
        m = s.amax(dim=-1, keepdim=True).detach() if sk else torch.zeros(heads, sq, 1, dtype=torch.float64)
        m = torch.where(torch.isfinite(m), m, 0.0)
        e = torch.exp(s - m)
        total = e.sum(dim=-1, keepdim=True)
        outs.append(torch.einsum("hij,jhd->ihd", e / torch.where(total > 0, total, 1.0), v[cro[b]:cro[b + 1]]))
        lses.append((m + torch.log(total)).squeeze(-1).T)
    out, lse = torch.cat(outs), torch.cat(lses)
    (out * torch.tensor(np.asarray(dout, np.float64))).sum().backward()
    return out.detach().numpy(), lse.detach().numpy(), tuple(x.grad.numpy() for x in ins)


TORCH_MASKS = [NullMask(), CausalMask(), SlidingWindowCausalMask(9), ChunkedMask(16), ChunkedCausalMask(7)]


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-300))


TORCH_CASES = [pytest.param(m, 16, dt, id=f"H16-{np.dtype(dt).name}-{type(m).__name__}")
               for dt in (np.float64, BF16, FP16) for m in TORCH_MASKS]
TORCH_CASES += [pytest.param(m, 128, BF16, id=f"H128-bfloat16-{type(m).__name__}") for m in TORCH_MASKS[1::2]]


@pytest.mark.parametrize("mask,heads,dtype", TORCH_CASES)
def test_gradients_equal_torch_autograd(mask, heads, dtype):
    """Odd lengths, a ragged batch with an empty sequence and a sequence without keys, prefix
    context at cache offsets, key rows after the last sequence. 16-bit inputs are upcast; their
    ``out`` and ``lse`` come in float32, as the kernels return them (``out_dtype=float32``), their
    ``dout`` in q's dtype."""
    seed = 7 * heads + TORCH_MASKS.index(mask)
    c = make_case([37, 0, 61, 5], [50, 3, 61, 0], heads=heads, dtype=dtype, seed=seed, cache_offsets=[5, 0, 0, 2],
                  extra_keys=3)
    scale = 0.1
    dout = np.random.default_rng(seed).standard_normal((c.q.shape[0], heads, 128)).astype(dtype)
    out, lse, want = dense_grads(c, mask, scale, dout)
    if dtype != np.float64:
        out, lse = out.astype(np.float32), lse.astype(np.float32)
    got = backward(c, dout, out, lse, mask, scale)
    tol = 1e-12 if dtype == np.float64 else 2e-6  # the float32 rounding of out and lse
    for name, g, w in zip(("dq", "dk", "dv", "dk_rope"), got, want):
        assert g.shape == w.shape and g.dtype == np.float64
        assert rel(g, w) < tol, (name, rel(g, w))
    assert not got[0][37 + 61:].any()        # the queries of the sequence without keys
    assert not got[1][-3:].any() and not got[3][-3:].any()  # key rows after the last sequence


# ------------------------------------------------------------------------------------------------
# NaN and Inf (docs/contract.md, "The backward": the rules written out here independently)

NAN_MASKS = [NullMask(), CausalMask(), SlidingWindowCausalMask(9), ChunkedMask(16), ChunkedCausalMask(12)]


def nan_case():
    """Sequence 0: 70 queries from position -15, 90 keys from position 5 (under the causal masks rows
    0..19 see no key and keys 50..89 no query); sequence 1: 20 and 20; two key rows after them.
    Three heads."""
    return make_case([70, 20], [90, 20], heads=3, dtype=np.float64, seed=31, cache_offsets=[5, 0],
                     q_start_pos=[-15, 0], extra_keys=2)


@functools.lru_cache(maxsize=None)
def clean_run(mask):
    """``(case, dout, out, lse, grads)`` of the NaN tests, clean (cached per mask)."""
    c = nan_case()
    out, lse = forward(c, mask)
    dout = np.random.default_rng(32).standard_normal(out.shape)
    return c, dout, out, lse, backward(c, dout, out, lse, mask)


def fresh(mask):
    """A new case and copies of its dout, out and lse to poison, and the clean gradients."""
    c, dout, out, lse, grads = clean_run(mask)
    c = nan_case()
    return c, dout.copy(), out.copy(), lse.copy(), grads


def active(c, mask, lse):
    """[Sq0, H]: the rows of sequence 0 that see a key and whose lse is not -inf."""
    vis = seq_visible(c, mask, 0)
    return vis.any(axis=1)[:, None] & (lse[:vis.shape[0]] != -np.inf)


def nan_reach(c, mask, lse, where, i=None, j=None, h=None, d=None):
    """The contract's rules: the NaN positions of (dq, dk, dv, dk_rope) for one NaN in ``where``
    (row i or key j of sequence 0, head h, value d)."""
    vis = seq_visible(c, mask, 0)
    act = active(c, mask, lse)
    tq, heads = lse.shape
    tk = c.k.shape[0]
    dq, dk, dv, dkr = (np.zeros(s, bool) for s in ((tq, heads, 192), (tk, heads, 128), (tk, heads, 128), (tk, 1, 64)))
    if where in ("q", "lse", "dout", "out"):
        if act[i, h]:
            seen = vis[i]
            dq[i, h] = True
            dk[:len(seen)][seen, h] = True
            dkr[:len(seen)][seen] = True
            if where in ("q", "lse"):
                dv[:len(seen)][seen, h] = True
            elif where == "dout":
                dv[:len(seen)][seen, h, d] = True
    else:
        hs = list(range(heads)) if where == "k_rope" else [h]
        for hh in hs:
            rows = vis[:, j] & act[:, hh]
            dq[:len(rows)][rows, hh] = True
            if rows.any():
                dk[j, hh] = dkr[j] = True
                if where != "v":
                    dv[j, hh] = True
    return dq, dk, dv, dkr


def assert_nan_exactly(got, want, clean):
    for name, g, w, cl in zip(("dq", "dk", "dv", "dk_rope"), got, want, clean):
        np.testing.assert_array_equal(np.isnan(g), w, err_msg=name)
        np.testing.assert_allclose(g[~w], cl[~w], rtol=1e-12, atol=1e-14, err_msg=name)


def poison(c, dout, out, lse, where, i, j, h, d, value):
    if where == "q":
        c.q[i, h, d] = value
    elif where == "lse":
        lse[i, h] = value
    elif where == "dout":
        dout[i, h, d] = value
    elif where == "out":
        out[i, h, d] = value
    elif where == "k":
        c.k[j, h, d] = value
    elif where == "k_rope":
        c.k_rope[j, 0, d] = value
    else:
        c.v[j, h, d] = value


WHERE = ["q", "lse", "dout", "out", "k", "k_rope", "v"]
I, J, H, D = 40, 19, 1, 5  # row 40 of sequence 0 (position 25), key 19 (position 24), head 1
D_ROPE = 128 + 7           # a value of q's rope part


@pytest.mark.parametrize("mask", NAN_MASKS, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("where", WHERE + ["q_rope"])
def test_nan_reaches_what_the_contract_says(mask, where):
    """Rules 1-5: a NaN on a row's side (q, its rope part, lse, dout, out) or a key's side (k, its
    shared rope, v) reaches exactly the gradients the rules list; every other value is the clean
    run's."""
    c, dout, out, lse, clean = fresh(mask)
    name, d = ("q", D_ROPE) if where == "q_rope" else (where, D)
    want = nan_reach(c, mask, lse, name, i=I, j=J, h=H, d=d)
    assert all(w.any() for w in want[:2]) and want[2].any() == (name not in ("out", "v"))
    poison(c, dout, out, lse, name, I, J, H, d, np.nan)
    assert_nan_exactly(backward(c, dout, out, lse, mask), want, clean)


@pytest.mark.parametrize("mask", [CausalMask(), SlidingWindowCausalMask(9)], ids=lambda m: type(m).__name__)
def test_rows_that_see_no_key_and_keys_no_row_sees_change_nothing(mask):
    """Rule 6: rows 0..19 of sequence 0 see no key, keys 50..89 are seen by no row, two key rows
    lie after every sequence: NaN in all of their inputs (lse included) changes nothing; their
    gradients are 0."""
    c, dout, out, lse, clean = fresh(mask)
    vis = seq_visible(c, mask, 0)
    rows, keys = ~vis.any(axis=1), np.r_[~vis.any(axis=0), np.zeros(20, bool), np.ones(2, bool)]
    assert rows[:20].all() and keys[50:90].all()
    rows = np.r_[rows, np.zeros(20, bool)]
    for a in (c.q, dout, out, lse):
        a[rows] = np.nan
    for a in (c.k, c.v, c.k_rope):
        a[keys] = np.nan
    got = backward(c, dout, out, lse, mask)
    for g, cl in zip(got, clean):
        np.testing.assert_allclose(g, cl, rtol=1e-12, atol=1e-14)
    assert not got[0][rows].any() and not any(g[keys].any() for g in got[1:])


def test_a_row_whose_lse_is_minus_inf_is_skipped():
    """Rule 6: row I sees keys, but given lse -inf it gets dq 0 and contributes nothing, whatever its
    q, dout and out hold: the gradients are those of dout 0 for that row (and head)."""
    mask = CausalMask()
    c, dout, out, lse, _ = fresh(mask)
    dout0 = dout.copy()
    dout0[I, H] = 0.0
    want = backward(c, dout0, out, lse, mask)
    lse[I, H] = -np.inf
    c.q[I, H, 3], dout[I, H, 4], out[I, H, 5] = np.nan, np.nan, np.inf
    got = backward(c, dout, out, lse, mask)
    assert not got[0][I, H].any() and seq_visible(c, mask, 0)[I].any()
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)


def test_nan_never_leaves_its_sequence():
    c, dout, out, lse, clean = fresh(NullMask())
    for a in (c.q[:70], dout[:70], out[:70], lse[:70], c.k[:90], c.v[:90], c.k_rope[:90]):
        a[...] = np.nan
    got = backward(c, dout, out, lse, NullMask())
    for g, cl, rows in zip(got, clean, (slice(0, 70), slice(0, 90), slice(0, 90), slice(0, 90))):
        assert np.isnan(g[rows]).all()
        np.testing.assert_array_equal(np.delete(g, np.arange(rows.stop), axis=0),
                                      np.delete(cl, np.arange(rows.stop), axis=0))


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["+inf", "-inf"])
@pytest.mark.parametrize("where", WHERE + ["q_rope"])
def test_inf_changes_only_what_a_nan_would_reach(where, sign):
    """Rule 7: an Inf changes only values that a NaN in its place makes NaN (to +-Inf, NaN, or
    another finite value), and changes some of them."""
    mask = CausalMask()
    c, dout, out, lse, clean = fresh(mask)
    name, d = ("q", D_ROPE) if where == "q_rope" else (where, D)
    reach = nan_reach(c, mask, lse, name, i=I, j=J, h=H, d=d)
    poison(c, dout, out, lse, name, I, J, H, d, sign * np.inf)
    got = backward(c, dout, out, lse, mask)
    for g, r, cl in zip(got, reach, clean):
        assert not (~np.isfinite(g) & ~r).any()
        np.testing.assert_allclose(g[~r], cl[~r], rtol=1e-12, atol=1e-14)
    assert any((g[r] != cl[r]).any() for g, r, cl in zip(got, reach, clean))


def test_minus_inf_score_gives_zero_weight_and_nan_through_zero_times_inf():
    """Rule 7's example: -inf in key J's rope makes the scores of the rows that see it +-inf; where
    -inf, P = 0, and dq of those rows holds 0 * -inf = NaN in that rope column only."""
    mask = CausalMask()
    c, dout, out, lse, clean = fresh(mask)
    d = 7
    c.k_rope[J, 0, d] = -np.inf
    got = backward(c, dout, out, lse, mask)
    sees = seq_visible(c, mask, 0)[:, J]
    minus = sees & (c.q[:70, H, 128 + d] > 0)  # score -inf: weight 0
    assert minus.any()
    dq = got[0][:70, H]
    assert np.isnan(dq[minus, 128 + d]).all()
    assert np.isfinite(np.delete(dq[minus], 128 + d, axis=1)).all()


# ------------------------------------------------------------------------------------------------
# results written in place, the keywords of the GPU function, progress, memory


@pytest.mark.parametrize("dtype", [np.float64, np.float32, BF16])
def test_results_are_written_in_place_every_element(dtype):
    c = make_case([9, 0, 4], [12, 3, 4], heads=2, dtype=BF16, seed=41, extra_keys=2)
    out, lse = forward(c)
    dout = np.random.default_rng(42).standard_normal(out.shape).astype(BF16)
    want = backward(c, dout, out.astype(np.float32), lse.astype(np.float32))
    given = [np.full(w.shape, np.nan, dtype) for w in want]
    got = backward(c, dout, out.astype(np.float32), lse.astype(np.float32), dq=given[0], dk=given[1], dv=given[2],
                   dk_rope=given[3])
    for g, x, w in zip(got, given, want):
        assert g is x and not np.isnan(x.astype(np.float64)).any()
        np.testing.assert_array_equal(x, w.astype(dtype))
    only_dk = np.full(want[1].shape, np.nan, dtype)
    got = backward(c, dout, out.astype(np.float32), lse.astype(np.float32), dk=only_dk)
    assert got[1] is only_dk and all(g.dtype == np.float64 for i, g in enumerate(got) if i != 1)
    np.testing.assert_array_equal(got[0], want[0])


def test_gpu_keywords_are_accepted():
    c = make_case([9, 4], [12, 4], heads=2, dtype=BF16, seed=43)
    out, lse = forward(c)
    dout = np.random.default_rng(44).standard_normal(out.shape)
    want = backward(c, dout, out, lse)
    for kw in (dict(deterministic=True, stream=object(), kernel="sm90", q_max_seq_len=9),
               dict(kernel="sm80", validate=False), dict(progress=False)):
        for g, w in zip(backward(c, dout, out, lse, **kw), want):
            np.testing.assert_array_equal(g, w)


def test_progress_shows_when_asked_or_when_the_call_is_long(capsys, monkeypatch):
    c = make_case([20], [20], heads=2, dtype=BF16, seed=45)
    out, lse = forward(c)
    args = (np.ones(out.shape), out, lse)
    backward(c, *args)
    assert capsys.readouterr().err == ""
    backward(c, *args, progress=True)
    err = capsys.readouterr().err
    assert "mla_cupy.reference.mla_prefill_backward" in err and "100%" in err
    monkeypatch.setattr(reference, "_BWD_SECONDS_PER_PAIR", 1.0)  # as if every pair took a second
    backward(c, *args)
    assert "100%" in capsys.readouterr().err
    backward(c, *args, progress=False)
    assert capsys.readouterr().err == ""


def test_working_memory_is_bounded():
    """Peak memory beside the inputs and the results: under WORK_BYTES for full blocks of rows and
    keys, and no more for twice the keys (keys in blocks) or 32x the heads (a group at a time)."""
    import tracemalloc

    peaks = []
    for sq, sk, heads in ((1024, 1024, 2), (1024, 2048, 2), (64, 1024, 64)):
        c = make_case([sq], [sk], heads=heads, dtype=BF16, seed=46)
        dout, out = np.ones((sq, heads, 128), BF16), np.zeros((sq, heads, 128), np.float32)
        lse = np.full((sq, heads), 50.0, np.float32)  # P = exp(S - 50): tiny, finite
        tracemalloc.start()
        res = backward(c, dout, out, lse, mask=NullMask())  # every step a full one
        peaks.append(tracemalloc.get_traced_memory()[1] - sum(r.nbytes for r in res))
        tracemalloc.stop()
    assert max(peaks) < reference.WORK_BYTES, peaks
    assert max(peaks) < 1.1 * peaks[0], peaks


# ------------------------------------------------------------------------------------------------
# the checks: every bad argument names itself, before anything is computed or written


def bad_args():
    """Valid positional arguments (two sequences, two heads, bf16), to spoil one at a time."""
    c = make_case([5, 3], [6, 3], heads=2, dtype=BF16, seed=47)
    return dict(dout=np.zeros((8, 2, 128), BF16), q=c.q, k=c.k, v=c.v, k_rope=c.k_rope, out=np.zeros((8, 2, 128), BF16),
                lse=np.zeros((8, 2), np.float32), valid_length=c.valid_length, cache_row_offsets=c.cache_row_offsets)


HOST_BAD = [
    # the backward's own arrays
    (dict(dout=None), TypeError, "dout: expected an array, got NoneType"),
    (dict(dout=np.zeros((8, 2), BF16)), ValueError, r"dout: expected a 3-D array"),
    (dict(dout=np.zeros((8, 3, 128), BF16)), ValueError, r"dout: expected shape \[8, 2, 128\]"),
    (dict(dout=np.zeros((8, 2, 128), np.int32)), TypeError, "dout: expected a floating-point dtype, got int32"),
    (dict(dout=np.zeros((8, 2, 128), np.uint8)), TypeError, "dout: the backward takes no fp8 data"),
    (dict(out=None), TypeError, "out: expected an array, got NoneType"),
    (dict(out=np.zeros((8, 2, 192), BF16)), ValueError, r"out: expected shape \[8, 2, 128\]"),
    (dict(out=np.zeros((8, 2, 128), np.int64)), TypeError, "out: expected a floating-point dtype"),
    (dict(lse=None), TypeError, "lse: expected an array, got NoneType"),
    (dict(lse=np.zeros((8, 2, 1), np.float32)), ValueError, "lse: expected a 2-D array"),
    (dict(lse=np.zeros((8, 3), np.float32)), ValueError, r"lse: expected shape \[8, 2\]"),
    (dict(lse=np.zeros((8, 2), np.float16)), TypeError, "lse: expected dtype float32 or float64, got float16"),
    (dict(dq=np.zeros((8, 2, 128))), ValueError, r"dq: expected shape \[8, 2, 192\]"),
    (dict(dq=np.zeros((8, 2, 192), np.int32)), TypeError, "dq: expected a floating-point dtype"),
    (dict(dk=np.zeros((9, 2, 192))), ValueError, r"dk: expected shape \[9, 2, 128\]"),
    (dict(dv=np.zeros((8, 2, 128))), ValueError, r"dv: expected shape \[9, 2, 128\]"),
    (dict(dv=np.zeros((9, 2, 128), np.uint8)), TypeError, "dv: the backward takes no fp8 data"),
    (dict(dk_rope=np.zeros((9, 2, 64))), ValueError, r"dk_rope: expected shape \[9, 1, 64\]"),
    (dict(dk_rope=[0.0]), TypeError, "dk_rope: expected an array, got list"),
    (dict(deterministic="yes"), TypeError, "deterministic: expected a bool, got str"),
    # what the backward refuses
    (dict(k_rope=PagedKVCache(np.zeros((2, 16, 1, 576), BF16), np.zeros((2, 1), np.int32), 16)), ValueError,
     "k_rope: the backward takes a plain .* PagedKVCache is not supported"),
    (dict(k_rope=np.zeros((9, 1, 64), np.uint8)), TypeError, "k_rope: the backward takes no fp8 data"),
    (dict(k=np.zeros((9, 2, 128), np.uint8)), TypeError, "k: the backward takes no fp8 data"),
    (dict(q=np.zeros((8, 2, 192), np.int16)), TypeError, "q: expected a floating-point dtype, got int16"),
    # the forward's checks of the shared arguments, with the forward's messages
    (dict(q=np.zeros((8, 2, 128), BF16)), ValueError, "q: expected head size Dqk = 192"),
    (dict(v=np.zeros((8, 2, 128), BF16)), ValueError, r"v: expected shape \[9, 2, 128\]"),
    (dict(k_rope=np.zeros((9, 2, 64), BF16)), ValueError, r"k_rope: expected shape \[9, 1, 64\]"),
    (dict(valid_length=np.array([0, 5, 7], np.uint32)), ValueError, "valid_length: the last offset must equal Tq"),
    (dict(cache_row_offsets=np.array([0, 6, 3], np.uint32)), ValueError, "cache_row_offsets: offsets must be non-decr"),
    (dict(scale=-1.0), ValueError, "scale: expected a positive float"),
    (dict(mask="causal"), TypeError, "mask: expected a mla_cupy mask"),
    (dict(q_max_seq_len=4), ValueError, "q_max_seq_len: a sequence has 5 queries"),
    (dict(cache_offsets=np.zeros(3, np.uint32)), ValueError, "cache_offsets: expected 2 entries"),
    (dict(q_start_pos=np.zeros(2, np.uint32)), TypeError, "q_start_pos: expected dtype int32 or int64"),
    (dict(kernel="sm70"), ValueError, "kernel: expected one of"),
    (dict(progress="yes"), TypeError, "progress: expected None, True or False"),
    (dict(q=np.zeros((8, 2, 192), ml_dtypes.float8_e4m3fn)), TypeError, "q: the backward takes no fp8 data"),
    (dict(dout=np.zeros((8, 2, 128), ml_dtypes.float8_e5m2)), TypeError, "dout: the backward takes no fp8 data"),
]


@pytest.mark.parametrize("over,exc,match", HOST_BAD, ids=[f"{list(o)[0]}-{i}" for i, (o, _, _) in enumerate(HOST_BAD)])
def test_the_reference_refuses_each_bad_argument_by_name(over, exc, match):
    a = bad_args()
    kw = {n: x for n, x in over.items() if n not in a}
    a.update({n: x for n, x in over.items() if n in a})
    dk = np.full((9, 2, 128), np.nan)  # a given result: untouched when the call is refused
    if "dk" not in kw:
        kw["dk"] = dk
    with pytest.raises(exc, match=match):
        reference.mla_prefill_backward(*a.values(), **kw)
    assert np.isnan(dk).all()


def test_the_reference_writes_numpy_results_only():
    class Elsewhere:  # an array of another library, as the checks see one
        shape, dtype = (8, 2, 192), np.dtype(np.float32)

    with pytest.raises(TypeError, match="dq: the reference computes on the host; expected a NumPy array, got Elsewhere"):
        reference.mla_prefill_backward(*bad_args().values(), dq=Elsewhere())


def device_args():
    """Valid arguments of the GPU function as fake device arrays (host memory that says it is on
    the device; nothing reads it as such here)."""
    return {n: dev(x) for n, x in bad_args().items()}


def check_device(**over):
    a = device_args()
    kw = dict(scale=None, mask=None, q_max_seq_len=None, cache_offsets=None, q_start_pos=None, validate=True,
              device=True, read_offsets=True)
    kw.update({n: x for n, x in over.items() if n not in a})
    a.update({n: x for n, x in over.items() if n in a})
    return check_backward_inputs(*a.values(), **kw)


def test_valid_device_arguments_pass_the_checks():
    p = check_device(dq=dev(np.zeros((8, 2, 192), BF16)), dk=dev(np.zeros((9, 2, 128), BF16)),
                     dk_rope=dev(np.zeros((9, 1, 64), BF16)), out=dev(np.zeros((8, 2, 128), np.float32)),
                     deterministic=True, kernel="sm90")
    assert (p.batch, p.heads, p.tq, p.tk, p.max_sq) == (2, 2, 8, 9, 5)


DEVICE_BAD = [
    (dict(dout=dev(np.zeros((8, 2, 128), FP16))), TypeError, r"dout: expected dtype bfloat16 \(the dtype of q\), got float16"),
    (dict(dout=dev(np.zeros((8, 2, 128), np.float32))), TypeError, "dout: expected dtype bfloat16 .*got float32"),
    (dict(out=dev(np.zeros((8, 2, 128), np.float64))), TypeError,
     r"out: expected dtype bfloat16 or float32 \(the dtype of q, or float32\), got float64"),
    (dict(lse=dev(np.zeros((8, 2), np.float64))), TypeError, "lse: expected dtype float32, got float64"),
    (dict(dq=dev(np.zeros((8, 2, 192), FP16))), TypeError, r"dq: expected dtype bfloat16 \(the dtype of q\), got float16"),
    (dict(dq=dev(np.zeros((8, 2, 192), np.float32))), TypeError, r"dq: expected dtype bfloat16 \(the dtype of q\)"),
    (dict(dk=dev(np.zeros((9, 2, 128), np.float64))), TypeError, r"dk: expected dtype bfloat16 \(the dtype of q\)"),
    (dict(dv=dev(np.zeros((9, 2, 128), np.uint8))), TypeError, "dv: the backward takes no fp8 data"),
    (dict(dk_rope=dev(np.zeros((9, 1, 64), np.float64))), TypeError, r"dk_rope: expected dtype bfloat16 \(the dtype of q\)"),
    (dict(k_rope=dev(np.zeros((9, 1, 64), np.uint8))), TypeError, "k_rope: the backward takes no fp8 data"),
    (dict(k_rope=dev(np.zeros((9, 1, 64), FP16))), TypeError, r"k_rope: expected dtype bfloat16 \(the dtype of q\)"),
    (dict(q=dev(np.zeros((8, 2, 192), np.uint8))), TypeError, "q: expected dtype bfloat16 or float16, got uint8"),
    # where the backward's own arrays live, and their layout (after every other check)
    (dict(dout=np.zeros((8, 2, 128), BF16)), TypeError, "dout: expected a device array"),
    (dict(dk_rope=np.zeros((9, 1, 64), BF16)), TypeError, "dk_rope: expected a device array"),
    (dict(out=dev(np.zeros((8, 2, 256), BF16))[:, :, ::2]), ValueError, "out: the last dimension must be contiguous"),
    (dict(dq=dev(np.zeros((8, 2, 196), BF16))[:, :, :192]), ValueError,
     "dq: every stride but the last must be a multiple of 16 bytes"),
    (dict(lse=dev(np.zeros((2, 8), np.float32)).T), ValueError, "lse: the head dimension must be contiguous"),
    (dict(lse=np.zeros((8, 2), np.float32)), TypeError, "lse: expected a device array"),
]


@pytest.mark.parametrize("over,exc,match", DEVICE_BAD,
                         ids=[f"{list(o)[0]}-{i}" for i, (o, _, _) in enumerate(DEVICE_BAD)])
def test_the_gpu_checks_refuse_each_bad_argument_by_name(over, exc, match):
    with pytest.raises(exc, match=match):
        check_device(**over)


def test_host_data_on_a_machine_without_a_gpu_names_the_reference(as_if_no_gpu):
    a = bad_args()
    with pytest.raises(RuntimeError, match="use mla_cupy.reference.mla_prefill_backward on the CPU"):
        check_backward_inputs(*a.values(), scale=None, mask=None, q_max_seq_len=None, cache_offsets=None,
                              q_start_pos=None, validate=True, device=True, read_offsets=True,
                              api="mla_prefill_backward")


@pytest.mark.parametrize("mask", [CausalMask(), SlidingWindowCausalMask(3)], ids=["causal", "window"])
def test_the_gradient_of_lse_enters_as_the_loss_reads_it(mask):
    """``dlse``: the gradient of L = sum(dout * out) + sum(dlse * lse), against central differences
    (rows that see no key have lse -inf and take no part)."""
    c = make_case([4, 3], [6, 5], heads=2, dtype=np.float64, seed=41, cache_offsets=[3, 0], q_start_pos=[1, 7])
    rng = np.random.default_rng(41)
    scale = 0.13
    out, lse = forward(c, mask, scale)
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    grads = dict(zip(("q", "k", "v", "k_rope"), backward(c, dout, out, lse, mask, scale, dlse=dlse)))
    plain = backward(c, dout, out, lse, mask, scale)
    assert not np.allclose(grads["q"], plain[0])  # dlse changes the result

    def loss(name, delta):
        x = getattr(c, name)
        setattr(c, name, x + delta)
        try:
            o, l = forward(c, mask, scale)
            return float((dout * o).sum() + (dlse * np.where(np.isfinite(l), l, 0.0)).sum())
        finally:
            setattr(c, name, x)

    eps = 1e-5
    for name, g in grads.items():
        for _ in range(3):
            u = rng.standard_normal(getattr(c, name).shape)
            want = (loss(name, eps * u) - loss(name, -eps * u)) / (2 * eps)
            got = float((g * u).sum())
            assert abs(got - want) <= 1e-7 + 1e-6 * abs(want), (name, got, want)

"""benchmarks/ab.py's FlashAttention-3 rows on the CPU (torch on the CPU, FA3 replaced by a
recorder): the call takes K at 192 width, the batch offsets, the longest sequences, the scale and
the mask; ``+kbuild`` builds K inside each call; ``fa3-fp8`` gives e4m3 q, K and v with descales per
(sequence, head) that give the inputs back."""
import math

import numpy as np
import pytest
from _scripts import load_script

from mla_cupy import bench

torch = pytest.importorskip("torch")
ab = load_script("benchmarks/ab.py", "ab_fa3_tool")
peers = ab.peers

CASE = bench.BenchCase("ragged-3+5", (3, 5), (4, 6), heads=2, causal=True)


def _sets(n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(CASE.sq), sum(CASE.sk)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    return [dict(q=r(tq, 2, 192), k=r(tk, 2, 128), v=r(tk, 2, 128), k_rope=r(tk, 1, 64)) for _ in range(n)]


@pytest.fixture
def fa3_calls(monkeypatch):
    calls = []

    def fa3(q, k, v, cu_q, cu_k, mq, mk, **kw):
        calls.append(dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, mq=mq, mk=mk, **kw))
        return torch.zeros(q.shape[0], q.shape[1], 128), None  # (out, lse), as some versions return

    monkeypatch.setattr(peers, "fa3_function", lambda: (fa3, "recorder"))
    return calls


def test_fa3_takes_k_at_192_and_the_batch(fa3_calls):
    sets = _sets()
    call, _ = ab.FACTORIES["fa3"](CASE, sets, {})
    out = call(1)
    assert tuple(out.shape) == (8, 2, 128), "the output, not (out, lse)"
    c = fa3_calls[-1]
    assert c["q"].data_ptr() == sets[1]["q"].data_ptr() and c["v"].data_ptr() == sets[1]["v"].data_ptr()
    want_k = torch.cat([sets[1]["k"], sets[1]["k_rope"].expand(10, 2, 64)], dim=-1)
    assert torch.equal(c["k"], want_k)
    assert c["cu_q"].tolist() == [0, 3, 8] and c["cu_k"].tolist() == [0, 4, 10]
    assert c["cu_q"].dtype == torch.int32 and (c["mq"], c["mk"]) == (5, 6)
    assert c["softmax_scale"] == pytest.approx(1 / math.sqrt(192)) and c["causal"] is True
    assert "q_descale" not in c
    call(1)
    assert fa3_calls[-1]["k"] is c["k"], "K is built once, before the timed calls"


def test_kbuild_builds_k_inside_each_call(fa3_calls):
    sets = _sets()
    call, _ = ab.FACTORIES["fa3+kbuild"](CASE, sets, {})
    call(0)
    call(0)
    k1, k2 = fa3_calls[-2]["k"], fa3_calls[-1]["k"]
    assert k1 is not k2 and torch.equal(k1, k2) and k1.shape[-1] == 192


def test_fp8_gives_e4m3_inputs_with_descales_per_sequence_and_head(fa3_calls):
    sets = _sets()
    call, _ = ab.FACTORIES["fa3-fp8"](CASE, sets, {})
    call(0)
    c = fa3_calls[-1]
    for name, x, offs in (("q", sets[0]["q"], [0, 3, 8]),
                          ("k", peers.k192_of(sets[0], 2), [0, 4, 10]),
                          ("v", sets[0]["v"], [0, 4, 10])):
        x8, d = c[name], c[name + "_descale"]
        assert x8.dtype == torch.float8_e4m3fn and tuple(d.shape) == (2, 2) and d.dtype == torch.float32
        rows = torch.as_tensor(np.repeat([0, 1], np.diff(offs)))
        back = x8.float() * d[rows][:, :, None]
        err = (back - x.float()).abs().max() / x.float().abs().max()
        assert err < 2 ** -3, f"{name}: {err}"  # e4m3 keeps 3 mantissa bits
        for b in range(2):  # each (sequence, head)'s largest value maps to the top of e4m3
            seg = x8[offs[b]:offs[b + 1]].float().abs()
            assert torch.equal(seg.amax(dim=(0, 2)), torch.full((2,), 448.0))


def test_fa3_left_out_when_it_does_not_import(monkeypatch):
    monkeypatch.setattr(peers, "fa3_function", lambda: None)
    with pytest.raises(ab.LeftOut, match="fa3_fwd_interface"):
        ab.FACTORIES["fa3"](CASE, _sets(1), {})

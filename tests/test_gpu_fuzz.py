"""Property-based GPU test: random ragged batches, masks, windows, heads, dtypes, strides and rope
sources against the float64 reference, with NaN-poisoned outputs (pytest -m gpu)."""
import os
import warnings

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from mla_cupy import CausalMask, ChunkedCausalMask, ChunkedMask, NullMask, PagedKVCache, SlidingWindowCausalMask

from _cases import BF16, FP16, make_case
from gpu_util import KERNELS, run_and_check
from test_gpu_paged_merge import build_paged

pytestmark = pytest.mark.gpu

# lengths: 0, 1, and values around every tile size (64 keys, 128 query rows)
LENGTHS = st.one_of(st.sampled_from([0, 1, 2, 63, 64, 65, 127, 128, 129, 191, 257]), st.integers(0, 300))
MASK = st.one_of(
    st.just(NullMask()), st.just(CausalMask()),
    st.builds(SlidingWindowCausalMask, st.integers(1, 300)),
    st.builds(ChunkedMask, st.integers(1, 300)),
    st.builds(ChunkedCausalMask, st.integers(1, 300)),
)
RAN = []
# MLA_FUZZ_NO_SHRINK=1: report the first failing example as found (device time is scarce)
PHASES = [Phase.explicit, Phase.reuse, Phase.generate] if os.environ.get("MLA_FUZZ_NO_SHRINK") else list(Phase)


@st.composite
def problems(draw):
    b = draw(st.integers(0, 12))
    heads = draw(st.sampled_from([1, 16, 128])) if b <= 3 else draw(st.sampled_from([1, 16]))
    sq = [draw(LENGTHS) for _ in range(b)]
    prefix = [draw(st.sampled_from([0, 0, 1, 37, 200])) for _ in range(b)]
    sk = [max(0, s + p - draw(st.sampled_from([0, 0, 5]))) for s, p in zip(sq, prefix)]
    co = [draw(st.integers(0, 1000)) for _ in range(b)] if draw(st.booleans()) else None
    qs = [draw(st.integers(-300, 1500)) for _ in range(b)] if draw(st.booleans()) else None
    return dict(sq=sq, sk=sk, heads=heads, co=co, qs=qs, mask=draw(MASK), dtype=draw(st.sampled_from([BF16, FP16])),
                out_f32=draw(st.booleans()), paged=draw(st.sampled_from([None, 16, 64, 512])), seed=draw(st.integers(0, 2**31)),
                kernel=draw(st.sampled_from(KERNELS)))


@settings(max_examples=int(os.environ.get("MLA_FUZZ_EXAMPLES", "100")), deadline=None, suppress_health_check=list(HealthCheck),
          phases=PHASES)
@given(problems())
def test_fuzz_against_reference(p):
    import cupy as cp

    c = make_case(p["sq"], p["sk"], p["heads"], p["dtype"], seed=p["seed"], cache_offsets=p["co"], q_start_pos=p["qs"])
    kw = {}
    if p["paged"] and len(p["sq"]):
        blocks, lut = build_paged(c, p["paged"], seed=p["seed"] % 1000)
        kw = dict(k_rope=PagedKVCache(cp.asarray(blocks), cp.asarray(lut), p["paged"]),
                  ref_k_rope=PagedKVCache(blocks, lut, p["paged"]))
    run_and_check(c, mask=p["mask"], out_dtype=np.float32 if p["out_f32"] else None, kernel=p["kernel"], **kw)
    RAN.append(1)


@pytest.mark.skipif("sm90" not in KERNELS, reason="the fp8 variants run on the Hopper kernel")
@settings(max_examples=int(os.environ.get("MLA_FUZZ_EXAMPLES", "100")) // 2, deadline=None,
          suppress_health_check=list(HealthCheck), phases=PHASES)
@given(problems(), st.sampled_from(["fp8", "fp8_rope"]))
def test_fuzz_fp8_against_reference(p, variant):
    """The same random problems through the fp8 variants (bf16 inputs quantized on the host)."""
    import cupy as cp

    from mla_cupy import quant
    from test_gpu_fp8 import check_fp8, run_fp8_rope

    c = make_case(p["sq"], p["sk"], p["heads"], BF16, seed=p["seed"], cache_offsets=p["co"], q_start_pos=p["qs"])
    out_dtype = np.float32 if p["out_f32"] else None
    if variant == "fp8":
        # Wrong answers, not the accuracy bar: the contract's 3e-2 is asserted on the fixed cases of
        # test_gpu_fp8.py; on random short slices the e4m3 rounding of P alone reached 3.2% (H200),
        # so the fuzz allows 5e-2 here (the contract's bound for any slice is 6e-2).
        check_fp8(c, mask=p["mask"], out_dtype=out_dtype, tol=5e-2)
    else:
        r8, sc = quant.quantize_rope_blocks(c.k_rope)
        run_fp8_rope(c, cp.asarray(r8.view(np.uint8)), cp.asarray(sc), mask=p["mask"])
    RAN_FP8.append(1)


RAN_FP8 = []


def test_fuzz_report():
    warnings.warn(UserWarning(f"fuzz: {len(RAN)} random cases ran against the reference, "
                              f"{len(RAN_FP8)} more through the fp8 variants"))
    assert len(RAN) >= 1

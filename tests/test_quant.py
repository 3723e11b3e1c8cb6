"""fp8 quantizers (SPEC "Data types") and the fp8 references, on the CPU."""
import numpy as np
import pytest

from mla_cupy import fp8, quant, reference
from mla_cupy._arrays import FP8_E4M3
from mla_cupy.masks import CausalMask, NullMask

from _cases import BF16, make_case


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def test_e4m3_saturates_and_rounds():
    x = np.array([1000.0, -1e9, 448.0, 0.0, 1.0, 0.3], np.float32)
    y = quant.to_e4m3(x).astype(np.float32)
    assert y[0] == 448 and y[1] == -448 and y[2] == 448 and y[3] == 0 and y[4] == 1
    assert abs(y[5] - 0.3) <= 0.3 * 2 ** -4  # 3 mantissa bits: half an ulp is 1/16 relative


def test_per_token_scales_follow_the_spec():
    c = make_case([7, 5], [9, 4], 4, BF16, seed=3)
    qt = quant.quantize_per_token(c.q, c.k, c.v, c.k_rope)
    q32, k32 = c.q.astype(np.float32), c.k.astype(np.float32)
    np.testing.assert_array_equal(qt["q_scale"][:, 0], np.abs(q32).max(axis=(1, 2)) / 448)
    np.testing.assert_array_equal(qt["k_scales"][:, 0], np.abs(k32).max(axis=(1, 2)) / 448)
    assert qt["q_nope"].dtype == FP8_E4M3 and qt["k"].dtype == FP8_E4M3 and qt["v"].dtype == FP8_E4M3
    assert qt["q_rope"].dtype == BF16 and qt["k_rope"].dtype == BF16
    assert np.abs(qt["k"].astype(np.float32)).max() <= 448
    # dequantized inputs are the originals up to e4m3 / bf16 rounding
    deq_q = qt["q_scale"][:, :, None] * np.concatenate([qt["q_nope"].astype(np.float32), qt["q_rope"].astype(np.float32)], -1)
    assert rel(deq_q, q32) < 4e-2
    assert rel(qt["k_scales"][:, :, None] * qt["k_rope"].astype(np.float32), c.k_rope.astype(np.float32)) < 1e-2


def test_a_zero_token_gets_scale_one():
    q = np.zeros((2, 1, 192), np.float32)
    q[1] = 1.0
    k = np.zeros((1, 1, 128), np.float32)
    qt = quant.quantize_per_token(q, k, k, np.zeros((1, 1, 64), np.float32))
    assert qt["q_scale"][0, 0] == 1.0 and qt["k_scales"][0, 0] == 1.0
    assert not np.isnan(qt["q_nope"].astype(np.float32)).any()


@pytest.mark.parametrize("mask", [CausalMask(), NullMask()], ids=["causal", "null"])
def test_fp8_per_token_reference_tracks_bf16_attention(mask):
    c = make_case([33, 7, 1], [40, 7, 65], 16, BF16, seed=5)
    exact = reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets, mask=mask)
    qt = quant.quantize_per_token(c.q, c.k, c.v, c.k_rope)
    got = reference.mla_prefill_fp8(qt["q_nope"], qt["q_rope"], qt["q_scale"], qt["k"], qt["k_scales"], qt["v"],
                                    qt["k_rope"], c.valid_length, c.cache_row_offsets, mask=mask)
    assert rel(got, exact) < 8e-2  # fp8 inputs: a few percent, the SPEC's accuracy scale
    # the same data as uint8 bytes gives the same answer
    as_bytes = reference.mla_prefill_fp8(qt["q_nope"].view(np.uint8), qt["q_rope"], qt["q_scale"],
                                         qt["k"].view(np.uint8), qt["k_scales"], qt["v"].view(np.uint8), qt["k_rope"],
                                         c.valid_length, c.cache_row_offsets, mask=mask)
    np.testing.assert_array_equal(as_bytes, got)


def test_fp8_rope_reference():
    c = make_case([20, 3], [25, 9], 4, BF16, seed=6)
    exact = reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets)
    r8, rs = quant.quantize_rope_blocks(c.k_rope)
    assert rs.shape == (34, 1, 1) and rs.dtype == np.float32
    got = reference.mla_prefill_fp8_rope(c.q, c.k, c.v, r8, rs, c.valid_length, c.cache_row_offsets)
    assert rel(got, exact) < 3e-2


def test_fp8_without_scales_or_with_wrong_dtype_is_refused():
    c = make_case([4], [4], 2, BF16, seed=7)
    r8, rs = quant.quantize_rope_blocks(c.k_rope)
    with pytest.raises(ValueError, match=r"k_rope_scales: an fp8 \(uint8\) k_rope needs its float32 scales"):
        reference.mla_prefill_fp8_rope(c.q, c.k, c.v, r8, None, c.valid_length, c.cache_row_offsets)
    with pytest.raises(TypeError, match="k_rope_scales: expected dtype float32, got float64"):
        reference.mla_prefill_fp8_rope(c.q, c.k, c.v, r8, rs.astype(np.float64), c.valid_length, c.cache_row_offsets)
    with pytest.raises(ValueError, match=r"k_rope_scales: only an fp8 \(uint8\) k_rope has scales"):
        reference.mla_prefill_fp8_rope(c.q, c.k, c.v, c.k_rope, rs, c.valid_length, c.cache_row_offsets)


def test_quantizers_accept_empty_batches():
    """B = 0 / Tq = 0 / Tk = 0: empty outputs of the right shapes (found by the GPU fuzz)."""
    from mla_cupy._arrays import BF16

    q, k, v, r = (np.zeros((0, 4, n), BF16) for n in (192, 128, 128, 64))
    f = quant.quantize_per_token(q, k, v, r[:, :1])
    assert f["q_nope"].shape == (0, 4, 128) and f["q_scale"].shape == (0, 1) and f["k_scales"].shape == (0, 1)
    r8, sc = quant.quantize_rope_blocks(r[:, :1])
    assert r8.shape == (0, 1, 64) and sc.shape == (0, 1, 1)
    assert quant.dequantize_rope_blocks(r8, sc).shape == (0, 1, 64)


@pytest.mark.parametrize("sk", [[0], [1, 0, 7, 63, 65, 129, 40], [16, 32, 17], []])
def test_transpose_v_host_layout(sk):
    """The V^T model (kernels/vt_layout.cuh): every key of every sequence sits at column
    col0(b) + 16 * (j // 16) + p with VT_SIGMA[p] = j % 16, regions are 16-aligned and disjoint,
    and every other byte is zero."""
    rng = np.random.default_rng(len(sk))
    tk, heads = sum(sk) + 2, 3
    v = rng.integers(1, 256, (tk, heads, 128), dtype=np.uint8)  # no zero bytes: zeros mark the gaps
    cro = np.concatenate([[0], np.cumsum(sk)]).astype(np.int64)
    vt = quant.transpose_v_host(v, cro)
    assert vt.shape == (heads, 128, quant.vt_columns(tk, len(sk))) and vt.shape[2] % 16 == 0
    assert sorted(quant.VT_SIGMA) == list(range(16))
    seen = np.zeros(vt.shape[2], bool)
    for b in range(len(sk)):
        c0 = fp8.vt_col0(cro[b], b)
        assert c0 % 16 == 0
        for j in range(sk[b]):
            col = c0 + 16 * (j // 16) + int(np.flatnonzero(quant.VT_SIGMA == j % 16)[0])
            assert not seen[col], "regions overlap"
            seen[col] = True
            np.testing.assert_array_equal(vt[:, :, col], v[cro[b] + j])
    assert not vt[:, :, ~seen].any()


def test_per_token_e4m3_rope_scales_cover_the_rope():
    """e4m3_rope=True: q_scale as before (all 192 values of every head), k_scales over key j's 128
    nope values of every head AND its 64 rope values; every part e4m3 under those scales."""
    c = make_case([7, 5], [9, 4], 4, BF16, seed=3)
    c.k_rope[2] = c.k_rope[2] * 1000  # the rope decides key 2's scale
    qt = quant.quantize_per_token(c.q, c.k, c.v, c.k_rope, e4m3_rope=True)
    base = quant.quantize_per_token(c.q, c.k, c.v, c.k_rope)
    q32, k32, r32 = (x.astype(np.float32) for x in (c.q, c.k, c.k_rope))
    np.testing.assert_array_equal(qt["q_scale"], base["q_scale"])
    np.testing.assert_array_equal(qt["q_nope"].view(np.uint8), base["q_nope"].view(np.uint8))
    want = np.maximum(np.abs(k32).max(axis=(1, 2)), np.abs(r32).max(axis=(1, 2))) / 448
    np.testing.assert_array_equal(qt["k_scales"][:, 0], want.astype(np.float32))
    assert qt["k_scales"][2, 0] == np.float32(np.abs(r32[2]).max() / 448) > base["k_scales"][2, 0]
    for n in ("q_nope", "q_rope", "k", "k_rope", "v"):
        assert qt[n].dtype == FP8_E4M3, n
    deq_q = qt["q_scale"][:, :, None] * np.concatenate([qt["q_nope"].astype(np.float32), qt["q_rope"].astype(np.float32)], -1)
    assert rel(deq_q, q32) < 4e-2
    deq_r = qt["k_scales"][:, :, None] * qt["k_rope"].astype(np.float32)
    assert rel(deq_r, r32) < 4e-2 and np.abs(qt["k_rope"].astype(np.float32)).max() <= 448
    z = quant.quantize_per_token(np.zeros((1, 1, 192), np.float32), np.zeros((1, 1, 128), np.float32),
                                 np.zeros((1, 1, 128), np.float32), np.zeros((1, 1, 64), np.float32), e4m3_rope=True)
    assert z["q_scale"][0, 0] == 1.0 and z["k_scales"][0, 0] == 1.0  # an all-zero token: scale 1


@pytest.mark.parametrize("mask", [CausalMask(), NullMask()], ids=["causal", "null"])
def test_e4m3_mode_reference_tracks_bf16_attention(mask):
    """The reference reads e4m3 rope parts (ml_dtypes or their uint8 bytes) as the true query /
    key scaled by q_scale / k_scales, like the bf16 rope parts."""
    c = make_case([33, 7, 1], [40, 7, 65], 16, BF16, seed=5)
    exact = reference.mla_prefill(c.q, c.k, c.v, c.k_rope, c.valid_length, c.cache_row_offsets, mask=mask)
    qt = quant.quantize_per_token(c.q, c.k, c.v, c.k_rope, e4m3_rope=True)
    args = [qt[n] for n in ("q_nope", "q_rope", "q_scale", "k", "k_scales", "v", "k_rope")]
    got = reference.mla_prefill_fp8(*args, c.valid_length, c.cache_row_offsets, mask=mask)
    assert rel(got, exact) < 8e-2
    as_bytes = [a.view(np.uint8) if a.dtype == FP8_E4M3 else a for a in args]
    np.testing.assert_array_equal(reference.mla_prefill_fp8(*as_bytes, c.valid_length, c.cache_row_offsets, mask=mask),
                                  got)
    # the same values as bfloat16 rope parts (e4m3 is exact in bfloat16): the same float64 result
    as_bf16 = list(args)
    as_bf16[1], as_bf16[6] = (args[i].astype(np.float32).astype(BF16) for i in (1, 6))
    np.testing.assert_array_equal(reference.mla_prefill_fp8(*as_bf16, c.valid_length, c.cache_row_offsets, mask=mask),
                                  got)


def test_host_vt_model_is_the_kernels():
    """The host's V^T model (the CPU transposer and the reference need it without a compiled module)
    has the kernels' group size and column order: kVtAlign of kernels/vt_layout.cuh (read by
    mla_cupy.dims) and its vt_sigma, the formula evaluated here as the header writes it."""
    import re

    from mla_cupy import dims

    src = (dims.KERNEL_DIR / "vt_layout.cuh").read_text()
    align = dims.kernel_int("vt_layout.cuh", "kVtAlign")
    body = re.search(r"int vt_sigma\(int p\) \{ return (.*?); \}", src).group(1)
    assert fp8.VT_ALIGN == align
    assert [eval(body, {}, {"p": p}) for p in range(align)] == list(fp8.VT_SIGMA)

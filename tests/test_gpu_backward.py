"""GPU tests of mla_prefill_backward against the float64 reference backward (pytest -m gpu).

Every gradient is written into a NaN-poisoned output first, so a row the kernels never write fails.
The reference takes the forward's out and lse as the kernels do (the GPU forward's, here)."""
import numpy as np
import pytest

import mla_cupy
from mla_cupy import CausalMask, ChunkedCausalMask, ChunkedMask, NullMask, SlidingWindowCausalMask, reference

from _cases import BF16, FP16, make_case, rel_err
from gpu_util import GRADIENTS, KERNELS, BackwardProblem

pytestmark = pytest.mark.gpu

kernels = pytest.mark.parametrize("kernel", KERNELS)
MASKS = [NullMask(), CausalMask(), SlidingWindowCausalMask(37), ChunkedMask(50), ChunkedCausalMask(50)]
# odd lengths, a sequence without queries, one with fewer keys than a key block, one over several blocks
ODD_SQ = [1, 7, 63, 65, 129, 0, 200]
ODD_SK = [1, 7, 63, 65, 129, 5, 300]


def assert_like_reference(c, mask, kernel, deterministic=False, **kw):
    """Forward (out and lse) and backward on the GPU into poisoned buffers, every gradient against the
    reference (gpu_util.check_gradients); returns the gradients on the host."""
    import cupy as cp

    bp = BackwardProblem(c, mask, kernel, **kw)
    grads = bp.run(deterministic=deterministic)
    bp.check(grads)
    return [cp.asnumpy(g) for g in grads]


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@kernels
def test_every_mask_and_dtype(mask, dtype, kernel):
    c = make_case(ODD_SQ, ODD_SK, 16, dtype, seed=len(type(mask).__name__))
    assert_like_reference(c, mask, kernel)


@pytest.mark.parametrize("mask", [CausalMask(), NullMask()], ids=lambda m: type(m).__name__)
@kernels
def test_128_heads(mask, kernel):
    c = make_case([300, 1, 130], [300, 1, 200], 128, BF16, seed=3)
    assert_like_reference(c, mask, kernel)


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: type(m).__name__)
@kernels
def test_prefix_context_and_positions(mask, kernel):
    c = make_case([65, 100, 1, 33], [300, 1000, 129, 33], 16, BF16, seed=7, cache_offsets=[0, 77, 1000, 5])
    assert_like_reference(c, mask, kernel)
    c = make_case([64, 50, 20], [128, 40, 20], 16, FP16, seed=8, cache_offsets=[100, 0, 3], q_start_pos=[150, -30, -7])
    assert_like_reference(c, mask, kernel)


@pytest.mark.parametrize("mask", [CausalMask(), SlidingWindowCausalMask(37)], ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@kernels
def test_without_read_back_tk_bounds_the_grid(mask, deterministic, kernel):
    """With q_max_seq_len and validate=False nothing is read back: the grid spans Tk's key blocks,
    the blocks past a sequence's own end do nothing (a ragged batch, an empty sequence, prefix
    context, query positions; rows after the last sequence); deterministic mode repeats its bits."""
    import cupy as cp

    c = make_case([65, 0, 1, 200, 30], [300, 4, 129, 201, 31], 16, BF16, seed=23,
                  cache_offsets=[0, 3, 7, 50, 0], q_start_pos=[200, 0, 100, 40, 1], extra_keys=70)
    bp = BackwardProblem(c, mask, kernel)
    call = dict(q_max_seq_len=200, validate=False, deterministic=deterministic)
    first = bp.run(**call)
    bp.check(first)
    if deterministic:
        again = bp.run(**call)
        assert all(cp.asnumpy(a).tobytes() == cp.asnumpy(b).tobytes() for a, b in zip(first, again))


@kernels
def test_rows_of_no_sequence_and_queries_that_see_nothing(kernel):
    # Key rows past the last sequence get zero gradients; queries at negative positions (causal) see no
    # key and get a zero dq.
    c = make_case([40, 30], [50, 20], 16, BF16, seed=11, q_start_pos=[-100, 5], extra_keys=37)
    grads = assert_like_reference(c, CausalMask(), kernel)
    for g in grads[1:]:
        assert not g[70:].astype(np.float32).any()
    assert not grads[0][:40].astype(np.float32).any()


@kernels
def test_no_queries_or_no_sequences(kernel):
    assert_like_reference(make_case([0, 0], [30, 5], 16, BF16, seed=12), CausalMask(), kernel)
    assert_like_reference(make_case([], [], 16, BF16, seed=13, extra_keys=9), CausalMask(), kernel)


@kernels
@pytest.mark.parametrize("layout", ["end-aligned", "keys-past-every-query"])
def test_deterministic_mode_repeats_bits(kernel, layout):
    """Deterministic mode: correct and the same bits on every run; also where the last key blocks
    of a sequence are seen by no query (query positions given: 1 query at 50 before 200 keys),
    whose empty ranges of query blocks must not hide the blocks before them from the key-block
    order of the dq sums (which then waited forever)."""
    import cupy as cp

    if layout == "end-aligned":
        c = make_case([300, 129], [400, 129], 16, BF16, seed=14)
    else:
        c = make_case([1, 300, 70], [200, 129, 500], 16, BF16, seed=14, q_start_pos=[50, 0, 5])
    bp = BackwardProblem(c, CausalMask(), kernel)
    first = bp.run(deterministic=True)
    bp.check(first)
    for _ in range(3):
        again = bp.run(deterministic=True)
        for a, b in zip(first, again):
            assert cp.asnumpy(a).tobytes() == cp.asnumpy(b).tobytes()


@kernels
def test_rope_as_a_view_of_latent_rows_and_torch_tensors(kernel):
    import torch

    c = make_case([77, 200], [99, 250], 8, BF16, seed=15)
    dev = "cuda"
    t = {n: torch.from_numpy(np.asarray(getattr(c, n).view(np.uint16) if getattr(c, n).dtype == BF16
                                        else getattr(c, n))) for n in ("q", "k", "v", "k_rope")}
    q, k, v = (t[n].view(torch.bfloat16).to(dev) for n in ("q", "k", "v"))
    latent = torch.randn(c.k_rope.shape[0], 1, 576, device=dev, dtype=torch.bfloat16)
    latent[:, :, 512:] = t["k_rope"].view(torch.bfloat16).to(dev)
    rope = latent[:, :, 512:576]
    vl, cro = (torch.from_numpy(x.astype(np.int32)).to(dev) for x in (c.valid_length, c.cache_row_offsets))
    out, lse = mla_cupy.mla_prefill(q, k, v, rope, vl, cro, return_lse=True, kernel=kernel)
    dout = torch.randn(out.shape, device=dev, dtype=torch.bfloat16)
    dq, dk, dv, dkr = mla_cupy.mla_prefill_backward(dout, q, k, v, rope, out, lse, vl, cro, kernel=kernel)
    assert all(isinstance(x, torch.Tensor) for x in (dq, dk, dv, dkr)) and dkr.shape == (c.k_rope.shape[0], 1, 64)

    def host(x):
        return x.float().cpu().numpy()

    ref = reference.mla_prefill_backward(host(dout), c.q, c.k, c.v, c.k_rope, host(out), host(lse), c.valid_length,
                                         c.cache_row_offsets)
    for name, g, r in zip(GRADIENTS, (dq, dk, dv, dkr), ref):
        assert rel_err(host(g), r) < 1e-2, name


@kernels
def test_gradient_of_lse(kernel):
    assert_like_reference(make_case([130, 33], [200, 33], 16, BF16, seed=16), None, kernel, dlse=True, seed=5)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@kernels
def test_float32_out_dlse_deterministic(dtype, kernel):
    """The forward's float32 out (the pre-pass reads it), the gradient of lse and deterministic mode
    together, on a ragged batch with an empty sequence, prefix context and query positions."""
    c = make_case([70, 1, 0, 129], [100, 1, 9, 200], 16, dtype, seed=18, cache_offsets=[0, 5, 3, 40],
                  q_start_pos=[30, 5, 0, 90])
    assert_like_reference(c, SlidingWindowCausalMask(100), kernel, deterministic=True, out_dtype=np.float32,
                          dlse=True)


@pytest.mark.parametrize("deterministic", [False, True])
def test_autograd_through_the_torch_op(deterministic):
    """loss.backward() through mla_cupy.torch_ops.mla_prefill on CUDA tensors (out and lse in the
    loss) against the reference backward of the same out, lse, dout and dlse."""
    import torch

    from mla_cupy import torch_ops

    c = make_case([130, 7], [300, 7], 16, BF16, seed=17)

    def t(x):
        return torch.from_numpy(np.ascontiguousarray(x.view(np.uint16))).view(torch.bfloat16).cuda()

    q, k, v, r = (t(getattr(c, n)).requires_grad_() for n in ("q", "k", "v", "k_rope"))
    vl, cro = (torch.from_numpy(x.astype(np.int32)).cuda() for x in (c.valid_length, c.cache_row_offsets))
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    try:
        out, lse = torch_ops.mla_prefill(q, k, v, r, vl, cro, return_lse=True)
        dout, dlse = torch.randn_like(out), torch.randn_like(lse)
        ((out.float() * dout.float()).sum() + (lse * dlse).sum()).backward()
    finally:
        torch.use_deterministic_algorithms(False)

    def host(x):
        return x.detach().float().cpu().numpy()

    ref = reference.mla_prefill_backward(host(dout), c.q, c.k, c.v, c.k_rope, host(out), host(lse), c.valid_length,
                                         c.cache_row_offsets, dlse=host(dlse))
    for name, g, w in zip(GRADIENTS, (q.grad, k.grad, v.grad, r.grad), ref):
        assert rel_err(host(g), w) < 1e-2, name


@kernels
def test_a_plans_run_backward_and_a_cached_call(kernel):
    """A plan's run_backward (ragged, prefix context, query positions) against the reference, run
    again into new poisoned buffers, and bit-equal in deterministic mode to the one-shot call, which
    the plan cache then serves (a hit) with the same bits."""
    import cupy as cp

    c = make_case([65, 0, 1, 200], [300, 4, 129, 201], 16, BF16, seed=19, cache_offsets=[0, 3, 7, 50],
                  q_start_pos=[200, 0, 100, 40])
    bp = BackwardProblem(c, CausalMask(), kernel)
    d = bp.d
    pl = mla_cupy.plan(d["valid_length"], d["cache_row_offsets"], num_heads=16, dtype=BF16, mask=CausalMask(),
                       kernel=kernel, **bp.extra)

    def run_plan():
        grads = bp.gradients()
        got = pl.run_backward(bp.dout, d["q"], d["k"], d["v"], d["k_rope"], bp.out, bp.lse, dq=grads[0],
                              dk=grads[1], dv=grads[2], dk_rope=grads[3], deterministic=True)
        assert all(g is w for g, w in zip(got, grads))
        return grads

    first = run_plan()
    bp.check(first)
    again = run_plan()
    hits = mla_cupy.plan_cache_info().hits
    for _ in range(2):
        one_shot = bp.run(deterministic=True)
        for a, b, c_ in zip(first, again, one_shot):
            assert cp.asnumpy(a).tobytes() == cp.asnumpy(b).tobytes() == cp.asnumpy(c_).tobytes()
    assert mla_cupy.plan_cache_info().hits >= hits + 1

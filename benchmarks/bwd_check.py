"""First GPU check of the backward: our gradients against float64 ones computed on the GPU by torch
(the same formulas from the given out and lse, and autograd of a dense float64 forward), per case;
deterministic repeatability; then a rough timing against torch SDPA's cuDNN backward."""
import math
import sys
import time

import cupy as cp
import numpy as np
import torch

import mla_cupy
from mla_cupy.backward import mla_prefill_backward

dev = "cuda"


def positions(sq, sk, co=0, qs=None):
    kp = co + torch.arange(sk, device=dev)
    q0 = qs if qs is not None else co + sk - sq
    return q0 + torch.arange(sq, device=dev), kp


def visible(mask, qp, kp):
    q, k = qp[:, None], kp[None, :]
    name = type(mask).__name__
    if name == "NullMask":
        return torch.ones(q.shape[0], k.shape[1], dtype=torch.bool, device=dev)
    if name == "CausalMask":
        return k <= q
    a = mask.arg
    if name == "SlidingWindowCausalMask":
        return (k <= q) & (q - k < a)
    if name == "ChunkedMask":
        return torch.div(q, a, rounding_mode="floor") == torch.div(k, a, rounding_mode="floor")
    if name == "ChunkedCausalMask":
        return (k <= q) & (torch.div(q, a, rounding_mode="floor") == torch.div(k, a, rounding_mode="floor"))
    raise ValueError(name)


def ref_backward(dout, q, k, v, rope, out, lse, sq, sk, mask, scale, co):
    """float64, from the given out and lse (what the kernel computes); and autograd of a dense forward."""
    H = q.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float64, device=dev)
    dk = torch.zeros(k.shape, dtype=torch.float64, device=dev)
    dv = torch.zeros(v.shape, dtype=torch.float64, device=dev)
    dr = torch.zeros(rope.shape, dtype=torch.float64, device=dev)
    adq, adk, adv, adr = (torch.zeros_like(x) for x in (dq, dk, dv, dr))
    qo, ko = 0, 0
    for b in range(len(sq)):
        a, n = sq[b], sk[b]
        if a and n:
            qp, kp = positions(a, n, co[b])
            vis = visible(mask, qp, kp)  # [a, n]
            Q = q[qo:qo + a].double()
            K = torch.cat([k[ko:ko + n].double(), rope[ko:ko + n].double().expand(n, H, 64)], -1)
            V = v[ko:ko + n].double()
            dO = dout[qo:qo + a].double()
            S = torch.einsum("qhd,khd->hqk", Q, K) * scale
            L = lse[qo:qo + a].double().T[:, :, None]  # [H, a, 1]
            P = torch.where(vis[None], torch.exp(S - torch.where(torch.isinf(L), torch.zeros_like(L), L)), 0.0)
            P = torch.where(torch.isinf(L), 0.0, P)
            D = (dO * out[qo:qo + a].double()).sum(-1).T[:, :, None]
            dP = torch.einsum("qhd,khd->hqk", dO, V)
            dS = torch.where(vis[None], P * (dP - D), 0.0)
            dv[ko:ko + n] = torch.einsum("hqk,qhd->khd", P, dO)
            dq[qo:qo + a] = torch.einsum("hqk,khd->qhd", dS, K) * scale
            dK = torch.einsum("hqk,qhd->khd", dS, Q) * scale
            dk[ko:ko + n] = dK[..., :128]
            dr[ko:ko + n, 0] = dK[..., 128:].sum(1)
            # autograd of a dense forward
            Qa, Ka, Va, Ra = (x.detach().requires_grad_() for x in (Q, k[ko:ko + n].double(), V, rope[ko:ko + n].double()))
            Kf = torch.cat([Ka, Ra.expand(n, H, 64)], -1)
            Sa = torch.einsum("qhd,khd->hqk", Qa, Kf) * scale
            Sa = Sa.masked_fill(~vis[None], -math.inf)
            Pa = torch.softmax(Sa, -1).nan_to_num(0.0)
            Oa = torch.einsum("hqk,khd->qhd", Pa, Va)
            (Oa * dO).sum().backward()
            adq[qo:qo + a], adk[ko:ko + n], adv[ko:ko + n], adr[ko:ko + n] = Qa.grad, Ka.grad, Va.grad, Ra.grad
        qo += a
        ko += n
    return (dq, dk, dv, dr), (adq, adk, adv, adr)


def rel(a, b):
    a, b = a.double(), b.double()
    d = torch.linalg.norm((a - b).flatten())
    n = torch.linalg.norm(b.flatten())
    return float(d / n) if n > 0 else float(d)


def case(sq, sk, H, mask, dtype=torch.bfloat16, co=None, seed=0, det=False):
    torch.manual_seed(seed)
    B = len(sq)
    co = co or [0] * B
    Tq, Tk = sum(sq), sum(sk)
    q = torch.randn(Tq, H, 192, device=dev, dtype=dtype)
    k = torch.randn(Tk, H, 128, device=dev, dtype=dtype)
    v = torch.randn(Tk, H, 128, device=dev, dtype=dtype)
    rope = torch.randn(Tk, 1, 64, device=dev, dtype=dtype)
    dout = torch.randn(Tq, H, 128, device=dev, dtype=dtype)
    vl = torch.tensor(np.cumsum([0] + sq), dtype=torch.int32, device=dev)
    cro = torch.tensor(np.cumsum([0] + sk), dtype=torch.int32, device=dev)
    cot = torch.tensor(co, dtype=torch.int32, device=dev)
    out, lse = mla_cupy.mla_prefill(q, k, v, rope, vl, cro, mask=mask, cache_offsets=cot, return_lse=True)
    poison = [torch.full(s, float("nan"), device=dev, dtype=dtype) for s in
              ((Tq, H, 192), (Tk, H, 128), (Tk, H, 128), (Tk, 1, 64))]
    g = mla_prefill_backward(dout, q, k, v, rope, out, lse, vl, cro, mask=mask, cache_offsets=cot,
                             dq=poison[0], dk=poison[1], dv=poison[2], dk_rope=poison[3], deterministic=det)
    torch.cuda.synchronize()
    ref, auto = ref_backward(dout, q, k, v, rope, out, lse, sq, sk, mask, 1 / math.sqrt(192), co)
    errs = [rel(x, r) for x, r in zip(g, ref)]
    aerrs = [rel(r, a) for r, a in zip(ref, auto)]
    nans = [int(torch.isnan(x).sum()) for x in g]
    rep = None
    if det:
        g2 = mla_prefill_backward(dout, q, k, v, rope, out, lse, vl, cro, mask=mask, cache_offsets=cot, deterministic=True)
        rep = all(torch.equal(a, b) for a, b in zip(g, g2))
    return errs, aerrs, nans, rep


def cases():
    M = mla_cupy
    return [
        ("H16 1x128 causal", [128], [128], 16, M.CausalMask()),
        ("H16 1x512 causal", [512], [512], 16, M.CausalMask()),
        ("H16 1x300 null", [300], [300], 16, M.NullMask()),
        ("H16 ragged causal", [300, 17, 0, 129, 64], [1300, 17, 40, 129, 200], 16, M.CausalMask()),
        ("H16 swc 100", [700], [700], 16, M.SlidingWindowCausalMask(100)),
        ("H16 chunked 128", [500], [600], 16, M.ChunkedMask(128)),
        ("H16 chunkedcausal 96", [500], [500], 16, M.ChunkedCausalMask(96)),
        ("H128 1x1024 causal", [1024], [1024], 128, M.CausalMask()),
        ("H8 fp16 ragged", [77, 200], [99, 250], 8, M.CausalMask()),
    ]


def run_case(i):
    name, sq, sk, H, mask = cases()[i]
    dt = torch.float16 if "fp16" in name else torch.bfloat16
    errs, aerrs, nans, _ = case(sq, sk, H, mask, dt)
    print(f"{name:24s} rel err dq dk dv dkr {['%.2e' % e for e in errs]} (formula vs autograd "
          f"{['%.1e' % e for e in aerrs]}) nan {nans}", flush=True)


def main():
    import subprocess
    for i in range(len(cases())):
        try:
            r = subprocess.run([sys.executable, __file__, "case", str(i)], capture_output=True, text=True,
                               timeout=120 if i == 0 else 60)
        except subprocess.TimeoutExpired:
            print(f"case {i} ({cases()[i][0]}) TIMED OUT (a hang?)", flush=True)
            return
        print(r.stdout.strip() or f"case {i} ({cases()[i][0]}) FAILED: {r.stderr.strip()[-600:]}", flush=True)
        if r.returncode and i == 0:
            san = subprocess.run(["compute-sanitizer", "--tool", "memcheck", "--print-limit", "6", sys.executable, __file__,
                                  "case", "0"], capture_output=True, text=True, timeout=120)
            print("memcheck:", (san.stdout + san.stderr)[-4000:], flush=True)
            return
    errs, _, nans, rep = case([1000, 333], [1000, 400], 16, mla_cupy.CausalMask(), det=True)
    print(f"deterministic: errs {['%.2e' % e for e in errs]} nan {nans} repeat-equal {rep}", flush=True)
    # timing
    for H, S in ((128, 4096), (128, 8192)):
        torch.manual_seed(0)
        q = torch.randn(S, H, 192, device=dev, dtype=torch.bfloat16)
        k = torch.randn(S, H, 128, device=dev, dtype=torch.bfloat16)
        v = torch.randn(S, H, 128, device=dev, dtype=torch.bfloat16)
        rope = torch.randn(S, 1, 64, device=dev, dtype=torch.bfloat16)
        dout = torch.randn(S, H, 128, device=dev, dtype=torch.bfloat16)
        vl = torch.tensor([0, S], dtype=torch.int32, device=dev)
        out, lse = mla_cupy.mla_prefill(q, k, v, rope, vl, vl, return_lse=True)
        bufs = [torch.empty(s, device=dev, dtype=torch.bfloat16) for s in ((S, H, 192), (S, H, 128), (S, H, 128), (S, 1, 64))]

        from mla_cupy.backward import prepare_backward
        launch, ptrs, _res, sp = prepare_backward(dout, q, k, v, rope, out, lse, vl, vl, scale=None, mask=None,
                                                  q_max_seq_len=S, cache_offsets=None, q_start_pos=None, dq=bufs[0],
                                                  dk=bufs[1], dv=bufs[2], dk_rope=bufs[3], deterministic=False,
                                                  stream=None, validate=False, kernel="auto")
        ws = cp.empty((launch.ws_floats,), cp.float32)
        print(f"  workspace {launch.workspace_bytes() / 2**20:.0f} MiB, groups {launch.groups}, grid {launch.main.grid}")

        def ours():
            launch.launch(ptrs, sp, ws)

        from torch.nn.attention import SDPBackend, sdpa_kernel
        qt = q.permute(1, 0, 2)[None].detach().requires_grad_()
        kt = torch.cat([k, rope.expand(S, H, 64)], -1).permute(1, 0, 2)[None].detach().requires_grad_()
        vt = v.permute(1, 0, 2)[None].detach().requires_grad_()
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=1 / math.sqrt(192))
        go = dout.permute(1, 0, 2)[None]

        def cudnn():
            torch.autograd.grad(o, (qt, kt, vt), go, retain_graph=True)

        flops = 2 * (192 + 128 + 128 + 192 + 192) * H * S * (S + 1) / 2
        res = {}
        for fn, nm in ((ours, "ours"), (cudnn, "cudnn"), (ours, "ours"), (cudnn, "cudnn")):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            st.record()
            n = 10
            for _ in range(n):
                fn()
            en.record()
            torch.cuda.synchronize()
            res.setdefault(nm, []).append(st.elapsed_time(en) / n)
        print(f"H{H} 1x{S}: ours {res['ours']} ms ({flops / min(res['ours']) / 1e9:.0f} TFLOP/s), cudnn {res['cudnn']} ms "
              f"({flops / min(res['cudnn']) / 1e9:.0f} TFLOP/s)", flush=True)


def ab(base_dir: str, rounds: int = 7):
    """The backward of the kernels under base_dir against the current ones, one process, interleaved
    rounds in alternating order; median of per-round time ratios (current / base), spread, SM clock."""
    import statistics

    import _variant
    from ab import NvmlSampler
    from mla_cupy import _backward
    from mla_cupy.backward import prepare_backward

    specs = [("H128 1x4096", 128, [4096]), ("H128 1x8192", 128, [8192]), ("H16 1x8192", 16, [8192]),
             ("H128 ragged 512..4096", 128, [512, 1024, 2048, 4096]), ("H128 1x2048", 128, [2048])]
    with NvmlSampler() as nv:
        for name, H, seqs in specs:
            torch.manual_seed(0)
            S = sum(seqs)
            q = torch.randn(S, H, 192, device=dev, dtype=torch.bfloat16)
            k = torch.randn(S, H, 128, device=dev, dtype=torch.bfloat16)
            v = torch.randn(S, H, 128, device=dev, dtype=torch.bfloat16)
            rope = torch.randn(S, 1, 64, device=dev, dtype=torch.bfloat16)
            dout = torch.randn(S, H, 128, device=dev, dtype=torch.bfloat16)
            vl = torch.tensor(np.cumsum([0] + seqs), dtype=torch.int32, device=dev)
            out, lse = mla_cupy.mla_prefill(q, k, v, rope, vl, vl, return_lse=True)
            variants = {}
            for label, src in (("base", base_dir), ("new", None)):
                saved = _variant.use_sources(src) if src else None
                _backward._KERNELS.clear()
                bufs = [torch.empty(s, device=dev, dtype=torch.bfloat16) for s in
                        ((S, H, 192), (S, H, 128), (S, H, 128), (S, 1, 64))]
                launch, ptrs, _r, sp = prepare_backward(
                    dout, q, k, v, rope, out, lse, vl, vl, scale=None, mask=None, q_max_seq_len=max(seqs),
                    cache_offsets=None, q_start_pos=None, dq=bufs[0], dk=bufs[1], dv=bufs[2], dk_rope=bufs[3],
                    deterministic=False, stream=None, validate=False, kernel="auto")
                ws = cp.empty((launch.ws_floats,), cp.float32)
                variants[label] = (launch, ptrs, sp, ws, bufs)
                if saved is not None:
                    _variant.restore(saved)
                _backward._KERNELS.clear()
            for label, (launch, ptrs, sp, ws, bufs) in variants.items():
                launch.launch(ptrs, sp, ws)
            torch.cuda.synchronize()
            diffs = [rel(a, b) for a, b in zip(variants["new"][4], variants["base"][4])]
            flops = 2 * (192 + 128 + 128 + 192 + 192) * H * sum(s * (s + 1) / 2 for s in seqs)
            times = {"base": [], "new": []}
            mark = nv.mark()
            for r in range(rounds):
                order = ["base", "new"] if r % 2 == 0 else ["new", "base"]
                for label in order:
                    launch, ptrs, sp, ws, _ = variants[label]
                    for _ in range(2):
                        launch.launch(ptrs, sp, ws)
                    reps = []
                    for _ in range(5):
                        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        st.record()
                        launch.launch(ptrs, sp, ws)
                        en.record()
                        torch.cuda.synchronize()
                        reps.append(st.elapsed_time(en))
                    times[label].append(statistics.median(reps))
            ratios = [n / b for n, b in zip(times["new"], times["base"])]
            clk = nv.summary(mark)
            print(f"{name:22s} new/base time {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}); "
                  f"base {statistics.median(times['base']):.3f} ms = {flops / statistics.median(times['base']) / 1e9:.0f}"
                  f" TFLOP/s, new {statistics.median(times['new']):.3f} ms = "
                  f"{flops / statistics.median(times['new']) / 1e9:.0f}; SM {clk.get('sm_mhz_median', 0):.0f} MHz "
                  f"({clk.get('sm_mhz_min', 0):.0f}-{clk.get('sm_mhz_max', 0):.0f}), {clk.get('power_w_median', 0):.0f} W;"
                  f" new vs base rel diff {['%.1e' % d for d in diffs]}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "case":
        run_case(int(sys.argv[2]))
    elif len(sys.argv) > 2 and sys.argv[1] == "ab":
        ab(sys.argv[2])
    else:
        main()

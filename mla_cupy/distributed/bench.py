"""Context-parallel prefill on W ranks against one device: equality per mask, then scaling.

Run on W GPUs (one process per GPU)::

    torchrun --nproc-per-node W -m mla_cupy.distributed.bench --seq 131072 --heads 128

On one GPU without torchrun (W = 1), or on the CPU with gloo and the float64 reference at a tiny
size (a smoke test of the whole path)::

    python -m mla_cupy.distributed.bench --seq 32768 --heads 16
    torchrun --nproc-per-node 2 -m mla_cupy.distributed.bench --device cpu --seq 64 --heads 2

What it does, in one run:

1. equality: a ragged batch (three sequences, one with keys before its queries) under every mask,
   and a paged rope cache (each rank's cache holds only its own keys; the others' slots are NaN),
   through the ring and the all-gather, gathered and compared with the one-device call
   (relative error per (sequence, head) slice against the contract's bound, lse, empty rows);
2. scaling: 1 x ``--seq`` tokens, causal: the one-device call (every rank runs it on its own
   device at the same time), the ring and the all-gather on W ranks, the ring's communication
   alone (no compute) and its compute alone (no communication), and the parallel efficiency
   ``t(1) / (W * t(W))``.

NCCL's NVLink multicast (NVLS) stays off: the variables of ``NVLS_OFF`` are set in ``os.environ``
before the process group starts (torchrun passes the environment to every rank it starts).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TOL = 1e-2  # the contract: bf16 per-slice relative error


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init(device: str):
    """Start the process group (torchrun's environment, or a one-process group) and pick the
    rank's device; returns it."""
    import torch
    import torch.distributed as dist

    os.environ.update(NVLS_OFF)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        kw = {"device_id": torch.device("cuda", torch.cuda.current_device())} if device == "cuda" else {}
        if "RANK" in os.environ:
            dist.init_process_group(backend, **kw)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, **kw)
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def make_problem(sq: Sequence[int], sk: Sequence[int], heads: int, device, dtype, seed: int,
                 cache_offsets: Optional[Sequence[int]] = None) -> Dict[str, Any]:
    """The same random ragged problem on every rank (a seeded generator on the rank's device)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    tq, tk = int(sum(sq)), int(sum(sk))

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    off = {"device": device, "dtype": torch.int32}
    return dict(q=randn(tq, heads, 192), k=randn(tk, heads, 128), v=randn(tk, heads, 128), k_rope=randn(tk, 1, 64),
                valid_length=torch.tensor(np.r_[0, np.cumsum(sq)], **off),
                cache_row_offsets=torch.tensor(np.r_[0, np.cumsum(sk)], **off),
                cache_offsets=None if cache_offsets is None else torch.tensor(cache_offsets, **off))


def one_device(p: Dict[str, Any], mask, k_rope=None):
    """The one-device call: the kernel on CUDA, the float64 reference on the CPU; ``(out, lse)``."""
    import torch

    import mla_cupy
    from mla_cupy import PagedKVCache

    rope = p["k_rope"] if k_rope is None else k_rope
    if p["q"].is_cuda:
        return mla_cupy.mla_prefill(p["q"], p["k"], p["v"], rope, p["valid_length"], p["cache_row_offsets"],
                                    mask=mask, cache_offsets=p["cache_offsets"], return_lse=True)

    def host(x):
        return None if x is None else x.detach().numpy()

    if isinstance(rope, PagedKVCache):
        rope = PagedKVCache(host(rope.blocks).astype(np.float64), host(rope.lookup_table), rope.page_size, rope.rope_offset)
    else:
        rope = host(rope).astype(np.float64)
    o, l = mla_cupy.reference.mla_prefill(*(host(p[n]).astype(np.float64) for n in ("q", "k", "v")), rope,
                                          host(p["valid_length"]), host(p["cache_row_offsets"]), mask=mask,
                                          cache_offsets=None if p["cache_offsets"] is None
                                          else host(p["cache_offsets"]).astype(np.uint32), return_lse=True)
    return torch.from_numpy(o).to(p["q"].dtype), torch.from_numpy(l)


def compare(out, lse, ref_out, ref_lse, valid_length) -> Dict[str, float]:
    """Worst per-(sequence, head) relative error of ``out``, worst |lse - ref| on seen rows, and
    whether the rows that see no key agree (0 output, -inf lse)."""
    import torch

    o, r = out.double().cpu(), ref_out.double().cpu()
    l, rl = lse.double().cpu(), ref_lse.double().cpu()
    vl = valid_length.cpu().numpy().astype(np.int64)
    worst = 0.0
    for b in range(len(vl) - 1):
        rs, os_ = r[vl[b]:vl[b + 1]], o[vl[b]:vl[b + 1]]
        den = torch.linalg.vector_norm(rs, dim=(0, 2))
        num = torch.linalg.vector_norm(os_ - rs, dim=(0, 2))
        if len(den):
            worst = max(worst, float(torch.where(den > 0, num / torch.where(den > 0, den, 1), num).max()))
    empty = torch.isneginf(rl)
    seen = ~empty
    lse_err = float((l[seen] - rl[seen]).abs().max()) if bool(seen.any()) else 0.0
    empty_ok = bool(torch.equal(torch.isneginf(l), empty)) and bool((o[empty] == 0).all())
    return {"rel_err": worst, "lse_err": lse_err, "empty_rows_ok": empty_ok}


def own_pages_cache(p: Dict[str, Any], layout, rank: int, page_size: int):
    """A paged rope cache that holds only ``rank``'s keys (one block per page of each sequence;
    every other slot NaN, so reading another rank's key would show), and the full cache the
    one-device call reads."""
    import torch

    from ..paged import PagedKVCache

    vl_k = p["cache_row_offsets"].cpu().numpy().astype(np.int64)
    co = np.zeros(len(vl_k) - 1, np.int64) if p["cache_offsets"] is None else p["cache_offsets"].cpu().numpy()
    pages = int(max(((co + np.diff(vl_k) + page_size - 1) // page_size).max(), 1))
    batch, dev, dt = len(vl_k) - 1, p["q"].device, p["q"].dtype
    lut = torch.arange(batch * pages, dtype=torch.int32, device=dev).view(batch, pages)
    full = torch.zeros((batch * pages, page_size, 1, 576), dtype=dt, device=dev)
    mine = torch.full_like(full, float("nan"))
    for b in range(batch):
        t = torch.arange(int(co[b]), int(co[b] + vl_k[b + 1] - vl_k[b]), device=dev)
        full[lut[b, t // page_size].long(), t % page_size, 0, 512:] = p["k_rope"][vl_k[b]:vl_k[b + 1], 0]
    rows = torch.from_numpy(layout.k.positions(rank)).to(dev)
    seq = torch.from_numpy(layout.k.sequences(rank)).to(dev)
    ids, slots = lut[seq, rows // page_size].long(), rows % page_size
    mine[ids, slots] = full[ids, slots]
    return PagedKVCache(mine, lut, page_size), PagedKVCache(full, lut, page_size)


def check_equality(args, device, dtype) -> List[Dict[str, Any]]:
    """Step 1: every mask, ring and all-gather, and a paged cache, against the one-device call."""
    import torch.distributed as dist

    from .. import masks
    from .prefill import VARIANTS, context_parallel_prefill
    from .shard import gather, shard

    n = args.check_seq
    sq = [n, n // 3 + 17, 5]
    prefix = n // 4
    sk = [n, n // 3 + 17 + prefix, 5]
    p = make_problem(sq, sk, args.heads, device, dtype, seed=1, cache_offsets=[0, 3, 2 * n])
    mask_list = [kind.from_arg(max(1, n // 5) if kind is masks.SlidingWindowCausalMask else max(1, n // 3))
                 for kind in masks.MASK_KINDS]  # windows of n // 5 keys, chunks of n // 3
    rows = []
    args_in = (p["q"], p["k"], p["v"], p["k_rope"], p["valid_length"], p["cache_row_offsets"])
    sh = shard(*args_in, cache_offsets=p["cache_offsets"])
    cases = [(m, None) for m in mask_list] + [(masks.CausalMask(), args.page_size)]
    for mask, page_size in cases:
        if page_size is None:
            local, ref_rope = sh, None
        else:
            mine, ref_rope = own_pages_cache(p, sh.layout, dist.get_rank(), page_size)
            local = sh._replace(k_rope=mine)
        ref_out, ref_lse = one_device(p, mask, ref_rope)
        for variant in VARIANTS:
            o, l = context_parallel_prefill(*local, mask=mask, return_lse=True, variant=variant)
            res = compare(gather(o, sh.layout), gather(l, sh.layout), ref_out, ref_lse, p["valid_length"])
            res.update(check="equality", mask=repr(mask), variant=variant, paged=page_size,
                       ok=res["rel_err"] < TOL and res["empty_rows_ok"])
            rows.append(res)
    return rows


def timed(fn: Callable[[], Any], iters: int, warmup: int, cuda: bool) -> float:
    """Median seconds of ``fn`` on this rank, each run started after a barrier; the maximum over
    the ranks (a W-rank call ends when its slowest rank does)."""
    import torch
    import torch.distributed as dist

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    t = torch.tensor([float(np.median(times))], dtype=torch.float64, device="cuda" if cuda else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def scaling(args, device, dtype) -> Dict[str, Any]:
    """Step 2: 1 x seq tokens, causal, on one device and on W ranks."""
    import torch
    import torch.distributed as dist

    from ..masks import CausalMask
    from .attention import NoAttention, default_attention
    from .prefill import context_parallel_prefill, run_prefill
    from .shard import shard
    from .transport import TorchTransport

    cuda = device.type == "cuda"
    w = dist.get_world_size()
    n = args.seq
    p = make_problem([n], [n], args.heads, device, dtype, seed=2)
    mask = CausalMask()
    t1 = timed(lambda: one_device(p, mask), args.iters, args.warmup, cuda)
    sh = shard(p["q"], p["k"], p["v"], p["k_rope"], p["valid_length"], p["cache_row_offsets"])
    del p
    if cuda:
        torch.cuda.empty_cache()
    tr = TorchTransport()
    res: Dict[str, Any] = {"check": "scaling", "world_size": w, "seq": n, "heads": args.heads, "t1_s": t1}
    for variant in ("ring", "all_gather"):
        res[f"t_{variant}_s"] = timed(lambda: context_parallel_prefill(*sh, mask=mask, variant=variant),
                                      args.iters, args.warmup, cuda)
    attn = default_attention(sh.q)
    body = (sh.q, sh.k, sh.v, sh.k_rope, sh.layout, tr)
    res["t_ring_comm_only_s"] = timed(lambda: run_prefill(*body, NoAttention(), mask=mask, scale=None),
                                      args.iters, args.warmup, cuda)
    res["t_ring_compute_only_s"] = timed(lambda: run_prefill(*body, attn, mask=mask, scale=None, exchange=False),
                                         args.iters, args.warmup, cuda)
    for variant in ("ring", "all_gather"):
        res[f"efficiency_{variant}"] = t1 / (w * res[f"t_{variant}_s"])
    pairs = n * (n + 1) / 2
    res["tflops_per_gpu_ring"] = 2 * args.heads * pairs * (192 + 128) / res["t_ring_s"] / w / 1e12
    return res


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m mla_cupy.distributed.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=131072, help="tokens of the scaling run (one sequence, causal)")
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--check-seq", type=int, default=4096, help="tokens of the longest sequence of the equality batch")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: gloo and the float64 reference (a smoke test at tiny sizes)")
    ap.add_argument("--skip-scaling", action="store_true")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results here (rank 0)")
    return ap.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run both steps; rank 0 prints one JSON line per result. Returns 1 when an equality check fails."""
    import torch
    import torch.distributed as dist

    args = parse(argv)
    device = init(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float64
    rank = dist.get_rank()
    results = check_equality(args, device, dtype)
    if not args.skip_scaling:
        results.append(scaling(args, device, dtype))
    ok = all(r.get("ok", True) for r in results)
    if rank == 0:
        env = {"world_size": dist.get_world_size(), "backend": dist.get_backend(), "torch": torch.__version__,
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               **{k: os.environ.get(k) for k in NVLS_OFF}}
        for r in [env] + results:
            print(json.dumps(r), flush=True)
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump({"env": env, "results": results}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

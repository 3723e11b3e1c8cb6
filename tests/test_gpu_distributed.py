"""Context-parallel prefill on GPUs (pytest -m gpu): W ranks simulated as threads on one GPU
through the same ring code, real W = 2 / 4 / 8 over NCCL where the GPUs exist, and the runner,
all against the one-GPU ``mla_prefill`` and the float64 reference."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mla_cupy  # noqa: E402
from mla_cupy import PagedKVCache, reference  # noqa: E402
from mla_cupy.masks import (CausalMask, ChunkedCausalMask, ChunkedMask, NullMask,  # noqa: E402
                            SlidingWindowCausalMask)
from mla_cupy.distributed import VARIANTS, context_parallel_prefill, gather, shard, simulate  # noqa: E402

from _cases import BF16, make_case, per_slice_errors  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch without CUDA")]

ROOT = Path(__file__).resolve().parent.parent
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
MASKS = [NullMask(), CausalMask(), SlidingWindowCausalMask(100), ChunkedMask(128), ChunkedCausalMask(96)]
TOL = 1e-2  # SPEC: bf16 per-slice relative error


def ragged_case(seed=0):
    """Three sequences, one with 150 keys before its queries, one shorter than 2W."""
    return make_case([700, 333, 5], [700, 483, 5], heads=4, seed=seed, cache_offsets=[0, 17, 900])


def to_torch(case, device):
    def t(x):
        return torch.from_numpy(np.asarray(x, np.float32)).to(device=device, dtype=torch.bfloat16)

    return dict(q=t(case.q), k=t(case.k), v=t(case.v), k_rope=t(case.k_rope),
                valid_length=torch.from_numpy(case.valid_length.astype(np.int32)).to(device),
                cache_row_offsets=torch.from_numpy(case.cache_row_offsets.astype(np.int32)).to(device),
                cache_offsets=torch.from_numpy(case.cache_offsets.astype(np.int32)).to(device))


def paged(case, device, page_size=64):
    """The case's rope in a paged cache (pages in reverse order): host copy for the reference, device copy."""
    cro, co = case.cache_row_offsets.astype(np.int64), case.cache_offsets.astype(np.int64)
    sk = np.diff(cro)
    pages = int(((co + sk + page_size - 1) // page_size).max())
    batch = len(sk)
    lut = np.arange(batch * pages, dtype=np.int32)[::-1].reshape(batch, pages).copy()
    blocks = np.zeros((batch * pages, page_size, 1, 576), np.float32)
    for b in range(batch):
        t = co[b] + np.arange(sk[b])
        blocks[lut[b, t // page_size], t % page_size, 0, 512:] = case.k_rope[cro[b]:cro[b + 1], 0].astype(np.float32)
    host = PagedKVCache(blocks.astype(BF16), lut, page_size)
    dev = PagedKVCache(torch.from_numpy(blocks).to(device=device, dtype=torch.bfloat16), torch.from_numpy(lut).to(device),
                       page_size)
    return host, dev


def check(case, out, lse, mask, ref_rope=None, one_gpu=None):
    """CP result vs the float64 reference (SPEC accuracy) and vs the one-GPU kernel result."""
    got = out.float().cpu().numpy().astype(np.float64)
    ref, ref_lse = reference.mla_prefill(case.q, case.k, case.v, case.k_rope if ref_rope is None else ref_rope,
                                         case.valid_length, case.cache_row_offsets, mask=mask,
                                         cache_offsets=case.cache_offsets, return_lse=True)
    assert not np.isnan(got).any()
    empty = np.isneginf(ref_lse)
    assert np.all(got[empty] == 0)
    assert max(per_slice_errors(got, ref, case.valid_length)) < TOL
    lse_h = lse.cpu().numpy()
    np.testing.assert_array_equal(np.isneginf(lse_h), empty)
    np.testing.assert_allclose(lse_h[~empty], ref_lse[~empty], rtol=2e-2, atol=2e-2)
    if one_gpu is not None:
        o1 = one_gpu.float().cpu().numpy().astype(np.float64)
        assert max(per_slice_errors(got, o1, case.valid_length)) < TOL


def run_simulated(p, world, mask, variant, k_rope=None):
    def rank_fn(tr):
        sh = shard(p["q"], p["k"], p["v"], p["k_rope"], p["valid_length"], p["cache_row_offsets"],
                   cache_offsets=p["cache_offsets"], transport=tr)
        if k_rope is not None:
            sh = sh._replace(k_rope=k_rope)
        o, l = context_parallel_prefill(*sh, mask=mask, return_lse=True, variant=variant, transport=tr)
        return gather(o, sh.layout, transport=tr), gather(l, sh.layout, transport=tr)

    return simulate(world, rank_fn)[0]


@pytest.mark.parametrize("mask", MASKS, ids=repr)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_simulated_ranks_match_one_gpu(world, mask):
    case = ragged_case(seed=world)
    p = to_torch(case, "cuda")
    one = mla_cupy.mla_prefill(p["q"], p["k"], p["v"], p["k_rope"], p["valid_length"], p["cache_row_offsets"],
                               mask=mask, cache_offsets=p["cache_offsets"])
    for variant in VARIANTS:
        out, lse = run_simulated(p, world, mask, variant)
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and out.is_cuda
        check(case, out, lse, mask, one_gpu=one)


@pytest.mark.parametrize("world", [2, 4])
def test_simulated_ranks_paged_rope(world):
    case = ragged_case(seed=9)
    p = to_torch(case, "cuda")
    host_cache, dev_cache = paged(case, "cuda")
    for mask in (CausalMask(), ChunkedCausalMask(96)):
        out, lse = run_simulated(p, world, mask, "ring", k_rope=dev_cache)
        check(case, out, lse, mask, ref_rope=host_cache)


def _nccl_worker(rank, world, init_file):
    import torch.distributed as dist

    os.environ.update(NVLS_OFF)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    case = ragged_case(seed=world)
    p = to_torch(case, torch.device("cuda", rank))
    host_cache, dev_cache = paged(case, torch.device("cuda", rank))
    sh = shard(p["q"], p["k"], p["v"], p["k_rope"], p["valid_length"], p["cache_row_offsets"],
               cache_offsets=p["cache_offsets"])
    for mask, k_rope, ref_rope in [(m, None, None) for m in MASKS] + [(CausalMask(), dev_cache, host_cache)]:
        one = mla_cupy.mla_prefill(p["q"], p["k"], p["v"], p["k_rope"], p["valid_length"], p["cache_row_offsets"],
                                   mask=mask, cache_offsets=p["cache_offsets"])
        local = sh if k_rope is None else sh._replace(k_rope=k_rope)
        for variant in VARIANTS:
            o, l = context_parallel_prefill(*local, mask=mask, return_lse=True, variant=variant)
            out, lse = gather(o, sh.layout), gather(l, sh.layout)
            check(case, out, lse, mask, ref_rope=ref_rope, one_gpu=one)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_nccl_ranks_match_one_gpu(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    import torch.multiprocessing as mp

    os.environ.update(NVLS_OFF)  # inherited by the spawned ranks
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_nccl_worker, args=(world, os.path.join(d, "init")), nprocs=world, join=True)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_runner(world, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    out = tmp_path / "cp.json"
    launch = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                                                  str(world)]
    cmd = launch + ["-m", "mla_cupy.distributed.bench", "--seq", "16384", "--heads", "16", "--check-seq", "2048",
                    "--iters", "2", "--warmup", "1", "--json", str(out)]
    env = {**os.environ, **NVLS_OFF, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["env"]["world_size"] == world and res["env"]["backend"] == "nccl"
    checks = [r for r in res["results"] if r["check"] == "equality"]
    assert len(checks) == 2 * 6 and all(r["ok"] for r in checks)
    s = next(r for r in res["results"] if r["check"] == "scaling")
    assert s["t1_s"] > 0 and s["t_ring_s"] > 0 and s["t_ring_comm_only_s"] > 0 and s["t_ring_compute_only_s"] > 0
    assert 0 < s["efficiency_ring"] <= 1.5

"""Context-parallel prefill without a GPU: the zigzag layout, the ring schedule and its mask skips
(host code), the ring run as threads of one process and as gloo processes with the float64
reference as local attention, and the runner under torchrun, all against the one-process reference."""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mla_cupy import PagedKVCache, reference  # noqa: E402
from mla_cupy.masks import (CausalMask, ChunkedCausalMask, ChunkedMask, NullMask,  # noqa: E402
                            SlidingWindowCausalMask)
from mla_cupy.distributed import (VARIANTS, ZigzagLayout, block_visible, context_parallel_prefill,  # noqa: E402
                                  gather, rank_chunks, rank_schedule, shard, simulate)
from mla_cupy.distributed.transport import TorchTransport  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MASKS = [NullMask(), CausalMask(), SlidingWindowCausalMask(9), ChunkedMask(16), ChunkedCausalMask(13)]
H = 2


def ragged(seed=0, sq=(37, 0, 50, 9, 3), prefix=(0, 5, 20, 0, 0), cache_offsets=(3, 0, 10, 100, 7), q_start_pos=None):
    """A ragged float64 batch: some sequences with keys before their queries, one with no queries,
    one shorter than 2W (empty chunks)."""
    rng = np.random.default_rng(seed)
    sk = [a + b for a, b in zip(sq, prefix)]
    tq, tk = sum(sq), sum(sk)
    return dict(q=rng.standard_normal((tq, H, 192)), k=rng.standard_normal((tk, H, 128)),
                v=rng.standard_normal((tk, H, 128)), k_rope=rng.standard_normal((tk, 1, 64)),
                valid_length=np.r_[0, np.cumsum(sq)].astype(np.uint32),
                cache_row_offsets=np.r_[0, np.cumsum(sk)].astype(np.uint32),
                cache_offsets=np.asarray(cache_offsets, np.uint32),
                q_start_pos=None if q_start_pos is None else np.asarray(q_start_pos, np.int64))


def one_process(p, mask, k_rope=None):
    return reference.mla_prefill(p["q"], p["k"], p["v"], p["k_rope"] if k_rope is None else k_rope,
                                 p["valid_length"], p["cache_row_offsets"], mask=mask,
                                 cache_offsets=p["cache_offsets"], q_start_pos=p["q_start_pos"], return_lse=True)


def assert_same(out, lse, ref, ref_lse):
    out, lse = np.asarray(out), np.asarray(lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    seen = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=0, atol=1e-10)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-10)
    assert np.all(out[~seen] == 0)


def paged_caches(p, layout, rank, page_size=16):
    """The one-process paged cache of ``p``'s rope, and ``rank``'s own copy of it: only the slots of
    its keys hold values, every other slot is NaN (reading another rank's key would show)."""
    cro, co = p["cache_row_offsets"].astype(np.int64), p["cache_offsets"].astype(np.int64)
    sk = np.diff(cro)
    pages = int(((co + sk + page_size - 1) // page_size).max())
    batch = len(sk)
    lut = (np.arange(batch * pages, dtype=np.int32).reshape(batch, pages) * 7) % (batch * pages)  # scattered blocks
    blocks = np.full((batch * pages, page_size, 1, 576), np.nan)
    for b in range(batch):
        t = co[b] + np.arange(sk[b])
        blocks[lut[b, t // page_size], t % page_size, 0, 512:] = p["k_rope"][cro[b]:cro[b + 1], 0]
    mine = np.full_like(blocks, np.nan)
    t, s = layout.k.positions(rank), layout.k.sequences(rank)
    ids = lut[s, t // page_size]
    mine[ids, t % page_size] = blocks[ids, t % page_size]
    return PagedKVCache(blocks, lut, page_size), PagedKVCache(torch.from_numpy(mine), torch.from_numpy(lut), page_size)


# ---- host code: layout, skip logic, schedule -------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_layout_partitions_rows_and_positions(world):
    p = ragged(seed=world)
    lay = ZigzagLayout.from_offsets(p["valid_length"], p["cache_row_offsets"], world, cache_offsets=p["cache_offsets"])
    for side, off, total in ((lay.q, p["valid_length"], p["q"].shape[0]), (lay.k, p["cache_row_offsets"], p["k"].shape[0])):
        rows = np.concatenate([side.rows(r) for r in range(world)])
        np.testing.assert_array_equal(np.sort(rows), np.arange(total))
        assert sum(side.count(r) for r in range(world)) == total
        seq_of_row = np.searchsorted(off.astype(np.int64), np.arange(total), side="right") - 1
        for r in range(world):
            np.testing.assert_array_equal(side.sequences(r), seq_of_row[side.rows(r)])
            start = off.astype(np.int64)[side.sequences(r)]
            np.testing.assert_array_equal(side.positions(r), side.pos0[side.sequences(r)] + side.rows(r) - start)
        sizes = np.diff(side.bounds, axis=1)
        assert np.all(sizes.max(axis=1) - sizes.min(axis=1) <= 1)
    # queries default to the end of the keys, as in the one-GPU call
    np.testing.assert_array_equal(lay.q.pos0, lay.k.pos0 + lay.k.lengths - lay.q.lengths)
    assert rank_chunks(0, world) == (0, 2 * world - 1)


def brute_visible(mask, q_lo, q_hi, k_lo, k_hi):
    qp, kp = np.arange(q_lo, q_hi)[:, None], np.arange(k_lo, k_hi)[None, :]
    return bool(mask.visible(qp, kp).any()) if qp.size and kp.size else False


@pytest.mark.parametrize("mask", MASKS + [SlidingWindowCausalMask(1), ChunkedCausalMask(1)], ids=repr)
def test_block_visible_is_exact(mask):
    rng = np.random.default_rng(7)
    for _ in range(3000):
        q_lo, k_lo = (int(x) for x in rng.integers(-40, 60, 2))
        q_hi, k_hi = q_lo + int(rng.integers(0, 30)), k_lo + int(rng.integers(0, 30))
        assert block_visible(mask, q_lo, q_hi, k_lo, k_hi) == brute_visible(mask, q_lo, q_hi, k_lo, k_hi), \
            (q_lo, q_hi, k_lo, k_hi)


@pytest.mark.parametrize("mask", MASKS, ids=repr)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_schedule_covers_every_visible_pair_once(mask, world):
    p = ragged(seed=3)
    lay = ZigzagLayout.from_offsets(p["valid_length"], p["cache_row_offsets"], world, cache_offsets=p["cache_offsets"])
    tq, tk = p["q"].shape[0], p["k"].shape[0]
    vl, cro = p["valid_length"].astype(np.int64), p["cache_row_offsets"].astype(np.int64)
    qseq = np.searchsorted(vl, np.arange(tq), side="right") - 1
    kseq = np.searchsorted(cro, np.arange(tk), side="right") - 1
    qpos = lay.q.pos0[qseq] + np.arange(tq) - vl[qseq]
    kpos = lay.k.pos0[kseq] + np.arange(tk) - cro[kseq]
    visible = (qseq[:, None] == kseq[None, :]) & mask.visible(qpos[:, None], kpos[None, :])
    covered = np.zeros((tq, tk), np.int64)
    for rank in range(world):
        steps = rank_schedule(lay, rank, mask)
        assert len(steps) == world
        qrows = lay.q.rows(rank)
        for step, calls in enumerate(steps):
            for c in calls:
                assert c.src == (rank - step) % world
                krows = lay.k.rows(c.src)
                seen_any = False
                for i in range(len(c.q_pos0)):
                    qr = qrows[c.q_rows[0] + c.q_offsets[i]:c.q_rows[0] + c.q_offsets[i + 1]]
                    kr = krows[c.k_rows[0] + c.k_offsets[i]:c.k_rows[0] + c.k_offsets[i + 1]]
                    if len(qr):
                        assert qpos[qr[0]] == c.q_pos0[i]
                    if len(kr):
                        assert kpos[kr[0]] == c.k_pos0[i]
                    covered[np.ix_(qr, kr)] += 1
                    seen_any |= bool(visible[np.ix_(qr, kr)].any())
                assert seen_any, "a call the mask removes entirely was scheduled"
                assert c.max_q == int(np.diff(c.q_offsets).max())
    assert covered.max() <= 1, "a (query, key) pair computed twice"
    np.testing.assert_array_equal(covered[visible], 1)  # every visible pair computed once


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_zigzag_balances_causal_work_and_skips_half_the_calls(world):
    n = 2 * world * 5
    lay = ZigzagLayout.from_offsets(np.array([0, n]), np.array([0, n]), world)
    work = []
    for rank in range(world):
        steps = rank_schedule(lay, rank, CausalMask())
        assert [len(s) for s in steps] == [3] + [2] * (world - 1)
        pairs = 0
        for c in (c for s in steps for c in s):
            qp = c.q_pos0[0] + np.arange(c.q_offsets[1])
            kp = c.k_pos0[0] + np.arange(c.k_offsets[1])
            pairs += int(CausalMask().visible(qp[:, None], kp[None, :]).sum())
        work.append(pairs)
    assert len(set(work)) == 1 and sum(work) == n * (n + 1) // 2


def test_sliding_window_skips_far_blocks():
    world, n = 4, 800
    lay = ZigzagLayout.from_offsets(np.array([0, n]), np.array([0, n]), world)
    counts = [sum(len(s) for s in rank_schedule(lay, r, SlidingWindowCausalMask(10))) for r in range(world)]
    full = [sum(len(s) for s in rank_schedule(lay, r, CausalMask())) for r in range(world)]
    # a window of 10 keys reaches the own chunk and the one before it only
    assert all(c <= 4 for c in counts) and sum(counts) < sum(full)


# ---- the ring as W threads of one process, float64 reference ----------------------------------------


def run_threads(p, world, mask, variant, paged=False, out_dtype=None):
    def rank_fn(tr):
        t = {n: torch.from_numpy(p[n]) for n in ("q", "k", "v", "k_rope")}
        sh = shard(t["q"], t["k"], t["v"], t["k_rope"], p["valid_length"], p["cache_row_offsets"],
                   cache_offsets=p["cache_offsets"], q_start_pos=p["q_start_pos"], transport=tr)
        if paged:
            sh = sh._replace(k_rope=paged_caches(p, sh.layout, tr.rank)[1])
        o, l = context_parallel_prefill(*sh, mask=mask, return_lse=True, variant=variant, transport=tr,
                                        out_dtype=out_dtype)
        return gather(o, sh.layout, transport=tr), gather(l, sh.layout, transport=tr)

    return simulate(world, rank_fn)


@pytest.mark.parametrize("mask", MASKS, ids=repr)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_threads_match_one_process(mask, world):
    p = ragged(seed=world)
    ref, ref_lse = one_process(p, mask)
    for variant in VARIANTS:
        results = run_threads(p, world, mask, variant)
        for out, lse in results:  # every rank gathers the same full result
            assert out.dtype == torch.float64
            assert_same(out, lse, ref, ref_lse)


@pytest.mark.parametrize("world", [2, 4])
def test_threads_paged_rope_each_rank_reads_its_own_pages(world):
    p = ragged(seed=11)
    lay = ZigzagLayout.from_offsets(p["valid_length"], p["cache_row_offsets"], world, cache_offsets=p["cache_offsets"])
    full_cache = paged_caches(p, lay, 0)[0]
    for mask in (CausalMask(), ChunkedMask(16)):
        ref, ref_lse = one_process(p, mask, k_rope=full_cache)
        out, lse = run_threads(p, world, mask, "ring", paged=True)[0]
        assert_same(out, lse, ref, ref_lse)


def test_threads_query_positions_inside_the_keys_and_out_dtype():
    # chunked prefill: queries at given positions in the middle of their keys (q_start_pos)
    p = ragged(seed=5, sq=(20, 31), prefix=(30, 9), cache_offsets=(0, 4), q_start_pos=(12, 10))
    ref, ref_lse = one_process(p, CausalMask())
    out, lse = run_threads(p, 3, CausalMask(), "ring", out_dtype=np.float32)[1]
    assert out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), ref, rtol=0, atol=1e-6)
    np.testing.assert_allclose(lse.numpy(), ref_lse, rtol=0, atol=1e-10)


def test_errors_name_the_argument():
    p = ragged()
    lay = ZigzagLayout.from_offsets(p["valid_length"], p["cache_row_offsets"], 2)
    with pytest.raises(ValueError, match="world_size"):
        ZigzagLayout.from_offsets(p["valid_length"], p["cache_row_offsets"], 0)
    with pytest.raises(ValueError, match="valid_length"):
        ZigzagLayout.from_offsets(np.array([1, 4]), np.array([0, 4]), 2)
    with pytest.raises(ValueError, match="cache_offsets"):
        ZigzagLayout.from_offsets(p["valid_length"], p["cache_row_offsets"], 2, cache_offsets=np.array([1]))
    with pytest.raises(ValueError, match="rank"):
        rank_schedule(lay, 2, CausalMask())
    with pytest.raises(ValueError, match="group"):
        TorchTransport()

    def call(tr, **kw):
        t = {n: torch.from_numpy(p[n]) for n in ("q", "k", "v", "k_rope")}
        sh = shard(t["q"], t["k"], t["v"], t["k_rope"], p["valid_length"], p["cache_row_offsets"], transport=tr)
        args = dict(zip(("q", "k", "v", "k_rope", "layout"), sh))
        args.update(kw)
        return context_parallel_prefill(**args, transport=tr)

    for kw, exc, word in ((dict(variant="tree"), ValueError, "variant"), (dict(mask="causal"), TypeError, "mask"),
                          (dict(layout=ZigzagLayout.from_offsets(p["valid_length"], p["cache_row_offsets"], 3)),
                           ValueError, "layout"), (dict(layout=None), TypeError, "layout"),
                          (dict(q=torch.zeros(3, H, 192, dtype=torch.float64)), ValueError, "q"),
                          (dict(out_dtype=np.int32), TypeError, "out_dtype")):
        with pytest.raises(exc, match=word):
            simulate(2, lambda tr: call(tr, **kw))


def test_import_needs_no_torch():
    code = "import sys, mla_cupy, mla_cupy.distributed; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


# ---- gloo processes and the runner under torchrun ------------------------------------------------------


def _gloo_worker(rank, world, init_file):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    groups = {w: dist.new_group(list(range(w))) for w in (2, 3)}  # every rank creates every group
    groups[world] = None  # the world group
    for w, group in sorted(groups.items()):
        if rank >= w:
            continue
        p = ragged(seed=20 + w)
        for mask in MASKS:
            ref, ref_lse = one_process(p, mask)
            t = {n: torch.from_numpy(p[n]) for n in ("q", "k", "v", "k_rope")}
            sh = shard(t["q"], t["k"], t["v"], t["k_rope"], p["valid_length"], p["cache_row_offsets"],
                       cache_offsets=p["cache_offsets"], group=group)
            for variant in VARIANTS:
                o, l = context_parallel_prefill(*sh, mask=mask, return_lse=True, variant=variant, group=group)
                assert_same(gather(o, sh.layout, group=group), gather(l, sh.layout, group=group), ref, ref_lse)
    dist.destroy_process_group()


@pytest.mark.slow  # three process groups of 2, 3 and 4 processes
def test_gloo_processes_w2_w3_w4_match_one_process():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_gloo_worker, args=(4, os.path.join(d, "init")), nprocs=4, join=True)


@pytest.mark.slow  # torchrun starts two processes that import torch
def test_runner_under_torchrun_on_cpu(tmp_path):
    out = tmp_path / "cp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "mla_cupy.distributed.bench",
           "--device", "cpu", "--seq", "48", "--heads", "2", "--check-seq", "40", "--iters", "1", "--warmup", "0",
           "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    import json

    res = json.loads(out.read_text())
    assert res["env"]["world_size"] == 2 and res["env"]["NCCL_NVLS_ENABLE"] == "0"
    checks = [r for r in res["results"] if r["check"] == "equality"]
    assert len(checks) == 2 * 6 and all(r["ok"] for r in checks)
    assert all(r["rel_err"] < 1e-12 for r in checks)
    scaling = next(r for r in res["results"] if r["check"] == "scaling")
    assert scaling["world_size"] == 2 and scaling["t_ring_s"] > 0 and scaling["efficiency_ring"] > 0


def test_merge_into_is_the_reference_merge():
    """The host merge of the reference backend is mla_cupy.reference.merge_states, empty sides included."""
    from mla_cupy.distributed.attention import merge_into

    rng = np.random.default_rng(3)
    out, part = (torch.from_numpy(rng.standard_normal((6, 2, 128))) for _ in range(2))
    lse, part_lse = (torch.from_numpy(rng.standard_normal((6, 2))) for _ in range(2))
    lse[0], part_lse[1] = -np.inf, -np.inf  # one empty side each
    lse[2], part_lse[2] = -np.inf, -np.inf  # both empty
    want_out, want_lse = reference.merge_states(out.numpy(), lse.numpy(), part.numpy(), part_lse.numpy())
    before = out.clone()
    merge_into(out, lse, part, part_lse)
    assert np.array_equal(out.numpy(), want_out) and np.array_equal(lse.numpy(), want_lse)
    assert torch.equal(out[0], part[0]) and torch.equal(out[1], before[1])  # an empty side adds nothing
    assert (out[2] == 0).all() and (lse[2] == -np.inf).all()

// The producer warpgroup's two roles.
//   load thread (warp 0): takes the key tiles (scheduler.cuh) and issues every TMA copy: a tile's
//     rope rows once (k's column blocks 4-5), then per head of its group that head's k (blocks 0-3)
//     and v once the consumers are done with the previous head's, then per query block the q rows
//     with their lse_log2 (q_full) and the dout rows with their D (do_full), into a ring of kStages.
//     Tiles whose key block no query sees load nothing (the consumers write zero gradients).
//   dq thread (warp 1): per query block, each consumer's staged 64 x 96 dq half added to the
//     block's dq_accum chunk by one bulk reduction (cp.reduce.async.bulk .add.f32), the staging
//     released once the reduction has read it; at the end of a tile that a query sees, each
//     consumer's staged rope rows (its keys that exist) added to rope_part's one slot likewise.
//     Deterministic mode: the reductions of a chunk in key block order (the chunk's semaphore counts
//     the key blocks that have added to it), and a key block's rope rows in head-group order (the
//     block's semaphore counts the groups that have added them).
#pragma once
#include "config.cuh"
#include "scheduler.cuh"
#include "shared_storage.cuh"

namespace mla {
namespace sm90_bwd {

template <class Mask>
__device__ __forceinline__ void producer_load(const Params& p, const Smem& sm, const KeyTiles& sched,
                                              const Mask& mask) {
  using namespace sm90;
  int it = 0;     // query blocks loaded: the position in the q / dout ring
  int heads = 0;  // heads loaded (kv_full's completions)
  int tiles = 0;  // tiles whose rope was loaded (rope_full's)
  int idx = blockIdx.x;
  for (int n = 0;; ++n) {
    bwd::KeyTile t;
    idx = sched.find(p, mask, idx, t);
    sched.publish(n, t);
    if (!t.valid) break;
    if (t.m_begin < t.m_end) {
      const WorkTile& w = t.w;
      const int kv_row = static_cast<int>(w.kv_row0 + t.n0);
      mbar_wait(sm.rope_empty(), (tiles & 1) ^ 1);  // the first tile does not wait
      mbar_expect_tx(sm.rope_full(), (kKBlocks - kKNopeBlocks) * kKBlk);
      for (int c = 0; c < kKBlocks - kKNopeBlocks; ++c)
        tma_load_2d(sm.rope() + c * kKBlk, &p.tm_rope, sm.rope_full(), c * 32, kv_row);
      ++tiles;
      for (int hh = 0; hh < t.heads; ++hh, ++heads) {
        const int h = t.h0 + hh;
        mbar_wait(sm.kv_empty(), (heads & 1) ^ 1);
        mbar_expect_tx(sm.kv_full(), kKNopeBlocks * kKBlk + kVBytes);
        for (int c = 0; c < kKNopeBlocks; ++c) tma_load_3d(sm.k() + c * kKBlk, &p.tm_k, sm.kv_full(), c * 32, h, kv_row);
        for (int c = 0; c < kDv / 64; ++c) tma_load_3d(sm.v() + c * kVBlk, &p.tm_v, sm.kv_full(), c * 64, h, kv_row);
        const float* lse_h = p.lse_log2 + static_cast<i64>(h) * p.num_chunks * kBlockM;
        const float* dpsum_h = p.dpsum + static_cast<i64>(h) * p.num_chunks * kBlockM;
#pragma unroll 1
        for (int m = t.m_begin; m < t.m_end; ++m, ++it) {
          const int s = it % kStages;
          const u32 empty_parity = ((it / kStages) & 1) ^ 1;
          const int q_row = static_cast<int>(w.q_row0) + m * kBlockM;
          const i64 stat = bwd::chunk_of(static_cast<u32>(w.q_row0), w.b, m) * kBlockM;
          mbar_wait(sm.q_empty(s), empty_parity);
          mbar_expect_tx(sm.q_full(s), kQBytes + kStatBytes);
          for (int c = 0; c < kDqk / 64; ++c) tma_load_3d(sm.q(s) + c * kQBlk, &p.tm_q, sm.q_full(s), c * 64, h, q_row);
          bulk_load(sm.lse(s), lse_h + stat, kStatBytes, sm.q_full(s));
          mbar_wait(sm.do_empty(s), empty_parity);
          mbar_expect_tx(sm.do_full(s), kDoBytes + kStatBytes);
          for (int c = 0; c < kDv / 64; ++c)
            tma_load_3d(sm.dout(s) + c * kQBlk, &p.tm_do, sm.do_full(s), c * 64, h, q_row);
          bulk_load(sm.dpsum(s), dpsum_h + stat, kStatBytes, sm.do_full(s));
        }
      }
    }
    idx = sched.next(idx);
  }
}

template <class Mask>
__device__ __forceinline__ void dq_reduce(const Params& p, const Smem& sm, const KeyTiles& sched, const Mask& mask) {
  using namespace sm90;
  int staged = 0;  // stagings reduced, dq halves and rope rows (dq_full's completions per consumer)
  for (int n = 0;; ++n) {
    bwd::KeyTile t;
    sched.take(n, t, false);
    if (!t.valid) break;
    const WorkTile& w = t.w;
    for (int hh = 0; hh < t.heads; ++hh) {
      const int h = t.h0 + hh;
#pragma unroll 1
      for (int m = t.m_begin; m < t.m_end; ++m, ++staged) {
        const i64 chunk = bwd::chunk_of(static_cast<u32>(w.q_row0), w.b, m);
        float* dst = p.dq_accum + (static_cast<i64>(h) * p.num_chunks + chunk) * kBlockM * kDqk;
        int* sem = p.deterministic ? p.dq_sem + static_cast<i64>(h) * p.num_chunks + chunk : nullptr;
        if (sem != nullptr) {  // wait for the key blocks that add to the chunk before this one (dq_turn)
          const int turn = bwd::dq_turn(mask, w, m, t.n_block, kBlockN);
          while (bwd::load_acquire(sem) != turn) {
          }
        }
        for (int c = 0; c < kConsumers; ++c) {
          mbar_wait(sm.dq_full(c), staged & 1);
          fence_proxy_async();  // the consumer's staging stores (acquired above), to the async proxy
          bulk_reduce_add_f32(dst + c * kDqHalf, sm.dq_stage(c), kDqHalf * 4);
          bulk_commit();
        }
        if (sem != nullptr) {
          bulk_wait();  // the additions done, not only the staging read
          asm volatile("fence.proxy.async.global;\n" ::: "memory");
          bwd::add_release(sem, 1);
        } else {
          bulk_wait_read();
        }
        for (int c = 0; c < kConsumers; ++c) mbar_arrive(sm.dq_empty(c));
      }
    }
    if (t.m_begin < t.m_end) {  // the tile's rope rows (Consumer::stage_rope), its keys that exist
      float* dst = p.rope_part + (w.kv_row0 + t.n0) * kDr;
      int* sem = p.deterministic ? p.rope_sem + bwd::key_block_of(static_cast<u32>(w.kv_row0), w.b, t.n_block, kBlockN)
                                 : nullptr;
      if (sem != nullptr) {  // the groups before this one (handed out before it: decode_key_tile)
        const int turn = t.h0 / p.heads_per_group;
        while (bwd::load_acquire(sem) != turn) {
        }
      }
      for (int c = 0; c < kConsumers; ++c) {
        const int keys = min(kWgKeys, w.sk - t.n0 - c * kWgKeys);
        mbar_wait(sm.dq_full(c), staged & 1);
        if (keys > 0) {
          fence_proxy_async();
          bulk_reduce_add_f32(dst + c * kWgKeys * kDr, sm.dq_stage(c), keys * kDr * 4);
          bulk_commit();
        }
      }
      if (sem != nullptr) {
        bulk_wait();
        asm volatile("fence.proxy.async.global;\n" ::: "memory");
        bwd::add_release(sem, 1);
      } else {
        bulk_wait_read();
      }
      for (int c = 0; c < kConsumers; ++c) mbar_arrive(sm.dq_empty(c));
      ++staged;
    }
  }
  bulk_wait();
}

}  // namespace sm90_bwd
}  // namespace mla

// The producer roles: one thread of warp 0 takes the work tiles (scheduler.cuh: from the counter, or
// from the scheduler warp with three consumers) and issues the TMA copies of each one's K and V
// tiles into the ring of V::kStages stages, K and V with their own full / empty mbarriers so that
// K of tile t+1 can load while V of tile t is in use. With a 16-bit rope the K stage's rope block
// comes from its own map, shared by every head: over k_rope, or over the key rows a paged cache's
// rope was gathered into (rope_gather.cu); an fp8 rope's rows are written by the rope warp
// (rope_warp.cuh). The Q warp (kQWarp) loads each consumer's 64 Q rows on their own barriers,
// once that consumer is done with its previous rows: a consumer that finishes a work tile first
// starts the next one while the other still runs its last P V and its epilogue (the K/V ring,
// which both release, bounds how far it runs ahead).
#pragma once
#include "../vt_layout.cuh"
#include "config.cuh"
#include "scheduler.cuh"
#include "shared_storage.cuh"

namespace mla {
namespace sm90 {

template <class V, class Mask, bool kPaged>
__device__ __forceinline__ void producer_load(const Params& p, const Smem<V>& sm, const TileHandout& sched,
                                              const Mask& mask) {
  constexpr int kS = V::kStages;
  constexpr bool kRopeTma = kRopeByTma<V>;
  static_assert(!(V::kRopeE4m3 && kPaged), "an e4m3 rope under the per-token scales is plain only");
  static_assert(!(V::kEvenKeyRows && kPaged), "the key scales in pairs with a plain rope only");
  // K stage bytes that arrive by TMA (k_full's expect_tx; a box past the tensor's end counts in
  // full, its missing rows zero-filled): the nope block(s), the rope block unless the rope warp
  // writes it (16 KiB of 16-bit rows, or 8 KiB of e4m3 rows), the key scales (fp8). Q's (q_load)
  // is its nope block(s) and rope block, by the same rule, a consumer's share at a time.
  constexpr int kKTxBytes = V::kNopeBlocks * kBlk<V> + (kRopeTma ? kRopeBytes<V> : 0) + (V::kFp8 ? kScaleBox<V> * 4 : 0);
  int it = 0;  // key tiles loaded so far: the position in the K/V ring, continued across work tiles
  int idx = blockIdx.x;
  for (int n = 0;; ++n) {
    WorkInfo work;
    if constexpr (kSchedulerWarp<V>) {
      sched.take_one(n, work);
    } else {
      idx = sched.find<V>(p, mask, idx, work);
      sched.publish(n, work);
    }
    if (!work.valid) break;
    if (work.num_tiles > 0) {
      const WorkTile& w = work.w;
      // fp8: the sequence's first column in V^T (vt_layout.cuh)
      const i64 vt_col = V::kFp8 ? vt_col0(static_cast<u32>(w.kv_row0), w.b) + work.n_begin : 0;
      // K of key tile t into ring position i, and V of key tile t into ring position i (each tile's K
      // and V share a position; their stages are released apart)
      auto load_k = [&](int t, int i) {
        const int s = i % kS;
        const int row = static_cast<int>(w.kv_row0 + work.n_begin + t * V::kBlockN);
        mbar_wait(sm.k_empty(s), ((i / kS) & 1) ^ 1);  // the first pass over the ring does not wait
        mbar_expect_tx(sm.k_full(s), kKTxBytes);
        for (int c = 0; c < V::kNopeBlocks; ++c)
          tma_load_3d(sm.k(s) + c * kBlk<V>, &p.tm_k, sm.k_full(s), c * kColBlock, w.h, row);
        if (kRopeTma) tma_load_2d(sm.rope(s), &p.tm_rope, sm.k_full(s), 0, row);
        if (V::kFp8) tma_load_1d(sm.k_scales(s), &p.tm_k_scales, sm.k_full(s), row & ~3);  // 16-byte aligned start
      };
      auto load_v = [&](int t, int i) {
        const int s = i % kS;
        const int row = static_cast<int>(w.kv_row0 + work.n_begin + t * V::kBlockN);
        mbar_wait(sm.v_empty(s), ((i / kS) & 1) ^ 1);
        mbar_expect_tx(sm.v_full(s), kVBytes<V>);
        if constexpr (V::kFp8) {  // V^T: 128 values x 128 key columns (16-byte aligned: the tile starts on a group)
          tma_load_3d(sm.v(s), &p.tm_v, sm.v_full(s), static_cast<int>(vt_col + t * V::kBlockN), 0, w.h);
        } else {
          for (int c = 0; c < 2; ++c) tma_load_3d(sm.v(s) + c * kBlk<V>, &p.tm_v, sm.v_full(s), c * kColBlock, w.h, row);
        }
      };
      // K and V of tile t together (V of tile t - 1 after K of tile t, the consumers' order,
      // measured level: benchmarks/NOTES.md)
      auto load_tile = [&](int t) {
        load_k(t, it);
        load_v(t, it);
      };
      if constexpr (kSchedulerWarp<V>) {
        // one tile per iteration: an unrolled loop keeps each copy's addresses live past 32 registers
#pragma unroll 1
        for (int t = 0; t < work.num_tiles; ++t, ++it) load_tile(t);
      } else {
        for (int t = 0; t < work.num_tiles; ++t, ++it) load_tile(t);
      }
    }
    if constexpr (kSchedulerWarp<V>) mbar_arrive(sched.issued());
    else idx = sched.next(idx);
  }
}

// The Q warp (whole warp kQWarp; lane 0 issues): consumer c's 64 rows of each work tile's Q (rows
// c * 64 .. of every column block: 128-byte rows, or 64-byte ones in the all-e4m3 rope block)
// into its share of the Q buffer, once c has released the previous ones; q_full(c) completes on the
// bytes (expect_tx kQBytes / V::kConsumers). Work tiles without key tiles load nothing (the
// consumers skip them).
template <class V>
__device__ __forceinline__ void q_load(const Params& p, const Smem<V>& sm, const TileHandout& sched) {
  static_assert(kQBytes<V> % V::kConsumers == 0, "equal shares");
  const bool leader = threadIdx.x % 32 == 0;
  int nq = 0;  // Q tiles loaded so far
  for (int n = 0;; ++n) {
    WorkInfo work;
    sched.take(n, work);
    if (!work.valid) break;
    if (work.num_tiles == 0) continue;
    const WorkTile& w = work.w;
    if (leader) {
      for (int c = 0; c < V::kConsumers; ++c) {
        mbar_wait(sm.q_empty(c), (nq & 1) ^ 1);  // consumer c is done with its previous rows
        mbar_expect_tx(sm.q_full(c), kQBytes<V> / V::kConsumers);
        const int qrow = static_cast<int>(w.q_row0 + work.m0) + c * kWgRows;
        const u32 rows = sm.q() + c * kWgRows * 128;  // this consumer's first row: 128-byte rows
        if constexpr (V::kFp8) {
          tma_load_3d(rows, &p.tm_q, sm.q_full(c), 0, w.h, qrow);  // 128 e4m3 nope values
          tma_load_3d(sm.q() + kQBlk<V> + c * kWgRows * kRopeRowBytes<V>, &p.tm_q_rope, sm.q_full(c), 0, w.h, qrow);
        } else {
          for (int cb = 0; cb < kDqk / kColBlock; ++cb)
            tma_load_3d(rows + cb * kQBlk<V>, &p.tm_q, sm.q_full(c), cb * kColBlock, w.h, qrow);
        }
      }
    }
    ++nq;
  }
}

}  // namespace sm90
}  // namespace mla

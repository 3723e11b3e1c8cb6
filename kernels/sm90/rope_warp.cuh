// The rope warp (warp 1, with a paged cache or an fp8 rope): writes each key tile's rope rows into
// the rope block of its K stage, alongside warp 0's TMA of the nope blocks; its lanes' 64 arrivals
// and warp 0's expect_tx complete the stage's k_full. Three ways:
//  * paged 16-bit cache, tile starting on a multiple of rope_box_rows (min(page size, 128); 0 when
//    the cache has no tensor map) with every key readable: one TMA box per rope_box_rows keys from
//    tm_rope (the cache as [num_blocks][page_size][64]), never crossing a page;
//  * other 16-bit tiles: a cp.async gather row by row (the consumers then issue fence.proxy.async
//    before wgmma reads them, as the memory model requires between generic-proxy writes and
//    async-proxy reads);
//  * fp8 rope (plain or paged): each lane loads its rows' 64 e4m3 bytes and scale, and stores them
//    dequantized to the 16-bit type.
// Unreadable keys (bad block ids) are zero-filled; a tile with one is flagged kTileUnreadable, with a
// readable bit per key (a ballot per 32 rows), and the consumers mask its unreadable keys. The counted
// form of the cp.async arrival (.noinc) keeps k_full's count at 1 + 64 per phase: the
// pending-count-raising form computes correct results but over-arrives the barrier, which
// compute-sanitizer's synccheck reports.
#pragma once
#include "../rope_source.cuh"
#include "config.cuh"
#include "fp8.cuh"
#include "scheduler.cuh"
#include "shared_storage.cuh"

namespace mla {
namespace sm90 {

template <class V, bool kPaged>
__device__ __forceinline__ void rope_warp_load(const Params& p, const Smem<V>& sm, const TileHandout& sched) {
  using T = typename V::Elem;
  using Paged = RopeSource<true>;
  constexpr int kS = V::kStages;
  constexpr int kRopeRows = kBlockN / 32;  // rows per lane: keys lane + 32 i
  const int lane = threadIdx.x % 32;
  const RopeArgs ra{p.rope_base, p.rope_row_stride, p.rope_block_stride, p.lookup, p.lookup_stride,
                    p.log2_page_size, p.num_blocks, p.max_pages};
  int it = 0;
  for (int n = 0;; ++n) {
    WorkInfo k;
    sched.take(n, k);
    if (!k.valid) break;
    const WorkTile& w = k.w;
    // The blocks of the lane's rope rows of a tile (kNoBlock past the span; 0 for a plain source),
    // looked up one tile ahead so the page-table reads overlap the wait for a free stage.
    u32 blk[kRopeRows];
    auto lookup_rows = [&](int t) {
#pragma unroll
      for (int i = 0; i < kRopeRows; ++i) {
        const int j = k.n_begin + t * kBlockN + lane + 32 * i;
        blk[i] = j >= k.n_end ? kNoBlock : (kPaged ? Paged::block(ra, w.b, w.k_pos0 + j) : 0u);
      }
    };
    if (k.num_tiles > 0) lookup_rows(0);
    for (int t = 0; t < k.num_tiles; ++t, ++it) {
      const int s = it % kS;
      const int n0 = k.n_begin + t * kBlockN;
      const int rows = min(kBlockN, k.n_end - n0);  // keys of the span in this tile
      const i64 t0 = w.k_pos0 + n0;                 // cache position of the tile's row 0
      bool bad = false;                             // a key of the span cannot be read
#pragma unroll
      for (int i = 0; i < kRopeRows; ++i) bad |= lane + 32 * i < rows && blk[i] == kNoBlock;
      bad = __any_sync(0xffffffffu, bad);
      const bool boxes = kPaged && !V::kRope8 && p.rope_box_rows > 0 && !bad && (t0 & (p.rope_box_rows - 1)) == 0;
      mbar_wait(sm.k_empty(s), ((it / kS) & 1) ^ 1);  // as warp 0: the first pass does not wait
      const u32 dst = sm.rope(s);
      bool ok_row[kRopeRows];  // readable bit of each of the lane's rows (unread unless bad)
      if constexpr (V::kRope8) {
#pragma unroll
        for (int i = 0; i < kRopeRows; ++i) {
          const int x = lane + 32 * i;
          const bool ok = blk[i] != kNoBlock;
          const unsigned char* src = nullptr;
          float sc = 0.f;
          if (ok) {
            const i64 kv_row = w.kv_row0 + n0 + x;
            if (kPaged) {
              src = Paged::at<unsigned char>(ra, blk[i], t0 + x);
              sc = p.rope_scales[static_cast<i64>(blk[i]) * p.rope_scale_block_stride +
                                 Paged::slot(ra, t0 + x) * p.rope_scale_row_stride];
            } else {
              src = static_cast<const unsigned char*>(p.rope_base) + kv_row * p.rope_row_stride;
              sc = p.rope_scales[kv_row * p.rope_scale_row_stride];
            }
          }
          store_rope_row_e4m3<T>(dst + x * 128, x, src, sc);
          ok_row[i] = ok;
        }
        fence_proxy_async();         // the dequantized rows, visible to wgmma
        mbar_arrive(sm.k_full(s));  // (in place of the cp.async arrivals)
      } else if (boxes) {
        // Rows past the span stay as they are: their scores are masked. Lane 0's expect_tx and 31
        // plain arrivals here stand for the cp.async arrivals.
        const int nbox = (rows + p.rope_box_rows - 1) / p.rope_box_rows;
        if (lane == 0) mbar_expect_tx(sm.k_full(s), nbox * p.rope_box_rows * 128);
        else mbar_arrive(sm.k_full(s));
#pragma unroll
        for (int i = 0; i < kRopeRows; ++i) {
          const int x = lane + 32 * i;
          if (x < rows && (x & (p.rope_box_rows - 1)) == 0)
            tma_load_3d(dst + x * 128, &p.tm_rope, sm.k_full(s), 0, Paged::slot(ra, t0 + x), static_cast<int>(blk[i]));
        }
      } else {
        // 8 chunks of 16 bytes per row, written in the 128-byte swizzle (chunk c of row x at chunk
        // c ^ (x % 8)).
#pragma unroll
        for (int i = 0; i < kRopeRows; ++i) {
          const int x = lane + 32 * i;
          const bool ok = blk[i] != kNoBlock;
          const T* src = ok ? Paged::at<T>(ra, blk[i], t0 + x) : static_cast<const T*>(p.rope_base);
#pragma unroll
          for (int c = 0; c < 8; ++c) cp_async_16(dst + x * 128 + ((c ^ (x & 7)) << 4), src + c * 8, ok);
          ok_row[i] = ok;
        }
        mbar_cp_async_arrive(sm.k_full(s));  // arrives when this lane's copies have landed
      }
      if (bad) {  // warp-uniform: every lane wrote ok_row
#pragma unroll
        for (int i = 0; i < kRopeRows; ++i) {
          const u32 word = __ballot_sync(0xffffffffu, ok_row[i]);  // keys 32 i .. 32 i + 31
          if (lane == 0) sm.s.key_ok[s][i] = word;
        }
      }
      if (lane == 0)
        sm.s.tile_flags[s] = (bad ? kTileUnreadable : 0u) | (!V::kRope8 && !boxes ? kTileGathered : 0u);
      __syncwarp();
      mbar_arrive(sm.k_full(s));  // release: the flags are visible once the barrier completes
      if (t + 1 < k.num_tiles) lookup_rows(t + 1);
    }
  }
}

}  // namespace sm90
}  // namespace mla

// The rope warp (warp 1, with a paged cache or an fp8 rope). Per key tile, after its K stage is
// free: the tile's flags (a tile with a key it cannot read, a block id outside the cache or a page
// past the table, is flagged kTileUnreadable, with a readable bit per key: a ballot per 32 rows;
// the consumers mask its unreadable keys), then with an fp8 rope (plain or paged) the rows: each
// lane loads its rows' 64 e4m3 bytes and scale, stores them dequantized to the 16-bit type into the
// stage's rope block and fences them (generic-proxy writes read by wgmma through the async proxy),
// so the consumers never fence. A paged 16-bit rope's rows come by warp 0's TMA from the key rows
// rope_gather.cu wrote before the launch: one box per tile whatever the page size, the page-table
// reads (for the flags) off the loads' path. Its 32 lanes' arrivals (one each, after the flags
// and rows) and warp 0's expect_tx complete the stage's k_full: 1 + 32 per phase.
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
  constexpr int kRopeRows = kKeyWords<V>;  // rows per lane: keys lane + 32 i (one readable-bit word each)
  const int lane = threadIdx.x % 32;
  const RopeArgs ra{p.rope_base, p.rope_row_stride, p.rope_block_stride, p.lookup, p.lookup_stride,
                    p.log2_page_size, p.num_blocks, p.max_pages};
  int it = 0;
  for (int n = 0;; ++n) {
    WorkInfo work;
    sched.take(n, work);
    if (!work.valid) break;
    const WorkTile& w = work.w;
    // The blocks of the lane's rope rows of a tile (kNoBlock past the span; 0 for a plain source),
    // looked up one tile ahead so the page-table reads overlap the wait for a free stage.
    u32 blk[kRopeRows];
    auto lookup_rows = [&](int t) {
#pragma unroll
      for (int i = 0; i < kRopeRows; ++i) {
        const int j = work.n_begin + t * V::kBlockN + lane + 32 * i;
        blk[i] = j >= work.n_end ? kNoBlock : (kPaged ? Paged::block(ra, w.b, w.k_pos0 + j) : 0u);
      }
    };
    if (work.num_tiles > 0) lookup_rows(0);
    for (int t = 0; t < work.num_tiles; ++t, ++it) {
      const int s = it % kS;
      const int n0 = work.n_begin + t * V::kBlockN;
      const int rows = min(V::kBlockN, work.n_end - n0);  // keys of the span in this tile
      const i64 t0 = w.k_pos0 + n0;                 // cache position of the tile's row 0
      bool bad = false;                             // a key of the span cannot be read
#pragma unroll
      for (int i = 0; i < kRopeRows; ++i) bad |= lane + 32 * i < rows && blk[i] == kNoBlock;
      bad = __any_sync(0xffffffffu, bad);
      mbar_wait(sm.k_empty(s), ((it / kS) & 1) ^ 1);  // as warp 0: the first pass does not wait
      const u32 dst = sm.rope(s);
      bool ok_row[kRopeRows];  // readable bit of each of the lane's rows
#pragma unroll
      for (int i = 0; i < kRopeRows; ++i) ok_row[i] = blk[i] != kNoBlock;
      // The flags first: every lane's one arrival below releases them with the rows.
      if (bad) {  // warp-uniform
#pragma unroll
        for (int i = 0; i < kRopeRows; ++i) {
          const u32 word = __ballot_sync(0xffffffffu, ok_row[i]);  // keys 32 i .. 32 i + 31
          if (lane == 0) sm.s.key_ok[s][i] = word;
        }
      }
      if (lane == 0) sm.s.tile_flags[s] = bad ? kTileUnreadable : 0u;
      __syncwarp();
      if constexpr (V::kRope8) {
#pragma unroll
        for (int i = 0; i < kRopeRows; ++i) {
          const int x = lane + 32 * i;
          const bool ok = ok_row[i];
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
        }
        fence_proxy_async();  // the dequantized rows, visible to wgmma
        mbar_arrive(sm.k_full(s));
      } else {
        mbar_arrive(sm.k_full(s));  // the flags only: the rows come by warp 0's TMA
      }
      if (t + 1 < work.num_tiles) lookup_rows(t + 1);
    }
  }
}

}  // namespace sm90
}  // namespace mla

// The epilogue: normalize each row of O, merge it into out / lse when accumulating (chunked
// prefill), store it and its natural-log lse. Two ways:
//   * direct (../softmax.cuh: store_rows): each thread stores its fragment, 4 bytes per value pair;
//   * staged (MLA_SM90_SMEM_EPILOGUE, 16-bit outputs, not accumulating): each warpgroup writes its
//     64 normalized rows into the last key tile's V stage (held by the mainloop until here), then
//     every thread stores 16-byte chunks of whole rows. The V stage is free only once BOTH
//     consumers' last P V has read it, hence the barrier over both before the first write; it is
//     released to the producer after the chunks are read.
// The staging layout: warpgroup c's rows at byte 16 KiB * c, row r at 256 r, its 16-byte chunk j at
// (j ^ (r % 8)) * 16: the fragment writes (8 rows x 4 lanes per warp and chunk) and the chunk
// reads (8 consecutive chunks of a row per quarter warp) are free of bank conflicts.
#pragma once
#include "../softmax.cuh"
#include "config.cuh"
#include "fp8.cuh"
#include "scheduler.cuh"
#include "shared_storage.cuh"

namespace mla {
namespace sm90 {

// Whether variant V writes OutT through the V stage (with accumulate off, checked at run time).
template <class V, typename OutT>
constexpr bool kStagedEpilogue = MLA_SM90_SMEM_EPILOGUE && !V::kFp8 && sizeof(OutT) == 2 && kVBytes<V> >= kBlockM * kDv * 2;

template <class V, typename OutT>
__device__ __forceinline__ void epilogue_store(const Params& p, const Smem<V>& sm, const WorkInfo& k, int row0,
                                               float (&o)[kOTiles][4], OnlineSoftmax& smx, int held_stage) {
  if constexpr (V::kFp8) {  // O holds kPScale * P V and the row sums kPScale * sum(P) (fp8.cuh)
#pragma unroll
    for (int i = 0; i < kOTiles; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[i][e] *= 1.f / kPScale;
    smx.row_sum[0] *= 1.f / kPScale;
    smx.row_sum[1] *= 1.f / kPScale;
  }
  OutT* out = static_cast<OutT*>(p.out);
  constexpr bool kFast = MLA_SM90_FAST_EPILOGUE;
  if constexpr (kStagedEpilogue<V, OutT>) {
    if (held_stage >= 0) {
      const WorkTile& w = k.w;
      const int lane = threadIdx.x % 32;
      const int cw = threadIdx.x / 128 - 1;
      const u32 stage = sm.v(held_stage) + cw * (kWgRows * kDv * 2);
      named_barrier_sync(kEpilogueBar, kConsumerThreads);  // both consumers' last P V has read V
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const MergeWeights mw = row_weights<kFast>(smx, r, false, neg_inf());
        const int wrow = row0 - k.m0 - cw * kWgRows + 8 * r;  // row inside the warpgroup's 64
#pragma unroll
        for (int dt = 0; dt < kOTiles; ++dt)
          sts32(stage + wrow * 256 + ((dt ^ (wrow & 7)) << 4) + 4 * (lane & 3),
                Elem<OutT>::pack(o[dt][2 * r] * mw.wb, o[dt][2 * r + 1] * mw.wb));
        if (p.lse != nullptr && (lane & 3) == 0 && row0 + 8 * r < w.sq)
          p.lse[(w.q_row0 + row0 + 8 * r) * p.lse_st + w.h] = mw.lse;
      }
      named_barrier_sync(kEpilogueBar + 1 + cw, 128);  // this warpgroup's rows are in shared memory
      const int wtid = threadIdx.x % 128;
      const int wr0 = k.m0 + cw * kWgRows;
#pragma unroll
      for (int i = 0; i < kWgRows * 16 / 128; ++i) {
        const int id = wtid + 128 * i, r = id / 16, j = id % 16;  // row r, 16-byte chunk j
        u32 x[4];
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3])
                     : "r"(stage + r * 256 + ((j ^ (r & 7)) << 4)));
        if (wr0 + r < w.sq) {
          OutT* dst = out + (w.q_row0 + wr0 + r) * p.o_st + w.h * p.o_sh + 8 * j;
          *reinterpret_cast<uint4*>(dst) = make_uint4(x[0], x[1], x[2], x[3]);
        }
      }
      fence_proxy_async();  // these generic-proxy accesses before the next TMA write into the stage
      TileHandout::release(sm.v_empty(held_stage));  // the staged rows are read: V's stage is free
      return;
    }
  }
  store_rows<OutT, kFast>(o, smx, k.w, row0, out, p.o_st, p.o_sh, p.lse, p.lse_st, p.accumulate != 0);
}

}  // namespace sm90
}  // namespace mla

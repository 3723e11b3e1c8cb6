// The epilogue: normalize each row of O, merge it into out / lse when accumulating (chunked
// prefill), store it and its natural-log lse. Two ways:
//   * direct (../softmax.cuh: store_rows): each thread stores its fragment, 4 bytes per value pair
//     (a quad of lanes covers 16 bytes of a row: half of a 32-byte sector per store);
//   * staged (MLA_SM90_SMEM_EPILOGUE, 16-bit outputs, not accumulating): each consumer writes its
//     64 normalized rows into its own 8 KiB of SharedStorage::out_stage, one half of the columns
//     at a time; a consumer whose 64 rows all exist stores each half by one TMA store
//     (kTmaEpilogue, where the host gave out's map), the others' threads store whole
//     128-byte row halves in 16-byte chunks (a box would also write the rows past a sequence's end,
//     the next sequence's).
// The staging layout: row r at 128 r, its 16-byte chunk j at (j ^ (r % 8)) * 16, which is TMA's
// 128-byte swizzle of a 64-row box of 128-byte rows (each consumer's 8 KiB start on a 1 KiB boundary).
// A warp's fragment writes (8 rows x 4 lanes per chunk) and a quarter warp's chunk reads (the 8
// chunks of a row) are free of bank conflicts. Per work tile each consumer syncs its 128 threads
// four times on its own named barrier: before the first half is written (the last tile's reads are
// done: its threads', or its TMA store's, which the consumer's first thread, the one that issues
// them, waits for), after each half is written (after a fence that shows the writes to TMA, the
// async proxy), and before the second half overwrites the first. Nothing here touches the K/V
// stages, so the producer's loads of the next work tile never wait for the epilogue.
#pragma once
#include "../softmax.cuh"
#include "config.cuh"
#include "fp8.cuh"
#include "scheduler.cuh"
#include "shared_storage.cuh"

namespace mla {
namespace sm90 {

// Whether variant V writes OutT through the output staging (with accumulate off, checked at run time).
template <class V, typename OutT>
constexpr bool kStagedEpilogue = MLA_SM90_SMEM_EPILOGUE && sizeof(OutT) == 2;

template <class V, typename OutT>
__device__ __forceinline__ void epilogue_store(const Params& p, const Smem<V>& sm, const WorkInfo& work, int row0,
                                               float (&o)[kOTiles][4], OnlineSoftmax& smx) {
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
    if (p.accumulate == 0) {
      const WorkTile& w = work.w;
      const int lane = threadIdx.x % 32;
      const int cw = threadIdx.x / 128 - 1;
      const int wtid = threadIdx.x % 128;
      const int bar = kEpilogueBar<V> + cw;
      const u32 stage = sm.at(sm.s.out_stage) + cw * (kWgRows * kOutStageRowBytes);
      const int wr0 = work.m0 + cw * kWgRows;  // the consumer's first row in the work tile
      // every row of the consumer exists: its halves go by TMA; the first thread issues and waits
      const bool tma = kTmaEpilogue<V> && p.out_by_tma && row_exists<kEndAligned<V>>(wr0, w.sq) &&
                       row_exists<kEndAligned<V>>(wr0 + kWgRows - 1, w.sq);
      const bool issuer = wtid == 0;
      MergeWeights mw[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mw[r] = row_weights<kFast>(smx, r, false, neg_inf());
        if (p.lse != nullptr && (lane & 3) == 0 && row_exists<kEndAligned<V>>(row0 + 8 * r, w.sq))
          p.lse[(w.q_row0 + row0 + 8 * r) * p.lse_st + w.h] = mw[r].lse;
      }
      if (kTmaEpilogue<V> && issuer) bulk_wait_read();
      named_barrier_sync(bar, 128);  // this consumer's reads of the previous work tile are done
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (half == 1) {
          if (tma && issuer) bulk_wait_read();
          named_barrier_sync(bar, 128);  // the first half is read
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int wrow = row0 - wr0 + 8 * r;  // row inside the consumer's 64
#pragma unroll
          for (int j = 0; j < kOutStageHalf / 8; ++j) {
            const int dt = half * (kOutStageHalf / 8) + j;
            sts32(stage + wrow * kOutStageRowBytes + ((j ^ (wrow & 7)) << 4) + 4 * (lane & 3),
                  Elem<OutT>::pack(o[dt][2 * r] * mw[r].wb, o[dt][2 * r + 1] * mw[r].wb));
          }
        }
        if (tma) fence_proxy_async();
        named_barrier_sync(bar, 128);  // the half is in shared memory
        if (tma) {
          if (issuer) {
            tma_store_3d(&p.tm_out, stage, half * kOutStageHalf, w.h, static_cast<int>(w.q_row0 + wr0));
            bulk_commit();
          }
          continue;
        }
        constexpr int kChunks = kOutStageRowBytes / 16;  // 8 per row
#pragma unroll
        for (int i = 0; i < kWgRows * kChunks / 128; ++i) {
          const int id = wtid + 128 * i, r = id / kChunks, j = id % kChunks;  // row r, 16-byte chunk j
          u32 x[4];
          asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3])
                       : "r"(stage + r * kOutStageRowBytes + ((j ^ (r & 7)) << 4)));
          if (row_exists<kEndAligned<V>>(wr0 + r, w.sq)) {
            OutT* dst = out + (w.q_row0 + wr0 + r) * p.o_st + w.h * p.o_sh + half * kOutStageHalf + 8 * j;
            *reinterpret_cast<uint4*>(dst) = make_uint4(x[0], x[1], x[2], x[3]);
          }
        }
      }
      return;
    }
  }
  store_rows<OutT, kFast, kEndAligned<V>>(o, smx, work.w, row0, out, p.o_st, p.o_sh, p.lse, p.lse_st, p.accumulate != 0);
}

// After a consumer's last work tile: its TMA stores complete before the CTA exits (their source is
// the CTA's shared memory).
template <class V, typename OutT>
__device__ __forceinline__ void epilogue_drain() {
  if constexpr (kStagedEpilogue<V, OutT> && kTmaEpilogue<V>) {
    if (threadIdx.x % 128 == 0) bulk_wait();
  }
}

}  // namespace sm90
}  // namespace mla

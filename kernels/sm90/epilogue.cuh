// The epilogue: normalize each row of O, merge it into out / lse when accumulating (chunked
// prefill), store it and its natural-log lse. Two ways, and a third for a shared work tile's rows
// (epilogue_store_shared, below: three consumers' partial states of the same rows merged first):
//   * direct (../softmax.cuh: store_rows): each thread stores its fragment, 4 bytes per value pair
//     (a quad of lanes covers 16 bytes of a row: half of a 32-byte sector per store);
//   * staged (MLA_SM90_SMEM_EPILOGUE, 16-bit outputs, not accumulating): each consumer writes its
//     64 normalized rows into its own 8 KiB of SharedStorage::out_stage, one half of the columns
//     at a time, and its threads store whole 128-byte row halves in 16-byte chunks.
// The staging layout: row r at 128 r, its 16-byte chunk j at (j ^ (r % 8)) * 16. A warp's fragment
// writes (8 rows x 4 lanes per chunk) and a quarter warp's chunk reads (the 8 chunks of a row) are
// free of bank conflicts. Per work tile each consumer syncs its 128 threads four times on its own
// named barrier: before the first half is written (the last tile's reads are done), after each
// half is written, and before the second half overwrites the first. Nothing here touches the
// K/V stages, so the producer's loads of the next work tile never wait for the epilogue.
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
__device__ __forceinline__ void epilogue_store(const Params& p, const Smem<V>& sm, const WorkInfo& k, int row0,
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
      const WorkTile& w = k.w;
      const int lane = threadIdx.x % 32;
      const int cw = threadIdx.x / 128 - 1;
      const int wtid = threadIdx.x % 128;
      const int bar = kEpilogueBar<V> + cw;
      const u32 stage = sm.at(sm.s.out_stage) + cw * (kWgRows * kOutStageRowBytes);
      const int wr0 = k.m0 + cw * kWgRows;  // the consumer's first row in the work tile
      MergeWeights mw[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mw[r] = row_weights<kFast>(smx, r, false, neg_inf());
        if (p.lse != nullptr && (lane & 3) == 0 && row_exists<kEndAligned<V>>(row0 + 8 * r, w.sq))
          p.lse[(w.q_row0 + row0 + 8 * r) * p.lse_st + w.h] = mw[r].lse;
      }
      named_barrier_sync(bar, 128);  // this consumer's reads of the previous work tile are done
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (half == 1) named_barrier_sync(bar, 128);  // the first half is read
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
        named_barrier_sync(bar, 128);  // the half is in shared memory
        constexpr int kChunks = kOutStageRowBytes / 16;  // 8 per row
#pragma unroll
        for (int i = 0; i < kWgRows * kChunks / 128; ++i) {
          const int id = wtid + 128 * i, r = id / kChunks, j = id % kChunks;  // row r, 16-byte chunk j
          u32 x[4];
          lds128(stage + r * kOutStageRowBytes + ((j ^ (r & 7)) << 4), x);
          if (row_exists<kEndAligned<V>>(wr0 + r, w.sq)) {
            OutT* dst = out + (w.q_row0 + wr0 + r) * p.o_st + w.h * p.o_sh + half * kOutStageHalf + 8 * j;
            *reinterpret_cast<uint4*>(dst) = make_uint4(x[0], x[1], x[2], x[3]);
          }
        }
      }
      return;
    }
  }
  store_rows<OutT, kFast, kEndAligned<V>>(o, smx, k.w, row0, out, p.o_st, p.o_sh, p.lse, p.lse_st, p.accumulate != 0);
}

// A shared work tile's epilogue (is_shared_tile; kSplitKeys), by the three consumers together, each of
// which ran the rows of consumer rc = first_busy over every third key tile (mainloop.cuh): the exact
// merge of their three softmax states (M the largest of the three maxima, each state weighted by
// exp2(m - M)), normalized and merged into out / lse as store_rows does. Through the output staging,
// which holds no K/V stage: the states (16 bytes a thread), then O half by half (64 columns), each
// consumer adding its weighted values into a zeroed row-major buffer (red.shared.add; rows padded
// by 8 floats: at most 2-way bank conflicts; the first padding float holds the row's weight of
// what out already holds) and all 384 threads storing the sums in 16-byte chunks. O is only read
// here: merging it back into registers made ptxas spill the loops' registers. Seven barriers of the
// three consumers: before (every consumer's previous epilogue has read its staging), after the
// states, after each half's adds and after its stores, and after the buffer is zeroed between
// halves. The lse is read (accumulating) before the first adds' barrier and written after it.
template <class V, typename OutT>
__device__ __forceinline__ void epilogue_store_shared(const Params& p, const Smem<V>& sm, const WorkInfo& k,
                                                      const float (&o)[kOTiles][4], const OnlineSoftmax& own) {
  constexpr int kPassTiles = kOutStageHalf / 8;  // O's n-tiles per pass
  constexpr int kRowFloats = kOutStageHalf + 8;  // a buffer row: 64 values, then padding
  constexpr int kChunks = kOutStageHalf / 4;     // 16-byte chunks of a row per pass
  constexpr bool kFast = MLA_SM90_FAST_EPILOGUE;
  constexpr float kOScale = V::kFp8 ? 1.f / kPScale : 1.f;  // O and the sums hold kPScale * P (fp8.cuh)
  const WorkTile& w = k.w;
  const int cw = threadIdx.x / 128 - 1, tid = threadIdx.x % 128, lane = threadIdx.x % 32;
  const int rc = first_busy<V>(k);
  const int frow = (tid / 32) * 16 + lane / 4;  // the thread's row g among the 64
  const int row0 = k.m0 + rc * kWgRows;          // the rows' first in the sequence
  const u32 st_at = sm.at(sm.s.out_stage), o_at = st_at + 3 * 128 * 16;
  static_assert(3 * 128 * 16 + kWgRows * kRowFloats * 4 <= kOutStageBytes<V>, "the merge's buffer");
  OutT* out = static_cast<OutT*>(p.out);
  const bool accumulate = p.accumulate != 0;
  auto zero_buffer = [&] {
    for (int i = thread_index_here() - 128; i < kWgRows * kOutStageHalf; i += kConsumerThreads<V>)
      sts32(o_at + ((i / kOutStageHalf) * kRowFloats + i % kOutStageHalf) * 4, 0u);
  };
  named_barrier_sync(kMergeBar<V>, kConsumerThreads<V>);
  sts128f(st_at + (cw * 128 + tid) * 16, own.row_max[0], own.row_max[1], own.row_sum[0], own.row_sum[1]);
  zero_buffer();
  named_barrier_sync(kMergeBar<V>, kConsumerThreads<V>);
  OnlineSoftmax smx;  // the merged state
  float f[2];         // this consumer's O factor of rows g, g + 8: its weight times the row's wb
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float m[3], l = 0.f;
#pragma unroll
    for (int c = 0; c < 3; ++c) m[c] = __uint_as_float(lds32(st_at + (c * 128 + tid) * 16 + 4 * r));
    const float mx = fmaxf(m[0], fmaxf(m[1], m[2]));
    const float ref = mx == neg_inf() ? 0.f : mx;  // no visible key in any: weights 0
#pragma unroll
    for (int c = 0; c < 3; ++c) l += fast_exp2(m[c] - ref) * __uint_as_float(lds32(st_at + (c * 128 + tid) * 16 + 8 + 4 * r));
    smx.row_max[r] = mx;
    smx.row_sum[r] = l * kOScale;
    f[r] = fast_exp2(own.row_max[r] - ref) * kOScale;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + frow + 8 * r;
    const bool exists = row_exists<kEndAligned<V>>(row, w.sq);
    const float lse_old = accumulate && exists ? p.lse[(w.q_row0 + row) * p.lse_st + w.h] : neg_inf();
    const MergeWeights mw = row_weights<kFast>(smx, r, accumulate, lse_old);
    f[r] *= mw.wb;
    smx.row_max[r] = mw.lse;  // kept for the store after the first barrier
    if (cw == rc && (lane & 3) == 0) sts32(o_at + ((frow + 8 * r) * kRowFloats + kOutStageHalf) * 4, __float_as_uint(mw.wa));
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int j = 0; j < kPassTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        red_add_f32(o_at + ((frow + 8 * (e / 2)) * kRowFloats + 8 * j + 2 * (lane & 3) + (e & 1)) * 4,
                    o[half * kPassTiles + j][e] * f[e / 2]);
    named_barrier_sync(kMergeBar<V>, kConsumerThreads<V>);
    if (half == 0 && cw == rc && p.lse != nullptr && (lane & 3) == 0) {  // every lse_old is read
#pragma unroll
      for (int r = 0; r < 2; ++r)
        if (row_exists<kEndAligned<V>>(row0 + frow + 8 * r, w.sq))
          p.lse[(w.q_row0 + row0 + frow + 8 * r) * p.lse_st + w.h] = smx.row_max[r];
    }
    for (int i = thread_index_here() - 128; i < kWgRows * kChunks; i += kConsumerThreads<V>) {
      const int r = i / kChunks, c = i % kChunks;
      if (!row_exists<kEndAligned<V>>(row0 + r, w.sq)) continue;
      float v[4];
      lds128f(o_at + (r * kRowFloats + 4 * c) * 4, v);
      OutT* dst = out + (w.q_row0 + row0 + r) * p.o_st + w.h * p.o_sh + half * kOutStageHalf + 4 * c;
      const float wa = __uint_as_float(lds32(o_at + (r * kRowFloats + kOutStageHalf) * 4));
      if (accumulate && wa > 0.f) {
        float lo[2], hi[2];
        load2<OutT>(dst, lo);
        load2<OutT>(dst + 2, hi);
        v[0] += wa * lo[0];
        v[1] += wa * lo[1];
        v[2] += wa * hi[0];
        v[3] += wa * hi[1];
      }
      store2<OutT>(dst, v[0], v[1]);
      store2<OutT>(dst + 2, v[2], v[3]);
    }
    named_barrier_sync(kMergeBar<V>, kConsumerThreads<V>);
    if (half == 0) {
      zero_buffer();
      named_barrier_sync(kMergeBar<V>, kConsumerThreads<V>);
    }
  }
}

}  // namespace sm90
}  // namespace mla
